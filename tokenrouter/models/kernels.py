"""The CPU kernels a projection can run on, and the choice between them, timed on this machine at load.

Each weight format has its candidates: fp32 and bf16 weights MKL's `F.linear` (what transformers runs),
`W @ x.T` for few rows, MKL on the weight stored transposed (`x @ Wt`) and oneDNN's packed GEMM; int8 and int4
weights torch's weight-only kernels with bf16 or fp32 activations and ours with two-digit int8 activations
(`int4-vnni` on AVX512-VNNI, `int4-avx2` / `int8-avx2` on AVX2, `-avxvnni` with AVX-VNNI); int4 also ours with one
digit (`int4-vnni-a8`, `int4-avx2-a8`, `int4-avxvnni-a8`: another arithmetic, so only where a config names one or
`dtype: auto` chose it on its own agreement record, never on timing alone: `prepare.prepare_linears`). Which is
fastest depends on the CPU (MKL takes a slow path on the AMD EPYC machines here, oneDNN's packing lost to MKL at
batch 1 on an Intel one), so each projection shape is timed at the decode batch sizes that matter and the choice is
cached per machine (`~/.cache/tokenrouter/kernels/`). A float projection never takes a kernel slower than
`F.linear` at any of those batch sizes (see `fastest`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenrouter.models.kernels_timing import Timing, agree, time_kernels
from tokenrouter.models.quant import Int4Weight, Int8Weight, quantize_int4, quantize_int8

SMALL_ROWS = 16
TIMED_BATCHES = (1, 4, 16)


class Kernel:
    """One projection's weights in one kernel's layout: `kernel(x)` is `x @ W.T + b` in x's dtype."""
    name = "?"
    family = ""  # ours: the native module it runs on (its name in tokenrouter/models/native.py)

    def __init__(self, bias: torch.Tensor | None):
        self.bias = bias

    @classmethod
    def module(cls):
        """Ours: the built module of `family`, or None where it cannot be built."""
        from tokenrouter.models import native
        return native.build(native.BY_NAME[cls.family])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` in the kernel's own output dtype (bf16 for a bf16-activation kernel)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.bias is not None:  # NOTE: a bf16 output plus x's fp32 bias is fp32: one op casts and adds
            out = torch.add(out, self.bias)
        return _as(out, x.dtype)

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
        return F.linear(_as(x, self.weight.dtype), self.weight)

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
        x = _as(x, self.weight.dtype)
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
        return _as(x, self.weight_t.dtype) @ self.weight_t

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
        return torch.ops.mkldnn._linear_pointwise(_as(x, self.dtype), self.packed, None, "none", [], "")

    def tensors(self):
        return [self.packed] + super().tensors()


class Int8(Kernel):
    """`aten._weight_int8pack_mm`: int8 weights, one scale per output channel, activations in `act`."""

    def __init__(self, q: Int8Weight, bias, act: torch.dtype):
        super().__init__(bias)
        self.name = f"int8-{_short(act)}"
        self.act, self.codes, self.scale = act, q.codes.contiguous(), q.scale.to(act)

    def matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(_as(x, self.act), self.codes, self.scale)

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
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(_as(x, self.act), self.packed, self.group, self.scale_zeros)
        return out if out.shape[1] == self.n else out[:, :self.n]

    def tensors(self):
        return [self.packed, self.scale_zeros] + super().tensors()


class Int4Vnni(Kernel):
    """Our AVX512-VNNI kernel (`native.vnni`, csrc/vnni_gemm.cpp): integer dot products of the codes with
    the activations split per 32 columns into two int8 digits (about 15 bits, where bf16 keeps 8), a scale and
    a zero per 32 columns in fp16 (a larger group's are repeated). It reads the weights near memory bandwidth
    where torch's int4 kernel is compute-bound at one row (17920x1536, 2 cores of an Intel Xeon: 0.85 against
    0.93-1.19 ms)."""
    name = "int4-vnni"
    family = "vnni"
    op_name = "int4_mm"  # the module's function: two digits per activation

    def __init__(self, q: Int4Weight, bias):
        super().__init__(bias)
        self.op = getattr(self.module(), self.op_name)
        n, k = q.codes.shape
        blocks, pad = k // 32, -n % 16
        scale, low = (t.repeat_interleave(q.group // 32, dim=1) for t in (q.scale, q.low))
        # column 16 h + 4 j + t of a block: [N/16, row, blocks, h, j, t] -> nibble h of [N/16, blocks, j, row, t]
        codes = F.pad(q.codes, (0, 0, 0, pad)).reshape(-1, 16, blocks, 2, 4, 4)
        self.n = n
        self.codes = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).contiguous()
        self.scale, self.low = (F.pad(t, (0, 0, 0, pad)).reshape(-1, 16, blocks).transpose(1, 2).contiguous().half()
                                for t in (scale, low))

    def matmul(self, x):
        return self.op(x.float(), self.codes, self.scale, self.low, self.n)

    def tensors(self):
        return [self.codes, self.scale, self.low] + super().tensors()


class Int4VnniA8(Int4Vnni):
    """int4-vnni with one int8 digit per activation (xs = amax / 127 per 32 columns, llama.cpp's Q8_0
    activations): half the integer dot products, about 8 bits of activation."""
    name = "int4-vnni-a8"
    op_name = "int4_mm_a8"


class Int4Avx2(Int4Vnni):
    """Our AVX2 kernel (`native.avx2`, csrc/avx2_gemm.cpp) on int4-vnni's layout with int4-vnni's arithmetic (the
    same floats): vpmaddubsw / vpmaddwd instead of vpdpbusd, for CPUs without AVX512-VNNI."""
    name = "int4-avx2"
    family = "avx2"


class Int4Avx2A8(Int4Avx2):
    """int4-avx2 with int4-vnni-a8's one-digit activations and arithmetic (the same floats): vpmaddubsw on the
    codes as they are packed, half the multiplies of int4-avx2."""
    name = "int4-avx2-a8"
    op_name = "int4_mm_a8"


class Int4AvxVnni(Int4Avx2):
    """int4-avx2 built with AVX-VNNI (`native.avxvnni`): vpdpbusd where int4-avx2 takes vpmaddubsw, vpaddw and a
    block's vpmaddwd, the same floats."""
    name = "int4-avxvnni"
    family = "avxvnni"


class Int4AvxVnniA8(Int4AvxVnni):
    """int4-avx2-a8 built with AVX-VNNI, the same floats."""
    name = "int4-avxvnni-a8"
    op_name = "int4_mm_a8"


class Int8Vnni(Kernel):
    """Our AVX512-VNNI kernel for int8 weights (`native.vnni`, csrc/vnni_gemm.cpp): integer dot products with the
    activations in int4-vnni's two int8 digits, as one int16 (vpdpwssd), where torch's int8 kernels take bf16 or
    fp32 activations. Sixteen weight rows a register; the columns padded to blocks of 32."""
    name = "int8-vnni"
    family = "vnni"

    def __init__(self, q: Int8Weight, bias):
        super().__init__(bias)
        self.op = self.module().int8_mm
        n, k = q.codes.shape
        blocks, pad = -(-k // 32), -n % 16
        codes = F.pad(q.codes, (0, 32 * blocks - k, 0, pad))
        # columns 2c, 2c + 1 of a block: [N/16, row, blocks, c, 2] -> [N/16, blocks, c, row, 2]
        self.codes = codes.reshape(-1, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
        self.scale = F.pad(q.scale.float(), (0, pad)).contiguous()
        self.n = n

    def matmul(self, x):
        return self.op(x.float(), self.codes, self.scale, self.n)

    def tensors(self):
        return [self.codes, self.scale] + super().tensors()


class Int8Avx2(Int8Vnni):
    """Our AVX2 kernel (`native.avx2`, csrc/avx2_gemm.cpp) on int8-vnni's layout with int8-vnni's arithmetic (the
    same floats): vpmaddwd on eight rows a register instead of vpdpwssd on sixteen."""
    name = "int8-avx2"
    family = "avx2"


class Int8AvxVnni(Int8Avx2):
    """int8-avx2 built with AVX-VNNI (`native.avxvnni`): vpdpwssd for vpmaddwd and vpaddd, the same floats."""
    name = "int8-avxvnni"
    family = "avxvnni"


# our kernels by weight format
OURS = {"int8": (Int8Vnni, Int8Avx2, Int8AvxVnni),
        "int4": (Int4Vnni, Int4VnniA8, Int4Avx2, Int4Avx2A8, Int4AvxVnni, Int4AvxVnniA8)}


def superseded() -> set[str]:
    """Our kernels this machine does not time (it runs them where a config names one): those of a build whose
    successor was built here (native.SUCCESSOR: the AVX2 build's where the AVX-VNNI build is made, its floats in
    fewer instructions). On a Zen 5 (2026-12-07) int4-avxvnni(-a8) took 0.94-1.02x int4-avx2(-a8)'s time at one
    row and 0.64-0.78x from two, int8-avxvnni 0.95-1.02x int8-avx2's (docs/kernels.md)."""
    from tokenrouter.models import native
    return {k.name for kernels in OURS.values() for k in kernels if native.superseded(native.BY_NAME[k.family], True)}


def blocks_of_32(q) -> bool:
    """int4 weights whose groups are whole blocks of 32 columns (what the two-digit int4 kernels take)."""
    return isinstance(q, Int4Weight) and q.codes.shape[1] % 32 == 0 and q.group % 32 == 0


def ours_fit(q, kernel: type[Kernel]) -> bool:
    """Our `kernel` can run `q` (int8, or int4 in 32-column blocks) and its module is built on this machine."""
    return (isinstance(q, Int8Weight) or blocks_of_32(q)) and kernel.module() is not None


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # NOTE: x.to(its own dtype) returns x, but only after a dispatch (about a microsecond, several per layer)
    return x if x.dtype == dtype else x.to(dtype)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def has_onednn(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_fast() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run at least as fast as fp32 ones (without, they are emulated and slow)."""
    from tokenrouter.models.native import cpu_flags
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and has_onednn(torch.bfloat16)


Builder = Callable[[], Kernel]


def candidates(weight_format: str, weight: torch.Tensor, bias, quantized=None,
               skip: set[str] = frozenset()) -> dict[str, Builder]:
    """The kernels that can run one projection in `weight_format`, by name (each builds on call), but for
    those of ours named in `skip` (whose native module is then not built for them)."""
    if weight_format in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, weight_format)
        found = {"mkl": lambda: Dense(weight, bias, dtype), "w@x.T": lambda: SmallRows(weight, bias, dtype),
                 "x@Wt": lambda: Transposed(weight, bias, dtype)}
        if has_onednn(dtype):
            found["onednn"] = lambda: OneDNN(weight, bias, dtype)
        return found
    acts = (torch.bfloat16, torch.float32)
    if weight_format == "int8":
        found = {f"int8-{_short(a)}": (lambda a=a: Int8(quantized, bias, a)) for a in acts}
    else:
        found = {f"int4-{_short(a)}": (lambda a=a: Int4(quantized, bias, a)) for a in acts}
    for kernel in OURS[weight_format]:
        if kernel.name not in skip and ours_fit(quantized, kernel):
            found[kernel.name] = lambda kernel=kernel: kernel(quantized, bias)
    return found


def machine() -> dict:
    """What a kernel cache's timings depend on (its file is named by a hash of this)."""
    from tokenrouter.bench.machine import cpu_info
    from tokenrouter.models.native import KERNELS, cpu_flags, version
    return {"cpu": cpu_info()[0], "flags": sorted(cpu_flags()), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "native": version(KERNELS)}


def machine_key() -> str:
    m = machine()
    text = f"{m['cpu']}|{m['flags']}|{m['torch']}|{m['threads']}|{m['cpus']}|{m['native']}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path():
    from tokenrouter.models.sources import cache_dir
    return cache_dir() / "kernels" / f"{machine_key()}.json"


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
    return min(timed, key=lambda n: geomean(timed[n]))


def geomean(values: list[float]) -> float:
    return math.exp(math.fsum(math.log(v) for v in values) / len(values))


CACHE_VERSION = 2  # 2: entries record when and under what load they were timed; version 1 files are re-timed


class KernelChoice:
    """Kernel names per (weight format, shape), timed per machine and kept in a JSON file. A timing set taken on
    a busy machine or inconsistent in rows is timed once more; if it still is, its choice serves this process
    only and the shape is timed again at the next start."""

    def __init__(self, path=None, forced: str = ""):
        self.path = path if path is not None else cache_path()
        self.forced = forced
        self.entries: dict[str, dict] = self._read()
        self.used: dict[str, dict] = {}
        self.uncached: dict[str, str] = {}  # key -> why its timing was not cached

    def _read(self) -> dict[str, dict]:
        if not self.path or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            # NOTE: a version 1 file (entries at the top, no load recorded) may hold timings taken on a busy
            # machine; its shapes are timed again as they are used and the file rewritten as version 2
            return {}
        return data.get("entries", {})

    @staticmethod
    def key(weight_format: str, out_features: int, in_features: int) -> str:
        return f"{weight_format}|{out_features}x{in_features}"

    def cached(self, weight_format: str, shape: tuple[int, int], names: list[str]) -> bool:
        entry = self.entries.get(self.key(weight_format, *shape))
        return bool(self.forced) or (entry is not None and entry.get("kernel") in names
                                     and set(entry.get("candidates", [])) == set(names))

    def choose(self, weight_format: str, shape: tuple[int, int], builds: list[dict[str, Builder]],
               act: torch.dtype, group: int = 0) -> str:
        key = self.key(weight_format, *shape)
        names = list(builds[0])
        if self.forced:
            if self.forced not in names:
                raise ValueError(f"kernel={self.forced!r} cannot run {weight_format} weights; it takes {names}")
            self.used[key] = {"kernel": self.forced, "forced": True}
            return self.forced
        if not self.cached(weight_format, shape, names):
            timing, why = settle(lambda: time_kernels(builds, shape[1], act, TIMED_BATCHES))
            entry = {"kernel": fastest(timing.ms), "candidates": names, "batches": list(TIMED_BATCHES),
                     "ms": {n: [round(v, 4) for v in t] for n, t in timing.ms.items()}, "taken": timing.taken,
                     "load": timing.load(), "act": _short(act), "layers": len(builds), "group": group}
            if why:
                self.uncached[key] = why
            else:
                self.entries[key] = entry
                self._save()
            self.used[key] = entry
            return entry["kernel"]
        self.used[key] = self.entries[key]
        return self.entries[key]["kernel"]

    def summary(self) -> str:
        """The kernels in use, by how many projection shapes took each: 'int4-vnni x6, mkl x1'."""
        counts: dict[str, int] = {}
        for entry in self.used.values():
            counts[entry["kernel"]] = counts.get(entry["kernel"], 0) + 1
        return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda item: -item[1]))

    def _save(self) -> None:
        if not self.path:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # NOTE: every process of the user shares the file: merge what another wrote since this one read it
            entries = {**self._read(), **self.entries}
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            data = {"version": CACHE_VERSION, "machine": machine(), "entries": entries}
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass  # an unwritable cache only means timing again next load


def settle(measure: Callable[[], Timing]) -> tuple[Timing, str]:
    """A timing set and why it must not be cached ('' if it may): measured once more when the first is busy or
    inconsistent. Two idle sets that agree on a kernel running faster with more rows show a real property of
    the CPU's kernel (MKL's 4-row path on some AMD EPYCs), not noise: that one is cached."""
    first = measure()
    if not first.problem():
        return first, ""
    second = measure()
    if not second.problem() or (not first.busy and not second.busy and agree(first.ms, second.ms)):
        return second, ""
    quieter = min((first, second), key=lambda t: t.others if t.others is not None else 0.0)
    return quieter, second.problem()


BEATEN = 1.10  # --check reports a cached choice whose kernel is now this much slower than the fastest


def check(path, margin: float = BEATEN) -> list[dict]:
    """Time again every choice cached in `path` (on random weights of each shape, on the threads the file was
    timed on): per shape the cached kernel, the fastest now and how much slower the cached one is."""
    data = json.loads(path.read_text())
    torch.set_num_threads(data["machine"]["threads"])
    rows = []
    for key, entry in sorted(data["entries"].items()):
        fmt, shape = key.split("|")
        out_features, in_features = (int(v) for v in shape.split("x"))
        # the candidates the choice was made among (a model bound to some, or without the one-digit kernels)
        offered = set(entry.get("candidates", [])) or None
        builds = [{n: b for n, b in random_candidates(fmt, (out_features, in_features), entry.get("group", 0)).items()
                   if offered is None or n in offered} for _ in range(entry.get("layers", 1))]
        act = {"fp32": torch.float32, "bf16": torch.bfloat16}[entry.get("act", "fp32")]
        timing = time_kernels(builds, in_features, act, tuple(entry.get("batches", TIMED_BATCHES)))
        del builds
        now, cached = fastest(timing.ms), entry["kernel"]
        full = len(timing.ms[now])
        ratio = (geomean(timing.ms[cached]) / geomean(timing.ms[now]) if len(timing.ms.get(cached, [])) == full
                 else math.inf)  # pruned: 4x slower at one row
        rows.append({"shape": key, "cached": cached, "fastest": now, "slower": round(ratio, 3),
                     "beaten": ratio > margin, "ms": timing.ms, "taken": entry.get("taken", ""),
                     "load_then": entry.get("load", {}), "load_now": timing.load(), "problem": timing.problem()})
    return rows


def random_candidates(weight_format: str, shape: tuple[int, int], group: int) -> dict[str, Builder]:
    weight = torch.randn(shape) * 0.02
    quantized = (quantize_int8(weight) if weight_format == "int8"
                 else quantize_int4(weight, group or 32) if weight_format == "int4" else None)
    return candidates(weight_format, weight, None, quantized)


def weight_bytes(weight_format: str, shape: tuple[int, int]) -> int:
    """A quantized projection's bytes as our kernels hold it: int8 codes and a scale per row; int4 codes two to a
    byte and an fp16 scale and zero per 32 columns (torch's int4 layout: the same within 1%)."""
    n, k = shape
    return n * k + 4 * n if weight_format == "int8" else n * k // 2 + n * (k // 32) * 4


def time_shapes(shapes: list[tuple[str, tuple[int, int]]], batches: tuple[int, ...], runs: int) -> dict:
    """Every candidate of each (format, shape) on random weights (`time_kernels`: four layers cycled, the fastest
    of 9 calls), `runs` times over: per candidate the median ms at each batch size; beside them the floor of
    reading the weights once at this machine's read rate (a streaming sum over 512 MiB)."""
    from tokenrouter.bench.roofline import measure_roofline
    read = measure_roofline(gemm_n=256, copy_mib=512)["read_gbps"]
    rows = []
    for fmt, shape in shapes:
        builds = [random_candidates(fmt, shape, 32) for _ in range(4)]
        timings = [time_kernels(builds, shape[1], torch.float32, batches) for _ in range(runs)]
        del builds
        ms = {name: [round(statistics.median(t.ms[name][i] for t in timings), 4)
                     for i in range(min(len(t.ms[name]) for t in timings))] for name in timings[0].ms}
        rows.append({"format": fmt, "shape": list(shape), "ms": ms, "floor_ms": weight_bytes(fmt, shape) / read / 1e6,
                     "others": [t.others for t in timings], "loadavg": timings[-1].loadavg})
    return {"machine": machine(), "read_gbps": read, "batches": list(batches), "runs": runs, "rows": rows}


def print_times(result: dict) -> None:
    print(f"{result['machine']['cpu']}, {result['machine']['threads']} thread(s), read {result['read_gbps']:.1f} GB/s;"
          f" ms per call at {result['batches']} rows, median of {result['runs']} runs")
    for row in result["rows"]:
        shape = f"{row['format']} {row['shape'][0]}x{row['shape'][1]}"
        print(f"{shape:<18} {'floor':<13} {row['floor_ms']:8.3f}")
        for name, ms in sorted(row["ms"].items(), key=lambda item: item[1][0]):
            print(f"{'':<18} {name:<13} " + " ".join(f"{v:8.3f}" for v in ms))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenrouter.models.kernels",
                                     description="The per-machine CPU kernel choices (~/.cache/tokenrouter/kernels).")
    parser.add_argument("--check", action="store_true",
                        help=f"time every cached choice of this machine again and report those now beaten by more "
                             f"than {BEATEN - 1:.0%}% (exit status 1 if any)")  # argparse formats help with %
    parser.add_argument("--json", action="store_true", help="with --check: one JSON object per shape")
    parser.add_argument("--time", default="", metavar="FMT:NxK,...",
                        help="time the candidates of these projections (e.g. int4:4864x896,int8:896x4864) on random "
                             "weights, beside the floor of reading the weights once; nothing is cached")
    parser.add_argument("--batch", default="1,4,16", help="with --time: comma-separated rows per call")
    parser.add_argument("--runs", type=int, default=3, help="with --time: timings per shape (their median is shown)")
    parser.add_argument("--out", default="", help="with --time: write the figures here as JSON")
    parser.add_argument("--threads", type=int, default=0, help="with --time: torch's threads (default: as set)")
    args = parser.parse_args(argv)
    if args.time:
        if args.threads:
            torch.set_num_threads(args.threads)
        shapes = [(fmt, tuple(int(v) for v in dims.split("x")))
                  for fmt, _, dims in (item.partition(":") for item in args.time.split(","))]
        result = time_shapes(shapes, tuple(int(b) for b in args.batch.split(",")), args.runs)
        print_times(result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    here = {k: v for k, v in machine().items() if k != "threads"}
    files = sorted(cache_path().parent.glob("*.json"))
    beaten = 0
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            print(f"{path}: unreadable", file=sys.stderr)
            continue
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            print(f"{path}: cache version {data.get('version', 1) if isinstance(data, dict) else '?'}, "
                  f"not {CACHE_VERSION}: its shapes are timed again at the next load")
            continue
        if {k: v for k, v in data["machine"].items() if k != "threads"} != here:
            continue  # another CPU or torch sharing the home directory
        print(f"{path.name}: {len(data['entries'])} shapes, {data['machine']['threads']} thread(s)")
        if not args.check:
            continue
        for row in check(path):
            beaten += row["beaten"]
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            verdict = (f"BEATEN by {row['fastest']} ({row['slower']:.2f}x slower)" if row["beaten"]
                       else f"holds ({row['fastest']} fastest now, cached {row['slower']:.2f}x)")
            note = f"; not conclusive: {row['problem']}" if row["problem"] else ""
            print(f"  {row['shape']:<24} {row['cached']:<10} {verdict}; timed {row['taken'] or '?'} "
                  f"(others {row['load_then'].get('others', '?')}){note}", flush=True)
    if not files:
        print(f"no kernel cache in {cache_path().parent}")
    return 1 if beaten else 0


if __name__ == "__main__":
    sys.exit(main())
