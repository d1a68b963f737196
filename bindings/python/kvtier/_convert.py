"""Conversions between Python objects and libkvtier's C structures.

Two directions:
- Spill: duck-typed engine layers (``.keys/.values/.offset`` [+ rotating
  attributes], a list ``.state``, or quantized ``(packed, scales, biases)``
  tuples with ``bits``/``group_size``) holding numpy arrays, bf16 stand-ins
  (anything whose ``str(dtype)`` ends in "bfloat16" and that converts with
  ``astype(numpy.float32)``) or anything ``numpy.asarray`` accepts, become a
  ``kvt_layer`` array.  The numpy buffers are referenced, not copied: the
  ``_Keep`` object returned with them must stay alive until the C call that
  reads them has returned (kvt_tier_spill copies before returning).  In hold
  mode (``build_layers(cache, hold=True)``, for kvt_tier_spill_nocopy) each
  tensor is also classified: its buffer is *frozen* when nobody can change
  it until the writer releases it (an MLX array, pinned through a reference
  of our own; a numpy array read-only down to an immutable owner; an array
  this module made), and *shared* otherwise; ``_Keep.unshared()`` then
  copies the shared ones, so the keep-alive list can be held instead of
  copied.
- Promote: a ``kvt_entry`` becomes the reference's list of layer dicts.  Tensor
  data is shared, not copied: each array's ``base`` chain ends in a ctypes
  buffer whose ``_owner`` is the ``EntryHandle`` that frees the entry when the
  last array (or the handle) goes away.  BF16 is the exception: numpy has no
  bfloat16, so BF16 tensors are returned as float32 copies with the
  reference's ``*_original_dtype: "bfloat16"`` hint.
"""

from __future__ import annotations

import array as _array
import copy as _copy
import ctypes
import sys
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import _lib as L

# numpy dtype -> kvt_dtype.
_NP_TO_KVT = {
    np.dtype(np.bool_): L.DTYPE_BOOL,
    np.dtype(np.uint8): L.DTYPE_U8,
    np.dtype(np.int8): L.DTYPE_I8,
    np.dtype(np.int16): L.DTYPE_I16,
    np.dtype(np.uint16): L.DTYPE_U16,
    np.dtype(np.float16): L.DTYPE_F16,
    np.dtype(np.int32): L.DTYPE_I32,
    np.dtype(np.uint32): L.DTYPE_U32,
    np.dtype(np.float32): L.DTYPE_F32,
    np.dtype(np.int64): L.DTYPE_I64,
    np.dtype(np.uint64): L.DTYPE_U64,
    np.dtype(np.float64): L.DTYPE_F64,
}
_KVT_TO_NP = {v: k for k, v in _NP_TO_KVT.items()}

# Original-dtype hint names (MLX dtype names, as the reference records them).
_HINT_NAMES = {
    L.DTYPE_BOOL: "bool_",
    L.DTYPE_U8: "uint8",
    L.DTYPE_I8: "int8",
    L.DTYPE_I16: "int16",
    L.DTYPE_U16: "uint16",
    L.DTYPE_F16: "float16",
    L.DTYPE_BF16: "bfloat16",
    L.DTYPE_I32: "int32",
    L.DTYPE_U32: "uint32",
    L.DTYPE_F32: "float32",
    L.DTYPE_I64: "int64",
    L.DTYPE_U64: "uint64",
    L.DTYPE_F64: "float64",
}
_HINT_CODES = {v: k for k, v in _HINT_NAMES.items()}
_HINT_CODES["bool"] = L.DTYPE_BOOL

KV_ATTRS = ("max_size", "keep", "step", "_idx")  # optional KV integers, reference order


# --------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------


def tokens_arg(tokens: Sequence[int]) -> Tuple[Any, int]:
    """(ctypes int32 array or None, n) for a token sequence.  Built through
    array('i', ...) exactly like the reference's _tokens_to_blob, so values
    outside int32 raise OverflowError as they do there."""
    arr = _array.array("i", tokens)
    n = len(arr)
    if n == 0:
        return None, 0
    return (ctypes.c_int32 * n).from_buffer(arr), n


