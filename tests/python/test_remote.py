"""The shared remote tier through the Python binding and the CLI: a private
redis-server on a free loopback port (killed at the end), two SSDCacheTier
instances on different directories as two machines (remote_url /
remote_mode), what one spills the other promotes with equal arrays, the
per-tier stats, option validation, and `kvtier ls|stats|verify --remote`.
Skipped when redis-server is not installed or libkvtier has no Redis support.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

import redis_servers as rs
from conftest import Budget, kv_layer, make_tier, run
from kvtier import ssd_cache as kv

pytestmark = [pytest.mark.tier_profiles,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis: redis-server not installed")]


@pytest.fixture
def redis_url(tmp_path):
    proc, port = rs.start(str(tmp_path / "srv"))
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        rs.stop([proc])


def _tier(path, url, mode, **kw):
    try:
        return make_tier(path, remote_url=url, remote_mode=mode,
                         remote_prefix="py:", **kw)
    except Exception as e:  # KvtierUnsupported in builds without hiredis
        if "no Redis support" in str(e):
            pytest.skip("hiredis: libkvtier built without hiredis")
        raise


def test_config_validation():
    with pytest.raises(ValueError):
        kv.SSDCacheConfig(cache_dir="/tmp/x", remote_mode="remote")
    with pytest.raises(ValueError):
        kv.SSDCacheConfig(cache_dir="/tmp/x", remote_url="redis://h:1")
    with pytest.raises(ValueError):
        kv.SSDCacheConfig(cache_dir="/tmp/x", remote_url="redis://h:1",
                          remote_mode="both")
    c = kv.SSDCacheConfig(cache_dir="/tmp/x", remote_url="redis://h:1",
                          remote_mode="local+remote")
    assert c.remote_keep_local is True


def test_two_nodes_share(tmp_path, redis_url, rng):
    a = _tier(str(tmp_path / "a"), redis_url, "local+remote")
    b = _tier(str(tmp_path / "b"), redis_url, "local+remote")
    a.start_writer()
    toks = tuple(range(7, 47))
    layers = [kv_layer(rng, 40), kv_layer(rng, 40, np.float32)]
    assert a.enqueue_spill(toks, layers, 4242) is True
    a.flush(timeout=30)
    assert a.get_stats()["remote_spill_count"] == 1
    # lookups see the remote entry (issue 16): what the promote below finds.
    # B learns of A's spill from the store's event channel, asynchronously:
    # wait for it, bounded (the mirror is eventually consistent).
    deadline = time.monotonic() + 10
    hit = b.lookup_ssd(toks)
    while hit is None and time.monotonic() < deadline:
        time.sleep(0.02)
        hit = b.lookup_ssd(toks)
    assert hit is not None and hit["num_tokens"] == 40
    bud = Budget()
    got = run(b.async_promote(toks, bud.reserve, bud.release))
    assert got is not None and bud.reserved == 4242
    assert np.array_equal(got[0]["keys"], layers[0].keys)
    assert np.array_equal(got[1]["values"], layers[1].values)
    st = b.get_stats()
    assert st["remote_hits"] == 1 and st["ssd_hits"] == 1
    assert st["local_hits"] == 0 and st["remote_available"] == 1
    # kept a local copy
    assert b.lookup_ssd(toks)["num_tokens"] == 40
    # miss everywhere
    assert run(b.async_promote((1, 2, 3), bud.reserve, bud.release)) is None
    assert b.get_stats()["remote_misses"] >= 1
    a.close()
    b.close()

    cli = os.path.join(os.path.dirname(os.environ["KVTIER_LIBRARY"]), "tools",
                       "kvtier")
    if os.path.exists(cli):
        p = subprocess.run([cli, "ls", "--remote", redis_url, "--remote-prefix",
                            "py:", "--json"], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        ls = json.loads(p.stdout)
        assert [e["token_hash"] for e in ls["entries"]] == [kv._tokens_hash(toks)]
        assert ls["entries"][0]["num_tokens"] == 40
        p = subprocess.run([cli, "stats", "--remote", redis_url,
                            "--remote-prefix", "py:", "--json"],
                           capture_output=True, text=True)
        assert p.returncode == 0 and json.loads(p.stdout)["entries"] == 1
        p = subprocess.run([cli, "verify", "--remote", redis_url,
                            "--remote-prefix", "py:", "--json"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["bad"] == 0
        h = kv._tokens_hash(toks)
        p = subprocess.run([cli, "show", "--remote", redis_url, "--remote-prefix",
                            "py:", h[:10], "--json"], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        sh = json.loads(p.stdout)
        assert sh["entry"]["token_hash"] == h and sh["entry"]["num_tokens"] == 40
        assert len(sh["describe"]["layers"]) == 2
        p = subprocess.run([cli, "show", "--remote", redis_url, "--remote-prefix",
                            "py:", "abcd"], capture_output=True, text=True)
        assert p.returncode != 0 and "no entry abcd" in p.stderr
        gc = [cli, "gc", "--remote", redis_url, "--remote-prefix", "py:",
              "--max-entries", "1", "--json"]
        p = subprocess.run(gc, capture_output=True, text=True)
        assert p.returncode == 0 and json.loads(p.stdout)["removed_count"] == 0
        time.sleep(1.1)
        p = subprocess.run(gc[:-3] + ["--older-than", "1s", "--dry-run", "--json"],
                           capture_output=True, text=True)
        out = json.loads(p.stdout)
        assert p.returncode == 0 and out["dry_run"] and out["removed_count"] == 1
        p = subprocess.run(gc[:-3] + ["--older-than", "1s", "--json"],
                           capture_output=True, text=True)
        out = json.loads(p.stdout)
        assert out["removed"][0]["token_hash"] == h and out["remaining"] == 0
        p = subprocess.run([cli, "ls", "--remote", redis_url, "--remote-prefix",
                            "py:", "--json"], capture_output=True, text=True)
        assert json.loads(p.stdout)["entries"] == []
        p = subprocess.run([cli, "ls", "--remote", "redis://127.0.0.1:1"],
                           capture_output=True, text=True)
        assert p.returncode == 3 and "redis://127.0.0.1:1" in p.stderr
