"""Turn a decoder's projections into CPU kernels: quantize them as they load (int8, int4; cached on disk like
the fp32 conversion), then give every projection shape the kernel that measured fastest on this machine."""
from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from tokenrouter.bench import progress
from tokenrouter.models.calibration import OUR_INT4
from tokenrouter.models.kernels import KernelChoice, candidates, superseded
from tokenrouter.models.decoder import load_weights, rank_part, weight_files, weight_tensors
from tokenrouter.models.layers import Linear
from tokenrouter.models.safetensors_io import SafetensorsReader, SafetensorsWriter, release_memory
from tokenrouter.models.quant import (INT4_FIT, Int4Weight, Int8Weight, cat_rows, from_tensors, int4_group,
                                      quantize_int4, quantize_int8, to_tensors)
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
    files = weight_files(model_dir)
    stamp = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    fit = f"|{INT4_FIT}" if dtype == "int4" else ""
    key = hashlib.sha256(f"{stamp}|{dtype}|{group}|{tp_rank}/{tp_size}{fit}".encode()).hexdigest()[:16]
    return cache_dir() / "quant" / f"{Path(model_dir).name}-{dtype}{group if dtype == 'int4' else ''}-{key}.safetensors"


def quantize(weight: torch.Tensor, dtype: str, group: int) -> Int8Weight | Int4Weight:
    fmt, g = weight_format(dtype, weight.shape[1], group)
    w = weight.detach().float()
    return quantize_int4(w, g) if fmt == "int4" else quantize_int8(w)


@torch.no_grad()
def load_quantized(model: nn.Module, model_dir: Path, dtype: str, group: int, cache_file: Path | None) -> dict:
    """Load `model` with every projection in `dtype`'s codes, never all of it in fp32: the codes come from
    `cache_file` one projection at a time (the projections' weights are not read at all), or from the weights
    one tensor at a time, each quantized and freed before the next is read (a GGUF's int4 blocks are taken as
    they are: GGUFWeights.int4); then they are streamed to `cache_file`. The embedded 1.5B held 7 GB in fp32
    before its projections were quantized; loaded this way it peaks near the size of its embedding and codes."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    params = {f"{name}.weight": name for name in linears}
    cached = cache_file is not None and cache_file.is_file()
    load_weights(model, model_dir, skip=frozenset(params))
    if cached:
        for m in linears.values():
            m.drop_weight()
        return read_codes(cache_file, list(linears))

    out, parts = {}, defaultdict(dict)
    for t in weight_tensors(model, model_dir, f"quantize to {dtype} (once; cached)"):
        if t.target not in params:
            continue
        name = params[t.target]
        fmt, g = weight_format(dtype, linears[name].in_features, group)
        q = t.reader.int4(t.key, g) if fmt == "int4" and model.tp.size == 1 else None
        if q is None:
            q = quantize(rank_part(t.name, t.reader.read(t.key), model.tp), dtype, group)
        parts[t.target][t.shard] = q
        if len(parts[t.target]) == t.shards:
            out[name] = cat_rows([parts[t.target][i] for i in range(t.shards)])
            del parts[t.target]
            linears[name].drop_weight()
            release_memory()
    missing = [name for name in linears if name not in out and not (name == "lm_head" and model.cfg.tie_word_embeddings)]
    if missing:
        raise KeyError(f"{model_dir}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if "lm_head" not in out:  # tied: the embedding's weight, never read under its own name
        out["lm_head"] = quantize(model.lm_head.weight, dtype, group)
        model.lm_head.drop_weight()
    exact = [q.exact for q in out.values() if hasattr(q, "group")]
    if exact:
        log(f"{Path(model_dir).name}: {sum(exact) / len(exact):.0%} of int4 groups exact from the source's 4-bit grid")
    if cache_file is not None:
        write_codes(cache_file, out)
    return out


def read_codes(cache_file: Path, names: list[str]) -> dict:
    """The codes of `names` from a cache file, one projection's tensors at a time (each read into a fresh,
    aligned allocation: the int8 / int4 kernels crashed (SIGSEGV) on tensors at a mapped file's offsets)."""
    out = {}
    with SafetensorsReader(cache_file) as f:
        keys = defaultdict(list)
        for key in f.keys():
            keys[key.rsplit(".", 1)[0]].append(key)
        for name in names:
            out[name] = from_tensors(name, {key: f.read(key) for key in keys[name]})
    return out


