#!/usr/bin/env python3
"""srcgraph.py - the include and call graph of src/, and the layering rules it must keep.

Nodes are the files under src/. A file points at each header it includes and, for calls, at the
.c file that defines the function called (Debian's cflow lists each function's callees; a call
to a static function resolves inside its own file first). Calls through a function pointer - a
backend's vtable - are no edge: that is what a seam is for.

The rules (--check exits 1 naming every breach):
  * no edge runs up: a file uses only its own layer and the layers before it, in the order of
    KVT_LAYERS in CMakeLists.txt (base engine format index store tier);
  * no circle: no file reaches itself again, inside a folder or across folders;
  * no .c file in src/ is longer than MAX_LINES;
  * a promote (kvt_tier_promote and everything it may call) passes through at most PROMOTE_FILES
    files of the orchestration layers (index, store, tier) on its deepest chain of calls.
Before the real tree, the checker runs on a small tree it writes with one breach of each kind and
fails unless it finds each one, so this test cannot pass by finding nothing.

Without cflow the test is skipped with the tag cflow (exit 77; CI's strict mode fails that)."""
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

MAX_LINES = 900
PROMOTE_FILES = 10
ORCHESTRATION = ("index", "store", "tier")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
DEFINED = re.compile(r"^(\w+)\(\) <.* at (\S+):\d+>(?: \(R\))?:?$")


def layers_of(root):
    """The layer order, from CMakeLists.txt's KVT_LAYERS."""
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        m = re.search(r"set\(KVT_LAYERS ([^)]*)\)", f.read())
    if not m:
        raise SystemExit("srcgraph: no set(KVT_LAYERS ...) in CMakeLists.txt")
    return m.group(1).split()


def strip_comments(text):
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


class Graph:
    def __init__(self, root):
        self.root = root
        self.src = os.path.join(root, "src")
        self.layers = layers_of(root)
        self.files = sorted(
            os.path.relpath(os.path.join(d, f), self.src)
            for d, _, fs in os.walk(self.src) for f in fs if f.endswith((".c", ".h")))
        self.edges = collections.defaultdict(dict)  # file -> {file: why}
        self.defs = {}                               # global function -> file
        self.calls = {}                              # (file, fn) -> [(file, fn)]
        self._includes()
        self._calls()

    def text(self, p):
        with open(os.path.join(self.src, p), errors="replace") as f:
            return f.read()

    def _add(self, a, b, why):
        if a != b:
            self.edges[a].setdefault(b, why)

    def _includes(self):
        for p in self.files:
            for h in INCLUDE.findall(self.text(p)):
                for cand in (h, os.path.join(os.path.dirname(p), h)):
                    if os.path.isfile(os.path.join(self.src, cand)):
                        self._add(p, os.path.normpath(cand), "includes " + h)
                        break

    def _calls(self):
        local, raw = {}, {}
        for p in (f for f in self.files if f.endswith(".c")):
            out = subprocess.run(
                ["cflow", "-A", "-A", "--depth=2", "--omit-arguments", "--omit-symbol-names",
                 os.path.join(self.src, p)], capture_output=True, text=True).stdout
            code = strip_comments(self.text(p))
            local[p], cur = set(), None
            for line in out.splitlines():
                if not line.startswith(" "):
                    m = DEFINED.match(line.strip())
                    cur = m.group(1) if m else None
                    if cur:
                        local[p].add(cur)
                        raw[(p, cur)] = []
                elif cur:
                    raw[(p, cur)].append(line.strip().split("(")[0])
            for fn in local[p]:
                if not re.search(r"\bstatic\b[^;{}]*\b%s\s*\(" % re.escape(fn), code):
                    self.defs.setdefault(fn, p)
        for (p, fn), callees in raw.items():
            out = []
            for c in callees:
                tgt = p if c in local[p] else self.defs.get(c)
                if tgt:
                    out.append((tgt, c))
                    self._add(p, tgt, "calls %s from %s" % (c, fn))
            self.calls[(p, fn)] = out

    def layer(self, p):
        return self.layers.index(p.split("/")[0])

    def ups(self):
        return [(a, b, w) for a, bs in sorted(self.edges.items()) for b, w in sorted(bs.items())
                if self.layer(b) > self.layer(a)]

    def circles(self):
        """Strongly connected components of more than one file (Tarjan, iterative)."""
        index, low, onstack, stack, out, n = {}, {}, set(), [], [], 0
        for root in self.files:
            if root in index:
                continue
            work = [(root, iter(sorted(self.edges.get(root, {}))))]
            index[root] = low[root] = n
            n += 1
            stack.append(root)
            onstack.add(root)
            while work:
                v, it = work[-1]
                w = next(it, None)
                if w is None:
                    work.pop()
                    if work:
                        low[work[-1][0]] = min(low[work[-1][0]], low[v])
                    if low[v] == index[v]:
                        comp = []
                        while True:
                            x = stack.pop()
                            onstack.discard(x)
                            comp.append(x)
                            if x == v:
                                break
                        if len(comp) > 1:
                            out.append(sorted(comp))
                elif w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    onstack.add(w)
                    work.append((w, iter(sorted(self.edges.get(w, {})))))
                elif w in onstack:
                    low[v] = min(low[v], index[w])
        return out

    def long_files(self):
        return [(p, self.text(p).count("\n")) for p in self.files
                if p.endswith(".c") and self.text(p).count("\n") > MAX_LINES]

    def promote_chain(self, entry="kvt_tier_promote"):
        """The deepest chain of orchestration files the calls reachable from entry run through."""
        start = self.defs.get(entry)
        if not start:
            return []
        seen, todo = set(), [(start, entry)]
        while todo:
            v = todo.pop()
            if v not in seen:
                seen.add(v)
                todo.extend(self.calls.get(v, ()))
        fe = collections.defaultdict(set)
        for v in seen:
            for w in self.calls.get(v, ()):
                if w in seen and w[0] != v[0]:
                    fe[v[0]].add(w[0])
        best = {}

        def chain(f, path):
            if f in best:
                return best[f]
            nxt = [chain(g, path | {f}) for g in sorted(fe[f]) if g not in path]
            here = [f] if f.split("/")[0] in ORCHESTRATION else []
            best[f] = here + max(nxt, key=len, default=[])
            return best[f]

        sys.setrecursionlimit(10000)
        return chain(start, frozenset())


