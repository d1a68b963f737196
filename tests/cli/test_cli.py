#!/usr/bin/python3
"""CLI tests: run the `kvtier` binary against prepared cache directories and
check exit codes, --json output and the effect on the directory.

Directories: good (written by `kvtier bench --keep` with several presets,
dtypes and both storage modes), corrupted (a byte flipped in a layer file,
an entry directory removed, orphan and stale tmp directories), written by the
reference (tests/reference/make_ref_cache.py, when present), empty, missing,
not a directory, not a cache.

Usage: test_cli.py --kvtier PATH [--holder PATH] --src SRCDIR GROUP
GROUP: help, errors, empty, good, corrupt, gc, chunks, reference, bench, live
(live: `kvtier stats` reading the live counters of a running process,
tests/cli/live_holder.c, given by --holder).
Exit 0 pass, 1 fail, 77 skipped.  Data is generated (seeded), never
downloaded; nothing here asserts timings.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

KVTIER = None
HOLDER = None
SRC = None
FAILURES = []
COMMANDS = ["ls", "stats", "show", "verify", "gc", "reindex", "bench"]


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what, file=sys.stderr)
    return cond


def run(*args, timeout=300, env=None):
    p = subprocess.run([KVTIER, *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


def run_json(*args, expect=0):
    rc, out, err = run(*args, "--json")
    check(rc == expect, f"{' '.join(args)} --json: exit {rc}, expected "
                        f"{expect}; stderr: {err.strip()[:400]}")
    try:
        return json.loads(out)
    except ValueError:
        check(False, f"{' '.join(args)} --json: stdout is not JSON: "
                     f"{out[:200]!r}")
        return {}


def tmpdir(tag):
    d = tempfile.mkdtemp(prefix=f"kvtier-cli-{tag}-")
    return d


def tree_state(d):
    """Names, sizes, mtimes of every file below d, plus index.db's digest:
    what a read-only command must leave exactly as it was."""
    state = {}
    for root, _dirs, files in os.walk(d):
        for f in files:
            if f.startswith("index.db-"):  # SQLite's shm/wal side files
                continue
            p = os.path.join(root, f)
            st = os.lstat(p)
            state[os.path.relpath(p, d)] = (st.st_size, st.st_mtime_ns)
    idx = os.path.join(d, "index.db")
    if os.path.exists(idx):
        with open(idx, "rb") as fh:
            state["index.db#sha"] = hashlib.sha256(fh.read()).hexdigest()
    return state


def run_with_tty_stderr(*args):
    """Runs kvtier with stderr on a pseudo-terminal; returns what it wrote
    there."""
    import pty
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([KVTIER, *args], stdout=subprocess.DEVNULL,
                             stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                b = os.read(master, 4096)
            except OSError:  # EIO once the child closed the pty
                break
            if not b:
                break
            chunks.append(b)
        p.wait(timeout=120)
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def make_good(d, small=False):
    """A cache written by kvtier itself: 4 presets/modes, 2 entries each."""
    runs = [
        ["--preset", "llama3-8b", "--seed", "1"],
        ["--preset", "hybrid", "--seed", "2", "--dtype", "bf16"],
        ["--preset", "quantized", "--seed", "3"],
        ["--preset", "llama3-8b", "--seed", "4", "--storage", "compat",
         "--dtype", "bf16", "--durability", "none"],
    ]
    if small:
        runs = runs[:1]
    for extra in runs:
        rc, out, err = run("bench", d, "--quick", "--no-disk", "--keep",
                           "--no-progress", "--entries", "2", "--tokens",
                           "16", *extra)
        if not check(rc == 0, f"bench {extra} to prepare {d}: exit {rc}: "
                              f"{err.strip()[:400]}"):
            raise SystemExit(1)


def entries(d):
    return run_json("ls", d).get("entries", [])


# ---- groups --------------------------------------------------------------


def t_help():
    rc, out, err = run("--help")
    check(rc == 0, "--help exits 0")
    for c in COMMANDS:
        check(c in out, f"--help mentions {c}")
    check("Exit codes" in out, "--help documents exit codes")
    for c in COMMANDS:
        rc, out, _ = run(c, "--help")
        check(rc == 0, f"{c} --help exits 0")
        check(out.startswith(f"usage: kvtier {c}"), f"{c} --help usage line")
        check("--json" in out, f"{c} --help mentions --json")
    rc, out, _ = run("help", "gc")
    check(rc == 0 and "--dry-run" in out, "help gc")
    rc, out, _ = run("--version")
    check(rc == 0 and out.startswith("kvtier "), "--version")
    rc, _, err = run()
    check(rc == 2 and "usage" in err, "no arguments: usage, exit 2")
    rc, _, err = run("frobnicate")
    check(rc == 2 and "unknown command" in err, "unknown command: exit 2")
    rc, _, err = run("ls", "/tmp", "--bogus")
    check(rc == 2 and "unknown option" in err, "unknown option: exit 2")
    rc, _, _ = run("ls")
    check(rc == 2, "ls without DIR: exit 2")
    rc, _, _ = run("ls", "a", "b")
    check(rc == 2, "ls with two DIRs: exit 2")
    rc, _, _ = run("show", "/tmp")
    check(rc == 2, "show without HASH: exit 2")
    rc, _, _ = run("gc", "/tmp")
    check(rc == 2, "gc without limits: exit 2")
    for bad in (["--max-size", "10Q"], ["--max-size", "-1"],
                ["--max-entries", "0"], ["--older-than", "7x"],
                ["--older-than", "0"]):
        rc, _, _ = run("gc", "/tmp", *bad)
        check(rc == 2, f"gc {bad}: exit 2")
    for bad in (["--preset", "gpt5"], ["--dtype", "f8"],
                ["--storage", "zip"], ["--durability", "maybe"],
                ["--entries", "0"], ["--tokens", "x"]):
        rc, _, _ = run("bench", *bad)
        check(rc == 2, f"bench {bad}: exit 2")
    rc, out, _ = run("ls", "--sort", "colour", "/tmp", "--json")
    check(rc == 2, "ls --sort colour: exit 2")


def t_errors():
    base = tmpdir("errors")
    try:
        missing = os.path.join(base, "missing")
        afile = os.path.join(base, "file")
        with open(afile, "w") as fh:
            fh.write("not a cache\n")
        notcache = os.path.join(base, "notcache")
        os.mkdir(notcache)
        with open(os.path.join(notcache, "README"), "w") as fh:
            fh.write("hello\n")
        cases = [(missing, "no such directory"), (afile, "not a directory"),
                 (notcache, "not a kvtier cache")]
        for path, msg in cases:
            for cmd in (["ls"], ["stats"], ["show", None, "abcd1234"],
                        ["verify"], ["verify", None, "--repair"],
                        ["gc", None, "--max-entries", "1"],
                        ["stats", None, "--prometheus"]):
                args = [cmd[0], path] + [a for a in cmd[2:]]
                rc, out, err = run(*args)
                check(rc == 3, f"{args}: exit {rc}, expected 3")
                check(msg in err, f"{args}: stderr names the problem "
                                  f"({msg!r}): {err.strip()!r}")
                check("Traceback" not in err and "Sanitizer" not in err,
                      f"{args}: no crash")
            d = run_json("ls", path, expect=3)
            check(d.get("error", {}).get("exit_code") == 3,
                  f"ls {path} --json: error object with exit_code 3")
            check(msg in d.get("error", {}).get("message", ""),
                  f"ls {path} --json: error message")
        # data/ without an index; a garbage index.db; an unsafe mode.
        noindex = os.path.join(base, "noindex")
        os.makedirs(os.path.join(noindex, "data"))
        rc, _, err = run("ls", noindex)
        check(rc == 3 and "no index.db" in err, f"data/ without index: {err}")
        garbage = os.path.join(base, "garbage")
        os.makedirs(os.path.join(garbage, "data"), mode=0o700)
        os.chmod(garbage, 0o700)
        with open(os.path.join(garbage, "index.db"), "wb") as fh:
            fh.write(b"this is not an SQLite database" * 100)
        for cmd in (["ls"], ["stats"], ["verify"]):
            rc, _, err = run(cmd[0], garbage)
            check(rc == 3 and "cannot open cache" in err,
                  f"{cmd[0]} garbage index.db: exit {rc}: {err.strip()}")
            check("Sanitizer" not in err, "garbage index.db: no crash")
        unsafe = os.path.join(base, "unsafe")
        make_good(unsafe, small=True)
        os.chmod(unsafe, 0o777)
        rc, _, err = run("ls", unsafe)
        check(rc == 3 and "cannot open cache" in err,
              f"group/world-writable cache refused: exit {rc}: {err}")
        check(not os.path.exists(missing), "nothing created for a missing dir")
        check(os.listdir(notcache) == ["README"], "not-a-cache dir untouched")
        # Unreadable directory (meaningless as root, who reads anything).
        if os.geteuid() != 0:
            locked = os.path.join(base, "locked")
            os.mkdir(locked, 0o000)
            rc, _, err = run("ls", locked)
            check(rc == 3 and "cannot" in err, "unreadable dir: exit 3")
            os.chmod(locked, 0o700)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def t_empty():
    d = tmpdir("empty")
    try:
        j = run_json("ls", d)
        check(j.get("total") == 0 and j.get("entries") == [], "empty: ls")
        rc, out, _ = run("ls", d)
        check(rc == 0 and "no entries" in out, "empty: human ls")
        j = run_json("stats", d)
        check(j.get("entries") == 0 and j.get("disk_bytes") == 0,
              "empty: stats")
        rc, out, _ = run("stats", d, "--prometheus")
        check(rc == 0 and "kvtier_" in out, "empty: prometheus")
        j = run_json("verify", d)
        check(j.get("checked") == 0 and j.get("clean") is True,
              "empty: verify")
        run_json("verify", d, "--repair")
        j = run_json("gc", d, "--max-entries", "1")
        check(j.get("removed_count") == 0, "empty: gc")
        rc, _, _ = run("show", d, "abcdef12")
        check(rc == 5, f"empty: show exit {rc}, expected 5")
        check(os.listdir(d) == [], "empty: nothing created in the directory")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def t_good():
    d = tmpdir("good")
    try:
        make_good(d)
        before = tree_state(d)
        j = run_json("ls", d)
        es = j.get("entries", [])
        check(j.get("total") == 8 and len(es) == 8, f"ls: 8 entries, got "
                                                    f"{j.get('total')}")
        keys = ["token_hash", "prefix_hash", "num_tokens", "disk_bytes",
                "memory_bytes", "created_at", "accessed_at", "storage_mode",
                "num_layers", "layer_kinds", "dtypes"]
        for e in es:
            for k in keys:
                check(k in e, f"ls entry has {k}")
            check(e.get("num_tokens") == 16, "ls: tokens")
            check(e.get("num_layers") == 32, "ls: 32 layers")
            check(e.get("disk_bytes", 0) > 0, "ls: disk bytes")
            check("error" not in e, f"ls: entry readable: {e.get('error')}")
        kinds = set()
        for e in es:
            kinds |= set(e.get("layer_kinds", {}))
        check({"kv", "arrays", "quant"} <= kinds, f"ls: kinds {kinds}")
        modes = {e.get("storage_mode") for e in es}
        check(modes == {"native", "compat"}, f"ls: modes {modes}")
        dts = set()
        for e in es:
            dts |= set(e.get("dtypes", []))
        check({"F16", "BF16", "U32", "F32"} <= dts, f"ls: dtypes {dts}")
        # sort and limit
        j = run_json("ls", d, "--sort", "size", "--limit", "3")
        sizes = [e["disk_bytes"] for e in j.get("entries", [])]
        check(j.get("count") == 3 and len(sizes) == 3, "ls --limit 3")
        check(sizes == sorted(sizes, reverse=True), "ls --sort size")
        j = run_json("ls", d, "--sort", "hash", "--reverse")
        hs = [e["token_hash"] for e in j.get("entries", [])]
        check(hs == sorted(hs, reverse=True), "ls --sort hash --reverse")
        rc, out, _ = run("ls", d)
        lines = out.strip().splitlines()
        check(rc == 0 and lines[0].split()[:4] ==
              ["HASH", "TOKENS", "LAYERS", "KINDS"], "ls table header")
        check(len(lines) == 10 and "8 of 8 entries" in lines[-1],
              "ls table: header + 8 rows + total line")
        rc, out, _ = run("ls", d, "--full", "--no-describe")
        check(rc == 0 and es[0]["token_hash"] in out, "ls --full")
        # stats
        j = run_json("stats", d)
        check(j.get("entries") == 8, "stats: entries")
        check(j.get("disk_bytes") == sum(e["disk_bytes"] for e in es),
              "stats: disk bytes = sum of entries")
        check(j.get("memory_bytes") == sum(e["memory_bytes"] for e in es),
              "stats: memory bytes")
        check(j.get("total_tokens") == 8 * 16, "stats: tokens")
        lbk = j.get("layers_by_kind", {})
        check(lbk.get("quant") == 64 and lbk.get("arrays") == 48,
              f"stats: layers by kind {lbk}")
        check(j.get("storage_modes", {}).get("compat") == 2,
              "stats: storage modes")
        check(j.get("oldest_created_at", 0) > 0, "stats: oldest")
        check("capacity" in j and "counters" in j, "stats: capacity/counters")
        j = run_json("stats", d, "--max-size", "1G", "--max-entries", "16")
        check(abs(j["capacity"]["entries_used_fraction"] - 0.5) < 1e-9,
              "stats: capacity fraction")
        rc, out, _ = run("stats", d, "--prometheus")
        check(rc == 0 and "kvtier_" in out and "# TYPE" in out,
              "stats --prometheus")
        rc, out, _ = run("stats", d)
        check(rc == 0 and "entries" in out and "quant" in out, "stats table")
        # show
        for e in es:
            h = e["token_hash"]
            j = run_json("show", d, h)
            desc = j.get("describe", {})
            layers = desc.get("layers", [])
            check(len(layers) == 32, f"show {h[:8]}: 32 layers")
            check(j.get("entry", {}).get("token_hash") == h, "show: hash")
        h = es[0]["token_hash"]
        rc, out, _ = run("show", d, h[:10])
        check(rc == 0 and h in out and "SHAPE" in out, "show by prefix")
        absent = "0" * 64
        while any(e["token_hash"].startswith(absent[:8]) for e in es):
            absent = absent.replace("0", "1")
        rc, _, err = run("show", d, absent)
        check(rc == 5 and "no entry" in err, f"show absent: exit {rc}")
        rc, _, _ = run("show", d, "xyz")
        check(rc == 2, "show bad hash: exit 2")
        # verify
        j = run_json("verify", d)
        check(j.get("checked") == 8 and j.get("ok") == 8 and
              j.get("clean") is True and j.get("problems") == [],
              f"verify good: {j}")
        rc, out, _ = run("verify", d)
        check(rc == 0 and "8 ok" in out, "verify human")
        # progress bar: on stderr when it is a terminal, never otherwise
        err_tty = run_with_tty_stderr("verify", d)
        check("verifying" in err_tty and "[" in err_tty,
              f"verify draws a progress bar on a terminal: {err_tty!r}")
        rc, _, err = run("verify", d)
        check("\r" not in err and "verifying" not in err,
              "no progress bar when stderr is not a terminal")
        err_tty = run_with_tty_stderr("verify", d, "--no-progress")
        check("verifying" not in err_tty, "--no-progress")
        # read-only commands changed nothing
        after = tree_state(d)
        check(before == after, "ls/stats/show/verify changed nothing: "
              f"{set(before.items()) ^ set(after.items())}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def flip_byte(path, where=None):
    size = os.path.getsize(path)
    pos = where if where is not None else size - 100
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0xFF]))


def t_corrupt():
    d = tmpdir("corrupt")
    try:
        make_good(d)
        es = entries(d)
        bad = es[0]["token_hash"]
        gone = es[1]["token_hash"]
        flip_byte(os.path.join(d, "data", bad, "layer_3.safetensors"))
        j = run_json("verify", d, expect=1)
        probs = {p["entry"]: p for p in j.get("problems", [])}
        check(bad in probs and probs[bad]["problem"] == "corrupt",
              f"verify names the corrupt entry: {probs}")
        check(j.get("ok") == 7 and j.get("clean") is False, "verify counts")
        rc, out, _ = run("verify", d)
        check(rc == 1 and bad in out and "corrupt" in out,
              "verify human names the entry")
        check(os.path.isdir(os.path.join(d, "data", bad)),
              "plain verify does not quarantine")
        # ls and stats still work with a corrupt entry present
        rc, _, _ = run("ls", d)
        check(rc == 0, "ls with a corrupt entry")
        # more damage: a missing entry dir, an orphan dir, a stale tmp dir
        shutil.rmtree(os.path.join(d, "data", gone))
        orphan = "ab" * 32
        shutil.copytree(os.path.join(d, "data", es[2]["token_hash"]),
                        os.path.join(d, "data", orphan))
        os.mkdir(os.path.join(d, "data", es[3]["token_hash"] + ".tmp"))
        j = run_json("verify", d, expect=1)
        kinds = {p["entry"][:64]: p["problem"] for p in j.get("problems", [])}
        check(kinds.get(bad) == "corrupt", "verify: corrupt")
        check(kinds.get(gone) == "missing", f"verify: missing {kinds}")
        check(kinds.get(orphan) == "orphan", f"verify: orphan {kinds}")
        check("stale-tmp" in kinds.values(), f"verify: stale tmp {kinds}")
        # repair
        j = run_json("verify", d, "--repair", expect=1)
        acts = {p["entry"][:64]: p["action"] for p in j.get("problems", [])}
        check(acts.get(bad) == "quarantined", f"repair quarantines: {acts}")
        check(os.path.isdir(os.path.join(d, "quarantine", bad)) or
              any(n.startswith(bad) for n in
                  os.listdir(os.path.join(d, "quarantine"))),
              "quarantine/<hash> exists")
        check(not os.path.exists(os.path.join(d, "data", bad)),
              "corrupt entry left data/")
        check(not os.path.exists(os.path.join(d, "data", orphan)),
              "orphan removed")
        check(not any(n.endswith(".tmp")
                      for n in os.listdir(os.path.join(d, "data"))),
              "stale tmp removed")
        # second verify is clean
        j = run_json("verify", d)
        check(j.get("clean") is True and j.get("checked") == 6,
              f"second verify clean: {j}")
        rc, _, _ = run("verify", d)
        check(rc == 0, "second verify exits 0")
        hs = {e["token_hash"] for e in entries(d)}
        check(bad not in hs and gone not in hs and len(hs) == 6,
              "ls after repair")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def unprivileged():
    """The argv prefix that runs a command without root's way past file
    modes: [] when not root, setpriv to uid/gid 65534 when root, None when
    neither can be had."""
    if os.geteuid() != 0:
        return []
    sp = shutil.which("setpriv")
    if not sp:
        return None
    return [sp, "--reuid=65534", "--regid=65534", "--clear-groups"]


def t_unlistable():
    """data/ that cannot be listed: never a clean verify. A read-only open
    does not list data/, so verify's comparison of data/ with the index is
    where it shows; a writable open (verify --repair, gc) refuses it. A
    chunks/ that cannot be listed fails gc --chunks and verify."""
    d = tmpdir("unlistable")
    try:
        make_good(d, small=True)
        data = os.path.join(d, "data")
        # data/ replaced by a file, or by a link: every open refuses it.
        os.rename(data, data + ".real")
        with open(data, "w") as f:
            f.write("x")
        for args in (("verify", d), ("verify", d, "--repair"),
                     ("gc", d, "--max-entries", "1")):
            rc, out, err = run(*args)
            check(rc == 3 and "data" in err and "not a directory" in err,
                  f"{args}: data/ a file: exit {rc}: {err.strip()[:300]}")
        os.unlink(data)
        os.symlink(data + ".real", data)
        rc, _, err = run("verify", d)
        check(rc == 3 and "symlink" in err,
              f"verify: data/ a link: exit {rc}: {err.strip()[:300]}")
        os.unlink(data)
        os.rename(data + ".real", data)
        rc, _, _ = run("verify", d)
        check(rc == 0, "verify clean again")
        # data/ that this user cannot read (write and search only).
        pre = unprivileged()
        if pre is None:
            print("SKIP(setpriv): cannot drop root to test an unreadable "
                  "data/")
            return
        if pre:
            for root, dirs, files in os.walk(d):
                for n in [root] + [os.path.join(root, x) for x in dirs + files]:
                    os.lchown(n, 65534, 65534)
        os.chmod(data, 0o311)
        p = subprocess.run(pre + [KVTIER, "verify", d], capture_output=True,
                           text=True, timeout=300)
        check(p.returncode == 4 and "cannot list data/" in p.stderr and
              "Permission denied" in p.stderr,
              f"verify: unreadable data/: exit {p.returncode}: "
              f"{p.stdout.strip()[-300:]} {p.stderr.strip()[:300]}")
        check("unlistable" in p.stdout and "--repair" not in p.stdout,
              f"verify names it, without offering a repair: {p.stdout}")
        p = subprocess.run(pre + [KVTIER, "verify", d, "--json"],
                           capture_output=True, text=True, timeout=300)
        try:
            j = json.loads(p.stdout)
        except ValueError:
            j = {}
        probs = {x["entry"]: x for x in j.get("problems", [])}
        check(p.returncode == 4 and j.get("exit_code") == 4 and
              j.get("clean") is False and
              probs.get("data/", {}).get("problem") == "unlistable" and
              "Permission denied" in probs["data/"].get("detail", ""),
              f"verify --json: unreadable data/: exit {p.returncode}: {j}")
        # Writable opens list data/ themselves and refuse it.
        for args in (("verify", d, "--repair"), ("gc", d, "--max-entries", "1")):
            p = subprocess.run(pre + [KVTIER, *args], capture_output=True,
                               text=True, timeout=300)
            check(p.returncode == 3 and "Permission denied" in p.stderr,
                  f"{args}: unreadable data/: exit {p.returncode}: "
                  f"{p.stderr.strip()[:300]}")
        # chunks/ that cannot be listed: the chunk gc did not run, so neither
        # gc --chunks nor verify may end as if it had.
        os.chmod(data, 0o700)
        chunks = os.path.join(d, "chunks")
        if not os.path.isdir(chunks):  # entries below a chunk: none yet
            os.mkdir(chunks)
            if pre:
                os.lchown(chunks, 65534, 65534)
        os.chmod(chunks, 0o311)
        p = subprocess.run(pre + [KVTIER, "gc", d, "--chunks"],
                           capture_output=True, text=True, timeout=300)
        check(p.returncode == 4 and "cleaning chunks/ failed" in p.stderr and
              "Permission denied" in p.stderr,
              f"gc --chunks: unreadable chunks/: exit {p.returncode}: "
              f"{p.stdout.strip()[-300:]} {p.stderr.strip()[:300]}")
        p = subprocess.run(pre + [KVTIER, "verify", d], capture_output=True,
                           text=True, timeout=300)
        check(p.returncode == 4 and "cannot scan chunks/" in p.stderr,
              f"verify: unreadable chunks/: exit {p.returncode}: "
              f"{p.stderr.strip()[:300]}")
    finally:
        for sub in ("data", "chunks"):
            try:
                os.chmod(os.path.join(d, sub), 0o700)
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)


def t_gc():
    d = tmpdir("gc")
    try:
        rc, _, err = run("bench", d, "--quick", "--no-disk", "--keep",
                         "--no-progress", "--entries", "6", "--tokens", "16")
        check(rc == 0, f"prepare gc dir: {err.strip()[:300]}")
        es = entries(d)
        check(len(es) == 6, "gc: 6 entries")
        state = tree_state(d)
        j = run_json("gc", d, "--max-entries", "2", "--dry-run")
        check(j.get("dry_run") is True, "dry run flag")
        check(j.get("removed_count") == 4 and len(j.get("removed", [])) == 4,
              f"dry run reports 4: {j}")
        check(len(entries(d)) == 6, "dry run removed nothing")
        check(tree_state(d) == state, "dry run changed no file")
        # The least recently used go first.
        lru = sorted(es, key=lambda e: e["accessed_at"])
        want = {e["token_hash"] for e in lru[:4]}
        check({r["token_hash"] for r in j["removed"]} == want,
              "dry run picks the LRU entries")
        j = run_json("gc", d, "--max-entries", "2")
        reported = {r["token_hash"] for r in j.get("removed", [])}
        left = {e["token_hash"] for e in entries(d)}
        check(len(left) == 2, f"gc leaves 2: {len(left)}")
        check(reported == {e["token_hash"] for e in es} - left,
              "gc removes exactly what it reports")
        for h in reported:
            check(not os.path.exists(os.path.join(d, "data", h)),
                  "removed entry's files are gone")
        # size limit
        sizes = sorted(e["disk_bytes"] for e in entries(d))
        j = run_json("gc", d, "--max-size", str(sizes[0]))
        check(j.get("removed_count") == 1 and j.get("remaining") == 1,
              f"gc --max-size: {j}")
        # age
        j = run_json("gc", d, "--older-than", "1h")
        check(j.get("removed_count") == 0, "gc --older-than 1h: nothing")
        time.sleep(2.1)
        j = run_json("gc", d, "--older-than", "1s", "--dry-run")
        check(j.get("removed_count") == 1 and
              j["removed"][0]["reason"] == "expired", f"age dry run: {j}")
        check(len(entries(d)) == 1, "age dry run removed nothing")
        j = run_json("gc", d, "--older-than", "1s")
        check(j.get("removed_count") == 1 and len(entries(d)) == 0,
              f"gc --older-than: {j}")
        rc, out, _ = run("gc", d, "--max-entries", "5")
        check(rc == 0 and "removed 0 entries" in out, "gc human output")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def t_chunks():
    """The chunked store through the CLI: chains in ls/show, totals and the
    dedup ratio in stats, every chunk file verified (a damaged one moved
    aside alone: nothing that depends on it deleted), and gc's
    cleaning of chunks/ (stale tmp removed, a valid orphan adopted, a
    damaged one removed)."""
    import sqlite3
    base = tmpdir("chunks")
    try:
        j = run_json("bench", base, "--preset", "chat", "--quick", "--keep",
                     "--no-disk", "--no-progress")
        check(j.get("preset") == "chat", f"bench chat json: {j}")
        pq = j.get("prefix_query", {})
        check(pq.get("served_tokens", 0) >= 768 and pq.get("bit_exact"),
              f"chat: prefix served bit-exact: {pq}")
        check(0 < j.get("unaligned", {}).get("written_per_unique", 9) <= 2.0,
              f"chat: unaligned writes/unique: {j.get('unaligned')}")
        # The cold promotes' files (one chunk + a chain record per 256-token
        # entry, 2 entries in the one --quick round) evicted and counted.
        sp = j.get("spill_promote", {})
        pc = sp.get("page_cache", {})
        check(pc.get("files") == 2 * 2 and
              0 <= pc.get("resident_at_read", -1) <= 1 and
              sp.get("promote_flagged") ==
              (pc.get("resident_at_read", 0) > pc.get("resident_max", 1)),
              f"chat: cold residency reported and flagged: {sp}")
        d = os.path.join(base, "chat-prefix")
        state = tree_state(d)
        es = entries(d)
        check(len(es) == 4, f"chat-prefix: 4 entries, got {len(es)}")
        C = es[0].get("chunk_tokens", 0) if es else 0
        check(C >= 16, f"ls: chunk_tokens {C}")
        for e in es:
            want = e["num_tokens"] // C if C else -1
            check(e.get("chain_chunks") == want and e.get("chain_complete"),
                  f"ls: chain of {want} chunks: {e}")
            check(e.get("shared_chunks") == 1024 // C,
                  f"ls: the system prompt's chunks are shared: {e}")
        rc, out, _ = run("ls", d)
        check(rc == 0 and "CHAIN" in out and "SHARED" in out, "ls table")
        h = es[0]["token_hash"]
        sj = run_json("show", d, h[:12])
        ch = sj.get("chain") or {}
        links = ch.get("links", [])
        check(len(links) == es[0]["num_tokens"] // C and ch.get("complete"),
              f"show: chain links {len(links)}")
        check([k["index"] for k in links] == list(range(len(links))),
              "show: links in chain order")
        check(all(links[i]["parent"] == links[i - 1]["key"]
                  for i in range(1, len(links))), "show: parent links")
        check(links and links[0]["entries"] == 4 and links[-1]["entries"] == 1,
              f"show: sharing {[k['entries'] for k in links]}")
        rc, out, _ = run("show", d, h)
        check(rc == 0 and "chain " in out and links and links[0]["key"] in out,
              "show: chain table")
        st = run_json("stats", d)
        nch = 1024 // C + 4 * (256 // C)
        check(st.get("chunks", {}).get("count") == nch,
              f"stats: {nch} chunks: {st.get('chunks')}")
        ratio = st.get("dedup", {}).get("ratio", 0)
        check(ratio > 1.5, f"stats: dedup ratio {ratio}")
        rc, out, _ = run("stats", d)
        check(rc == 0 and "dedup" in out, "stats: dedup line")
        rc, out, _ = run("stats", d, "--prometheus")
        check(rc == 0 and f"kvtier_chunks {nch}" in out and
              "kvtier_chained_entries 4" in out, "stats --prometheus: chunks")
        v = run_json("verify", d)
        check(v.get("clean") and v.get("chunks_checked") == nch,
              f"verify clean: {v}")
        check(tree_state(d) == state, "ls/show/stats/verify changed nothing")

        # gc of chunks/: a stale tmp, a valid orphan (its row deleted, its
        # parent indexed), a damaged orphan.
        leaf = links[-1]["key"]
        db = sqlite3.connect(os.path.join(d, "index.db"))
        db.execute("DELETE FROM kvtier_chunks WHERE chunk_key = ?",
                   (bytes.fromhex(leaf),))
        db.commit()
        db.close()
        tmp = os.path.join(d, "chunks", leaf[:2], leaf + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(b"x" * 100)
        junk = "ab" * 32
        os.makedirs(os.path.join(d, "chunks", "ab"), exist_ok=True)
        with open(os.path.join(d, "chunks", "ab", junk + ".kvc"), "wb") as fh:
            fh.write(b"KVTCHUNK" + b"\0" * 200)
        state = tree_state(d)
        g = run_json("gc", d, "--chunks", "--dry-run")
        gc_ = g.get("chunks", {})
        check(gc_.get("tmp_removed") == 1 and gc_.get("adopted") == 1 and
              gc_.get("removed") == 1, f"gc --chunks --dry-run: {gc_}")
        check(tree_state(d) == state, "gc dry run changed nothing")
        v = run_json("verify", d, expect=1)
        kinds = {p["problem"] for p in v.get("problems", [])}
        check({"chunk-orphan", "chunk-stale-tmp"} <= kinds,
              f"verify reports chunks/ problems: {kinds}")
        g = run_json("gc", d, "--chunks")
        gc_ = g.get("chunks", {})
        check(gc_.get("tmp_removed") == 1 and gc_.get("adopted") == 1 and
              gc_.get("removed") == 1, f"gc --chunks: {gc_}")
        check(not os.path.exists(tmp), "stale tmp removed")
        check(not os.path.exists(os.path.join(d, "chunks", "ab",
                                              junk + ".kvc")),
              "damaged orphan removed")
        check(os.path.exists(os.path.join(d, "chunks", leaf[:2],
                                          leaf + ".kvc")),
              "valid orphan kept (adopted)")
        st = run_json("stats", d)
        check(st.get("chunks", {}).get("count") == nch, "adopted: indexed")
        v = run_json("verify", d)
        check(v.get("clean") is True, f"clean after gc: {v.get('problems')}")

        # A damaged shared chunk: verify finds it; --repair moves its file
        # alone aside and keeps every chunk below it and entry through it.
        n_ent = len(entries(d))
        names = data_names(d)
        bad = links[len(links) - 2]["key"]  # the last shared chunk
        p = os.path.join(d, "chunks", bad[:2], bad + ".kvc")
        with open(p, "r+b") as fh:
            fh.seek(-1, 2)
            b = fh.read(1)
            fh.seek(-1, 2)
            fh.write(bytes([b[0] ^ 0x55]))
        v = run_json("verify", d, expect=1)
        probs = [x for x in v.get("problems", [])
                 if x["problem"] == "chunk-corrupt"]
        check(len(probs) == 1 and bad in probs[0]["entry"],
              f"verify: the damaged chunk: {v.get('problems')}")
        v = run_json("verify", d, "--repair", expect=1)
        check(any(x["problem"] == "chunk-corrupt" and
                  x["action"] == "quarantined" for x in v.get("problems", [])),
              f"verify --repair quarantines: {v.get('problems')}")
        qd = os.path.join(d, "quarantine", "chunk-" + bad)
        kept = set(os.listdir(qd)) if os.path.isdir(qd) else set()
        check(kept == {bad + ".kvc"},
              f"quarantine holds the damaged chunk alone: {kept}")
        check(len(entries(d)) == n_ent and data_names(d) == names,
              "every entry through it kept (nothing deleted)")
        below = [l["key"] for l in links[len(links) - 1:]]
        for k in below:
            check(os.path.exists(os.path.join(d, "chunks", k[:2],
                                              k + ".kvc")),
                  f"the chunk below it kept: {k[:16]}")
        # Still a real problem (the entries through it are unservable)...
        v = run_json("verify", d, expect=1)
        check(any(x["problem"] == "chunk-corrupt" and bad in x["entry"]
                  for x in v.get("problems", [])),
              f"verify after repair: the chunk is still missing: {v}")
        # ...until the chunk is written again (here: the file put back).
        with open(os.path.join(qd, bad + ".kvc"), "rb") as fh:
            data = bytearray(fh.read())
        data[-1] ^= 0x55
        with open(p, "wb") as fh:
            fh.write(bytes(data))
        v = run_json("verify", d)
        check(v.get("clean") is True, f"clean once the chunk is back: {v}")

        # A store written with chunk_tokens 16: stats names the stored size,
        # not the default the CLI opens with (it said "of 256 tokens"), and
        # ls counts a chained entry's layers (its record lists none: the
        # chunks hold them; it said LAYERS 0).
        d16 = os.path.join(base, "c16")
        jb = run_json("bench", d16, "--quick", "--no-disk", "--no-progress",
                      "--keep", "--entries", "2", "--tokens", "64",
                      "--chunk-tokens", "16", "--durability", "none")
        nl = jb.get("workload", {}).get("layers", 0)
        st = run_json("stats", d16)
        ch = st.get("chunks", {})
        check(ch.get("chunk_tokens") == 16 and ch.get("chunk_sizes") == [16],
              f"stats: the stored chunk size: {ch}")
        rc, out, _ = run("stats", d16)
        check(rc == 0 and " of 16 tokens" in out and "of 256" not in out,
              f"stats text: the stored chunk size: {out}")
        es = entries(d16)
        check(len(es) == 2 and nl > 0 and
              all(e.get("num_layers") == nl and e.get("chain_chunks") == 4
                  for e in es), f"ls: {nl} layers of chained entries: {es}")
        rc, out, _ = run("ls", d16)
        rows = [ln.split() for ln in out.splitlines()[1:]
                if ln.strip() and not ln.startswith("(")]
        check(rc == 0 and len(rows) == 2 and
              all(r[2] == str(nl) for r in rows), f"ls LAYERS column: {out}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def t_reference():
    maker = os.path.join(SRC, "tests", "reference", "make_ref_cache.py")
    if not os.path.exists(maker):
        print("SKIP(ref-tree): tests/reference/make_ref_cache.py not in this tree")
        sys.exit(77)
    sys.path.insert(0, os.path.dirname(maker))
    import reference_loader
    if not os.path.exists(reference_loader.seed_path()):
        print(f"SKIP(seed): {reference_loader.seed_path()} not found (the reference "
              f"is assembled from it; set {reference_loader.SHARED_ENV})")
        sys.exit(77)
    d = tmpdir("ref")
    shutil.rmtree(d)
    try:
        p = subprocess.run(["/usr/bin/python3", maker, d, "--seed", "5",
                            "--entries", "4", "--layers", "4", "--kinds",
                            "kv,rotating,arrays,quantized", "--bf16"],
                           capture_output=True, text=True, timeout=300)
        if not check(p.returncode == 0, f"make_ref_cache.py: {p.stderr}"):
            return
        summary = json.loads(p.stdout)
        want = {e["token_hash"] for e in summary["entries"]}
        before = tree_state(d)
        j = run_json("ls", d)
        es = j.get("entries", [])
        check({e["token_hash"] for e in es} == want, "ls lists the "
                                                     "reference's entries")
        for e in es:
            check("error" not in e, f"ls: readable: {e.get('error')}")
            check(e.get("num_layers") == 4, "ls: 4 layers")
            check(e.get("storage_mode") not in ("?", None, "native"),
                  f"ls: reference mode {e.get('storage_mode')}")
        for e in es:
            j = run_json("show", d, e["token_hash"])
            check(len(j.get("describe", {}).get("layers", [])) == 4,
                  "show reference entry")
        j = run_json("stats", d)
        check(j.get("entries") == 4, "stats reference")
        j = run_json("verify", d)
        check(j.get("clean") is True and j.get("ok") == 4,
              f"verify reference: {j}")
        j = run_json("gc", d, "--max-entries", "1", "--dry-run")
        check(j.get("removed_count") == 3, "gc dry run on reference dir")
        check(tree_state(d) == before, "reference dir unchanged by "
                                       "inspection")
        # Maintenance works on it too.
        j = run_json("verify", d, "--repair")
        check(j.get("clean") is True, "verify --repair on a reference dir")
        j = run_json("gc", d, "--max-entries", "2")
        left = {e["token_hash"] for e in entries(d)}
        check(j.get("removed_count") == 2 and len(left) == 2 and
              {r["token_hash"] for r in j.get("removed", [])} == want - left,
              f"gc on a reference dir: {j}")
        # The reference can still read what is left (its own reader).
        reader = os.path.join(SRC, "tests", "reference", "read_ref_cache.py")
        if os.path.exists(reader):
            p = subprocess.run(["/usr/bin/python3", reader, d],
                               capture_output=True, text=True, timeout=300)
            check(p.returncode == 0, f"reference reads the dir after gc: "
                                     f"{p.stderr.strip()[:300]}")
            # A compat-mode directory written by `kvtier bench` is one the
            # reference reads.
            c = os.path.join(d, "compat")
            rc, _, err = run("bench", c, "--quick", "--no-disk", "--keep",
                             "--no-progress", "--entries", "2", "--tokens",
                             "16", "--preset", "hybrid", "--dtype", "bf16",
                             "--storage", "compat")
            check(rc == 0, f"bench compat: {err.strip()[:300]}")
            p = subprocess.run(["/usr/bin/python3", reader, c],
                               capture_output=True, text=True, timeout=300)
            check(p.returncode == 0, f"reference reads bench's compat dir: "
                                     f"{p.stderr.strip()[:300]}")
            try:
                got = json.loads(p.stdout)
            except ValueError:
                got = {}
            check(len(got.get("entries", [])) == 2 and not got.get("errors"),
                  f"reference read both entries: {got.get('errors')}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def t_bench():
    j = run_json("bench", "--quick", "--no-disk", "--no-progress",
                 "--entries", "2", "--tokens", "32")
    for k in ("workload", "spill", "spill_producer", "promote_warm",
              "promote_cold", "lookup_exact", "lookup_prefix", "disk_bytes",
              "memory_bytes", "verified"):
        check(k in j, f"bench --json has {k}")
    wl = j.get("workload", {})
    check(wl.get("entries") == 2 and wl.get("tokens") == 32, "bench workload")
    check(wl.get("entry_memory_bytes") == 32 * 2 * 8 * 32 * 128 * 2,
          "bench: llama3-8b entry size")
    promotes = 2 + j.get("promote_warm", {}).get("count", 0) + \
        j.get("promote_cold", {}).get("count", 0)
    check(j.get("verified", {}).get("mismatched_tensors") == 0 and
          j["verified"].get("exact_tensors") == 64 * promotes,
          f"bench verified every promoted tensor: {j.get('verified')}")
    check(j.get("promote_cold", {}).get("count") == 4, "bench cold count")
    check(j.get("lookup_prefix", {}).get("count", 0) > 0, "bench lookups")
    # The shared system prompt covers whole chunks (64 tokens, a quarter
    # shared, chunk_tokens 16): the workload's KV is random per entry, so a
    # prompt sharing a whole chunk of tokens would be served the first
    # entry's chunk - it once was, and `./scripts/run.sh` (1024 tokens, the
    # default 256) reported 1536 wrong tensors. Every promote stays exact.
    jc = run_json("bench", "--quick", "--no-disk", "--no-progress",
                  "--entries", "3", "--tokens", "64", "--chunk-tokens", "16",
                  "--durability", "none")
    vc = jc.get("verified", {})
    check(vc.get("mismatched_tensors") == 0 and vc.get("exact_tensors", 0) > 0,
          f"bench with chunks: every promoted tensor exact: {vc}")
    # The cold rounds evict every file a promote reads and report what stayed
    # cached: 3 entries x 2 cold rounds, each a chain record in data/<hash>/
    # and its 4 chunk files (64 tokens, C=16). Evicting data/<hash>/ alone
    # (the chunks served from RAM) counted 6 files.
    pc = jc.get("promote_cold", {}).get("page_cache", {})
    check(pc.get("files") == 3 * 2 * 5 and pc.get("pages", 0) >= 30,
          f"bench cold: every entry and chunk file evicted: {pc}")
    ra = pc.get("resident_at_read", -1)
    check(0 <= ra <= 1 and 0 <= pc.get("resident_before_eviction", -1) <= 1,
          f"bench cold: residency reported: {pc}")
    cold_flag = jc.get("promote_cold", {}).get("flagged")
    check(cold_flag == (ra > pc.get("resident_max", 0)),
          f"bench cold: flagged exactly when its files stayed cached: {pc}, "
          f"flagged {cold_flag}")
    check(j.get("disk") is None, "--no-disk: no disk figures")
    check(not os.path.exists(wl.get("dir", "/nonexistent")),
          "bench removed its temporary directory")
    # Disk measurement (fio when installed, else the builtin loop), tiny.
    j = run_json("bench", "--quick", "--no-progress", "--entries", "1",
                 "--tokens", "16", "--disk-size", "8M")
    disk = j.get("disk") or {}
    check(disk.get("write_direct_bps", 0) > 0 and
          disk.get("read_direct_bps", 0) > 0 and
          disk.get("read_buffered_bps", 0) > 0, f"disk figures: {disk}")
    check("ratio" in j.get("spill", {}) and "ratio" in
          j.get("promote_cold", {}), "ratios present")
    # Every figure held against a physical limit says whether it is flagged,
    # and is flagged whenever it is above that limit (or, cold, read cached
    # files): no figure above its limit goes out unmarked.
    for k in ("spill", "spill_end_to_end", "promote_warm", "promote_cold"):
        ph = j.get(k, {})
        above = ph.get("ratio", 0) > 1
        cached = k == "promote_cold" and \
            ph.get("page_cache", {}).get("resident_at_read", 0) > \
            ph.get("page_cache", {}).get("resident_max", 1)
        check(ph.get("flagged") == (above or cached) and
              (("flag" in ph) == ph.get("flagged")),
              f"bench {k}: flagged iff above its limit: {ph}")
    # Without fio on PATH: the built-in O_DIRECT loop, and the report says so.
    env = dict(os.environ, PATH="/nonexistent")
    rc, out, err = run("bench", "--quick", "--no-progress", "--entries", "1",
                       "--tokens", "16", "--disk-size", "8M", "--json",
                       env=env)
    check(rc == 0, f"bench without fio: {err.strip()[:300]}")
    try:
        disk = json.loads(out).get("disk") or {}
    except ValueError:
        disk = {}
    check(disk.get("tool") == "builtin" and "fio" in disk.get("note", "")
          and disk.get("write_direct_bps", 0) > 0, f"builtin disk: {disk}")
    # Explicit directory: created, kept with --keep, removed without.
    base = tmpdir("bench")
    try:
        kept = os.path.join(base, "kept")
        rc, out, err = run("bench", kept, "--quick", "--no-disk", "--keep",
                           "--no-progress", "--entries", "2", "--tokens", "8",
                           "--preset", "hybrid")
        check(rc == 0 and "promote cold" in out and "spill" in out,
              f"bench human output: {err.strip()[:300]}")
        check(len(entries(kept)) == 2, "--keep keeps the entries")
        gone = os.path.join(base, "gone")
        rc, _, _ = run("bench", gone, "--quick", "--no-disk", "--no-progress",
                       "--entries", "1", "--tokens", "8")
        check(rc == 0 and not os.path.exists(gone),
              "a directory bench created is removed without --keep")
        # An existing cache: bench adds and then removes only its own.
        rc, _, _ = run("bench", kept, "--quick", "--no-disk", "--no-progress",
                       "--entries", "2", "--tokens", "8", "--seed", "9")
        check(rc == 0 and len(entries(kept)) == 2,
              "bench in an existing cache leaves the user's entries alone")
        # A non-empty directory that is not a cache is refused, untouched.
        own = os.path.join(base, "own")
        os.mkdir(own)
        with open(os.path.join(own, "notes.txt"), "w") as fh:
            fh.write("mine\n")
        rc, _, err = run("bench", own, "--quick", "--no-disk", "--entries",
                         "1", "--tokens", "8")
        check(rc == 3 and "not a kvtier cache" in err and
              os.listdir(own) == ["notes.txt"], "bench refuses a user dir")
        for preset in ("quantized",):
            for storage in ("native", "compat"):
                j = run_json("bench", "--quick", "--no-disk", "--no-progress",
                             "--entries", "1", "--tokens", "64", "--preset",
                             preset, "--storage", storage)
                check(j.get("verified", {}).get("mismatched_tensors") == 0,
                      f"bench {preset} {storage} verified")
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Holder:
    """A live_holder process with DIR open: send() one command, wait for
    its "ok"."""

    def __init__(self, d, *args):
        self.p = subprocess.Popen([HOLDER, d, *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        first = self.p.stdout.readline().split()
        if len(first) != 2 or first[0] != "ready":
            raise RuntimeError(f"live_holder did not start: {first}")
        self.pid = int(first[1])

    def send(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        ans = self.p.stdout.readline().strip()
        check(ans == "ok", f"live_holder {cmd!r}: answered {ans!r}")

    def quit(self):
        self.p.stdin.write("quit\n")
        self.p.stdin.flush()
        return self.p.wait(timeout=60)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=60)


def t_verify_live():
    """verify beside a live writer reports only real problems: a chunked
    writer (chunk_tokens 16, at most 40 entries, so it evicts) spills all
    the time while verify runs; entries evicted or replaced and chunk files
    written between verify's listing and its reads are looked at again and
    are not problems (before, nearly every run exited 1 listing entries as
    missing). A real problem - a stray name is not one, a damaged entry the
    writer never touches again is - is still reported."""
    if not HOLDER:
        print("SKIP: no --holder")
        sys.exit(77)
    import threading
    d = tmpdir("verify-live")
    h = None
    try:
        h = Holder(d, "16", "40")
        h.send("spill 40")
        stop = threading.Event()

        def churn():
            while not stop.is_set():
                h.send("spill 10")
        th = threading.Thread(target=churn)
        th.start()
        try:
            for i in range(8):
                v = run_json("verify", d, "--no-progress")
                check(v.get("exit_code") == 0 and v.get("clean") is True,
                      f"verify beside a writer, run {i}: "
                      f"{[(p['problem'], p['entry'][-20:]) for p in v.get('problems', [])][:4]}")
        finally:
            stop.set()
            th.join()
        check(h.quit() == 0, "live_holder exits 0")
        h = None
        # Quiet again: one entry damaged for good is reported (exit 1).
        es = entries(d)
        check(len(es) > 0, "entries left")
        victim = os.path.join(d, "data", es[0]["token_hash"])
        names = sorted(os.listdir(victim)) if os.path.isdir(victim) else []
        f = [n for n in names if n.endswith(".kvr") or n.endswith(".safetensors")]
        check(bool(f), f"a file to damage in {names}")
        if f:
            with open(os.path.join(victim, f[0]), "r+b") as fh:
                fh.seek(-1, 2)
                b = fh.read(1)
                fh.seek(-1, 2)
                fh.write(bytes([b[0] ^ 0x55]))
            v = run_json("verify", d, "--no-progress", expect=1)
            check(any(p["entry"] == es[0]["token_hash"] and
                      p["problem"] == "corrupt" for p in v.get("problems", [])),
                  f"a real problem survives the second look: {v.get('problems')}")
    finally:
        if h:
            h.kill()
        shutil.rmtree(d, ignore_errors=True)


def live_counters(d):
    j = run_json("stats", d, "--no-describe")
    return j.get("live", {}), j.get("counters", {})


def t_live():
    if not HOLDER:
        print("SKIP: no --holder")
        sys.exit(77)
    d = tmpdir("live")
    h = None
    try:
        # Before any writer: no stats file, said so, counters zero.
        live, c = live_counters(d)
        check(live.get("status") == "no_stats_file" and live.get("alive") is False,
              f"live: before a writer: {live}")
        check(c.get("spill_count") == 0, "live: zero counters before a writer")

        h = Holder(d)
        h.send("spill 3")
        h.send("hit")
        h.send("miss")
        live, c = live_counters(d)
        check(live.get("alive") is True and live.get("pid") == h.pid,
              f"live: alive with the holder's pid {h.pid}: {live}")
        check(c.get("spill_count") == 3 and c.get("ssd_hits") == 1 and
              c.get("ssd_misses") == 1, f"live: counters after 3/1/1: {c}")
        check(c.get("tokens_requested") == 64 and c.get("tokens_served") == 32,
              f"live: token counters: {c}")
        check(sum(live.get("promote_latency_hist", [])) == 1 and
              sum(live.get("spill_latency_hist", [])) == 3,
              f"live: histograms: {live}")

        # The counters move while the holder runs.
        h.send("spill 2")
        h.send("hit")
        h.send("hit")
        live, c = live_counters(d)
        check(c.get("spill_count") == 5 and c.get("ssd_hits") == 3 and
              c.get("tokens_served") == 96, f"live: counters moved: {c}")
        rc, out, err = run("stats", d, "--prometheus")
        check(rc == 0 and "\nkvtier_spill_count_total 5\n" in out and
              "\nkvtier_live 1\n" in out and
              "\nkvtier_promote_latency_seconds_count 3\n" in out and
              "\nkvtier_spill_latency_seconds_count 5\n" in out and
              "\nkvtier_tokens_requested_total 128\n" in out and
              "\nkvtier_entries 5\n" in out,
              f"live: prometheus: {out[-1500:]} {err}")
        rc, out, _ = run("stats", d)
        check(rc == 0 and f"live from pid {h.pid}" in out and
              "5 (" in out, f"live: text output: {out}")

        # Refused spills: counted by reason in --json, text and Prometheus.
        h.send("refuse 4")
        _, c = live_counters(d)
        check(c.get("spill_refused_invalid") == 4 and
              c.get("spill_refused_too_big") == 0 and
              c.get("spill_refused_queue_full") == 0 and
              c.get("spill_refused_unsupported") == 0 and
              c.get("spill_refused_closed") == 0 and
              c.get("spill_refused_other") == 0 and c.get("spill_count") == 5,
              f"live: refusal counters: {c}")
        rc, out, _ = run("stats", d)
        check(rc == 0 and "refused  4: unsupported layer 0, invalid 4," in out,
              f"live: refusals in the text output: {out}")
        rc, out, _ = run("stats", d, "--prometheus")
        check(rc == 0 and "\nkvtier_spill_refused_invalid_total 4\n" in out and
              "# TYPE kvtier_spill_refused_other_total counter" in out,
              f"live: refusals in prometheus: {out[-1500:]}")

        # --watch: one JSON line per tick, following the holder.
        rc, out, err = run("stats", d, "--watch", "0.05", "--count", "3",
                           "--json")
        lines = [json.loads(x) for x in out.splitlines() if x.strip()]
        check(rc == 0 and len(lines) == 3 and
              all(x["live"]["alive"] and x["counters"]["spill_count"] == 5
                  for x in lines), f"live: --watch --json: {out[:600]} {err}")
        rc, out, _ = run("stats", d, "--watch", "0.05", "--count", "2")
        check(rc == 0 and len(out.splitlines()) == 2 and
              out.count(f"pid {h.pid}") == 2, f"live: --watch text: {out}")
        rc, out, _ = run("stats", d, "--watch", "0.05", "--count", "1",
                         "--prometheus")
        check(rc == 0 and "kvtier_live 1" in out, "live: --watch --prometheus")
        for bad in (["--watch", "0"], ["--watch", "x"], ["--count", "2"],
                    ["--watch", "1", "--count", "0"]):
            rc, _, err = run("stats", d, *bad)
            check(rc == 2, f"live: stats {bad}: exit {rc}, expected 2 ({err})")

        # Closed: the file stays, "not running", counters back to zero.
        check(h.quit() == 0, "live: holder closed cleanly")
        h = None
        live, c = live_counters(d)
        check(live.get("status") == "not_running" and live.get("alive") is False,
              f"live: after close: {live}")
        check(c.get("spill_count") == 0, "live: no live counters after close")
        rc, out, _ = run("stats", d, "--watch", "0.05", "--count", "1")
        check(rc == 0 and "no process has the directory open" in out,
              f"live: --watch after close: {out}")

        # Killed: state still "open" in the file, but the pid is gone.
        h = Holder(d)
        h.send("spill 1")
        check(live_counters(d)[0].get("alive") is True, "live: second holder")
        h.kill()
        h = None
        live, _ = live_counters(d)
        check(live.get("status") == "not_running", f"live: after SIGKILL: {live}")

        # Admission and the write budget: a second-sighting writer with a
        # budget of 86.4 MB a day (its bucket holds an hour: 3.6 MB) declines
        # three new prompts; every output shows the decisions and the budget.
        h = Holder(d, "256", "10000", "1", "86400000")
        h.send("spill 3")
        _, c = live_counters(d)
        check(c.get("admission_declined_unseen") == 3 and
              c.get("admission_admitted") == 0 and c.get("spill_count") == 0 and
              c.get("bytes_written_today") == 0 and
              c.get("write_budget_bytes_per_day") == 86400000 and
              c.get("write_budget_left") == 3600000 and
              c.get("ssd_lifetime_years") == 0.0,
              f"live: admission counters: {c}")
        rc, out, _ = run("stats", d)
        check(rc == 0 and "declined 3 first sighting, 0 budget" in out and
              "/day, " in out and " today, " in out,
              f"live: admission in the text output: {out}")
        rc, out, _ = run("stats", d, "--prometheus")
        check(rc == 0 and "\nkvtier_admission_declined_unseen_total 3\n" in out and
              "\nkvtier_write_budget_left 3600000\n" in out and
              "\nkvtier_bytes_written_today 0\n" in out,
              f"live: admission in prometheus: {out[-1500:]}")
        h.send("again 3")  # the same three prompts again: written
        _, c = live_counters(d)
        check(c.get("admission_admitted") == 3 and c.get("spill_count") == 3 and
              c.get("bytes_written_today") == c.get("spill_bytes") > 0 and
              # the bucket drains at 1000 B a wall-clock second meanwhile
              0 <= c.get("write_budget_left") - (3600000 - c.get("spill_bytes")) < 60000,
              f"live: second sighting written: {c}")
        check(h.quit() == 0, "live: admission holder closed cleanly")
        h = None
    finally:
        if h:
            h.kill()
        shutil.rmtree(d, ignore_errors=True)


def data_names(d):
    return sorted(n for n in os.listdir(os.path.join(d, "data"))
                  if len(n) == 64)


def t_reindex():
    """The index is never the only copy: without index.db, verify --repair
    deletes no valid entry (they are adopted), and reindex rebuilds every
    row from the entry directories, keeping the old index aside."""
    d = tmpdir("reindex")
    make_good(d)
    before = data_names(d)
    hashes = sorted(e["token_hash"] for e in entries(d))
    check(len(before) == 8 and hashes == before, "8 entries to start with")
    for suffix in ("", "-wal", "-shm"):
        p = os.path.join(d, "index.db" + suffix)
        if os.path.exists(p):
            os.remove(p)
    rc, out, err = run("verify", d, "--repair")
    check(rc in (0, 1), f"verify --repair without an index: exit {rc}: {err}")
    check(data_names(d) == before, "verify --repair deleted no valid entry")
    check(sorted(e["token_hash"] for e in entries(d)) == before,
          "every entry has its row again")
    j = run_json("reindex", d)
    check(j.get("entries") == 8 and j.get("quarantined") == 0,
          f"reindex --json: {j}")
    aside = [n for n in os.listdir(d) if n.startswith("index.db.reindexed-")]
    check(len(aside) >= 1, "the previous index kept aside")
    check(data_names(d) == before, "reindex deleted nothing")
    rc, out, err = run("verify", d)
    check(rc == 0, f"verify after reindex: exit {rc}: {err}")
    rc, out, err = run("reindex")
    check(rc == 2, "reindex without DIR is a usage error")
    # A chunk_tokens=16 cache (bench's chat preset, --chunk-tokens 16) reindexed by the CLI,
    # which opens with the default 256: every chained entry is adopted with
    # its chain, nothing quarantined or deleted.
    base = tmpdir("reindex-c16")
    j = run_json("bench", base, "--preset", "chat", "--quick", "--keep",
                 "--no-disk", "--no-progress", "--chunk-tokens", "16")
    d = os.path.join(base, "chat-prefix")
    before = data_names(d)
    hashes = sorted(e["token_hash"] for e in entries(d))
    check(len(before) >= 4 and hashes == before,
          f"chat-prefix: {len(before)} entries to start with")
    j = run_json("reindex", d)
    check(j.get("entries") == len(before) and j.get("quarantined") == 0,
          f"reindex --json of a chunk_tokens=16 cache: {j}")
    check(data_names(d) == before, "reindex of a C=16 cache deleted nothing")
    check(sorted(e["token_hash"] for e in entries(d)) == before,
          "every C=16 entry listed after reindex")
    rc, out, err = run("verify", d)
    check(rc == 0, f"verify after reindex of a C=16 cache: exit {rc}: {err}")


GROUPS = {"help": t_help, "errors": t_errors, "empty": t_empty,
          "good": t_good, "corrupt": t_corrupt, "gc": t_gc,
          "chunks": t_chunks,
          "reference": t_reference, "bench": t_bench, "live": t_live,
          "reindex": t_reindex, "verify_live": t_verify_live,
          "unlistable": t_unlistable}


def main():
    global KVTIER, SRC, HOLDER
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvtier", required=True)
    ap.add_argument("--holder")
    ap.add_argument("--src", required=True)
    ap.add_argument("group", choices=sorted(GROUPS))
    a = ap.parse_args()
    KVTIER, SRC, HOLDER = a.kvtier, a.src, a.holder
    GROUPS[a.group]()
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed", file=sys.stderr)
        return 1
    print(f"cli.{a.group}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
