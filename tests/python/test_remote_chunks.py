"""Chunks as the unit shared between nodes (issue 16 item 2, issue 13's
"chunks with the remote tier"), through the real client: two processes with
their own cache directories share one redis-server (then a 3-master Redis
Cluster), both in the chunked native store (chunk_tokens) with one model_id.
Node A (a child process) runs a multi-turn chat and a second conversation on
the same system prompt; node B, which spilled its own conversation on that
system prompt first, runs vllm-mlx's check_ssd flow (lookup_ssd,
lookup_ssd_prefix, _read_entry(prompt[:matched], file_path), _index.touch) on
longer prompts and is served A's prefixes bit-exact - an entry end of A's, and
a chunk-aligned prefix where no spill of A ended - while it fetches ONLY the
chunks it lacks (counted: chunk files appearing in B's directory, and
remote_read_bytes = their bytes + the adopted tails' bytes).  The shared
system prompt is stored once on the server whoever spilled it.  A second
model_id on the same server sees none of these chunks or chained entries.
Then the server is killed: B's lookups answer within 0.5 s each and never
raise, and what B adopted is still served locally.
Skipped without redis-server/redis-cli or Redis support in libkvtier.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

import redis_servers as rs
from conftest import kv_positional, make_tier

pytestmark = [pytest.mark.tier_profiles,
              pytest.mark.skipif(not rs.have_redis(), reason="redis-server/redis-cli missing")]

C = 64
LAYERS, HEADS, DIM = 3, 2, 16
PREFIX = "rch:"
MODEL = "shared-model"
SYS = list(range(100, 100 + 4 * C))  # the shared system prompt: 4 chunks


def kv_for(tokens):
    return kv_positional(tokens, LAYERS, HEADS, DIM)


def mem_of(n):
    return n * LAYERS * 2 * HEADS * DIM * 2


def turns():
    """A's spills: a 4-turn chat (turns of 50..150 tokens, unaligned) on the
    system prompt, and a second conversation on it."""
    chat, out = list(SYS), []
    for i, k in enumerate((50, 120, 90, 150)):
        chat = chat + [20000 + i * 1000 + j for j in range(k)]
        out.append(tuple(chat))
    out.append(tuple(SYS + [40000 + j for j in range(70)]))
    return out


def child_a(url: str, d: str, extra: str = "{}") -> None:
    """Node A (a child process): spill every turn, flush, close."""
    kw = eval(extra)  # test-owned literal dict of extra options (TLS files)
    a = make_tier(d, remote_url=url, remote_mode="local+remote", remote_prefix=PREFIX,
                  chunk_tokens=C, model_id=MODEL, **kw)
    a.start_writer()
    for toks in turns():
        assert a.enqueue_spill(toks, kv_for(toks), mem_of(len(toks)))
    a.flush(timeout=60)
    st = a.get_stats()
    assert st["remote_spill_count"] == len(turns()), st
    a.close()


def run_node_a(url: str, d: str, **kw) -> None:
    rs.run_node("test_remote_chunks", "child_a", url, d, repr(kw))


# The lookup timeout every node here is opened with: time bounds below are
# multiples of it, never wall-clock constants.
LOOKUP_MS = 250


def open_node(d: str, url: str, **kw):
    kw.setdefault("model_id", MODEL)
    kw.setdefault("remote_lookup_timeout_ms", LOOKUP_MS)
    return rs.tier_or_skip(make_tier, d, remote_url=url, remote_mode="local+remote",
                           remote_prefix=PREFIX, chunk_tokens=C, **kw)


def token_hash(toks):
    return hashlib.sha256(array.array("i", toks).tobytes()).hexdigest()


def files_under(d):
    out = {}
    for root, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[p] = os.path.getsize(p)
    return out


def same(got, toks) -> bool:
    ref = kv_for(toks)
    return got is not None and len(got) == len(ref) and all(
        np.array_equal(np.asarray(g["keys"]).view(np.uint16), r.keys.view(np.uint16))
        and np.array_equal(np.asarray(g["values"]).view(np.uint16), r.values.view(np.uint16))
        and g["offset"] == len(toks)
        for g, r in zip(got, ref))


def server_chunk_keys(procs_ports, cli_tls=()):
    n = 0
    for port in procs_ports:
        r = subprocess.run(["redis-cli", *cli_tls, "-p", str(port), "--scan", "--pattern",
                            PREFIX + "{c:*"], capture_output=True, text=True, timeout=30)
        n += len([x for x in r.stdout.split() if x])
    return n


def wait_mirror(b, prompt, want, timeout=10.0):
    """B's mirror learns A's chunks over the event channel (resynced at
    connect): wait, bounded, until a lookup reports want tokens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pre = b.lookup_ssd_prefix(prompt)
        if pre is not None and pre["num_tokens"] >= want:
            return
        time.sleep(0.05)


