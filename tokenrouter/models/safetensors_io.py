"""Safetensors written as their tensors arrive, and memory handed back as a load goes: what keeps a first start
(conversion, quantization) within a few GB. `safetensors.torch.save_file` builds the whole file in memory first
(the 1.5B's int4 codes: 1.6 GB more at the end of its quantization)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import math
from pathlib import Path

import numpy as np
import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.int64: "I64", torch.int8: "I8", torch.uint8: "U8"}


class SafetensorsWriter:
    """A safetensors file written as its tensors arrive, in the order of `entries` (name: (torch dtype, shape)), each
    in one or more blocks of rows: the header (names, dtypes, shapes, offsets) is known up front, so no tensor
    need be held whole, let alone the file."""

    def __init__(self, path: Path, entries: dict[str, tuple]):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self.sizes = {}
        for name, (dtype, shape) in entries.items():
            size = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.sizes[name] = size
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.order, self.done = list(self.sizes), 0
        self.file = open(path, "wb")
        self.file.write(len(text).to_bytes(8, "little") + text)

    def write(self, name: str, block) -> None:
        """Write the next rows of `name`: a C-contiguous numpy array or CPU tensor of the declared dtype."""
        # NOTE: tensors arrive in header order, a tensor's blocks as consecutive rows
        if not self.order or self.order[0] != name:
            raise RuntimeError(f"safetensors writer: expected {self.order[0] if self.order else 'nothing'}, got {name}")
        data = block.contiguous().numpy() if isinstance(block, torch.Tensor) else np.ascontiguousarray(block)
        self.file.write(memoryview(data).cast("B"))
        self.done += data.nbytes
        if self.done > self.sizes[name]:
            raise RuntimeError(f"safetensors writer: {name} got {self.done} bytes, expected {self.sizes[name]}")
        if self.done == self.sizes[name]:
            self.order.pop(0)
            self.done = 0

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.file.close()
        if kind is None and self.order:
            raise RuntimeError(f"safetensors writer: {len(self.order)} tensors never written ({self.order[0]}, ...)")


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_memory() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim; elsewhere nothing). A load that frees
    each projection's fp32 weight after quantizing it leaves the freed blocks between the codes it keeps, and
    glibc returns them only at the top of the heap: the 1.5B's load peaked 1.3 GB above what it held."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
