"""The measured H200 tables this project ships (data/, from ../shared/data: one H200, torch 2.11.0+cu130,
2026-12-04, random bf16 models of Qwen3-0.6B's and Qwen3-8B's shapes) and what is fitted to them:

- the H200 roofline preset's per-layer launch floor and the efficiencies of its weight and KV reads, by weighted
  least squares over the CUDA-graph decode steps (t = layers x floor + weight bytes / (bandwidth x e_w) + KV bytes
  / (bandwidth x e_kv), each row weighted by 1 / t so the fit minimises relative error), with every row's error
  kept for the report;
- the slowdown of a step while the other model steps on the same GPU from another process, from the routed runs
  of both placements at concurrency 16 (mean step time under `process` over `local`, per model).

NOTE: those decode steps ran the torch attention backend, which gathers each row's context into a dense tensor:
the fit reads its KV at about 5% of peak bandwidth (weights at about 83%). That is the engine as measured; the
Triton backend reads the cache in place, and `bench simulate --kv-efficiency` models it until it is measured.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np

from tokenrouter.simulate.devices import DEVICES, Device
from tokenrouter.simulate.shapes import KNOWN

DATA = Path(__file__).resolve().parent / "data"
H200_RUNNER = DATA / "h200-2026-12-04-runner.json"
H200_SERVE_LOCAL = DATA / "h200-2026-12-04-serve-local.json"
H200_SERVE_BOTH = DATA / "h200-2026-12-04-serve-local-vs-process.json"
RUNNER_MODES = {"graph": "graph_ms", "eager": "eager_ms"}


def runner_points(path: Path | str, models: str | list[str], mode: str = "graph",
                  dtype: str = "") -> list[tuple[int, int, float]]:
    """(batch, context, seconds) of a model's decode steps in a `bench runner --json` table: on CUDA (`results` rows
    by the config's model name, eager or graph), on a CPU (`results` rows by model name, the step of `dtype` or the
    first measured, at the table's prompt length), or the shipped H200 probe (`probe_cuda_graph`, by shape name).
    `models`: the names to look for, in order."""
    if mode not in RUNNER_MODES:
        raise ValueError(f"mode: must be one of {sorted(RUNNER_MODES)}, got {mode!r}")
    names = [models] if isinstance(models, str) else models
    data = json.loads(Path(path).read_text())
    rows = data.get("probe_cuda_graph", data.get("results", []))
    key = RUNNER_MODES[mode]

    def point(r):
        if "ours" in r:  # a CPU table: one context (the prompt length), each dtype's step
            steps = r["ours"]
            step = steps.get(dtype) or next((v for k, v in steps.items() if k.startswith(f"{dtype}=")), None) \
                or next(iter(steps.values()), None)
            return (r["batch"], data.get("prompt_len", 0), step["ms"] / 1e3) if step else None
        value = r.get(key)  # NOTE: None where the table has no such step (write_json writes NaN as null)
        return (r["batch"], r["context"], value / 1e3) if "context" in r and value is not None \
            and math.isfinite(value) else None

    for name in names:
        points = [x for x in (point(r) for r in rows if r.get("model") == name) if x is not None]
        if points:
            return points
    raise ValueError(f"{path}: no {mode} decode steps of {' or '.join(map(repr, names))} "
                     f"(it has {sorted({r.get('model') for r in rows})})")


def catch_up_points(path: Path | str, models: str | list[str]) -> dict[int, dict[int, float]]:
    """Tokens per row -> batch -> seconds of a model's timed catch-up steps at the table's smallest context (a CUDA
    `bench runner --json` table since 2026-12-05; {} where the table has none, as the shipped H200 probe)."""
    return _row_points(path, models, lambda key: key[len("catch_up"):-len("_ms")]
                       if key.startswith("catch_up") and key.endswith("_ms") else None)


def verify_points(path: Path | str, models: str | list[str], mode: str = "graph") -> dict[int, dict[int, float]]:
    """Tokens per row -> batch -> seconds of a model's timed verifying steps (a logit row at every token, as the
    verifier's step of verify:every=k) at the table's smallest context: in `mode` graph the replayed ones, and the
    eager ones where none was captured (the engine runs a verifying step eagerly then); {} where the table has
    none."""
    if mode not in RUNNER_MODES:
        raise ValueError(f"mode: must be one of {sorted(RUNNER_MODES)}, got {mode!r}")
    eager = _row_points(path, models, lambda key: _verify_tokens(key, "eager"))
    if mode == "eager":
        return eager
    graph = _row_points(path, models, lambda key: _verify_tokens(key, "graph"))
    return {n: {**eager.get(n, {}), **graph.get(n, {})} for n in sorted({*eager, *graph})}


def _verify_tokens(key: str, mode: str) -> str | None:
    """`verify5_graph_ms` -> '5' in mode graph; None for any other key."""
    suffix = f"_{mode}_ms"
    return key[len("verify"):-len(suffix)] if key.startswith("verify") and key.endswith(suffix) else None


def _row_points(path: Path | str, models: str | list[str], tokens_of) -> dict[int, dict[int, float]]:
    """Tokens per row -> batch -> seconds from the keys of a CUDA table's rows at its smallest context for which
    `tokens_of(key)` gives the tokens per row, of the first of `models` that the table has rows of."""
    names = [models] if isinstance(models, str) else models
    rows = json.loads(Path(path).read_text()).get("results", [])
    for name in names:
        mine = [r for r in rows if r.get("model") == name and "context" in r]
        if mine:
            base = min(r["context"] for r in mine)
            out: dict[int, dict[int, float]] = {}
            for r in mine:
                for key, value in r.items():
                    tokens = tokens_of(key) if r["context"] == base else None
                    if tokens and tokens.isdigit() and value:  # NOTE: a step not run is written as null
                        out.setdefault(int(tokens), {})[r["batch"]] = value / 1e3
            return out
    return {}


def runner_models(path: Path | str) -> list[str]:
    return sorted({r["model"] for r in json.loads(Path(path).read_text()).get("probe_cuda_graph", [])})


@functools.cache
def h200_fit() -> tuple[Device, list[dict]]:
    """The fitted H200 preset, and per measured row: model, batch, context, measured and predicted ms."""
    from tokenrouter.simulate.latency import RooflineLatency

    base = DEVICES["h200"]
    rows = []
    for model in runner_models(H200_RUNNER):
        shape = KNOWN[model]
        for batch, context, seconds in runner_points(H200_RUNNER, model):
            # the two memory terms at efficiency 1: weights, and the KV read and written, over peak bandwidth
            weights = shape.streamed_parameters * 2 / (base.memory_gbps * 1e9)
            kv = shape.kv_bytes_per_token(2) * batch * (context + 1) / (base.memory_gbps * 1e9)
            rows.append((model, batch, context, seconds, [shape.layers, weights, kv]))
    x = np.array([terms for *_, terms in rows]) / np.array([[r[3]] for r in rows])
    (floor, inverse_weights, inverse_kv), *_ = np.linalg.lstsq(x, np.ones(len(rows)), rcond=None)
    device = base.replace(memory_efficiency=float(min(1.0, 1 / inverse_weights)),
                          kv_efficiency=float(min(1.0, 1 / inverse_kv)), layer_floor_us=float(floor * 1e6),
                          source=f"efficiencies and floor fitted to {len(rows)} measured H200 CUDA-graph decode steps")
    report = []
    for model, batch, context, seconds, _ in rows:
        predicted = RooflineLatency(KNOWN[model], device).step_seconds([1] * batch, [context] * batch, batch)
        report.append({"model": model, "batch": batch, "context": context, "measured_ms": seconds * 1e3,
                       "predicted_ms": predicted * 1e3, "error": predicted / seconds - 1})
    return device, report


@functools.cache
def mps_slowdown() -> float:
    """How much longer a step takes on an H200 shared with the other model's process than taking turns with it."""
    local = {r["concurrency"]: r for r in json.loads(H200_SERVE_LOCAL.read_text())["results"]}
    both = json.loads(H200_SERVE_BOTH.read_text())["results"]
    process = next(r for r in both if r["placement"] == "process")
    c = process["concurrency"]
    ratios = [(process[f"{m}_busy_s"] / process[f"{m}_steps"]) / (local[c][f"{m}_busy_s"] / local[c][f"{m}_steps"])
              for m in ("small", "large")]
    return max(0.0, float(np.mean(ratios)) - 1)


@functools.cache
def fitted_devices() -> dict[str, Device]:
    """The H200 fitted; the other GPUs take its efficiencies and floor (assumed to carry over: the same engine)."""
    h200, _ = h200_fit()
    carried = dict(memory_efficiency=h200.memory_efficiency, kv_efficiency=h200.kv_efficiency,
                   layer_floor_us=h200.layer_floor_us,
                   source="datasheet peaks; efficiencies and floor carried over from the H200 fit (assumed)")
    return {"h200": h200, **{name: d.replace(**carried) for name, d in DEVICES.items() if name != "h200"}}
