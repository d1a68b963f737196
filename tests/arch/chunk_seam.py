#!/usr/bin/env python3
"""chunk_seam.py - the tier reaches chunks, local or remote, only through the chunk-store seam.

src/store/chunk_backend.h is the chunk-store seam: has, get, put, remove and lookup of chunk
files, implemented by the local chunk store (store/chunkstore_seam.c) and the Redis store
(store/redis/chunks.c). The entry-store seam (store/backend.h) hands out a backend's chunk
store and has no chunk operation of its own. This test reads the source (comments removed) and
fails on:
  * a call from src/tier/ to a function the seam stands for: the local store's
    kvti_chunkstore_read_bytes/_adopt/_lookup/_remove, the local seam's constructor, anything
    of the Redis backend's (kvti_rb_*, kvr_*), or an include of a store/redis/ header;
  * a src/tier/ file outside LOCAL_CHUNKS_OK that includes a local chunk store header
    (store/chunkstore*.h, store/local_chunks.h) directly: the tier's chunk orchestration reaches
    local chunks as it reaches remote ones, through the seam and the chunked store
    (store/chunked.h); LOCAL_CHUNKS_OK names the few files whose work is the local chunk
    directory's own and has no seam operation, each with its reason;
  * a member of kvti_backend_ops (store/backend.h) named chunk_*: chunk operations belong to
    the chunk-store vtable;
  * a chunk-store vtable missing one of the five operations in either implementation.
It first runs the same rules on files it writes with one breach of each kind, so it cannot
pass by matching nothing."""
import os
import re
import sys
import tempfile

BEHIND_SEAM = ("kvti_chunkstore_read_bytes", "kvti_chunkstore_adopt", "kvti_chunkstore_lookup",
               "kvti_chunkstore_remove", "kvti_chunkstore_seam_init")
CALL_RE = re.compile(r"(?<![\w.>])(%s|kvti_rb_\w+|kvr_\w+)\s*\(" % "|".join(BEHIND_SEAM))
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"(store/redis/[^"]+)"', re.M)
LOCAL_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"(store/(?:chunkstore\w*|local_chunks)\.h)"', re.M)
LOCAL_CHUNKS_OK = {
    # The tools' view and upkeep of chunks/ (verify one file, contain damage, gc of strays,
    # the lazy sweep): the local directory's maintenance, which a remote store does not have
    # and the seam (has, get, put, remove, lookup) does not carry.
    "chunk_tools.c": "local chunk maintenance",
    # The host RAM tier checks a cached chain against the local chunk files it stands for
    # (kvti_chunkstore_verify_mem; the chain itself it asks the chunked store for): a chain is
    # always served from the local store (a remote one after its chunks were copied in), so a
    # RAM copy only ever replaces local files.
    "ram_chain.c": "RAM copies checked against local chunk files",
}
OPS = ("has", "get", "put", "remove", "lookup")
IMPLS = ("store/chunkstore_seam.c", "store/redis/chunks.c")


def code_of(text, strings=True):
    """The text without comments (newlines kept), string literals kept or blanked."""
    def repl(m):
        if m.group(1):
            return m.group(1) if strings else '""'
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r'/\*.*?\*/|//[^\n]*|("(?:[^"\\]|\\.)*")', repl, text, flags=re.S)


def tier_breaches(path):
    with open(path, errors="replace") as f:
        text = f.read()
    code, bare = code_of(text), code_of(text, strings=False)
    line = lambda pos: code.count("\n", 0, pos) + 1
    out = ["%s:%d: %s() is behind the chunk-store seam" % (path, line(m.start()), m.group(1))
           for m in CALL_RE.finditer(bare)]
    out += ["%s:%d: includes %s, a backend's inside" % (path, line(m.start(1)), m.group(1))
            for m in INCLUDE_RE.finditer(code)]
    if os.path.basename(path) not in LOCAL_CHUNKS_OK:
        out += ["%s:%d: includes %s: the local chunk store is reached through the seam"
                % (path, line(m.start(1)), m.group(1)) for m in LOCAL_INCLUDE_RE.finditer(code)]
    return out


