"""mlx.core for the stand-in, in numpy, with the semantics the client code
relies on:

- ``array`` is an ndarray subclass with MLX's value semantics: indexing returns
  a new array (never a view that a later in-place write to the source could
  change, as MLX slices never are), while ``a[idx] = x`` writes into ``a``
  itself, as MLX's slice assignment does.  Arithmetic and ``astype`` make new
  arrays, so vllm-mlx's ``arr + 0`` detach copies.
- Buffer export works like MLX's: ``np.array(a)``, ``np.asarray(a)`` and
  ``memoryview(a)`` see the data in its dtype, zero-copy, through an export
  MLX marks writable (``readonly`` False, as MLX's getbuffer sets it) - so a
  consumer cannot tell from the flag that MLX treats arrays as values.
- ``copy.copy(a)`` and ``view(a, dtype)`` share a's data without copying, as
  MLX's ``__copy__`` (the same array descriptor) and ``view`` do.  In MLX a
  later ``a[idx] = x`` then rebinds ``a`` to a new buffer and leaves the
  sharer's data as it was; an ndarray cannot be rebound, so here that write
  raises RuntimeError instead of silently changing the sharer's data
  (a test that passes never relied on MLX's copy-on-write).  bfloat16 arrays (numpy has no
  bfloat16) hold their 16-bit patterns and refuse that export the way MLX's
  do (a RuntimeError about the buffer format string, the error the reference
  and kvtier catch to upcast); ``astype`` converts them exactly, and
  arithmetic on them rounds to nearest even as MLX does.  ``isinstance(x,
  mx.array)`` holds for both kinds.
- dtypes are objects with ``.size`` (bytes per element), as MLX's are
  (``mx.uint32.size`` is what QuantizedKVCache reads); arrays report numpy
  dtypes, which every operation here accepts too.
- ``quantize``/``dequantize``: MLX's affine scheme along the last axis, per
  group of ``group_size``: scale = (max - min) / (2**bits - 1), bias = min,
  code = round((w - bias) / scale) clipped, packed little-endian into uint32
  words (element j of a word in bits [j*bits, (j+1)*bits)); scales and biases
  in the input's dtype; dequantize = scale * code + bias worked in float32 and
  rounded once to the scales' dtype.
- ``eval`` does nothing (numpy is eager).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np


class Dtype:
    """An MLX dtype: a name, a size in bytes, and the numpy dtype behind it."""

    def __init__(self, name: str, np_dtype: Any) -> None:
        self.name = name
        self.np = None if np_dtype is None else np.dtype(np_dtype)
        self.size = 2 if self.np is None else self.np.itemsize

    def __repr__(self) -> str:
        return f"mlx.core.{self.name}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Dtype):
            return other.name == self.name
        try:
            return self.np is not None and np.dtype(other) == self.np
        except TypeError:
            return False

    def __hash__(self) -> int:
        return hash(self.name)


bool_ = Dtype("bool_", np.bool_)
uint8 = Dtype("uint8", np.uint8)
uint16 = Dtype("uint16", np.uint16)
uint32 = Dtype("uint32", np.uint32)
uint64 = Dtype("uint64", np.uint64)
int8 = Dtype("int8", np.int8)
int16 = Dtype("int16", np.int16)
int32 = Dtype("int32", np.int32)
int64 = Dtype("int64", np.int64)
float16 = Dtype("float16", np.float16)
float32 = Dtype("float32", np.float32)
float64 = Dtype("float64", np.float64)
bfloat16 = Dtype("bfloat16", None)


def _np_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    if isinstance(dtype, Dtype):
        if dtype.np is None:
            raise TypeError("bfloat16 has no numpy dtype (the stand-in's BF16 holds it)")
        return dtype.np
    return np.dtype(dtype)


def _to_bf16_bits(values: Any) -> np.ndarray:
    """float values -> bf16 bit patterns, round to nearest even (NaN kept)."""
    f = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
    wide = f.view(np.uint32).astype(np.uint64)
    bits = ((wide + (((wide >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        bits[nan] = ((wide[nan] >> 16) | 0x40).astype(np.uint16)
    return bits


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# Arrays made by copy.copy / view that share another array's memory, while
# they live (a dead one removes itself, on whichever thread dropped it).
_SHARERS: dict = {}  # id(weakref) -> weakref


def _unshare(r: Any) -> None:
    _SHARERS.pop(id(r), None)


def _share(a: np.ndarray) -> np.ndarray:
    r = weakref.ref(a, _unshare)
    _SHARERS[id(r)] = r
    return a


def _check_unshared(target: np.ndarray) -> None:
    """RuntimeError when a live sharer sees target's memory (see the module
    docstring: MLX would copy on write here)."""
    for r in list(_SHARERS.values()):
        other = r()
        if other is not None and other is not target and np.may_share_memory(other, target):
            raise RuntimeError("mlx stand-in: slice assignment into an array whose data a "
                               "copy.copy()/view() of it still shares; MLX would give the "
                               "assigned array a new buffer, which an ndarray cannot model")


class _ArrayType(type):
    """Lets isinstance(x, array) hold for bfloat16 arrays too, as one MLX
    array type covers every dtype."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, BF16) or type.__instancecheck__(cls, obj)


