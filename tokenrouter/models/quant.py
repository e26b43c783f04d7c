"""Weight-only quantization of a projection: int8 per output channel, int4 per group of input columns.

The codes are kept in a layout of our own (what the cache stores); a kernel packs them for its op at load.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

INT4_GROUPS = (256, 128, 64, 32)  # the group sizes torch's int4 CPU kernel takes
INT4_FIT = "clip3"  # names the int4 fit below in the quantization cache's key: a new fit is a new cache file
CLIP = (0.0, 0.04, 0.08)  # shares of a group's range an off-grid group may give up at either end


@dataclass(slots=True)
class Int8Weight:
    codes: torch.Tensor  # [N, K] int8, w = codes * scale
    scale: torch.Tensor  # [N] float32


@dataclass(slots=True)
class Int4Weight:
    codes: torch.Tensor  # [N, K] uint8 in 0..15, w = codes * scale + low (per group of `group` columns)
    scale: torch.Tensor  # [N, K // group] float32
    low: torch.Tensor  # [N, K // group] float32
    group: int
    exact: float = 0.0  # share of groups whose values already lay on a 4-bit grid (a Q4 GGUF's), kept exactly


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    # weight: [N, K] -> symmetric per-row codes
    scale = weight.abs().amax(1).clamp(min=1e-12) / 127
    codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(codes, scale.float())


def int4_group(k: int, group: int) -> int | None:
    """The group size for `k` input columns: the configured one where it divides k, else the largest that does."""
    if k % group == 0 and group in INT4_GROUPS:
        return group
    return next((g for g in INT4_GROUPS if g <= group and k % g == 0), None)


def quantize_int4(weight: torch.Tensor, group: int, block: int = 1 << 18) -> Int4Weight:
    """Asymmetric 4-bit codes per group. A group whose values already lie on a grid of at most 16 levels from
    its minimum to its maximum (every group of a Q4_K / Q4_0 / Q4_1 tensor dequantized from a GGUF) keeps
    that grid, so it loses nothing; any other group gets the 16 levels over its range, clipped at either end by
    the shares of CLIP that give the least squared error (the min/max fit among them). Done in rows of about
    `block` values at a time (in cache)."""
    n, k = weight.shape
    rows = max(1, block // k)
    parts = map_on_cores(lambda i: _int4_rows(weight[i:i + rows].float().reshape(-1, k // group, group)),
                         range(0, n, rows))
    codes, scale, low, exact = (torch.cat(t) for t in zip(*parts))
    return Int4Weight(codes.reshape(n, k), scale, low, group, exact.float().mean().item())


def map_on_cores(fn, items) -> list:
    """[fn(item) for item in items], the items spread over torch's threads, each call on one thread of its own.
    NOTE: torch would run each op of a small block across all its threads, and every op's threads meet at a
    barrier: a core taken by another process stalls them all. On 2 cores beside one busy process the 0.5B's int4
    fit took 136 s on torch's two threads, against 41 s on one (20 s on two on an idle machine)."""
    threads = torch.get_num_threads()
    items = list(items)
    if threads < 2 or len(items) < 2:
        return [fn(item) for item in items]

    def alone(item):
        torch.set_num_threads(1)  # NOTE: this thread's; restored for every thread below
        return fn(item)

    try:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(alone, items))
    finally:
        torch.set_num_threads(threads)


