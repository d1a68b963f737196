"""LayerSerializer family through kvt_layer_save/kvt_layer_load: snapshots
equal the reference's, files written by either side are read by the other
with identical arrays and metadata, promoted arrays share C memory safely."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import mlx_standin
import ssd_cache_ref as ref
from conftest import ArraysLayer, RotatingLayer, kv_layer
from kvtier import ssd_cache as kv


def _assert_layer_equal(a, b):
    assert set(a) == set(b), (set(a), set(b))
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert np.array_equal(a[k], b[k]), k
        elif isinstance(a[k], list) and a[k] and isinstance(a[k][0], np.ndarray):
            assert len(a[k]) == len(b[k])
            for x, y in zip(a[k], b[k]):
                assert x.dtype == y.dtype and np.array_equal(x, y)
        else:
            assert a[k] == b[k], k


def _snap_equal(s1, s2):
    assert set(s1) == set(s2)
    for k in s1:
        if isinstance(s1[k], np.ndarray):
            assert s1[k].dtype == s2[k].dtype and np.array_equal(s1[k], s2[k])
        elif k == "state_np":
            for x, y in zip(s1[k], s2[k]):
                assert x.dtype == y.dtype and np.array_equal(x, y)
        else:
            assert s1[k] == s2[k]


LAYERS = {
    "kv_f16": lambda rng: kv_layer(rng, 7),
    "kv_f32": lambda rng: kv_layer(rng, 5, np.float32),
    "kv_bf16": lambda rng: kv_layer(rng, 6, "bf16"),
    "rotating": lambda rng: RotatingLayer(rng.standard_normal((1, 2, 4, 8)).astype(np.float16),
                                          rng.standard_normal((1, 2, 4, 8)).astype(np.float16),
                                          9, 4, 2, 256, 1),
    "arrays": lambda rng: ArraysLayer([rng.standard_normal((1, 3, 8)).astype(np.float32),
                                       rng.integers(0, 9, (2, 2)).astype(np.int32)]),
    "arrays_bf16": lambda rng: ArraysLayer([mlx_standin.BF16Array(rng.standard_normal((2, 4))),
                                            rng.standard_normal((3,)).astype(np.float16)]),
    "arrays_empty": lambda rng: ArraysLayer([]),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_snapshot_matches_reference(name, rng):
    layer = LAYERS[name](rng)
    s_ref = ref.get_serializer_for_layer(layer).snapshot_layer(layer)
    s_kv = kv.get_serializer_for_layer(layer).snapshot_layer(layer)
    _snap_equal(s_kv, s_ref)


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("idx", [0, 3])
def test_kvtier_written_layer_read_by_reference(name, idx, rng, tmp_path):
    layer = LAYERS[name](rng)
    ser_kv = kv.get_serializer_for_layer(layer)
    ser_ref = ref.get_serializer_for_layer(layer)
    snap = ser_kv.snapshot_layer(layer)
    path = str(tmp_path / f"layer_{idx}.safetensors")
    meta_kv = ser_kv.serialize_layer(snap, idx, path)
    meta_ref = ser_ref.serialize_layer(ser_ref.snapshot_layer(layer), idx,
                                       str(tmp_path / "ref.safetensors"))
    # Every key the reference records, with the same value (kvtier may add more).
    for k, v in meta_ref.items():
        assert meta_kv[k] == v, k
    via_ref = ser_ref.deserialize_layer(path, meta_kv)
    expect = ser_ref.deserialize_layer(str(tmp_path / "ref.safetensors"), meta_ref)
    _assert_layer_equal(via_ref, expect)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_reference_written_layer_read_by_kvtier(name, rng, tmp_path):
    layer = LAYERS[name](rng)
    ser_ref = ref.get_serializer_for_layer(layer)
    path = str(tmp_path / "layer_2.safetensors")
    meta = ser_ref.serialize_layer(ser_ref.snapshot_layer(layer), 2, path)
    got = kv.get_serializer_for_layer(layer).deserialize_layer(path, meta)
    _assert_layer_equal(got, ser_ref.deserialize_layer(path, meta))


def test_deserialized_arrays_share_c_memory_and_outlive_everything(rng, tmp_path):
    layer = kv_layer(rng, 33, np.float32)
    ser = kv.KVCacheSerializer()
    path = str(tmp_path / "layer_0.safetensors")
    meta = ser.serialize_layer(ser.snapshot_layer(layer), 0, path)
    got = ser.deserialize_layer(path, meta)
    keys = got["keys"]
    # No copy: the array's memory belongs to the C entry, kept alive through base.
    base = keys
    while getattr(base, "base", None) is not None and isinstance(base, np.ndarray):
        base = base.base
    assert not isinstance(base, np.ndarray)
    assert hasattr(base, "_owner")
    del got, base
    gc.collect()
    os.remove(path)
    assert np.array_equal(keys, layer.keys)
    keys[0, 0, 0, 0] = 42.0  # writable, private to the caller
    assert keys[0, 0, 0, 0] == 42.0


def test_corrupt_layer_file_raises(rng, tmp_path):
    layer = kv_layer(rng, 4)
    ser = kv.KVCacheSerializer()
    path = str(tmp_path / "layer_0.safetensors")
    meta = ser.serialize_layer(ser.snapshot_layer(layer), 0, path)
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * 8)  # header length now absurd
    with pytest.raises(Exception):
        ser.deserialize_layer(path, meta)
    with pytest.raises(Exception):
        ref.KVCacheSerializer().deserialize_layer(path, meta)


class _NoDtypeArg:
    """An array-like as simple as the reference suite's mocks: __array__
    takes no dtype argument; numpy cannot hold its dtype (it raises MLX's
    buffer-format error), and astype gives a plain numpy-convertible one."""

    def __init__(self, data, dtype_name):
        self._data = data
        self.dtype = type("dtype", (), {"__str__": lambda self: f"mlx.core.{dtype_name}"})()

    def __array__(self):
        raise RuntimeError("buffer format string mismatch")

    def astype(self, _dt):
        data = self._data

        class Plain:
            def __array__(self):
                return data

        return Plain()


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3"])
def test_mx_to_numpy_safe_widens_what_numpy_cannot_hold(name):
    data = np.arange(6, dtype=np.float64).reshape(2, 3)
    out, orig = kv._mx_to_numpy_safe(_NoDtypeArg(data, name))
    assert out.dtype == np.float32 and np.array_equal(out, data) and orig == name
    plain, none = kv._mx_to_numpy_safe(np.ones(3, np.float16))
    assert plain.dtype == np.float16 and none is None
