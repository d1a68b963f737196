"""The loader that builds the reference module from the seed
(tests/reference/reference_loader.py): with the seed present the module is
complete and runs on the stand-ins only; a cut or altered seed is refused
with the member named; without the seed ``import ssd_cache_ref`` (and so
conftest) still works and every use of the reference reports the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

import reference_loader as loader
import ssd_cache_ref as ref

HERE = os.path.dirname(os.path.abspath(__file__))
REF_DIR = os.path.join(os.path.dirname(HERE), "reference")


def _seed_text():
    ref.SSDIndex  # skips (seed: ...) where there is no seed
    with open(loader.seed_path(), encoding="utf-8") as f:
        return f.read()


def test_every_documented_member_is_defined():
    members = loader.parse_seed(_seed_text())
    assert len(members) > 50
    for m in members:
        obj = ref
        for part in m.name.split("."):
            if "instance-attribute" in m.tags and "class-attribute" not in m.tags \
                    and part == m.short:
                break  # set by __init__, checked through the instances below
            assert hasattr(obj, part), m.name
            obj = getattr(obj, part)
    assert loader.undefined_globals(vars(ref)) == []
    # The class statements the loader rebuilt: bases, dataclass fields in
    # order, class attributes, the property from its documented expression.
    assert issubclass(ref.KVCacheSerializer, ref.LayerSerializer)
    assert ref.LayerSerializer.__abstractmethods__ == {
        "snapshot_layer", "serialize_layer", "deserialize_layer"}
    assert [f for f in ref.SSDCacheConfig.__dataclass_fields__] == [
        "cache_dir", "max_size_gb", "max_entries", "file_permissions",
        "dir_permissions", "spill_queue_size", "retention_seconds"]
    cfg = ref.SSDCacheConfig(cache_dir="x", max_size_gb=0.5)
    assert cfg.file_permissions == 0o600 and cfg.max_size_bytes == 512 * 1024 * 1024
    assert ref.SSDIndex._SCHEMA_VERSION == 1
    assert ref.KVCacheSerializer._ROTATING_ATTRS == ("max_size", "keep", "step", "_idx")
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        ref.SSDCacheConfig(cache_dir="x", max_entries=0)


def test_standins_do_not_leak_into_sys_modules(tmp_path):
    # The reference imports mlx.core / safetensors.numpy inside its
    # serializers: run them, then check no fake mlx became importable.
    import numpy as np

    layer = type("L", (), {})()
    layer.keys = layer.values = np.zeros((1, 1, 2, 4), np.float16)
    layer.offset = 2
    s = ref.KVCacheSerializer()
    meta = s.serialize_layer(s.snapshot_layer(layer), 0, str(tmp_path / "l.safetensors"))
    assert s.deserialize_layer(str(tmp_path / "l.safetensors"), meta)["offset"] == 2
    for name in ("mlx", "mlx.core", "safetensors", "safetensors.numpy", "mlx_lm",
                 "vllm_mlx", "vllm_mlx.memory_cache"):
        assert name not in sys.modules, name


def _cut(text, member, drop_line):
    """The seed with one line of ``member``'s source block removed."""
    lines = text.splitlines()
    head = lines.index(f"vllm_mlx.ssd_cache.{member}")
    mark = lines.index(loader.SOURCE_MARK, head)
    del lines[mark + 2 + drop_line]
    return "\n".join(lines) + "\n"


def test_cut_seed_is_refused_with_the_member(tmp_path):
    text = _seed_text()
    p = tmp_path / "cut.txt"
    p.write_text(_cut(text, "SSDIndex.touch", 3), encoding="utf-8")
    with pytest.raises(loader.SeedFormatError, match=r"SSDIndex\.touch: source block"):
        loader.source(str(p))
    # The unchanged text assembles.
    p.write_text(text, encoding="utf-8")
    assert "def touch(self" in loader.source(str(p))


def test_seed_without_an_import_it_needs_is_refused(tmp_path, monkeypatch):
    text = _seed_text()
    p = tmp_path / "seed.txt"
    p.write_text(text, encoding="utf-8")
    monkeypatch.setattr(loader, "_PRELUDE", loader._PRELUDE.replace("import sqlite3\n", ""))
    probe = types.ModuleType("reference_probe")
    monkeypatch.setitem(sys.modules, probe.__name__, probe)  # dataclass looks it up
    with pytest.raises(loader.SeedFormatError, match="no import provides: sqlite3"):
        loader.exec_into(probe.__dict__, str(p))


def _run(code, env_extra):
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([REF_DIR, HERE, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_without_the_seed_imports_work_and_uses_say_why(tmp_path):
    env = {loader.SHARED_ENV: str(tmp_path / "no-shared")}
    r = _run("import ssd_cache_ref as r, reference_loader as L\n"
             "try:\n    r.SSDCacheTier\nexcept L.ReferenceUnavailable as e:\n"
             "    print('unavailable', e)\n", env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("unavailable seed: ") and "no-shared" in r.stdout
    # conftest (which imports the layer classes of make_ref_cache, and so
    # ssd_cache_ref) imports; once pytest is loaded the reason is a skip.
    r = _run("import conftest, ssd_cache_ref as r\n"
             "try:\n    r.SSDCacheTier\nexcept BaseException as e:\n"
             "    print(type(e).__name__, e)\n", env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Skipped seed: "), r.stdout
    r = subprocess.run([sys.executable, os.path.join(REF_DIR, "make_ref_cache.py"),
                        str(tmp_path / "d")], capture_output=True, text=True,
                       env=dict(os.environ, **env), timeout=120)
    assert r.returncode == loader.EXIT_UNAVAILABLE and "seed: " in r.stderr
    assert not os.path.exists(tmp_path / "d" / "index.db")


def test_without_the_seed_pytest_reports_a_seed_skip(tmp_path):
    # A test module that touches the reference at import and a test that
    # touches it in its body: both reported as skips tagged seed.
    t = tmp_path / "test_probe.py"
    t.write_text("import ssd_cache_ref as ref\n\n"
                 "def test_body():\n    ref.SSDIndex\n", encoding="utf-8")
    m = tmp_path / "test_probe_module.py"
    m.write_text("import ssd_cache_ref as ref\nX = ref.SSDIndex\n\n"
                 "def test_never():\n    pass\n", encoding="utf-8")
    env = dict(os.environ, **{loader.SHARED_ENV: str(tmp_path / "no-shared")})
    env["PYTHONPATH"] = os.pathsep.join([REF_DIR, HERE, env.get("PYTHONPATH", "")])
    # -p conftest: our conftest as a plugin, for its SKIP(<tag>) lines.
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "conftest", str(t), str(m)], capture_output=True, text=True,
                       env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 skipped" in r.stdout, r.stdout
    assert "SKIP(seed): test_probe.py::test_body: " in r.stdout, r.stdout
    assert "SKIP(seed): test_probe_module.py" in r.stdout, r.stdout