def _int4_rows(g: torch.Tensor):
    # g: [rows, groups, group] -> codes (same shape, uint8), scale, low, exact: [rows, groups]
    low, high = g.amin(-1), g.amax(-1)
    span = high - low
    scale = torch.where(span > 0, span / 15, torch.ones_like(span))
    exact = span <= 0
    # NOTE: min and max are codes 0 and c for some c <= 15, so a grid's step is span / c; a group keeps the
    # smallest step (the most levels) its values lie on, within 1e-3 of a step. Only groups that can lie on one
    # are tried: values within 1e-3 of a step of at most 16 levels fall in at most 16 clusters no wider than
    # 2e-3 of the span, so a group with more gaps than 15 wider than 2.5e-3 of it cannot
    ordered = g.sort(-1).values
    gaps = (ordered[..., 1:] - ordered[..., :-1]) > 2.5e-3 * span[..., None]
    tried = ((gaps.sum(-1) <= 15) & (span > 0)).nonzero(as_tuple=True)
    shifted, spans, steps = g[tried] - low[tried][:, None], span[tried], scale[tried]
    found = torch.zeros_like(spans, dtype=torch.bool)
    left = torch.arange(len(spans))
    for levels in range(15, 0, -1):
        if not len(left):
            break
        step = spans[left] / levels
        codes = shifted[left] / step[:, None]
        on = (codes - codes.round()).abs().amax(-1).le(1e-3)
        steps[left[on]], found[left[on]] = step[on], True
        left = left[~on]
    scale[tried], exact[tried] = steps, found
    off = ~exact & (span > 0)
    if off.any():
        scale[off], low[off] = _clipped_fit(g[off], low[off], span[off])
    codes = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes, scale, low, exact


def _clipped_fit(g: torch.Tensor, low: torch.Tensor, span: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # g: [M, group] off-grid groups, low / span: [M] -> the scale and low of the least squared error over CLIP
    best = (torch.full_like(low, float("inf")), span / 15, low)
    for a in CLIP:
        for b in CLIP:
            lo, step = low + a * span, span * (1 - a - b) / 15
            codes = ((g - lo[:, None]) / step[:, None]).round().clamp(0, 15)
            err = (codes * step[:, None] + lo[:, None] - g).square().sum(-1)
            better = err < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip((err, step, lo), best))
    return best[1], best[2]


def cat_rows(parts: list[Int8Weight | Int4Weight]) -> Int8Weight | Int4Weight:
    """One projection's codes from its parts' (q / k / v of a fused qkv, each quantized alone: the codes of a
    row depend on that row alone)."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, Int8Weight) for p in parts):
        return Int8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))
    groups = {getattr(p, "group", None) for p in parts}
    if len(groups) != 1:
        raise ValueError(f"parts of one projection in different formats: groups {groups}")
    rows = [len(p.codes) for p in parts]
    exact = sum(p.exact * n for p, n in zip(parts, rows)) / sum(rows)
    return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.low for p in parts]), parts[0].group, exact)


def dequantize(q: Int8Weight | Int4Weight) -> torch.Tensor:
    if isinstance(q, Int8Weight):
        return q.codes.float() * q.scale[:, None]
    n, k = q.codes.shape
    g = q.codes.reshape(n, k // q.group, q.group).float()
    return (g * q.scale[..., None] + q.low[..., None]).reshape(n, k)


def to_tensors(name: str, q: Int8Weight | Int4Weight) -> dict[str, torch.Tensor]:
    """The cache's tensors of one projection (int4 codes two to a byte, even column in the low nibble)."""
    if isinstance(q, Int8Weight):
        return {f"{name}.codes": q.codes, f"{name}.scale": q.scale}
    nibbles = q.codes[:, 0::2] | (q.codes[:, 1::2] << 4)
    return {f"{name}.nibbles": nibbles, f"{name}.scale": q.scale, f"{name}.low": q.low,
            f"{name}.group": torch.tensor(q.group), f"{name}.exact": torch.tensor(q.exact)}


def from_tensors(name: str, t: dict[str, torch.Tensor]) -> Int8Weight | Int4Weight:
    if f"{name}.codes" in t:
        return Int8Weight(t[f"{name}.codes"], t[f"{name}.scale"])
    nibbles = t[f"{name}.nibbles"]
    codes = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).flatten(1)
    return Int4Weight(codes, t[f"{name}.scale"], t[f"{name}.low"], int(t[f"{name}.group"]), float(t[f"{name}.exact"]))
