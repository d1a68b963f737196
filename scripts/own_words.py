#!/usr/bin/python3
"""own_words.py - finds Python text of the project that was transcribed from
outside code: runs of six or more consecutive lines of a tracked Python file
(bindings/, tests/, bench/, scripts/, tools/) that also occur, consecutively,
in the reference's source as the seed prints it (../shared/seed/
ssd_cache_reference.txt, in the original module's order) or in one of the
upstream client's files (../shared/upstream/**/*.py).

Lines are compared after normalisation (all whitespace removed, single quotes
made double), and lines that carry no authorship are left out on both sides
before runs are formed: blank lines, imports, ``def``/``class`` signatures
(multi-line ones whole), decorators, lines of lone brackets, and constants -
an assignment of a literal, or a line that is only a literal (a dict item of
a literal table, a piece of an SQL string, say).  Docstrings always count,
one-line ones included.  Facts such as names, signatures and tables may carry
over; six consecutive lines of statements, docstrings or comments may not.

Usage: scripts/own_words.py [--min N] [--shared DIR] [--json] [FILE...]
Without FILE, every tracked Python file under the directories above.  Prints
one line per run, ``path:first-last: N lines also in SOURCE:line``; exit
status 0 when there is none, 1 when there are runs, 3 when ../shared (or
--shared / $KVT_SHARED_DIR) lacks the seed or the upstream files.
tests/python/test_own_words.py runs it as a test.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

import reference_loader  # noqa: E402

AREAS = ("bindings", "tests", "bench", "scripts", "tools")
MIN_RUN = 6
EXIT_UNAVAILABLE = reference_loader.EXIT_UNAVAILABLE

_LONE_BRACKETS = re.compile(r"^[()\[\]{}:,;\s]*$")
_SIGNATURE = re.compile(r"^(async\s+def|def|class)\s")
_IMPORT = re.compile(r"^(import\s|from\s+\S+\s+import\b)")
_LITERAL_NODES = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BinOp,
                  ast.UnaryOp, ast.operator, ast.unaryop, ast.expr_context)


def _is_literal_expr(text: str) -> bool:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return all(isinstance(n, _LITERAL_NODES) or n is tree for n in ast.walk(tree))


def _is_constant(line: str) -> bool:
    """An assignment of a literal (``X = 4``, ``n: int = 0``, ``A = 1 << 20``)
    or a line that is only a literal or a literal dict item."""
    body = line.rstrip(",")
    if _is_literal_expr(body) or _is_literal_expr("{" + body + "}"):
        return True
    m = re.match(r"^[A-Za-z_][\w.]*\s*(?::[^=]+)?=\s*(.+)$", line)
    return bool(m) and "==" not in line and _is_literal_expr(m.group(1).rstrip(","))


def _depth_change(line: str) -> int:
    """Bracket balance of a line, strings and comments left out (roughly:
    enough to follow a multi-line signature or import)."""
    depth = 0
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif line.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif c == "#":
            break
        elif c in "\"'":
            quote = c * 3 if line.startswith(c * 3, i) else c
            i += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        i += 1
    return depth


def _literal_tree(node: ast.AST) -> bool:
    return all(isinstance(n, _LITERAL_NODES) for n in ast.walk(node))


def docstring_and_constant_lines(text: str) -> tuple[set[int], set[int]]:
    """Line numbers of the file's docstrings (prose, however literal a
    one-line docstring looks) and of its literal assignments spanning lines
    (a table written over several lines); both empty when the text does not
    parse, and the per-line rules alone apply."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return set(), set()
    prose: set[int] = set()
    constants: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                prose.update(range(first.lineno, first.end_lineno + 1))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None \
                and _literal_tree(node.value):
            constants.update(range(node.lineno, node.end_lineno + 1))
    return prose, constants - prose