def entry_vtable_breaches(path):
    with open(path, errors="replace") as f:
        code = code_of(f.read())
    m = re.search(r"typedef struct kvti_backend_ops \{(.*?)\} kvti_backend_ops;", code, re.S)
    if not m:
        return ["%s: no kvti_backend_ops" % path]
    return ["%s: kvti_backend_ops has %s: a chunk operation outside the chunk-store seam"
            % (path, name) for name in re.findall(r"\(\s*\*\s*(chunk_\w+)\s*\)", m.group(1))]


def impl_breaches(path):
    if not os.path.isfile(path):
        return ["%s: missing: the store has no chunk-store vtable" % path]
    with open(path, errors="replace") as f:
        code = code_of(f.read())
    m = re.search(r"kvti_chunk_backend_ops\s+\w+\s*=\s*\{(.*?)\};", code, re.S)
    if not m:
        return ["%s: no kvti_chunk_backend_ops table" % path]
    have = set(re.findall(r"\.(\w+)\s*=", m.group(1)))
    return ["%s: the chunk-store vtable lacks %s" % (path, op) for op in OPS if op not in have]


def self_test():
    d = tempfile.mkdtemp()
    try:
        tier, be, impl, ok = (os.path.join(d, n)
                              for n in ("t.c", "backend.h", "impl.c", "chunk_tools.c"))
        with open(ok, "w") as f:
            f.write('#include "store/local_chunks.h"\n')
        with open(tier, "w") as f:
            f.write('/* kvti_rb_chunk_get( in a comment is fine */\n'
                    '#include "store/redis/internal.h"\n'
                    '#include "store/chunkstore_verify.h"\n'
                    '#include "store/chunked.h"\n'
                    'void a(void) {\n'
                    '  kvti_log(t, 1, "kvti_chunkstore_adopt( in a message");\n'
                    '  kvti_chunkstore_read_bytes(cs, k, &b, &n, 9);\n'
                    '  kvti_rb_chunks_init(rb);\n'
                    '}\n')
        with open(be, "w") as f:
            f.write("typedef struct kvti_backend_ops {\n  int (*put)(void);\n"
                    "  int (*chunk_get)(void);\n} kvti_backend_ops;\n")
        with open(impl, "w") as f:
            f.write("static const kvti_chunk_backend_ops o = {.name = \"x\", .has = h,\n"
                    "  .get = g, .put = p, .lookup = l};\n")
        found = tier_breaches(tier) + tier_breaches(ok) + entry_vtable_breaches(be)
        found += impl_breaches(impl)
    finally:
        for n in os.listdir(d):
            os.unlink(os.path.join(d, n))
        os.rmdir(d)
    want = ("kvti_chunkstore_read_bytes()", "kvti_rb_chunks_init()", "store/redis/internal.h",
            "chunk_get", "lacks remove", "store/chunkstore_verify.h: the local chunk store")
    if len(found) != len(want) or not all(any(w in b for b in found) for w in want):
        raise SystemExit("chunk_seam: self-test failed: %s" % found)


def main(argv):
    root = argv[0] if argv else os.path.join(os.path.dirname(__file__), "..", "..")
    self_test()
    src = os.path.join(root, "src")
    tier = os.path.join(src, "tier")
    sources = [os.path.join(tier, n) for n in sorted(os.listdir(tier)) if n.endswith((".c", ".h"))]
    found = [b for p in sources for b in tier_breaches(p)]
    found += entry_vtable_breaches(os.path.join(src, "store", "backend.h"))
    found += [b for impl in IMPLS for b in impl_breaches(os.path.join(src, impl))]
    print("".join(b + "\n" for b in found) + "chunk_seam: %d breach(es)" % len(found))
    return 1 if found else 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
