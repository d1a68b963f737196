"""Sanity of the test oracle itself: the safetensors stand-in follows the
spec, the MLX stand-in behaves like MLX where the reference depends on it,
and the reference, as reference_loader assembles it, round-trips its own
directories."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import make_ref_cache
import mlx_standin as mx
import read_ref_cache
import safetensors_np as st
import ssd_cache_ref as ref


def test_safetensors_layout(tmp_path):
    p = str(tmp_path / "x.safetensors")
    st.save_file({"b": np.arange(3, dtype=np.int16), "a": np.ones((2, 2), np.float32)}, p,
                 metadata={"k": "v"})
    raw = open(p, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8:9] == b"{"
    hdr, meta, start = st.parse_header(raw)
    assert meta == {"k": "v"} and hdr["a"]["data_offsets"] == [0, 16]
    assert hdr["b"] == {"dtype": "I16", "shape": [3], "data_offsets": [16, 22]}
    out = st.load_file(p)
    assert np.array_equal(out["b"], np.arange(3)) and out["a"].dtype == np.float32


@pytest.mark.parametrize("mutate", ["gap", "overlap", "past_end", "size"])
def test_safetensors_rejects_malformed(mutate):
    hdr = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    data = b"\0" * 8
    if mutate == "gap":
        hdr["t"]["data_offsets"] = [4, 12]
        data = b"\0" * 12
    elif mutate == "overlap":
        hdr["u"] = {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}
    elif mutate == "past_end":
        hdr["t"]["data_offsets"] = [0, 16]
        hdr["t"]["shape"] = [4]
    else:
        hdr["t"]["shape"] = [3]
    import json

    h = json.dumps(hdr).encode()
    with pytest.raises(st.SafetensorError):
        st.load(struct.pack("<Q", len(h)) + h + data)


def test_bf16_standin_fails_numpy_like_mlx():
    a = mx.BF16Array(np.array([1.0, 1.00390625, -2.5], np.float32))
    with pytest.raises(RuntimeError, match="buffer format string"):
        np.array(a)
    arr, orig = ref._mx_to_numpy_safe(a)
    assert orig == "bfloat16" and arr.dtype == np.float32
    assert arr.tolist() == [1.0, 1.0, -2.5]  # 1.00390625 rounds to even in bf16


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantize_formula(bits):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((2, 64)).astype(np.float32)
    p, s, b = mx.quantize(w, 32, bits, np.float32)
    per = 32 // bits
    q = np.array([[(int(p[r, j // per]) >> (bits * (j % per))) & ((1 << bits) - 1)
                   for j in range(64)] for r in range(2)], dtype=np.float32)
    exp = np.repeat(s, 32, axis=-1) * q + np.repeat(b, 32, axis=-1)
    assert np.array_equal(mx.dequantize(p, s, b, 32, bits), exp)
    assert np.abs(exp - w).max() <= np.repeat(s, 32, axis=-1).max() / 2 + 1e-6


def test_reference_roundtrip_all_kinds(tmp_path):
    d = str(tmp_path / "c")
    make_ref_cache.write_cache(d, make_ref_cache.build_entries(
        seed=1, entries=4, layers=4, bf16=True))
    s = read_ref_cache.read_cache(d)
    assert s["count"] == 4 and s["failed"] == 0
    lay = s["entries"][0]["layers"]
    assert lay[3]["keys"]["dtype"] == "float16"  # quantized -> dequantized, bf16 -> fp16
    assert lay[3]["keys_original_dtype"] == "bfloat16"
    assert lay[2]["state_original_dtypes"] == ["bfloat16", "bfloat16"]
