#!/usr/bin/env python3
"""tier_paths.py - nothing under src/tier/ builds a path inside the cache directory.

The layout of a cache directory has one owner, store/local* (store/local_layout.h names every
entry of it). The tier asks it and passes its policy in. This test reads src/tier/*.c (comments
removed) and fails on:
  * a call that reaches files by name or walks a directory itself (opendir, readdir, mkdirat,
    openat, renameat, unlinkat, fstatat and the project's kvti_* wrappers of them), or joins
    paths (kvti_path_join);
  * a path built by formatting (snprintf and friends, strcat, strcpy) from a string literal
    that holds a '/' or names an entry of the layout.
Messages (kvti_log, KVT_ERR) may name files: they are not paths. It first runs the same rules on
a file it writes with one breach of each kind, so it cannot pass by matching nothing."""
import os
import re
import sys
import tempfile

CALLS = ("opendir", "fdopendir", "readdir", "mkdir", "mkdirat", "openat", "renameat",
         "unlinkat", "fstatat", "lstatat", "kvti_fdopendir", "kvti_mkdirat", "kvti_openat",
         "kvti_openat_quiet", "kvti_renameat", "kvti_unlinkat", "kvti_lstatat",
         "kvti_path_join", "realpath")
BUILDERS = ("snprintf", "sprintf", "vsnprintf", "strcat", "strcpy", "strncat", "strncpy")
LAYOUT = ("index.db", "data", "chunks", "quarantine", "stats.bin", "kvtier.lock", "remote.tmp",
          ".kvc", "chunk-")
CALL_RE = re.compile(r"(?<![\w.>])(%s)\s*\(" % "|".join(map(re.escape, CALLS)))
BUILD_RE = re.compile(r"(?<![\w.>])(%s)\s*\(" % "|".join(BUILDERS))
STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def code_of(text):
    """The text without comments (string literals kept, a '/*' inside one left alone)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text[i] == '"':
            m = STRING.match(text, i)
            j = m.end() if m else i + 1
            out.append(text[i:j])
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def args_of(code, start):
    """The argument text of the call whose '(' is at start (balanced)."""
    depth, i = 0, start
    while i < len(code):
        c = code[i]
        if c == '"':
            m = STRING.match(code, i)
            i = m.end() if m else i + 1
            continue
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return code[start + 1:i]
        i += 1
    return code[start + 1:]


def breaches_in(path):
    with open(path, errors="replace") as f:
        code = code_of(f.read())
    line = lambda pos: code.count("\n", 0, pos) + 1
    out = []
    for m in CALL_RE.finditer(code):
        out.append("%s:%d: %s() reaches the cache's files itself" % (path, line(m.start()),
                                                                    m.group(1)))
    for m in BUILD_RE.finditer(code):
        for s in STRING.findall(args_of(code, m.end() - 1)):
            if "/" in s or any(name in s for name in LAYOUT):
                out.append('%s:%d: %s() builds a path from "%s"' % (path, line(m.start()),
                                                                  m.group(1), s))
    return out


def self_test():
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
        f.write('/* opendir( in a comment is fine */\n'
                'void a(char *p, const char *d) {\n'
                '  kvti_log(t, 1, "%s/index.db is damaged", d);\n'
                '  snprintf(p, 9, "%s/x", d);\n'
                '  snprintf(p, 9, "%s", "stats.bin");\n'
                '  DIR *x = opendir(d);\n'
                '}\n')
    try:
        found = breaches_in(f.name)
    finally:
        os.unlink(f.name)
    want = ['"%s/x"', '"stats.bin"', "opendir()"]
    if len(found) != 3 or not all(any(w in b for b in found) for w in want):
        raise SystemExit("tier_paths: self-test failed: %s" % found)


def main(argv):
    root = argv[0] if argv else os.path.join(os.path.dirname(__file__), "..", "..")
    self_test()
    tier = os.path.join(root, "src", "tier")
    found = []
    for name in sorted(os.listdir(tier)):
        if name.endswith((".c", ".h")):
            found += breaches_in(os.path.join(tier, name))
    for b in found:
        print(b)
    print("tier_paths: %d breach(es) in src/tier" % len(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
