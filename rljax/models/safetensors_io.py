"""Minimal reader/writer of the safetensors format over numpy memory maps.

The format is an 8-byte little-endian header length, a JSON header (``name -> {dtype,
shape, data_offsets}``, optional ``__metadata__``) and the raw little-endian tensor bytes.
Reading memory-maps the file, so slicing a tensor touches only the bytes of that slice:
each device's shard is read directly, and no full copy of the model is built per device.
bfloat16 comes from ``ml_dtypes`` (a JAX dependency), which ``safetensors.numpy`` lacks;
neither torch nor the ``safetensors`` package is needed at run time.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_TO_NP = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_FROM_NP = {v: k for k, v in _TO_NP.items()}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """``name -> read-only memory-mapped array`` for every tensor in ``path``."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path} is not a safetensors file (bad header: {e})") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if os.path.getsize(path) > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _TO_NP:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}; supported: {', '.join(_TO_NP)}")
        dtype = _TO_NP[info["dtype"]]
        begin, end = info["data_offsets"]
        out[name] = data[begin:end].view(dtype).reshape(info["shape"])
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` (numpy arrays, bfloat16 via ml_dtypes) to ``path`` in safetensors format."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _FROM_NP:
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}; supported: {', '.join(map(str, _FROM_NP))}")
        header[name] = {"dtype": _FROM_NP[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())  # little-endian hosts only (x86, ARM)
    os.replace(tmp, path)
