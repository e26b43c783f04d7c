"""Turn a loaded decoder's projections into CPU kernels: quantize them (int8, int4; cached on disk like the
fp32 conversion), then give every projection shape the kernel that measured fastest on this machine."""
from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from tokenrouter.bench import progress
from tokenrouter.models.kernels import KernelChoice, candidates
from tokenrouter.models.layers import Linear
from tokenrouter.models.quant import INT4_FIT, from_tensors, int4_group, quantize_int4, quantize_int8, to_tensors
from tokenrouter.models.sources import cache_dir, log

QUANTIZED = ("int8", "int4")
TIMED_LAYERS = 4  # projections of one shape the timing cycles over


def weight_format(dtype: str, in_features: int, group: int) -> tuple[str, int]:
    """The format one projection gets: int4 falls back to int8 where no int4 group size divides its inputs."""
    if dtype == "int4":
        g = int4_group(in_features, group)
        return ("int4", g) if g else ("int8", 0)
    return dtype, 0


def quant_cache_file(model_dir: Path, dtype: str, group: int, tp_rank: int, tp_size: int) -> Path:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    stamp = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    fit = f"|{INT4_FIT}" if dtype == "int4" else ""
    key = hashlib.sha256(f"{stamp}|{dtype}|{group}|{tp_rank}/{tp_size}{fit}".encode()).hexdigest()[:16]
    return cache_dir() / "quant" / f"{Path(model_dir).name}-{dtype}{group if dtype == 'int4' else ''}-{key}.safetensors"


def quantize_linears(linears: dict[str, Linear], dtype: str, group: int, cache_file: Path | None,
                     label: str = "") -> dict:
    """Every projection's codes, read from `cache_file` when it holds them, else quantized now and written there."""
    from safetensors.torch import load_file, save_file

    if cache_file is not None and cache_file.is_file():
        # NOTE: copied out of the file's buffer: its tensors sit at any offset, and the int8 / int4 kernels
        # crash (SIGSEGV) on weights that are not 64-byte aligned, which a fresh allocation is
        tensors = {k: v.clone() for k, v in load_file(cache_file).items()}
        return {name: from_tensors(name, tensors) for name in linears}
    out = {}
    with progress.step(f"quantize {label} to {dtype} (once; cached)", len(linears), "proj") as line:
        for name, module in linears.items():
            fmt, g = weight_format(dtype, module.weight.shape[1], group)
            w = module.weight.detach().float()
            out[name] = quantize_int4(w, g) if fmt == "int4" else quantize_int8(w)
            line.update()
        exact = [q.exact for q in out.values() if hasattr(q, "group")]
        if exact:
            line.set_postfix_str(f"{sum(exact) / len(exact):.0%} of int4 groups exact from the source's 4-bit grid")
    if cache_file is not None:
        tensors = {}
        for name, q in out.items():
            tensors.update(to_tensors(name, q))
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, cache_file)
    return out


@torch.no_grad()
def prepare_linears(model: nn.Module, dtype: str, act: torch.dtype, group: int = 32,
                    choice: KernelChoice | None = None, cache_file: Path | None = None) -> KernelChoice:
    """Give every projection of `model` its kernel; `dtype` is the weights' format (float32, bfloat16, int8,
    int4), `act` the dtype of the activations around them. A tied lm_head gets its own copy."""
    if model.lm_head.weight is model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)
    choice = choice or KernelChoice()
    label = getattr(model, "source", "") or "model"
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    quantized = quantize_linears(linears, dtype, group, cache_file, label) if dtype in QUANTIZED else {}
    shapes: dict[tuple[str, int, int], list[str]] = defaultdict(list)
    for name, m in linears.items():
        fmt, _ = weight_format(dtype, m.weight.shape[1], group)
        shapes[(fmt, *m.weight.shape)].append(name)

    def builds(name: str, fmt: str):
        m = linears[name]
        return candidates(fmt, m.weight.detach(), m.bias.detach() if m.bias is not None else None,
                          quantized.get(name))

    untimed = [key for key, names in shapes.items()
               if not choice.cached(key[0], key[1:], list(builds(names[0], key[0])))]
    line = progress.step(f"time kernels of {label} (once per machine)", len(untimed), "shape") if untimed else None
    # NOTE: one shape at a time, and its projections take their kernels (dropping the dense weights) before
    # the next shape is timed, so a timing holds one candidate's copy of one shape besides the model
    for (fmt, out_features, in_features), names in shapes.items():
        timed = [builds(name, fmt) for name in names[:TIMED_LAYERS]]
        kernel = choice.choose(fmt, (out_features, in_features), timed, act, quantized_group(quantized, names[0]))
        del timed
        for name in names:
            linears[name].prepare(builds(name, fmt)[kernel]())
        if line is not None and (fmt, out_features, in_features) in untimed:
            line.update()
    if line is not None:
        line.close()
    if choice.uncached:
        why = list(choice.uncached.values())
        more = f" (and {len(why) - 1} more such)" if len(why) > 1 else ""
        log(f"{len(why)} kernel timing(s) of {label} not cached, timed again at the next start: {why[0]}{more}")
    return choice


def quantized_group(quantized: dict, name: str) -> int:
    return getattr(quantized.get(name), "group", 0)