def write_codes(cache_file: Path, quantized: dict) -> None:
    """Stream the codes to `cache_file` (atomically: a reader sees the whole file or none)."""
    meta = {name: to_tensors(name, _on_meta(q)) for name, q in quantized.items()}  # shapes and dtypes, no data
    entries = {key: (t.dtype, list(t.shape)) for tensors in meta.values() for key, t in tensors.items()}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
    try:
        with SafetensorsWriter(tmp, entries) as writer:
            for name, q in quantized.items():
                for key, t in to_tensors(name, q).items():
                    writer.write(key, t)
        os.replace(tmp, cache_file)
    finally:
        tmp.unlink(missing_ok=True)  # a write cut short (a full disk) leaves no part file behind


def _on_meta(q: Int8Weight | Int4Weight) -> Int8Weight | Int4Weight:
    if isinstance(q, Int8Weight):
        return Int8Weight(q.codes.to("meta"), q.scale.to("meta"))
    return Int4Weight(q.codes.to("meta"), q.scale.to("meta"), q.low.to("meta"), q.group, q.exact)


@torch.no_grad()
def prepare_linears(model: nn.Module, dtype: str, act: torch.dtype, group: int = 32,
                    choice: KernelChoice | None = None, quantized: dict | None = None,
                    only: tuple[str, ...] = ()) -> KernelChoice:
    """Give every projection of `model` its kernel; `dtype` is the weights' format (float32, bfloat16, int8,
    int4), `act` the dtype of the activations around them; `quantized`: the projections' codes (load_quantized)
    where `dtype` is int8 / int4, consumed (each projection's leave the dict as its kernel takes them); `only`:
    the kernels a projection may take where any of them can run it (the arithmetic `dtype: auto` chose on). A
    tied lm_head gets its own copy of a float weight."""
    if dtype in QUANTIZED and quantized is None:
        raise ValueError(f"dtype {dtype}: prepare_linears needs the projections' codes (load_quantized)")
    quantized = quantized if quantized is not None else {}
    if dtype not in QUANTIZED and model.lm_head.weight is model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)
    choice = choice or KernelChoice()
    label = getattr(model, "source", "") or "model"
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    shapes: dict[tuple[str, int, int], list[str]] = defaultdict(list)
    for name, m in linears.items():
        fmt, _ = weight_format(dtype, m.in_features, group)
        shapes[(fmt, m.out_features, m.in_features)].append(name)

    skip = superseded() - {choice.forced} if dtype in QUANTIZED else set()  # NOTE: float weights build no module

    def builds(name: str, fmt: str):
        m = linears[name]
        found = candidates(fmt, m.weight.detach(), m.bias.detach() if m.bias is not None else None,
                           quantized.get(name), skip)
        if only:
            return {k: v for k, v in found.items() if k in only} or found
        # NOTE: one int8 digit per activation is another arithmetic than weight-only int4's (about 8 bits of each
        # activation, where the others keep 15 or bf16's): its kernels run where asked for by name, or by
        # `dtype: auto` on their own agreement record, never on timing alone
        return {k: v for k, v in found.items() if k not in OUR_INT4["int4-a8"] or k == choice.forced}

    untimed = [key for key, names in shapes.items()
               if not choice.cached(key[0], key[1:], list(builds(names[0], key[0])))]
    line = progress.step(f"time kernels of {label} (once per machine)", len(untimed), "shape") if untimed else None
    # NOTE: one shape at a time, and its projections take their kernels (dropping the dense weights and the
    # codes) before the next shape is timed, so a timing holds one candidate's copy of one shape besides the model
    for (fmt, out_features, in_features), names in shapes.items():
        timed = [builds(name, fmt) for name in names[:TIMED_LAYERS]]
        kernel = choice.choose(fmt, (out_features, in_features), timed, act, quantized_group(quantized, names[0]))
        del timed
        for name in names:
            linears[name].prepare(builds(name, fmt)[kernel]())
            quantized.pop(name, None)
        if line is not None and (fmt, out_features, in_features) in untimed:
            line.update()
    if line is not None:
        line.close()
    release_memory()
    if choice.uncached:
        why = list(choice.uncached.values())
        more = f" (and {len(why) - 1} more such)" if len(why) > 1 else ""
        log(f"{len(why)} kernel timing(s) of {label} not cached, timed again at the next start: {why[0]}{more}")
    return choice


def quantized_group(quantized: dict, name: str) -> int:
    return getattr(quantized.get(name), "group", 0)
