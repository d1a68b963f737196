#!/usr/bin/env python3
"""entry_seam.py - every store fills every operation of the entry-store seam.

src/store/backend.h declares the entry-store seam (kvti_backend_ops) and, beside it, what only a
remote store does (kvti_remote_ops). The tier drives the local store and a remote one through the
seam the same way, which holds only while no backend leaves an operation NULL: what one kind of
store alone has belongs outside the seam (store/local.h's kvti_backend_local_* for the local
directory, kvti_remote_ops for a remote store). This test reads the source (comments removed) and
fails on:
  * a kvti_backend_ops table under src/store/ that does not set every member of the vtable;
  * a kvti_remote_ops table anywhere under src/ that does not set every member;
  * a known implementation (the local and the Redis backend) without its table, so the test
    cannot pass by finding none.
Tables outside src/store/ are not stores and are not checked (tier/rchunks.c's read-only shim
over a staging directory fills get alone, and only the chunked read, which asks nothing else of a
backend that is not local, ever sees it). It first runs the same rules on files it writes with
one breach of each kind."""
import os
import re
import sys
import tempfile

IMPLS = {"store/local.c": ("kvti_backend_ops",),
         "store/redis/backend.c": ("kvti_backend_ops", "kvti_remote_ops")}
TABLE_RE = r"\b%s\s+(\w+)\s*=\s*\{(.*?)\};"


def code_of(text):
    """The text without comments (newlines kept)."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text,
                  flags=re.S)


def members(header, vtable):
    """The member names of typedef struct vtable { ... } vtable; in header."""
    with open(header, errors="replace") as f:
        code = code_of(f.read())
    m = re.search(r"typedef struct %s \{(.*?)\} %s;" % (vtable, vtable), code, re.S)
    if not m:
        raise SystemExit("entry_seam: no %s in %s" % (vtable, header))
    names = re.findall(r"\(\s*\*\s*(\w+)\s*\)\s*\(", m.group(1))
    names += re.findall(r"\b(\w+)\s*;", re.sub(r"\([^;]*\)\s*;", " @;", m.group(1)))
    return sorted(set(names))


def tables(path, vtable):
    """(name, set of designated members) of each vtable table defined in path."""
    with open(path, errors="replace") as f:
        code = code_of(f.read())
    return [(m.group(1), set(re.findall(r"\.(\w+)\s*=", m.group(2))))
            for m in re.finditer(TABLE_RE % vtable, code, re.S)]


def table_breaches(path, vtable, want):
    return ["%s: %s %s leaves %s NULL" % (path, vtable, name, op)
            for name, have in tables(path, vtable) for op in want if op not in have]


def check(src, header, impls=IMPLS):
    want = {v: members(header, v) for v in ("kvti_backend_ops", "kvti_remote_ops")}
    found = []
    for d, _, fs in os.walk(src):
        for n in sorted(fs):
            if not n.endswith(".c"):
                continue
            path = os.path.join(d, n)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            if rel.startswith("store/"):
                found += table_breaches(path, "kvti_backend_ops", want["kvti_backend_ops"])
            found += table_breaches(path, "kvti_remote_ops", want["kvti_remote_ops"])
    for rel, kinds in sorted(impls.items()):
        path = os.path.join(src, rel)
        for v in kinds:
            if not os.path.isfile(path) or not tables(path, v):
                found.append("%s: no %s table" % (path, v))
    return found


def self_test():
    with tempfile.TemporaryDirectory() as d:
        def write(rel, text):
            p = os.path.join(d, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(text)
        write("store/backend.h",
              "typedef struct kvti_backend_ops {\n  const char *name;\n"
              "  int (*put)(int a, int b);\n  /* int (*old)(void); */\n"
              "  void (*destroy)(int);\n} kvti_backend_ops;\n"
              "typedef struct kvti_remote_ops {\n  int (*find)(void);\n  int (*reach)(void);\n"
              "} kvti_remote_ops;\n")
        write("store/local.c", 'static const kvti_backend_ops l = {.name = "local", .put = p,\n'
              "  /* .destroy = d, */};\n")
        write("store/redis/backend.c",
              'static const kvti_backend_ops r = {.name = "r", .put = p, .destroy = d};\n'
              "static const kvti_remote_ops q = {.find = f};\n")
        write("tier/shim.c", "static const kvti_backend_ops s = {.name = \"s\"};\n")
        impls = dict(IMPLS, **{"store/gone.c": ("kvti_backend_ops",)})
        found = check(d, os.path.join(d, "store", "backend.h"), impls)
    expected = {"l leaves destroy NULL", "q leaves reach NULL", "gone.c: no kvti_backend_ops"}
    seen = {w for w in expected for b in found if w in b}
    if seen != expected or len(found) != len(expected):
        raise SystemExit("entry_seam: self-test failed: %s" % found)


def main(argv):
    self_test()
    src = os.path.join(argv[0] if argv else os.path.join(os.path.dirname(__file__), "..", ".."),
                       "src")
    breaches = check(src, os.path.join(src, "store", "backend.h"))
    print("\n".join(breaches + ["entry_seam: %d breach(es)" % len(breaches)]))
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
