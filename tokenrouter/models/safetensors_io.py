"""Safetensors written as their tensors arrive, read one tensor at a time without mapping the file, and memory
handed back as a load goes: what keeps a first start (conversion, quantization) within a few GB.
`safetensors.torch.save_file` builds the whole file in memory first (the 1.5B's int4 codes: 1.6 GB more at the
end of its quantization), and `safe_open` maps the whole file: every page a load reads stays in the process's
resident memory until the file is closed (the 1.5B's fp32 file: 6 GB of it by the end of its quantization)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import math
from pathlib import Path

import numpy as np
import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


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
        # NOTE: a tensor as its bytes (numpy has no bfloat16)
        data = (block.contiguous().view(-1).view(torch.uint8).numpy() if isinstance(block, torch.Tensor)
                else np.ascontiguousarray(block))
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


class FileReader:
    """A reader holding one open file (`self.file`), closed on leaving a `with` block."""

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


class SafetensorsReader(FileReader):
    """A safetensors file's tensors read one at a time with plain reads into fresh (or given) tensors: nothing
    of the file is mapped, so what a load has read does not stay resident in the process (the page cache keeps
    it as the system sees fit), and each tensor is a fresh, aligned allocation of its own."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = open(self.path, "rb", buffering=0)
        try:
            size = int.from_bytes(self._exact(8, 0), "little")
            if size > min(self.path.stat().st_size - 8, 100 << 20):
                raise ValueError(f"header of {size} bytes")
            header = json.loads(self._exact(size, 8))
            self.metadata = header.pop("__metadata__", None) or {}
            self.entries = {}
            for name, entry in header.items():
                dtype, shape, (start, end) = TORCH_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
                if end - start != dtype.itemsize * math.prod(shape):
                    raise ValueError(f"{name}: {end - start} bytes for {entry['dtype']} {shape}")
                self.entries[name] = (dtype, list(shape), 8 + size + start)
        except (ValueError, KeyError, TypeError) as error:
            self.file.close()
            raise ValueError(f"{self.path}: not a safetensors file this reader knows ({error!r})") from error

    def keys(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name`, read into `out` where it is a contiguous CPU tensor of the entry's dtype and shape (a
        parameter loaded in place), else into a fresh tensor."""
        dtype, shape, offset = self.entries[name]
        if out is None or not (out.dtype == dtype and list(out.shape) == shape and out.is_contiguous()
                               and out.device.type == "cpu"):
            out = torch.empty(shape, dtype=dtype)
        if out.numel():
            self._exact(out.numel() * dtype.itemsize, offset, out.view(-1).view(torch.uint8).numpy())
        return out

    def int4(self, name: str, group: int) -> None:
        """None: safetensors hold weights, not int4 codes (GGUFWeights.int4 may have them)."""
        return None

    def _exact(self, n: int, offset: int, into=None) -> bytes | None:
        return read_exact(self.file, self.path, n, offset, into)



def read_exact(file, path: Path, n: int, offset: int, into=None) -> bytes | None:
    """`n` bytes of `file` (opened unbuffered) at `offset`, into `into` (a writable buffer) or returned."""
    buffer = memoryview(bytearray(n) if into is None else into).cast("B")
    file.seek(offset)
    done = 0
    while done < n:
        got = file.readinto(buffer[done:])
        if not got:
            raise ValueError(f"{path} ends {n - done} bytes early")
        done += got
    return bytes(buffer) if into is None else None


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