class BF16:
    """A bfloat16 MLX array: its bit patterns in a uint16 numpy array."""

    __slots__ = ("_bits",)

    def __init__(self, bits: Any) -> None:
        self._bits = np.array(bits, dtype=np.uint16)

    @classmethod
    def of(cls, values: Any) -> "BF16":
        if isinstance(values, BF16):
            return cls(values._bits)
        return cls(_to_bf16_bits(values))

    dtype = property(lambda self: bfloat16)
    shape = property(lambda self: tuple(self._bits.shape))
    ndim = property(lambda self: self._bits.ndim)
    size = property(lambda self: int(self._bits.size))
    nbytes = property(lambda self: int(self._bits.nbytes))

    def __len__(self) -> int:
        return len(self._bits)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # What MLX's buffer export does for bf16 under numpy.
        raise RuntimeError("Item size 2 for PEP 3118 buffer format string B does not "
                           "match the dtype B item size 1.")

    def __getitem__(self, idx: Any) -> "BF16":
        return BF16(self._bits[idx])

    def __setitem__(self, idx: Any, value: Any) -> None:
        _check_unshared(self._bits)
        self._bits[idx] = value._bits if isinstance(value, BF16) else _to_bf16_bits(value)

    def __copy__(self) -> "BF16":
        out = BF16.__new__(BF16)
        out._bits = _share(self._bits.view())
        return out

    def view(self, dtype: Any) -> Any:
        return view(self, dtype)

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        if dtype == bfloat16:
            return BF16(self._bits)
        return _wrap(_bf16_to_f32(self._bits).astype(_np_dtype(dtype)))

    def __add__(self, other: Any) -> "BF16":
        o = other.astype(float32) if isinstance(other, BF16) else np.asarray(other, np.float32)
        return BF16.of(_bf16_to_f32(self._bits) + o)

    __radd__ = __add__

    def __deepcopy__(self, memo: Any) -> "BF16":
        return BF16(self._bits)

    def __repr__(self) -> str:
        return f"array(shape={self.shape}, dtype=bfloat16)"


class array(np.ndarray, metaclass=_ArrayType):  # noqa: N801 - MLX's name
    """See the module docstring."""

    def __new__(cls, values: Any, dtype: Any = None) -> Any:
        if dtype == bfloat16 or (dtype is None and isinstance(values, BF16)):
            return BF16.of(values)
        if isinstance(values, BF16):
            return values.astype(dtype)
        a = np.array(values, dtype=_np_dtype(dtype))
        if a.dtype == object:
            raise ValueError("cannot build an array from these values")
        return a.view(cls)

    def __getitem__(self, idx: Any) -> Any:
        out = super().__getitem__(idx)
        if isinstance(out, np.ndarray):
            return np.array(out).view(array)
        return out

    def __setitem__(self, idx: Any, value: Any) -> None:
        # Write through a plain view: ndarray's own slice assignment would go
        # through __getitem__ above and land in a copy.
        _check_unshared(self)
        base = self.view(np.ndarray)
        base[idx] = np.asarray(value)

    def __copy__(self) -> "array":
        return _share(np.ndarray.view(self, array))

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        if dtype == bfloat16:
            return BF16.of(self)
        return np.array(self, dtype=_np_dtype(dtype)).view(array)

    def item(self, *args: Any) -> Any:
        return np.ndarray.item(self, *args)

    def tolist(self) -> Any:
        return np.ndarray.tolist(self)


