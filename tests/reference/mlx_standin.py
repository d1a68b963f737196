"""Numpy stand-in for the few pieces of ``mlx.core`` (and of vllm-mlx /
mlx-lm) that the reference ssd_cache module touches, so the reference, as
reference_loader.py assembles it from the seed, runs on a machine without MLX.

What it emulates, and how:
- ``BF16Array``: an MLX bfloat16 array.  It holds float32 values already
  rounded to bf16 (round-to-nearest-even), reports ``str(dtype)`` as
  "mlx.core.bfloat16", and - exactly like a real MLX bf16 array under
  mlx >= 0.31 - makes ``np.array(arr)`` raise RuntimeError mentioning the
  "buffer format string", which is the error the reference's
  _mx_to_numpy_safe catches before upcasting with ``astype(mx.float32)``.
- ``float16`` / ``float32`` / ``bfloat16`` dtypes, ``eval`` (a no-op: numpy
  is eager), ``dequantize`` with MLX's affine formula
  (w = scale * q + bias per group of ``group_size`` elements along the last
  axis; q unpacked little-endian from uint32 words, 32/bits elements per
  word, element j of a word in bits [j*bits, (j+1)*bits)), computed in
  float32 and rounded once to the dtype of ``scales`` (MLX's output dtype).
- ``quantize``: the inverse, for tests that need packed data.
- ``KVCache``: a bare attribute holder standing in for mlx_lm's KVCache in
  the reference's ``_KVCache.__new__(_KVCache)`` dequantization path.
- ``_QuantizedCacheWrapper`` / ``_dequantize_cache``: stand-ins for
  vllm_mlx.memory_cache names; the wrapper is never instantiated here.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class _Bf16Dtype:
    """The dtype object of BF16Array: prints like MLX's (mlx.core.bfloat16)."""

    size = 2
    itemsize = 2
    name = "bfloat16"

    def __str__(self) -> str:
        return "mlx.core.bfloat16"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Bf16Dtype)

    def __hash__(self) -> int:
        return hash("mlx.core.bfloat16")


bfloat16 = _Bf16Dtype()
float16 = np.float16
float32 = np.float32