def tokens_blob(tokens: Sequence[int]) -> bytes:
    """The reference's _tokens_to_blob."""
    return _array.array("i", tokens).tobytes()


# --------------------------------------------------------------------------
# bf16 helpers
# --------------------------------------------------------------------------


def is_bf16(x: Any) -> bool:
    """True for a bf16 array object numpy cannot represent (MLX bf16 or the
    test stand-in): its dtype prints as ...bfloat16."""
    if isinstance(x, np.ndarray):
        return False
    return str(getattr(x, "dtype", "")).endswith("bfloat16")


def f32_to_bf16_bits(f: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 patterns, round to nearest even (exact for
    values that are already bf16)."""
    f = np.ascontiguousarray(f, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    out = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """uint16 bf16 patterns -> float32 (exact)."""
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(
        np.float32)


def to_numpy_safe(arr: Any) -> Tuple[np.ndarray, Optional[str]]:
    """``_mx_to_numpy_safe``: ``arr`` copied into a numpy array, plus the name
    of its dtype when numpy has no such dtype and the copy had to be widened
    to float32 (None otherwise).  bfloat16 is the case that occurs: it is
    recognised by its dtype's name, and also by the "buffer format string"
    RuntimeError MLX raises when numpy asks for such a buffer (any other
    RuntimeError propagates).  The name lets the promote side narrow it
    again."""
    if not is_bf16(arr):
        try:
            return np.array(arr), None
        except RuntimeError as e:
            if "buffer format string" not in str(e):
                raise
    # np.array() without a dtype: array-likes whose __array__ takes no
    # dtype argument must convert too.
    widened = np.array(arr.astype(np.float32))
    return widened.astype(np.float32, copy=False), str(arr.dtype).rpartition(".")[2]


# --------------------------------------------------------------------------
# Spill side: Python layers -> kvt_layer
# --------------------------------------------------------------------------


class _Keep(list):
    """Objects that must outlive the C call reading the layers.  In hold mode
    also the classification of the tensors (see the module docstring):
    ``shared`` lists (kvt_tensor, array) pairs whose buffer the caller may
    still change, ``frozen_bytes`` / ``shared_bytes`` their sizes."""

    def __init__(self, hold: bool = False) -> None:
        super().__init__()
        self.hold = hold
        self.shared: List[Tuple[Any, np.ndarray]] = []
        self.frozen_bytes = 0
        self.shared_bytes = 0

    def unshared(self) -> int:
        """Replaces every shared buffer by a private copy (the descriptors
        are repointed), so that everything in the list may be held until a
        kvt_tier_spill_nocopy releases it.  Returns the bytes copied."""
        copied = 0
        for t, arr in self.shared:
            own = np.array(arr, copy=True, order="C")
            self.append(own)
            t.data = own.ctypes.data if own.nbytes else None
            copied += int(own.nbytes)
        self.frozen_bytes += copied
        self.shared_bytes -= copied
        self.shared = []
        return copied

    @property
    def held_bytes(self) -> int:
        """Tensor bytes the list holds (frozen and shared)."""
        return self.frozen_bytes + self.shared_bytes


def _mlx_array_type() -> Any:
    """mlx.core.array when MLX (or the tests' stand-in of it) is loaded."""
    mod = sys.modules.get("mlx.core")
    return getattr(mod, "array", None) if mod is not None else None


def frozen_numpy(a: np.ndarray) -> bool:
    """True when nobody can write a's memory through numpy: a and every array
    in its base chain are read-only, and the chain ends in an immutable
    ``bytes`` object, a read-only memoryview of one, or a read-only array
    that owns its memory (turning writes back on for that owner while a spill
    holds it breaks the promise, as writing into a buffer handed to
    kvt_tier_spill_nocopy does).  A read-only view of a writable array, or of
    memory numpy does not own (mmap, ctypes, another library's buffer), is
    not frozen: its owner can still write it."""
    x: Any = a
    for _ in range(64):  # base chains are short; a cycle would be a numpy bug
        if isinstance(x, np.ndarray):
            if x.flags.writeable:
                return False
            if x.base is None:
                return bool(x.flags.owndata)
            x = x.base
        elif isinstance(x, memoryview):
            if not x.readonly:
                return False
            x = x.obj
        else:
            return isinstance(x, bytes)
    return False


def _pinned_mlx(x: Any, keep: _Keep) -> Optional[Tuple[np.ndarray, int]]:
    """(numpy array over x's data, kvt dtype) through MLX's buffer export, or
    None when x's data cannot be held as it is (not C-contiguous, a dtype
    with no numpy equivalent and no bit view).

    MLX arrays are values: an engine that "changes" one (slice assignment,
    ``+=``) rebinds its Python object to a new array, and MLX writes into the
    old buffer in place (donation) only when no other array references it.
    So the buffer is held through a reference of our own - ``copy.copy``
    (MLX's __copy__ shares the array's data without copying it), or the
    uint16 bit view of a bfloat16 array (``mlx.core.view``) - and never
    through the caller's object.  The export itself (``memoryview``) is what
    MLX gives numpy: the evaluated data, zero-copy; MLX marks it writable,
    which is why the flag is not what decides here."""
    mx = sys.modules.get("mlx.core")
    if is_bf16(x):
        view = getattr(mx, "view", None)
        if view is None:
            return None
        pin = view(x, mx.uint16)
        code = L.DTYPE_BF16
    else:
        pin = _copy.copy(x)
        code = -1
    try:
        mv = memoryview(pin)
    except (TypeError, ValueError, RuntimeError):
        return None
    a = np.asarray(mv)
    if not a.flags.c_contiguous or a.dtype.byteorder not in ("=", "|"):
        return None
    if code == -1:
        code = _NP_TO_KVT.get(a.dtype, -1)
        if code == -1:
            return None
    elif a.dtype != np.uint16:
        return None
    keep.extend((pin, mv))
    return a, code


def _fill_tensor(t: L.Tensor, x: Any, keep: _Keep, hint_code: int = 0) -> int:
    """Fills t from x; returns the original-dtype hint code for the tensor
    (hint_code, or 0).  In hold mode also classifies x's buffer (keep)."""
    frozen = False
    pinned = None
    if keep.hold:
        mxa = _mlx_array_type()
        if mxa is not None and isinstance(x, mxa):
            pinned = _pinned_mlx(x, keep)
    if pinned is not None:
        arr, code = pinned
        frozen = True
    elif is_bf16(x):
        f32 = np.asarray(x.astype(np.float32), dtype=np.float32)
        arr = f32_to_bf16_bits(f32)
        code = L.DTYPE_BF16
        frozen = True  # made here: nobody else has it
    else:
        a = np.asarray(x)
        made = False  # a private array made here (nobody else has it)
        if a.dtype.byteorder not in ("=", "|"):
            a = a.astype(a.dtype.newbyteorder("="))
            made = True
        code = _NP_TO_KVT.get(a.dtype)
        if code is None:
            raise ValueError(f"unsupported dtype {a.dtype} (safetensors has no such type)")
        arr = np.ascontiguousarray(a)
        made = made or arr is not a
        # Otherwise arr is x's own memory: frozen only if x is a numpy array
        # nobody can write (anything else numpy.asarray accepted may be a
        # view of memory its owner still changes).
        frozen = keep.hold and (made or (isinstance(x, np.ndarray) and frozen_numpy(x)))
    if arr.ndim > L.KVT_MAX_DIMS:
        raise ValueError(f"tensor has {arr.ndim} dimensions (max {L.KVT_MAX_DIMS})")
    keep.append(arr)
    t.dtype = code
    t.ndim = arr.ndim
    for i, d in enumerate(arr.shape):
        t.shape[i] = int(d)
    t.nbytes = int(arr.nbytes)
    t.data = arr.ctypes.data if arr.nbytes else None
    if keep.hold:
        if frozen:
            keep.frozen_bytes += int(arr.nbytes)
        else:
            keep.shared.append((t, arr))
            keep.shared_bytes += int(arr.nbytes)
    return hint_code


def _hint_from_sentinel(layer: Any, attr: str) -> int:
    name = getattr(layer, attr, None)
    if isinstance(name, str):
        return _HINT_CODES.get(name.rsplit(".", 1)[-1], 0)
    return 0


# Layer classes.  The reference decides per layer with three questions, in
# this order: are keys/values packed (a tuple or list of packed, scales,
# biases: mlx-lm's QuantizedKVCache and vllm-mlx's quantized wrapper)? does it
# carry keys, values and offset (the KV serializer)? is its state a list (the
# arrays serializer)?  Among KV layers, mlx-lm has one class with a window,
# RotatingKVCache, and that window is what max_size bounds; every other KV
# class (KVCache, ChunkedKVCache, QuantizedKVCache dequantized, the KVCache
# objects the scheduler rebuilds) has the class attribute step = 256 and no
# bound.  So a KV layer is rotating when its class is (or derives from)
# RotatingKVCache, or when it carries a max_size that is set (vllm-mlx copies
# max_size/keep/step/_idx onto the layers it trims and rebuilds, keeping the
# window).  step, keep and _idx are recorded whenever present, on any KV
# layer, as the reference records them; they never decide the kind.
KIND_QUANTIZED, KIND_KV, KIND_ROTATING, KIND_ARRAYS = "quantized", "kv", "rotating", "arrays"


def _has_window(layer: Any) -> bool:
    if any(k.__name__ == "RotatingKVCache" for k in type(layer).__mro__):
        return True
    return getattr(layer, "max_size", None) is not None


def layer_kind(layer: Any) -> str:
    """One of KIND_QUANTIZED, KIND_KV, KIND_ROTATING, KIND_ARRAYS for an
    engine layer (see above); ValueError naming the class when the reference
    would have no serializer for it."""
    if isinstance(getattr(layer, "keys", None), (tuple, list)):
        return KIND_QUANTIZED
    if all(hasattr(layer, a) for a in ("keys", "values", "offset")):
        if _has_window(layer):
            return KIND_ROTATING
        # mlx-lm's ChunkedKVCache drops its oldest rows once it holds more
        # than chunk_size tokens (start_position counts them): row i is then
        # token start_position + i, which no KV layer can say, and chunks or
        # prefixes cut from it would serve the wrong tokens' rows.
        front = getattr(layer, "start_position", 0)
        if isinstance(front, int) and front > 0:
            raise ValueError(f"{type(layer).__name__} trimmed at the front (start_position "
                             f"{front}): its rows do not start at token 0")
        return KIND_KV
    if isinstance(getattr(layer, "state", None), list):
        return KIND_ARRAYS
    raise ValueError(f"Unsupported cache layer type: {type(layer).__name__}")


def is_quantized_layer(layer: Any) -> bool:
    """True when the layer's keys are packed (see layer_kind)."""
    return layer_kind_or_none(layer) == KIND_QUANTIZED


def layer_kind_or_none(layer: Any) -> Optional[str]:
    try:
        return layer_kind(layer)
    except ValueError:
        return None


def _set_kv_attrs(out: L.Layer, get: Any) -> None:
    """Copies the optional KV integers (window bound, kept prefix, growth
    step, write position) through get(name) -> value or None."""
    for attr, field in (("max_size", "max_size"), ("keep", "keep"),
                        ("step", "step"), ("_idx", "idx")):
        v = get(attr)
        setattr(out, field, L.KVT_ABSENT if v is None else int(v))


def fill_layer(out: L.Layer, layer: Any, keep: _Keep) -> None:
    """Describes one engine layer in out (see module docstring and
    layer_kind).  Raises ValueError for a layer the reference has no
    serializer for."""
    kind = layer_kind(layer)
    if kind == KIND_QUANTIZED:
        keys = tuple(layer.keys)
        values = tuple(getattr(layer, "values", ()))
        if len(keys) != 3 or len(values) != 3:
            raise ValueError("quantized layer keys/values must be (packed, scales, biases)")
        tensors = (L.Tensor * 6)()
        hints = (ctypes.c_int32 * 6)()
        for i, x in enumerate(keys + values):
            _fill_tensor(tensors[i], x, keep)
        kh = _hint_from_sentinel(layer, "_ssd_keys_original_dtype")
        vh = _hint_from_sentinel(layer, "_ssd_values_original_dtype")
        hints[0], hints[3] = kh, vh
        keep.extend((tensors, hints))
        L.kvt_layer_init(ctypes.byref(out), L.LAYER_QUANTIZED_KV)
        out.num_tensors = 6
        out.tensors = tensors
        out.bits = int(getattr(layer, "bits", 8))
        out.group_size = int(getattr(layer, "group_size", 64))
        packed = np.asarray(keys[0]) if not is_bf16(keys[0]) else None
        default_off = packed.shape[-2] if packed is not None and packed.ndim >= 2 else 0
        out.offset = int(getattr(layer, "offset", default_off))
        out.orig_dtypes = hints if (kh or vh) else None
        return
    if kind in (KIND_KV, KIND_ROTATING):
        tensors = (L.Tensor * 2)()
        hints = (ctypes.c_int32 * 2)()
        hints[0] = _fill_tensor(tensors[0], layer.keys, keep,
                                _hint_from_sentinel(layer, "_ssd_keys_original_dtype"))
        hints[1] = _fill_tensor(tensors[1], layer.values, keep,
                                _hint_from_sentinel(layer, "_ssd_values_original_dtype"))
        keep.extend((tensors, hints))
        L.kvt_layer_init(ctypes.byref(out),
                         L.LAYER_ROTATING_KV if kind == KIND_ROTATING else L.LAYER_KV)
        out.num_tensors = 2
        out.tensors = tensors
        out.offset = int(layer.offset)
        _set_kv_attrs(out, lambda a: getattr(layer, a, None))
        out.orig_dtypes = hints if (hints[0] or hints[1]) else None
        return
    state = layer.state
    n = len(state)
    tensors = (L.Tensor * max(n, 1))()
    hints = (ctypes.c_int32 * max(n, 1))()
    for i, x in enumerate(state):
        _fill_tensor(tensors[i], x, keep)
    keep.extend((tensors, hints))
    L.kvt_layer_init(ctypes.byref(out), L.LAYER_ARRAYS)
    out.num_tensors = n
    out.tensors = tensors
    out.orig_dtypes = None


def build_layers(cache: Sequence[Any], hold: bool = False) -> Tuple[Any, int, _Keep]:
    """(kvt_layer array, count, keep-alive list) for a list of layers; hold:
    classify the buffers for a zero-copy spill (_Keep)."""
    keep = _Keep(hold)
    n = len(cache)
    layers = (L.Layer * max(n, 1))()
    for i, layer in enumerate(cache):
        try:
            fill_layer(layers[i], layer, keep)
        except ValueError as e:
            raise ValueError(f"layer {i}: {e}") from None
    keep.append(layers)
    return layers, n, keep


def layer_from_snapshot(snapshot: dict, keep: _Keep) -> L.Layer:
    """kvt_layer for a serializer snapshot (keys_np/values_np or state_np
    with the reference's *_original_dtype hints)."""
    out = L.Layer()
    if "state_np" in snapshot:
        state = snapshot["state_np"]
        n = len(state)
        tensors = (L.Tensor * max(n, 1))()
        hints = (ctypes.c_int32 * max(n, 1))()
        names = snapshot.get("state_original_dtypes") or [None] * n
        for i, x in enumerate(state):
            hints[i] = _fill_tensor(tensors[i], x, keep,
                                    _HINT_CODES.get(names[i] or "", 0))
        keep.extend((tensors, hints))
        L.kvt_layer_init(ctypes.byref(out), L.LAYER_ARRAYS)
        out.num_tensors = n
        out.tensors = tensors
        out.orig_dtypes = hints if any(hints[i] for i in range(n)) else None
        return out
    tensors = (L.Tensor * 2)()
    hints = (ctypes.c_int32 * 2)()
    hints[0] = _fill_tensor(tensors[0], snapshot["keys_np"], keep,
                            _HINT_CODES.get(snapshot.get("keys_original_dtype") or "", 0))
    hints[1] = _fill_tensor(tensors[1], snapshot["values_np"], keep,
                            _HINT_CODES.get(snapshot.get("values_original_dtype") or "", 0))
    keep.extend((tensors, hints))
    # A snapshot keeps no class: the window bound alone tells a rotating
    # layer (layer_kind's rule for layers without their class).
    windowed = snapshot.get("max_size") is not None
    L.kvt_layer_init(ctypes.byref(out), L.LAYER_ROTATING_KV if windowed else L.LAYER_KV)
    out.num_tensors = 2
    out.tensors = tensors
    out.offset = int(snapshot["offset"])
    _set_kv_attrs(out, snapshot.get)
    out.orig_dtypes = hints if (hints[0] or hints[1]) else None
    return out


# --------------------------------------------------------------------------
# Promote side: kvt_entry -> reference dicts
# --------------------------------------------------------------------------


class EntryHandle:
    """Owns one kvt_entry.  Arrays returned from it keep it alive; it is freed
    when the last of them (and this handle) is gone.  ``tier`` keeps the tier
    that produced it alive as long as the entry is."""

    __slots__ = ("ptr", "tier", "_fin", "__weakref__")

    def __init__(self, ptr: int, tier: Any = None) -> None:
        self.ptr = ptr
        self.tier = tier
        self._fin = weakref.finalize(self, L.kvt_entry_free, ptr)
        # At interpreter exit arrays may still be referenced; leaking the
        # entry then is harmless, freeing it under them is not.
        self._fin.atexit = False

    def free(self) -> None:
        """Frees now (only when no array from it is referenced)."""
        self._fin()


def _tensor_to_numpy(t: L.Tensor, owner: EntryHandle) -> Tuple[np.ndarray, Optional[str]]:
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    if t.dtype == L.DTYPE_BF16:
        n = int(t.nbytes)
        if n == 0:
            return np.zeros(shape, dtype=np.float32), "bfloat16"
        raw = (ctypes.c_uint16 * (n // 2)).from_address(t.data)
        bits = np.frombuffer(raw, dtype=np.uint16)
        return bf16_bits_to_f32(bits).reshape(shape), "bfloat16"
    dt = _KVT_TO_NP.get(t.dtype)
    if dt is None:
        raise ValueError(f"unknown dtype code {t.dtype} in entry")
    n = int(t.nbytes)
    if n == 0 or not t.data:
        return np.zeros(shape, dtype=dt), None
    buf = (ctypes.c_uint8 * n).from_address(t.data)
    buf._owner = owner  # the base chain keeps the entry alive
    return np.frombuffer(buf, dtype=dt).reshape(shape), None


def _stored_hint(lay: L.Layer, i: int) -> Optional[str]:
    if not lay.orig_dtypes:
        return None
    code = lay.orig_dtypes[i]
    return _HINT_NAMES.get(code) if code else None


def layer_to_dict(lay: L.Layer, owner: EntryHandle) -> dict:
    """The reference's deserialize_layer result for one kvt_layer."""
    arrays: List[np.ndarray] = []
    hints: List[Optional[str]] = []
    for i in range(lay.num_tensors):
        a, h = _tensor_to_numpy(lay.tensors[i], owner)
        arrays.append(a)
        hints.append(_stored_hint(lay, i) or h)
    kind = lay.kind
    if kind in (L.LAYER_KV, L.LAYER_ROTATING_KV):
        result: dict = {"keys": arrays[0], "values": arrays[1], "offset": int(lay.offset)}
        if hints[0] is not None:
            result["keys_original_dtype"] = hints[0]
        if hints[1] is not None:
            result["values_original_dtype"] = hints[1]
        for attr, field in (("max_size", "max_size"), ("keep", "keep"),
                            ("step", "step"), ("_idx", "idx")):
            v = getattr(lay, field)
            if v != L.KVT_ABSENT:
                result[attr] = int(v)
        return result
    if kind == L.LAYER_ARRAYS:
        result = {"state": arrays}
        if any(h is not None for h in hints):
            result["state_original_dtypes"] = hints
        return result
    if kind == L.LAYER_QUANTIZED_KV:
        result = {"keys": tuple(arrays[0:3]), "values": tuple(arrays[3:6]),
                  "offset": int(lay.offset), "bits": int(lay.bits),
                  "group_size": int(lay.group_size)}
        kh = hints[0] or hints[1]
        vh = hints[3] or hints[4]
        if kh is not None:
            result["keys_original_dtype"] = kh
        if vh is not None:
            result["values_original_dtype"] = vh
        return result
    raise ValueError(f"unknown layer kind {kind} in entry")


def _unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words [..., W] -> codes [..., W*32/bits]: each row is one
    little-endian bit stream, code i in stream bits [i*bits, (i+1)*bits)."""
    words = np.ascontiguousarray(packed, dtype="<u4")
    if 32 % bits == 0:
        per = 32 // bits
        shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
        codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        return codes.reshape(words.shape[:-1] + (words.shape[-1] * per,))
    stream = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    n = stream.shape[-1] // bits
    groups = stream[..., : n * bits].reshape(stream.shape[:-1] + (n, bits))
    weights = (np.uint32(1) << np.arange(bits, dtype=np.uint32))
    return (groups.astype(np.uint32) * weights).sum(axis=-1, dtype=np.uint32)


def _dense_from_quantized(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                          bits: int, group_size: int, scale_hint: Optional[str],
                          rows: int) -> np.ndarray:
    """MLX's affine dequantization of the first `rows` token rows: value =
    scale * code + bias per group of group_size along the last axis, worked
    in float32 and rounded once to the scales' dtype (a bf16 result stays
    float32 holding bf16 values; the caller passes the hint on)."""
    sl = (Ellipsis, slice(0, rows), slice(None))
    q = _unpack_codes(packed[sl], bits).astype(np.float32)
    s = np.repeat(np.asarray(scales[sl], dtype=np.float32), group_size, axis=-1)
    b = np.repeat(np.asarray(biases[sl], dtype=np.float32), group_size, axis=-1)
    if s.shape != q.shape or b.shape != q.shape:
        raise ValueError("quantized layer: scales/biases do not match the packed rows")
    w = s * q + b
    if scale_hint == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(w))
    return w.astype(np.asarray(scales).dtype)


def dense_kv_dict(d: dict) -> dict:
    """A natively stored quantized layer dict as the KV dict the reference
    returns for it (it dequantizes at spill): dense keys/values holding the
    first offset rows, offset and the dtype hints, which the scheduler's
    reconstruction turns into a KVCache.  Other dicts are returned as is."""
    if not isinstance(d.get("keys"), tuple):
        return d
    kp, ks, kb = d["keys"]
    vp, vs, vb = d["values"]
    rows = int(kp.shape[-2]) if kp.ndim >= 2 else 0
    off = d.get("offset", rows)
    rows = min(rows, off) if off is not None and off >= 0 else rows
    kh = d.get("keys_original_dtype")
    vh = d.get("values_original_dtype")
    out = {"keys": _dense_from_quantized(kp, ks, kb, d["bits"], d["group_size"], kh, rows),
           "values": _dense_from_quantized(vp, vs, vb, d["bits"], d["group_size"], vh, rows),
           "offset": rows if off is None or off < 0 else int(off)}
    if kh is not None:
        out["keys_original_dtype"] = kh
    if vh is not None:
        out["values_original_dtype"] = vh
    return out


def entry_to_layers(ptr: int, tier: Any = None, dense: bool = False) -> List[dict]:
    """Takes ownership of a kvt_entry and returns its layers as dicts;
    dense: natively stored quantized layers come back dequantized
    (dense_kv_dict), as the reference's promote returns them."""
    owner = EntryHandle(ptr, tier)
    n = L.kvt_entry_num_layers(ptr)
    out = []
    for i in range(n):
        lp = L.kvt_entry_layer(ptr, i)
        d = layer_to_dict(lp.contents, owner)
        out.append(dense_kv_dict(d) if dense else d)
    return out