def _wrap(a: Any) -> array:
    return np.asarray(a).view(array)


def zeros(shape: Any, dtype: Any = float32) -> Any:
    if dtype == bfloat16:
        return BF16(np.zeros(shape, dtype=np.uint16))
    return _wrap(np.zeros(shape, dtype=_np_dtype(dtype)))


def ones(shape: Any, dtype: Any = float32) -> array:
    return _wrap(np.ones(shape, dtype=_np_dtype(dtype)))


def concatenate(arrays: Sequence[Any], axis: int = 0) -> Any:
    if any(isinstance(a, BF16) for a in arrays):
        if not all(isinstance(a, BF16) for a in arrays):
            raise TypeError("the stand-in concatenates bfloat16 with bfloat16 only")
        return BF16(np.concatenate([a._bits for a in arrays], axis=axis))
    return _wrap(np.concatenate([np.asarray(a) for a in arrays], axis=axis))


def arange(*args: Any, dtype: Any = None) -> array:
    return _wrap(np.arange(*args, dtype=_np_dtype(dtype)))


def roll(a: Any, shift: Any, axis: Any = None) -> array:
    return _wrap(np.roll(np.asarray(a), shift, axis=axis))


def take_along_axis(a: Any, indices: Any, axis: int) -> array:
    return _wrap(np.take_along_axis(np.asarray(a), np.asarray(indices), axis=axis))


def pad(a: Any, pad_width: Any, constant_values: Any = 0) -> array:
    return _wrap(np.pad(np.asarray(a), pad_width, constant_values=constant_values))


def contiguous(a: Any) -> array:
    return _wrap(np.ascontiguousarray(a)).copy()


def where(c: Any, x: Any, y: Any) -> array:
    return _wrap(np.where(c, x, y))


def view(a: Any, dtype: Any) -> Any:
    """MLX's view: a's bits as dtype (same item size), sharing a's data."""
    if isinstance(a, BF16):
        bits = a._bits
    else:
        bits = np.asarray(a)
    if dtype == bfloat16:
        out = BF16.__new__(BF16)
        out._bits = _share(bits.view(np.uint16))
        return out
    return _share(bits.view(_np_dtype(dtype)).view(array))


def eval(*args: Any) -> None:  # noqa: A001 - MLX's name
    return None


def _check_quant(d: int, group_size: int, bits: int) -> None:
    if bits not in (2, 4, 8):
        raise ValueError(f"the stand-in quantizes to 2, 4 or 8 bits, not {bits}")
    if d % group_size or d % (32 // bits):
        raise ValueError(f"last dimension {d} does not split into groups of {group_size}")


def quantize(w: Any, group_size: int = 64, bits: int = 4, **_: Any) -> tuple:
    if isinstance(w, BF16):
        raise TypeError("the stand-in quantizes float16/float32 arrays only")
    x = np.asarray(w)
    d = x.shape[-1]
    _check_quant(d, group_size, bits)
    g = x.astype(np.float32).reshape(x.shape[:-1] + (d // group_size, group_size))
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    scale = np.where(scale == 0, np.float32(1.0), scale)
    # The codes are computed against the scales and biases as stored, so
    # dequantize reproduces the nearest representable level.
    s_st = scale.astype(x.dtype)
    b_st = lo.astype(x.dtype)
    s32 = s_st.astype(np.float32)[..., None]
    b32 = b_st.astype(np.float32)[..., None]
    q = np.clip(np.rint((g - b32) / s32), 0, levels).astype(np.uint32)
    per = 32 // bits
    q = q.reshape(x.shape[:-1] + (d // per, per))
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    packed = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    return _wrap(packed), _wrap(s_st), _wrap(b_st)


def dequantize(w: Any, scales: Any, biases: Any, group_size: int = 64, bits: int = 4,
               **_: Any) -> array:
    p = np.asarray(w, dtype=np.uint32)
    per = 32 // bits
    _check_quant(p.shape[-1] * per, group_size, bits)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    q = ((p[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.float32)
    q = q.reshape(p.shape[:-1] + (p.shape[-1] * per,))
    s = np.asarray(scales)
    out = (np.repeat(s.astype(np.float32), group_size, axis=-1) * q
           + np.repeat(np.asarray(biases).astype(np.float32), group_size, axis=-1))
    return _wrap(out.astype(s.dtype))