def bf16_round_bits(values: Any) -> np.ndarray:
    """float32 values -> uint16 bf16 bit patterns (round to nearest even;
    NaN kept NaN)."""
    f = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
    bits = f.view(np.uint32).astype(np.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_bits_to_f32(bits: Any) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    b = np.ascontiguousarray(np.asarray(bits, dtype=np.uint16))
    return (b.astype(np.uint32) << 16).view(np.float32)


class BF16Array:
    """A bfloat16 array as MLX would hand it to the reference.

    ``np.array(x)`` fails the way MLX bf16 does; ``x.astype(float32)``
    returns an exact float32 numpy array; ``x.bits()`` the raw uint16 words.
    """

    dtype = bfloat16

    def __init__(self, values: Any = None, *, bits: Any = None) -> None:
        if bits is not None:
            self._bits = np.ascontiguousarray(np.asarray(bits, dtype=np.uint16))
        else:
            self._bits = bf16_round_bits(values)
        self._f32 = bf16_bits_to_f32(self._bits)

    @classmethod
    def from_bits(cls, bits: Any) -> "BF16Array":
        return cls(bits=bits)

    @property
    def shape(self) -> tuple:
        return tuple(self._bits.shape)

    @property
    def ndim(self) -> int:
        return self._bits.ndim

    @property
    def size(self) -> int:
        return int(self._bits.size)

    @property
    def nbytes(self) -> int:
        return int(self._bits.size) * 2

    def bits(self) -> np.ndarray:
        """The bf16 bit patterns as a uint16 numpy array."""
        return self._bits

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # The exact failure mlx >= 0.31 produces for bf16 through PEP 3118.
        raise RuntimeError(
            "Item size 2 for PEP 3118 buffer format string B does not match "
            "the dtype B item size 1."
        )

    def astype(self, dtype: Any) -> Any:
        if dtype is bfloat16 or isinstance(dtype, _Bf16Dtype):
            return BF16Array(bits=self._bits.copy())
        return self._f32.astype(dtype)

    def __getitem__(self, idx: Any) -> "BF16Array":
        return BF16Array(bits=self._bits[idx])

    def __len__(self) -> int:
        return len(self._bits)

    def __repr__(self) -> str:
        return f"BF16Array(shape={self.shape})"


def array(values: Any, dtype: Any = None) -> Any:
    """mx.array(values, dtype): BF16Array for bfloat16, numpy otherwise."""
    if dtype is bfloat16:
        return BF16Array(values)
    return np.asarray(values, dtype=dtype)


def eval(*arrays: Any) -> None:  # noqa: A001 - mirrors mx.eval
    """mx.eval: numpy is eager, nothing to materialise."""
    return None


def _as_f32(x: Any) -> np.ndarray:
    if isinstance(x, BF16Array):
        return x.astype(np.float32)
    return np.asarray(x).astype(np.float32)


def unpack(packed: Any, bits: int) -> np.ndarray:
    """uint32 words [..., W] -> uint32 codes [..., W * 32/bits], little-endian
    within each word."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 in this stand-in, got {bits}")
    p = np.asarray(packed, dtype=np.uint32)
    per = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))
    q = (p[..., None] >> shifts) & mask
    return q.reshape(p.shape[:-1] + (p.shape[-1] * per,))


def dequantize(w: Any, scales: Any, biases: Any, group_size: int = 64,
               bits: int = 4) -> Any:
    """mx.dequantize (affine mode) in numpy: see the module docstring."""
    q = unpack(w, bits).astype(np.float32)
    s = _as_f32(scales)
    b = _as_f32(biases)
    d = q.shape[-1]
    if d % group_size != 0 or s.shape[-1] * group_size != d or b.shape != s.shape:
        raise ValueError("scales/biases do not match packed shape and group_size")
    s_full = np.repeat(s, group_size, axis=-1)
    b_full = np.repeat(b, group_size, axis=-1)
    out = s_full * q + b_full
    if isinstance(scales, BF16Array):
        return BF16Array(out)
    return out.astype(np.asarray(scales).dtype)


def quantize(w: Any, group_size: int = 64, bits: int = 4,
             scale_dtype: Any = np.float16) -> tuple:
    """Affine quantization (MLX's scheme) of w along its last axis: returns
    (packed uint32, scales, biases) with scales/biases in scale_dtype
    (np.float16, np.float32 or bfloat16)."""
    x = _as_f32(w)
    d = x.shape[-1]
    if d % group_size != 0 or (d * bits) % 32 != 0:
        raise ValueError("last dimension must be a multiple of group_size and 32/bits")
    g = x.reshape(x.shape[:-1] + (d // group_size, group_size))
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    # Round scales/biases to their storage dtype first so q is computed
    # against the values dequantize will actually use.
    if scale_dtype is bfloat16:
        s_st, b_st = BF16Array(scale), BF16Array(lo)
    else:
        s_st, b_st = scale.astype(scale_dtype), lo.astype(scale_dtype)
    s32, b32 = _as_f32(s_st), _as_f32(b_st)
    q = np.clip(np.rint((g - b32[..., None]) / s32[..., None]), 0, levels)
    q = q.astype(np.uint32).reshape(x.shape[:-1] + (d,))
    per = 32 // bits
    qw = q.reshape(x.shape[:-1] + (d // per, per))
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    packed = np.bitwise_or.reduce(qw << shifts, axis=-1).astype(np.uint32)
    return packed, s_st, b_st


class KVCache:
    """Bare stand-in for mlx_lm.models.cache.KVCache (attributes only)."""

    keys: Any = None
    values: Any = None
    offset: int = 0


class _QuantizedCacheWrapper:
    """Stand-in for vllm_mlx.memory_cache._QuantizedCacheWrapper. Never
    instantiated by these tests, so isinstance checks on it are False, as
    they are for mlx-lm's native QuantizedKVCache layers."""


def _dequantize_cache(layers: list) -> list:
    """Stand-in for vllm_mlx.memory_cache._dequantize_cache (unreachable)."""
    raise NotImplementedError("vllm_mlx.memory_cache is not available")