def _strip_comment(line: str) -> str:
    """The line without its trailing comment (a ``#`` outside strings)."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif line.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif c == "#":
            return line[:i].rstrip()
        elif c in "\"'":
            quote = c * 3 if line.startswith(c * 3, i) else c
            i += len(quote) - 1
        i += 1
    return line


#: The two views a file is compared in: "text", every line that counts
#: (comments and docstrings included), and "code", the statements alone
#: (comments and docstrings dropped), so that neither copying prose nor
#: copying code with its comments taken out goes unseen.
VIEWS = ("text", "code")


def significant_lines(text: str, view: str = "text") -> list[tuple[int, str]]:
    """(line number, normalised text) of the lines that count in ``view``."""
    out = []
    prose, constants = docstring_and_constant_lines(text)
    carry = 0  # open brackets of a signature or import still being read
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if carry > 0:
            carry += _depth_change(line)
            continue
        if no in prose:
            if view == "text" and line:
                out.append((no, "".join(line.split()).replace("'", '"')))
            continue
        if no in constants:
            continue
        if view == "code":
            line = _strip_comment(line)
        if not line or _LONE_BRACKETS.match(line) or line.startswith("@"):
            continue
        if _SIGNATURE.match(line) or _IMPORT.match(line):
            carry = max(0, _depth_change(line))
            continue
        if _is_constant(line):
            continue
        out.append((no, "".join(line.split()).replace("'", '"')))
    return out


def _windows(lines: list[tuple[int, str]], n: int):
    for i in range(len(lines) - n + 1):
        yield i, hash(tuple(t for _, t in lines[i:i + n]))


class Sources:
    """Every n-line window of the outside texts, by view and hash."""

    def __init__(self, n: int):
        self.n = n
        self.where: dict[str, dict[int, tuple[str, int]]] = {v: {} for v in VIEWS}

    def add(self, name: str, text: str) -> None:
        for view in VIEWS:
            self.add_lines(name, view, significant_lines(text, view))

    def add_lines(self, name: str, view: str, lines: list[tuple[int, str]]) -> None:
        table = self.where[view]
        for i, h in _windows(lines, self.n):
            table.setdefault(h, (name, lines[i][0]))


def seed_stream(text: str, view: str) -> list[tuple[int, str]]:
    """The significant lines of the seed's source blocks (numbered as in the
    seed), block after block in the original module's order (the listing's
    line ranges; module attributes first): the order a transcription of the
    module would follow, so runs across short members are found too."""
    blocks = []
    for seq, m in enumerate(reference_loader.parse_seed(text)):
        if m.source:
            start = m.init_range[0] if "." not in m.name and m.init_range[0] else m.first_line
            code = "\n".join(m.source)
            blocks.append(((start, seq), [(m.source_line + no - 1, t)
                                          for no, t in significant_lines(code, view)]))
        elif "module-attribute" in m.tags or "class-attribute" in m.tags:
            line = next((ln.strip() for ln in m.text if ln.strip()), "")
            blocks.append(((0, seq), [(m.text_line, t)
                                      for _, t in significant_lines(line, view)]))
    out: list[tuple[int, str]] = []
    for _, lines in sorted(blocks, key=lambda b: b[0]):
        out.extend(lines)
    return out


def load_sources(shared: str, n: int) -> Sources:
    seed = os.path.join(shared, reference_loader.SEED_NAME)
    upstream = os.path.join(shared, "upstream")
    src = Sources(n)
    text = reference_loader.read_seed(seed)
    for view in VIEWS:
        src.add_lines(reference_loader.SEED_NAME, view, seed_stream(text, view))
    found = 0
    for d, _, files in os.walk(upstream):
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                with open(p, encoding="utf-8", errors="replace") as fh:
                    src.add(os.path.relpath(p, shared), fh.read())
                found += 1
    if not found:
        raise reference_loader.ReferenceUnavailable(f"no .py files under {upstream}")
    return src


def project_files(root: str = ROOT) -> list[str]:
    """Tracked Python files of the checked areas (every such file under them
    when the tree is not a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--", *AREAS],
                             capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for area in AREAS:
            for d, dirs, names in os.walk(os.path.join(root, area)):
                dirs[:] = [x for x in dirs if not x.startswith((".", "build"))]
                files += [os.path.relpath(os.path.join(d, x), root) for x in names]
    return sorted(f for f in files if f.endswith(".py"))


def runs_in(path: str, text: str, sources: Sources) -> list[dict]:
    """The file's runs of n or more lines found in an outside text, in either
    view; runs that overlap (one view's and the other's) are reported once,
    joined."""
    n = sources.n
    spans = []
    for view in VIEWS:
        lines = significant_lines(text, view)
        table = sources.where[view]
        cur = None
        for i, h in _windows(lines, n):
            if h not in table:
                continue
            if cur is not None and i <= cur["_end"] + 1:
                cur["_end"] = i
                continue
            cur = {"_start": i, "_end": i, "hit": table[h], "lines": lines}
            spans.append(cur)
    runs = []
    for sp in spans:
        lines = sp["lines"]
        runs.append({"path": path, "first": lines[sp["_start"]][0],
                     "last": lines[sp["_end"] + n - 1][0],
                     "lines": sp["_end"] - sp["_start"] + n,
                     "source": sp["hit"][0], "source_line": sp["hit"][1]})
    runs.sort(key=lambda r: (r["first"], -r["last"]))
    merged: list[dict] = []
    for r in runs:
        if merged and r["first"] <= merged[-1]["last"]:
            m = merged[-1]
            if r["last"] > m["last"]:
                m["last"] = r["last"]
                m["lines"] = max(m["lines"], r["lines"])
            continue
        merged.append(dict(r))
    return merged


def find_runs(files=None, shared=None, n: int = MIN_RUN) -> list[dict]:
    """Every run of n or more transcribed lines in the given (or all tracked)
    files. Raises ReferenceUnavailable when the outside texts are missing."""
    shared = shared or reference_loader.shared_dir()
    sources = load_sources(shared, n)
    found = []
    for f in files if files is not None else project_files():
        p = f if os.path.isabs(f) else os.path.join(ROOT, f)
        with open(p, encoding="utf-8", errors="replace") as fh:
            found += runs_in(os.path.relpath(p, ROOT), fh.read(), sources)
    return found


def format_run(r: dict) -> str:
    return (f"{r['path']}:{r['first']}-{r['last']}: {r['lines']} lines also in "
            f"{r['source']}:{r['source_line']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--min", type=int, default=MIN_RUN, help="shortest run reported (6)")
    ap.add_argument("--shared", help="the shared directory (default: $KVT_SHARED_DIR, "
                                     "else ../shared beside the repository)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    if args.min < 2:
        ap.error("--min must be at least 2")
    try:
        found = find_runs(args.files or None, args.shared, args.min)
    except reference_loader.ReferenceUnavailable as e:
        print(f"own_words: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.json:
        json.dump({"runs": found, "count": len(found)}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for r in found:
            print(format_run(r))
        print(f"own_words: {len(found)} run(s) of {args.min}+ transcribed lines",
              file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
