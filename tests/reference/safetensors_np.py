"""Stand-in for ``safetensors.numpy`` (not packaged in Debian): a spec-faithful
``save_file`` / ``load_file`` pair so the reference (reference_loader.py) can run here.

Format (https://github.com/huggingface/safetensors, "Format" section):
8-byte little-endian unsigned header length N, then N bytes of UTF-8 JSON
mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the start of the data section) plus an optional
"__metadata__" object of str -> str, then the data section.  Like the upstream
writer, the header is padded with spaces so the data section starts 8-byte
aligned, keys are written in sorted order, and tensors are laid out
back-to-back with no gaps.  Data is little-endian, C order.  BF16 tensors are
rejected on load because numpy has no bfloat16 (as ``safetensors.numpy``
itself cannot return them as numpy arrays).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, Optional

import numpy as np

# numpy dtype -> safetensors dtype name.
_NP_TO_ST = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(np.float64): "F64",
}
_ST_TO_NP = {v: k for k, v in _NP_TO_ST.items()}
_ST_SIZES = {name: dt.itemsize for name, dt in _ST_TO_NP.items()}
_ST_SIZES["BF16"] = 2

# Upstream refuses headers above 100 MB.
MAX_HEADER_SIZE = 100_000_000


class SafetensorError(Exception):
    """Malformed file or unsupported tensor (mirrors upstream's error type)."""


def _header_bytes(tensors: Dict[str, np.ndarray],
                  metadata: Optional[Dict[str, str]]) -> tuple[bytes, list]:
    header: dict = {}
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise SafetensorError("__metadata__ must map str to str")
        header["__metadata__"] = dict(metadata)
    order = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        dt = arr.dtype.newbyteorder("=") if arr.dtype.byteorder not in "=|" else arr.dtype
        if dt not in _NP_TO_ST:
            raise SafetensorError(f"unsupported dtype {arr.dtype} for tensor {name}")
        # Little-endian, C-contiguous bytes.
        data = np.ascontiguousarray(arr, dtype=dt.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": _NP_TO_ST[dt],
            "shape": [int(d) for d in arr.shape],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        order.append(data)
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    pad = (8 - (8 + len(text)) % 8) % 8
    return text + b" " * pad, order


def save(tensors: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """Serialises tensors to safetensors bytes."""
    header, datas = _header_bytes(tensors, metadata)
    return struct.pack("<Q", len(header)) + header + b"".join(datas)


def save_file(tensors: Dict[str, np.ndarray], filename: str,
              metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes tensors to filename (overwriting), as safetensors.numpy.save_file."""
    blob = save(tensors, metadata)
    with open(filename, "wb") as f:
        f.write(blob)


def parse_header(buf: bytes) -> tuple[dict, Optional[dict], int]:
    """Validates the header of a safetensors blob; returns (tensors, metadata,
    data_start).  Raises SafetensorError on anything malformed."""
    if len(buf) < 8:
        raise SafetensorError("file too small for a header length")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER_SIZE:
        raise SafetensorError("header too large")
    if 8 + n > len(buf):
        raise SafetensorError("header length runs past the end of the file")
    try:
        header = json.loads(buf[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorError(f"invalid header JSON: {e}") from e
    if not isinstance(header, dict):
        raise SafetensorError("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    data_len = len(buf) - 8 - n
    spans = []
    for name, info in header.items():
        try:
            dtype = info["dtype"]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorError(f"bad entry for tensor {name}") from e
        if dtype not in _ST_SIZES:
            raise SafetensorError(f"unknown dtype {dtype} for tensor {name}")
        if any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise SafetensorError(f"bad shape/offsets for tensor {name}")
        count = 1
        for d in shape:
            count *= d
        if count * _ST_SIZES[dtype] != end - begin:
            raise SafetensorError(f"size mismatch for tensor {name}")
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise SafetensorError(f"tensor {name} overlaps or leaves a gap")
        pos = end
    if pos != data_len:
        raise SafetensorError("data section length does not match the tensors")
    return header, metadata, 8 + n


def load(buf: bytes) -> Dict[str, np.ndarray]:
    """Deserialises safetensors bytes into writable numpy arrays."""
    header, _meta, start = parse_header(buf)
    out: Dict[str, np.ndarray] = {}
    for name in sorted(header):
        info = header[name]
        if info["dtype"] == "BF16":
            raise SafetensorError(f"tensor {name}: numpy has no bfloat16")
        dt = _ST_TO_NP[info["dtype"]].newbyteorder("<")
        begin, end = info["data_offsets"]
        arr = np.frombuffer(bytearray(buf[start + begin:start + end]), dtype=dt)
        out[name] = arr.astype(dt.newbyteorder("="), copy=False).reshape(info["shape"])
    return out


def load_file(filename: str) -> Dict[str, np.ndarray]:
    """Reads every tensor of a safetensors file, as safetensors.numpy.load_file."""
    with open(filename, "rb") as f:
        buf = f.read()
    return load(buf)


def read_metadata(filename: str) -> Optional[dict]:
    """The __metadata__ object of a file (None when absent)."""
    with open(filename, "rb") as f:
        buf = f.read()
    return parse_header(buf)[1]


__all__ = ["save", "save_file", "load", "load_file", "read_metadata",
           "parse_header", "SafetensorError"]

if __name__ == "__main__":  # pragma: no cover - manual inspection helper
    import sys
    for p in sys.argv[1:]:
        with open(p, "rb") as fh:
            hdr, meta, start = parse_header(fh.read())
        print(os.path.basename(p), json.dumps({"metadata": meta, "tensors": hdr}))