class Have:
    """Which chunk-aligned prefixes B stores locally (by their tokens)."""

    def __init__(self):
        self.p = set()

    def add(self, toks):
        for i in range(1, len(toks) // C + 1):
            self.p.add(tuple(toks[:i * C]))

    def missing(self, toks):
        return sum(1 for i in range(1, len(toks) // C + 1)
                   if tuple(toks[:i * C]) not in self.p)


def serve(b, bdir, have, prompt, want_len, entry_end):
    """One check_ssd round on B for prompt; asserts what is served and what
    was fetched."""
    assert b.lookup_ssd(prompt) is None
    pre = b.lookup_ssd_prefix(prompt)
    assert pre is not None, f"lookup_ssd_prefix missed ({len(prompt)} tokens)"
    m = pre["num_tokens"]
    assert m == want_len, (m, want_len)
    assert pre["file_path"] == token_hash(prompt[:m])
    assert pre["memory_bytes"] == mem_of(m)
    before = files_under(bdir)
    rb0 = b.get_stats()["remote_read_bytes"]
    got = b._read_entry(prompt[:m], pre["file_path"])
    assert same(got, prompt[:m]), f"{m} tokens not bit-exact"
    after = files_under(bdir)
    new = {p: s for p, s in after.items() if p not in before}
    new_chunks = [p for p in new if p.endswith(".kvc")]
    # ONLY the chunks B lacked were fetched
    assert len(new_chunks) == have.missing(prompt[:m]), (len(new_chunks), m)
    tail = sum(s for p, s in new.items() if not p.endswith(".kvc")
               and os.sep + "data" + os.sep in p)
    fetched = b.get_stats()["remote_read_bytes"] - rb0
    assert fetched == sum(new[p] for p in new_chunks) + tail, (fetched, new)
    if entry_end:
        assert tail > 0  # the entry's tail, adopted as a local chained entry
    have.add(prompt[:m])
    b._index.touch(prompt[:m])  # the scheduler's only touch
    # now local: a second round fetches nothing
    rb1 = b.get_stats()["remote_read_bytes"]
    assert same(b._read_entry(prompt[:m], token_hash(prompt[:m])), prompt[:m])
    assert b.get_stats()["remote_read_bytes"] == rb1
    return len(new_chunks)


def two_nodes(tmp_path, url, procs, ports, tls=None, cli_tls=()):
    tls = tls or {}
    bdir = str(tmp_path / "b")
    b = open_node(bdir, url, **tls)
    b.start_writer()
    # B's own conversation on the system prompt, spilled first (locally and
    # uploaded: its system-prompt chunks are then already on the server)
    mine = tuple(SYS + [60000 + j for j in range(40)])
    assert b.enqueue_spill(mine, kv_for(mine), mem_of(len(mine)))
    b.flush(timeout=30)
    have = Have()
    have.add(mine)
    run_node_a(url, str(tmp_path / "a"), **tls)
    # the system prompt is stored once on the server, whoever spilled it:
    # unique chunks = 4 (SYS) + A's chat beyond SYS + the second conversation
    tt = turns()
    uniq = set()
    for toks in list(tt) + [mine]:
        for i in range(1, len(toks) // C + 1):
            uniq.add(tuple(toks[:i * C]))
    assert server_chunk_keys(ports, cli_tls) == len(uniq)
    wait_mirror(b, tt[3] + (1,), len(tt[3]))
    fetched = 0
    # an entry end of A's (turn 2), as a prefix of B's longer prompt
    fetched += serve(b, bdir, have, tt[1] + (7, 8, 9), len(tt[1]), True)
    # a chunk-aligned prefix where no spill of A ended: A's last turn cut
    # mid-way, then B's own tokens
    cut = tt[3][:len(tt[3]) - 30] + (61000, 61001, 61002)
    want = (len(tt[3]) - 30) // C * C
    assert all(want != len(x) for x in tt)
    fetched += serve(b, bdir, have, cut, want, False)
    # the exact entries
    for toks in (tt[0], tt[4]):
        info = b.lookup_ssd(toks)
        assert info is not None and info["num_tokens"] == len(toks)
        assert info["memory_bytes"] == mem_of(len(toks))
        assert same(b._read_entry(toks, info["file_path"]), toks)
    assert fetched > 0
    # another model on the same server sees none of it
    other = open_node(str(tmp_path / "o"), url, model_id="another-model", **tls)
    time.sleep(0.3)
    for toks in tt:
        assert other.lookup_ssd(toks) is None
        pre = other.lookup_ssd_prefix(toks + (5,))
        assert pre is None, pre
        assert other._read_entry(toks[:C], token_hash(toks[:C])) is None
    other.close()
    # the server dies mid-way: lookups answer fast, never raise; what B
    # adopted is still served from its own directory
    rs.stop(procs)
    worst = 0.0
    for _ in range(3):
        for toks in tt:
            for f in (b.lookup_ssd, b.lookup_ssd_prefix):
                t0 = time.monotonic()
                f(toks + (3,))  # never raises
                worst = max(worst, time.monotonic() - t0)
        t0 = time.monotonic()
        pre = b.lookup_ssd_prefix(cut)
        worst = max(worst, time.monotonic() - t0)
        assert pre is not None and pre["num_tokens"] == want
    # a dead server refuses connections: no lookup waits out even a second
    # lookup timeout (one bounded wait each, at most)
    assert worst < 2 * LOOKUP_MS / 1000, \
        f"a lookup took {worst:.3f}s with the server down (timeout {LOOKUP_MS} ms)"
    assert same(b._read_entry(cut[:want], token_hash(cut[:want])), cut[:want])
    b.close()


def test_chunks_shared_standalone(tmp_path):
    port = rs.free_port()
    p, _ = rs.start(str(tmp_path / "srv"), "--notify-keyspace-events", "Exe", port=port)
    try:
        two_nodes(tmp_path, f"redis://127.0.0.1:{port}", [p], [port])
    finally:
        rs.stop([p])


def test_chunks_shared_cluster(tmp_path):
    procs, url = rs.cluster(str(tmp_path / "cl"))
    ports = [int(x.rsplit(":", 1)[1]) for x in url[len("redis://"):].split(",")]
    try:
        two_nodes(tmp_path, url, procs, ports)
    finally:
        rs.stop(procs)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")
def test_chunks_shared_tls_cluster(tmp_path):
    """The same over TLS to a 3-master cluster (tls-cluster yes: the nodes
    announce their TLS ports; certificates made here)."""
    c = rs.make_certs(str(tmp_path / "certs"))
    procs, url = rs.cluster(str(tmp_path / "cl"), certs=c)
    ports = [int(x.rsplit(":", 1)[1]) for x in url[len("rediss://"):].split(",")]
    try:
        two_nodes(tmp_path, url, procs, ports, tls=dict(remote_tls_ca_file=c["ca.crt"]),
                  cli_tls=("--tls", "--cacert", c["ca.crt"]))
    finally:
        rs.stop(procs)


def test_evicted_chunk_is_published_and_never_served(tmp_path):
    """A chunk the server evicts (here: deleted behind kvtier's back, with
    keyspace notifications on) leaves B's mirror; a chunk damaged on the
    server is refused by B's verification, deleted, and never served."""
    port = rs.free_port()
    p, _ = rs.start(str(tmp_path / "srv"), "--notify-keyspace-events", "Exe", port=port)
    url = f"redis://127.0.0.1:{port}"
    try:
        run_node_a(url, str(tmp_path / "a"))
        b = open_node(str(tmp_path / "b"), url)
        tt = turns()
        prompt = tt[3][:5 * C] + (1, 2, 3)
        wait_mirror(b, prompt, 5 * C)
        assert b.lookup_ssd_prefix(prompt)["num_tokens"] == 5 * C
        keys = subprocess.run(["redis-cli", "-p", str(port), "--scan", "--pattern",
                               PREFIX + "{c:*"], capture_output=True, text=True).stdout.split()
        # the CLI on the shared store: ls / show / verify understand chained
        # entries (verify checks every chunk of their chains)
        cli = os.path.join(os.path.dirname(os.environ["KVTIER_LIBRARY"]), "tools", "kvtier")
        rem = ["--remote", url, "--remote-prefix", PREFIX]
        if os.path.exists(cli):
            r = subprocess.run([cli, "ls", *rem, "--json"], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            ls = json.loads(r.stdout)["entries"]
            assert sorted(e["num_tokens"] for e in ls) == sorted(len(x) for x in tt)
            r = subprocess.run([cli, "show", *rem, token_hash(tt[3])[:12]],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            r = subprocess.run([cli, "verify", *rem, "--json"], capture_output=True,
                               text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            assert json.loads(r.stdout)["bad"] == 0
        # damage every chunk (a flipped byte in the data section): B must
        # refuse them all, delete them remotely and serve nothing
        for k in keys:
            v = subprocess.run(["redis-cli", "-p", str(port), "--no-raw", "STRLEN", k],
                               capture_output=True, text=True).stdout.strip()
            n = int(v.split()[-1])
            subprocess.run(["redis-cli", "-p", str(port), "SETRANGE", k, str(n - 5), "X"],
                           capture_output=True, text=True, check=True)
        if os.path.exists(cli):
            # a damaged chunk makes every entry over it damaged (and removed)
            r = subprocess.run([cli, "verify", *rem, "--json"], capture_output=True,
                               text=True)
            assert r.returncode == 1, r.stdout + r.stderr
            assert json.loads(r.stdout)["bad"] == len(tt)
        got = b._read_entry(prompt[:5 * C], token_hash(prompt[:5 * C]))
        assert got is None
        assert not [f for f in files_under(str(tmp_path / "b")) if f.endswith(".kvc")]
        # the damaged chunk was deleted remotely and published: gone from
        # the mirror, so the lookup no longer reports that chain
        pre = b.lookup_ssd_prefix(prompt)
        assert pre is None or pre["num_tokens"] < 5 * C
        # the rest expires on the server (keyspace notifications on): B's
        # mirror drops them, and A's chained entries, whose manifests
        # survive, are misses, never data
        left = subprocess.run(["redis-cli", "-p", str(port), "--scan", "--pattern",
                               PREFIX + "{c:*"], capture_output=True, text=True).stdout.split()
        assert 0 < len(left) < len(keys)
        for k in left:
            subprocess.run(["redis-cli", "-p", str(port), "PEXPIRE", k, "1"],
                           capture_output=True, text=True, check=True)
        deadline = time.monotonic() + 10
        while b.lookup_ssd_prefix(tt[4] + (9,)) is not None and \
                b.lookup_ssd_prefix(tt[4] + (9,))["num_tokens"] != len(tt[4]) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        for toks in tt:
            info = b.lookup_ssd(toks)
            if info is not None:
                assert b._read_entry(toks, info["file_path"]) is None
            pre = b.lookup_ssd_prefix(toks[:2 * C] + (9,))
            assert pre is None, pre
        b.close()
    finally:
        rs.stop([p])
