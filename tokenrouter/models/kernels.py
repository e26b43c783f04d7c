"""The CPU kernels a projection can run on, and the choice between them, timed on this machine at load.

Each weight format has its candidates: fp32 and bf16 weights MKL's `F.linear` (what transformers runs),
`W @ x.T` for few rows, MKL on the weight stored transposed (`x @ Wt`) and oneDNN's packed GEMM; int8 and int4
weights torch's weight-only kernels with bf16 or fp32 activations. Which is fastest depends on the CPU (MKL
takes a slow path on the AMD EPYC machines here, oneDNN's packing lost to MKL at batch 1 on an Intel one), so
each projection shape is timed at the decode batch sizes that matter and the choice is cached per machine
(`~/.cache/tokenrouter/kernels/`). A float projection never takes a kernel slower than `F.linear` at any of
those batch sizes (see `fastest`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenrouter.models.quant import Int4Weight, Int8Weight

SMALL_ROWS = 16
TIMED_BATCHES = (1, 4, 16)


class Kernel:
    """One projection's weights in one kernel's layout: `kernel(x)` is `x @ W.T + b` in x's dtype."""
    name = "?"

    def __init__(self, bias: torch.Tensor | None):
        self.bias = bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` in the kernel's own output dtype (bf16 for a bf16-activation kernel)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.bias is not None:  # NOTE: a bf16 output plus x's fp32 bias is fp32: one op casts and adds
            out = torch.add(out, self.bias)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [self.bias] if self.bias is not None else []


class Dense(Kernel):
    """MKL behind `F.linear`, in the weight's dtype."""
    name = "mkl"

    def __init__(self, weight: torch.Tensor, bias, dtype: torch.dtype):
        super().__init__(bias)
        self.weight = weight.to(dtype).contiguous()

    def matmul(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight)

    def tensors(self):
        return [self.weight] + super().tensors()


class SmallRows(Dense):
    # NOTE: on some CPUs MKL's small-row GEMM behind F.linear runs far below memory bandwidth; W @ x.T with at
    # least two columns streamed the weight 2-3x faster (../shared/MODELS.md). One row is padded to two.
    name = "w@x.T"

    def matmul(self, x):
        n = x.shape[0]
        if n > SMALL_ROWS:
            return super().matmul(x)
        x = x.to(self.weight.dtype)
        x = x.contiguous() if n > 1 else x.expand(2, -1).contiguous()
        return (self.weight @ x.T)[:, :n].T.contiguous()


class Transposed(Kernel):
    """MKL's GEMM on the weight stored transposed, [in, out]: `x @ Wt`. On the Intel machines here it streams
    fp32 weights faster than `F.linear` at every batch size (a 17920x1536 projection: 3.1 against 3.4 ms at
    one row, 5.3 against 7.2 at four)."""
    name = "x@Wt"

    def __init__(self, weight: torch.Tensor, bias, dtype: torch.dtype):
        super().__init__(bias)
        self.weight_t = weight.to(dtype).T.contiguous()

    def matmul(self, x):
        return x.to(self.weight_t.dtype) @ self.weight_t

    def tensors(self):
        return [self.weight_t] + super().tensors()


class OneDNN(Kernel):
    """oneDNN's packed GEMM (blocked weight layout), fp32 or bf16."""
    name = "onednn"

    def __init__(self, weight: torch.Tensor, bias, dtype: torch.dtype):
        super().__init__(bias)
        self.dtype = dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), SMALL_ROWS)

    def matmul(self, x):
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, None, "none", [], "")

    def tensors(self):
        return [self.packed] + super().tensors()


class Int8(Kernel):
    """`aten._weight_int8pack_mm`: int8 weights, one scale per output channel, activations in `act`."""

    def __init__(self, q: Int8Weight, bias, act: torch.dtype):
        super().__init__(bias)
        self.name = f"int8-{_short(act)}"
        self.act, self.codes, self.scale = act, q.codes.contiguous(), q.scale.to(act)

    def matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(x.to(self.act), self.codes, self.scale)

    def tensors(self):
        return [self.codes, self.scale] + super().tensors()


class Int4(Kernel):
    """`aten._weight_int4pack_mm_for_cpu`: 4-bit weights, a scale and a zero per group, activations in `act`.
    Its packing needs the output rows in sixteens, so a ragged one (a tiny vocabulary) is padded."""

    def __init__(self, q: Int4Weight, bias, act: torch.dtype):
        super().__init__(bias)
        self.name = f"int4-{_short(act)}"
        n, k = q.codes.shape
        pad = -n % 16
        codes, scale, low = q.codes.int(), q.scale, q.low
        if pad:
            codes = F.pad(codes, (0, 0, 0, pad))
            scale, low = F.pad(scale, (0, 0, 0, pad), value=1.0), F.pad(low, (0, 0, 0, pad))
        self.n, self.act, self.group = n, act, q.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # NOTE: the kernel computes (code - 8) * scale + zero, so zero is the group's value at code 8
        self.scale_zeros = torch.stack((scale, low + 8 * scale), dim=-1).transpose(0, 1).contiguous().to(act)

    def matmul(self, x):
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.act), self.packed, self.group, self.scale_zeros)
        return out if out.shape[1] == self.n else out[:, :self.n]

    def tensors(self):
        return [self.packed, self.scale_zeros] + super().tensors()


class Int4Vnni(Kernel):
    """Our AVX512-VNNI kernel (`native.int4_vnni`, csrc/int4_vnni.cpp): integer dot products of the codes with
    the activations split per 32 columns into two int8 digits (about 15 bits, where bf16 keeps 8), a scale and
    a zero per 32 columns in fp16 (a larger group's are repeated). It reads the weights near memory bandwidth
    where torch's int4 kernel is compute-bound at one row (17920x1536, 2 cores of an Intel Xeon: 0.85 against
    0.93-1.19 ms)."""
    name = "int4-vnni"

    def __init__(self, q: Int4Weight, bias):
        super().__init__(bias)
        from tokenrouter.models import native
        self.op = native.int4_vnni().int4_mm
        n, k = q.codes.shape
        blocks, pad = k // 32, -n % 4
        scale, low = (t.repeat_interleave(q.group // 32, dim=1) for t in (q.scale, q.low))
        codes = F.pad(q.codes, (0, 0, 0, pad)).reshape(-1, 4, blocks, 2, 16)
        self.n = n
        self.codes = (codes[..., 0, :] | (codes[..., 1, :] << 4)).transpose(1, 2).contiguous()
        self.scale, self.low = (F.pad(t, (0, 0, 0, pad)).reshape(-1, 4, blocks).transpose(1, 2).contiguous().half()
                                for t in (scale, low))

    def matmul(self, x):
        return self.op(x.float(), self.codes, self.scale, self.low, self.n)

    def tensors(self):
        return [self.codes, self.scale, self.low] + super().tensors()


def vnni_fits(q) -> bool:
    """The int4-vnni kernel can run `q` (32-column blocks) and is built on this machine."""
    from tokenrouter.models import native
    fits = isinstance(q, Int4Weight) and q.codes.shape[1] % 32 == 0 and q.group % 32 == 0
    return fits and native.int4_vnni() is not None


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def has_onednn(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_fast() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run at least as fast as fp32 ones (without, they are emulated and slow)."""
    from tokenrouter.bench.machine import cpu_info
    flags = cpu_info()[1]
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and has_onednn(torch.bfloat16)


Builder = Callable[[], Kernel]


def candidates(weight_format: str, weight: torch.Tensor, bias, quantized=None) -> dict[str, Builder]:
    """The kernels that can run one projection in `weight_format`, by name (each builds on call)."""
    if weight_format in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, weight_format)
        found = {"mkl": lambda: Dense(weight, bias, dtype), "w@x.T": lambda: SmallRows(weight, bias, dtype),
                 "x@Wt": lambda: Transposed(weight, bias, dtype)}
        if has_onednn(dtype):
            found["onednn"] = lambda: OneDNN(weight, bias, dtype)
        return found
    acts = (torch.bfloat16, torch.float32)
    if weight_format == "int8":
        return {f"int8-{_short(a)}": (lambda a=a: Int8(quantized, bias, a)) for a in acts}
    found = {f"int4-{_short(a)}": (lambda a=a: Int4(quantized, bias, a)) for a in acts}
    if vnni_fits(quantized):
        found["int4-vnni"] = lambda: Int4Vnni(quantized, bias)
    return found


def machine_key() -> str:
    from tokenrouter.bench.machine import cpu_info
    cpu, flags = cpu_info()
    text = f"{cpu}|{sorted(flags)}|{torch.__version__}|{torch.get_num_threads()}|{os.cpu_count()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path():
    from tokenrouter.models.sources import cache_dir
    return cache_dir() / "kernels" / f"{machine_key()}.json"


def time_kernels(builds: list[dict[str, Builder]], in_features: int, dtype: torch.dtype,
                 batches: tuple[int, ...] = TIMED_BATCHES) -> dict[str, list[float]]:
    """Median ms per call of each candidate at each batch size, cycling over the weights of several layers of
    the same shape (as a decode step does, so no timing runs from cache). A candidate 4x slower than the best
    at the first batch size is not timed further."""
    names = list(builds[0])
    kernels = {name: [b[name]() for b in builds] for name in names}
    result: dict[str, list[float]] = {}
    for i, m in enumerate(batches):
        x = torch.randn(m, in_features, dtype=dtype)
        for name in names:
            result.setdefault(name, []).append(_median_ms(kernels[name], x))
        if i == 0:
            best = min(r[0] for r in result.values())
            result = {n: r for n, r in result.items() if r[0] <= 4 * best}
            names = list(result)
    return result


def _median_ms(kernels: list[Kernel], x: torch.Tensor, repeat: int = 7) -> float:
    with torch.inference_mode():
        for k in kernels:
            k(x)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            for k in kernels:
                k(x)
            times.append((time.perf_counter() - t) / len(kernels))
    return sorted(times)[repeat // 2] * 1e3


REFERENCE = "mkl"  # F.linear: what transformers runs on a float weight
TOLERANCE = 1.02  # timing noise: a candidate within 2% of the reference at a batch size is not slower there


def fastest(timings: dict[str, list[float]]) -> str:
    """The candidate with the smallest geometric mean over the batch sizes (each batch size counts alike), among
    those never slower than the reference (`F.linear`, where it is a candidate) at any batch size: oneDNN's
    packed GEMM can win the mean by 2x at 4-16 rows and still lose 8% to `F.linear` at one row, and this
    runner must not be slower than transformers at any batch size."""
    full = max(len(t) for t in timings.values())
    timed = {n: t for n, t in timings.items() if len(t) == full}
    reference = timed.get(REFERENCE)
    if reference is not None:
        timed = {n: t for n, t in timed.items() if all(v <= TOLERANCE * r for v, r in zip(t, reference))}
    return min(timed, key=lambda n: math.fsum(math.log(v) for v in timed[n]))


class KernelChoice:
    """Kernel names per (weight format, shape), timed once per machine and kept in a JSON file."""

    def __init__(self, path=None, forced: str = ""):
        self.path = path if path is not None else cache_path()
        self.forced = forced
        self.entries: dict[str, dict] = {}
        if self.path and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self.entries = {}
        self.used: dict[str, dict] = {}

    @staticmethod
    def key(weight_format: str, out_features: int, in_features: int) -> str:
        return f"{weight_format}|{out_features}x{in_features}"

    def choose(self, weight_format: str, shape: tuple[int, int], builds: list[dict[str, Builder]],
               act: torch.dtype) -> str:
        key = self.key(weight_format, *shape)
        names = list(builds[0])
        if self.forced:
            if self.forced not in names:
                raise ValueError(f"kernel={self.forced!r} cannot run {weight_format} weights; it takes {names}")
            self.used[key] = {"kernel": self.forced, "forced": True}
            return self.forced
        entry = self.entries.get(key)
        if entry is None or entry.get("kernel") not in names or set(entry.get("candidates", [])) != set(names):
            timings = time_kernels(builds, shape[1], act)
            entry = {"kernel": fastest(timings), "candidates": names, "batches": list(TIMED_BATCHES),
                     "ms": {n: [round(v, 4) for v in t] for n, t in timings.items()}}
            self.entries[key] = entry
            self._save()
        self.used[key] = entry
        return entry["kernel"]

    def _save(self) -> None:
        if not self.path:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass  # an unwritable cache only means timing again next load
