#!/usr/bin/env python3
"""cache_paths.py - neither src/tier/ nor tools/ builds a path inside the cache directory.

The layout of a cache directory has one owner, store/local* (store/local_layout.h names every
entry of it). The tier asks it and passes its policy in; the tools ask it through the public
API (include/kvtier_sys.h: kvt_cache_dir_probe, kvt_cache_dir_list, kvt_cache_name_stat,
kvt_cache_chunk_name). This test reads the C files of both trees (comments removed) and fails
on:
  * in src/tier/: a call that reaches files by name or walks a directory itself (opendir,
    readdir, mkdirat, openat, renameat, unlinkat, fstatat and the project's kvti_* wrappers of
    them), or joins paths (kvti_path_join);
  * in tools/: a call that walks a directory (opendir, fdopendir, readdir, scandir) or stats a
    name without following it (lstat, fstatat) - a tool stats only a directory the user named;
  * in src/tier/: a path built by formatting (snprintf and friends, strcat, strcpy) from a
    string literal that holds a '/' or names an entry of the layout;
  * in tools/: the same from a literal that names an entry of the layout ("data/", "chunks/",
    "quarantine", "index.db", ...) - the tools format other paths of their own (bench runs),
    and messages into buffers (a literal holding a space is a sentence, not a name).
Messages (kvti_log, KVT_ERR, printf, cli_fail) may name files: they are not paths. It first runs
the same rules on files it writes with one breach of each kind, so it cannot pass by matching
nothing."""
import os
import re
import sys
import tempfile

CALLS = ("opendir", "fdopendir", "readdir", "mkdir", "mkdirat", "openat", "renameat",
         "unlinkat", "fstatat", "lstatat", "kvti_fdopendir", "kvti_mkdirat", "kvti_openat",
         "kvti_openat_quiet", "kvti_renameat", "kvti_unlinkat", "kvti_lstatat",
         "kvti_path_join", "realpath")
TOOL_CALLS = ("opendir", "fdopendir", "readdir", "readdir_r", "scandir", "lstat", "fstatat")
BUILDERS = ("snprintf", "sprintf", "vsnprintf", "strcat", "strcpy", "strncat", "strncpy")
LAYOUT = ("index.db", "data", "chunks", "quarantine", "stats.bin", "kvtier.lock", "remote.tmp",
          ".kvc", "chunk-")
# In tools/, a layout name as a path component: "data/", "%s/chunks", "quarantine", ...
TOOL_LAYOUT = re.compile(r"(?:^|/)(?:data|chunks)(?:/|$)|quarantine|index\.db|stats\.bin|"
                         r"kvtier\.lock|remote\.tmp|\.kvc\b|chunk-")


def calls_re(names):
    return re.compile(r"(?<![\w.>])(%s)\s*\(" % "|".join(map(re.escape, names)))


BUILD_RE = calls_re(BUILDERS)
STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def code_of(text):
    """The text without comments (string literals and newlines kept, a '/*' inside a literal
    left alone)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(" " + "\n" * text.count("\n", i, j))  # lines stay where they were
            i = j
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


def tier_path(s):
    return "/" in s or any(name in s for name in LAYOUT)


def tool_path(s):
    """A literal naming the layout, unless it is a sentence (a message formatted into a buffer,
    which holds spaces; no name of the layout does)."""
    return " " not in s and TOOL_LAYOUT.search(s) is not None


def breaches_in(path, calls=CALLS, is_path=tier_path):
    with open(path, errors="replace") as f:
        code = code_of(f.read())
    line = lambda pos: code.count("\n", 0, pos) + 1
    out = []
    for m in calls_re(calls).finditer(code):
        out.append("%s:%d: %s() reaches the cache's files itself" % (path, line(m.start()),
                                                                    m.group(1)))
    for m in BUILD_RE.finditer(code):
        for s in STRING.findall(args_of(code, m.end() - 1)):
            if is_path(s):
                out.append('%s:%d: %s() builds a path from "%s"' % (path, line(m.start()),
                                                                  m.group(1), s))
    return out


def expect(text, want, **rules):
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
        f.write(text)
    try:
        found = breaches_in(f.name, **rules)
    finally:
        os.unlink(f.name)
    if len(found) != len(want) or not all(any(w in b for b in found) for w in want):
        raise SystemExit("cache_paths: self-test failed: %s" % found)


def self_test():
    expect('/* opendir( in a comment is fine */\n'
           'void a(char *p, const char *d) {\n'
           '  kvti_log(t, 1, "%s/index.db is damaged", d);\n'
           '  snprintf(p, 9, "%s/x", d);\n'
           '  snprintf(p, 9, "%s", "stats.bin");\n'
           '  DIR *x = opendir(d);\n'
           '}\n', ['"%s/x"', '"stats.bin"', "opendir()"])
    expect('/* readdir( in a comment is fine */\n'
           'void a(char *p, const char *d, struct stat *st) {\n'
           '  cli_fail(1, "verify", 3, "%s/index.db: cannot read", d);\n'
           '  snprintf(p, 9, "%s/run-%d", d, 1);\n'
           '  snprintf(p, 9, "none: no stats.bin in %s", d);\n'
           '  stat(d, st);\n'
           '  snprintf(p, 9, "%s/data/%s", d, "x");\n'
           '  snprintf(p, 9, "chunks/%.2s/%s.kvc", d, d);\n'
           '  snprintf(p, 9, "%s/%s", d, "quarantine");\n'
           '  DIR *x = opendir(d);\n'
           '  struct dirent *e = readdir(x);\n'
           '  lstat(p, st);\n'
           '}\n', ['"%s/data/%s"', '"chunks/%.2s/%s.kvc"', '"quarantine"', "opendir()",
                    "readdir()", "lstat()"], calls=TOOL_CALLS, is_path=tool_path)


def sources(d):
    return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith((".c", ".h"))]


def main(argv):
    root = argv[0] if argv else os.path.join(os.path.dirname(__file__), "..", "..")
    self_test()
    found = []
    for path in sources(os.path.join(root, "src", "tier")):
        found += breaches_in(path)
    tools = sources(os.path.join(root, "tools"))
    if not tools:
        found.append("%s: no C files: the tools' rules checked nothing" % root)
    for path in tools:
        found += breaches_in(path, calls=TOOL_CALLS, is_path=tool_path)
    for b in found:
        print(b)
    print("cache_paths: %d breach(es) in src/tier and tools" % len(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