def breaches(root):
    g = Graph(root)
    out = []
    for a, b, why in g.ups():
        out.append("up: %s -> %s (%s)" % (a, b, why))
    for comp in g.circles():
        out.append("circle of %d files: %s" % (len(comp), " ".join(comp)))
        for a in comp:
            for b, why in sorted(g.edges[a].items()):
                if b in comp:
                    out.append("    %s -> %s (%s)" % (a, b, why))
    for p, n in g.long_files():
        out.append("too long: src/%s has %d lines (at most %d)" % (p, n, MAX_LINES))
    chain = g.promote_chain()
    if len(chain) > PROMOTE_FILES:
        out.append("promote passes through %d files (at most %d): %s"
                   % (len(chain), PROMOTE_FILES, " -> ".join(chain)))
    return out, g, chain


def self_test():
    """A tree with one breach of each kind; each must be found."""
    d = tempfile.mkdtemp(prefix="kvt-srcgraph-")
    try:
        with open(os.path.join(d, "CMakeLists.txt"), "w") as f:
            f.write("set(KVT_LAYERS base tier)\n")
        files = {
            "base/a.c": '#include "tier/t.h"\nint up(void) { return 0; }\n',
            "tier/t.h": "int t1(void);\n",
            "tier/t1.c": "int t2(void);\nint t1(void) { return t2(); }\n",
            "tier/t2.c": "int t1(void);\nint t2(void) { return t1(); }\n",
            "tier/long.c": "int l(void) { return 0; }\n" + "\n" * (MAX_LINES + 1),
            # a function that calls itself (cflow marks it) still has its edges
            "tier/r1.c": "int r2(void);\nint r1(int n) { return n ? r1(n - 1) : r2(); }\n",
            "tier/r2.c": "int r1(int n);\nint r2(void) { return r1(1); }\n",
        }
        chain = ["tier/p%d.c" % i for i in range(PROMOTE_FILES + 1)]
        for i, p in enumerate(chain):
            nxt = "p%d();" % (i + 1) if i + 1 < len(chain) else ""
            name = "kvt_tier_promote" if i == 0 else "p%d" % i
            files[p] = "void p%d(void);\nvoid %s(void) { %s }\n" % (i + 1, name, nxt)
        for p, t in files.items():
            os.makedirs(os.path.join(d, "src", os.path.dirname(p)), exist_ok=True)
            with open(os.path.join(d, "src", p), "w") as f:
                f.write(t)
        found, _, _ = breaches(d)
        kinds = {"up:": "an edge up", "circle": "a circle", "too long": "a long file",
                 "promote passes": "a deep promote"}
        missing = [what for k, what in kinds.items() if not any(b.startswith(k) for b in found)]
        if not any(b.startswith("circle") and "tier/r1.c" in b for b in found):
            missing.append("a circle through a recursive function")
        if missing:
            raise SystemExit("srcgraph: self-test failed, missed %s in %s"
                             % (", ".join(missing), found))
    finally:
        shutil.rmtree(d)


def main(argv):
    check = "--check" in argv
    args = [a for a in argv if not a.startswith("--")]
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "..")
    if not shutil.which("cflow"):
        print("SKIP(cflow): the source-graph test needs Debian's cflow")
        return 77
    if check:
        self_test()
    found, g, chain = breaches(root)
    print("srcgraph: %d files, %d edges; a promote passes through %d orchestration files: %s"
          % (len(g.files), sum(len(v) for v in g.edges.values()), len(chain), " -> ".join(chain)))
    for b in found:
        print(b)
    return 1 if check and found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
