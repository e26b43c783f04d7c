"""A simulated engine: the real service (runtime, subservers, schedulers, block managers, delayed batching, the
online tau choice) over simulated workers on a virtual clock, replaying a routing trace.

    svc, sim = simulated_service(load_config("config/r2r/Qwen3-0.6B_Qwen3-32B.yaml"), trace, device="h100")
    outs = run_trace(svc, sim, concurrency=16)

Where each model lives comes from the config: models whose devices overlap share a simulated device, and take
turns on it under placement `local` or step at once under `process` / `ray` (CUDA MPS or time-slicing), each
stretched by the contention measured on the H200 while the other steps. A step's time comes from a latency model
(latency.py): `roofline` on a device preset, or `profiled` from measured step times (an H200 table, a `bench
runner` table, or the engine profiles a recorded trace carries). KV pools are sized as the engine sizes them,
from each device's memory less the weights on it.
"""
from __future__ import annotations

import gc
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field

from tokenrouter.config import EngineConfig, ModelSpec
from tokenrouter.engine.clock import VirtualLoop
from tokenrouter.engine.messages import WorkerInfo
from tokenrouter.engine.simulated_worker import SimulatedDevice, SimulatedExecutor
from tokenrouter.engine.throughput_model import StepProfile, ThroughputModel
from tokenrouter.policies import split_policy
from tokenrouter.service.inprocess import Service
from tokenrouter.simulate.devices import Device, Network, device as device_preset, network as network_preset
from tokenrouter.simulate.fit import H200_RUNNER, catch_up_points, mps_slowdown, runner_points, verify_points
from tokenrouter.simulate.latency import HandoffLink, ProfiledLatency, RooflineLatency, step_profile
from tokenrouter.simulate.shapes import DTYPE_BYTES, ModelShape, shape_of
from tokenrouter.simulate.traces import Replay, Trace

GIB = 2**30
GC_YOUNG = 500_000  # a simulated run's threshold of the cyclic collector's youngest generation (run_trace)
CPU_KV_GIB = 1.0  # the engine's KV pool on a CPU when the config gives none
PROFILES = {"h200": (H200_RUNNER, "graph"), "h200-eager": (H200_RUNNER, "eager")}


class SimTokenizer:
    """What the runtime asks of a tokenizer, for models whose files a simulation does not need: no text (every
    piece decodes to "", so the runtime keeps no detokenizer), an end-of-sequence id no trace writes (replayed
    requests end at their recorded length)."""
    writes_text = False
    eos_token_id = -1
    unk_token_id = None

    def convert_tokens_to_ids(self, token: str):
        return None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class Simulation:
    """What a simulated service was built from, for the report."""
    replay: Replay
    latency: str
    device: Device | None
    devices: dict[str, str]  # model -> simulated device name
    mps: bool
    slowdown: float
    network: Network | None
    infos: dict[str, WorkerInfo] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # model -> where its step times come from

    def assumptions(self) -> list[str]:
        lines = [f"{m}: {self.sources[m]}; {self.infos[m].num_blocks} KV blocks of {self.infos[m].block_size} tokens "
                 f"on {self.devices[m]}" for m in self.sources]
        if self.device is not None:
            lines.append(self.device.assumptions())
        if self.mps:
            lines.append(f"models on one GPU step at once, each {self.slowdown:.0%} slower while the other steps "
                         "(measured on one H200, process placement against local)")
        if self.network is not None:
            lines.append(self.network.assumptions() + " (every catch-up crosses it, each way)")
        return lines


def latency_model(spec: ModelSpec, shape: ModelShape, latency: str, device: Device | None, profile: str,
                  trace: Trace):
    """(latency model, where its step times come from) of one model."""
    dtype_bytes = DTYPE_BYTES[spec.dtype]
    gpu = spec.device != "cpu"
    roofline = RooflineLatency(shape, device, dtype_bytes, spec.tensor_parallel_size) if gpu and device else None
    if latency == "roofline":
        if roofline is None:
            raise ValueError(f"--latency roofline: model {spec.name!r} is on the CPU; a roofline needs a GPU preset "
                             "(--latency profiled reads the step times a recorded trace carries)")
        return roofline, f"roofline, {shape.name} x{spec.tensor_parallel_size} GPU, {spec.dtype}"
    if latency != "profiled":
        raise ValueError(f"--latency: must be roofline or profiled, got {latency!r}")
    if profile:
        path, mode = PROFILES.get(profile, (profile, "graph"))
        if spec.tensor_parallel_size > 1:
            raise ValueError(f"--profile: {profile} times one GPU; model {spec.name!r} is tensor-parallel "
                             "(use --latency roofline)")
        points = runner_points(path, [spec.name, shape.name], mode, spec.dtype)
        catch_up = catch_up_points(path, [spec.name, shape.name])
        verify = verify_points(path, [spec.name, shape.name], mode)
        longer = "measured catch-up steps for longer rows" if catch_up else \
            "a roofline for longer rows" if roofline else "no cost for longer rows"
        if verify:
            longer += f", measured verifying steps of {'/'.join(map(str, verify))} tokens a row"
        return (ProfiledLatency.from_points(points, extra=roofline, source=f"{profile} ({mode})", catch_up=catch_up,
                                            verify=verify),
                f"profiled {profile} ({mode}) decode steps of {shape.name}, {longer}")
    if spec.name not in trace.profiles:
        raise ValueError(f"--latency profiled: the trace carries no step profile of model {spec.name!r} "
                         f"(it has {sorted(trace.profiles)}); give --profile h200 or a `bench runner` table")
    overhead = trace.overheads.get(spec.name, 0.0)
    return (ProfiledLatency.from_profile(StepProfile.from_dict(trace.profiles[spec.name]), overhead=overhead),
            f"profiled on {trace.machine or 'the recording machine'} (the trace's engine profile, "
            f"+{overhead * 1e3:.2f} ms per step outside the forward, as measured in the recorded run)")


def _groups(config: EngineConfig) -> dict[str, str]:
    """Model -> the name of its simulated device: models whose devices overlap share one."""
    names: dict[str, str] = {}
    for m in config.models:
        shared = [names[o.name] for o in config.models if o.name in names and set(o.devices) & set(m.devices)]
        names[m.name] = shared[0] if shared else ",".join(m.devices)
    return names


def worker_infos(config: EngineConfig, shapes: dict[str, ModelShape], device: Device | None,
                 groups: dict[str, str]) -> dict[str, WorkerInfo]:
    """Each model's KV pool, sized as the engine sizes it: `num_kv_blocks`, else `kv_cache_memory_gib` per rank,
    else (GPU) what `gpu_memory_utilization` of the device leaves after the weights placed on it, split evenly
    between the models sized that way; 1 GiB on a CPU."""
    weights = {m.name: shapes[m.name].num_parameters * DTYPE_BYTES[m.dtype] / m.tensor_parallel_size
               for m in config.models}
    infos = {}
    for m in config.models:
        shape = shapes[m.name]
        per_token = shape.kv_bytes_per_token(DTYPE_BYTES[m.dtype]) / m.tensor_parallel_size
        if m.num_kv_blocks:
            blocks = m.num_kv_blocks
        else:
            if m.kv_cache_memory_gib:
                budget = m.kv_cache_memory_gib * GIB
            elif m.device == "cpu" or device is None:
                budget = CPU_KV_GIB * GIB
            else:
                peers = [o for o in config.models if groups[o.name] == groups[m.name]]
                auto = [o for o in peers if not o.num_kv_blocks and not o.kv_cache_memory_gib]
                taken = sum(o.kv_cache_memory_gib * GIB or o.num_kv_blocks * o.block_size
                            * shapes[o.name].kv_bytes_per_token(DTYPE_BYTES[o.dtype]) / o.tensor_parallel_size
                            for o in peers)
                budget = (device.memory_gib * GIB * m.gpu_memory_utilization - sum(weights[o.name] for o in peers)
                          - taken) / len(auto)
            blocks = int(budget // (per_token * m.block_size))
        if blocks < 1:
            raise ValueError(f"models: {m.name!r} does not fit on {groups[m.name]}: its weights leave no KV cache")
        infos[m.name] = WorkerInfo(blocks, m.block_size, m.max_model_len or shape.max_position, shape.num_parameters,
                                   int(weights[m.name]), shape.vocab, groups[m.name], m.tensor_parallel_size)
    return infos


def simulated_service(config: EngineConfig, trace: Trace, latency: str = "roofline", device: str = "h200",
                      profile: str = "", network: str = "", kv_efficiency: float = 0.0) -> tuple[Service, Simulation]:
    """The engine of `config` on simulated workers replaying `trace`. `device`: the GPU preset every `cuda` device
    of the config stands for; `network`: the link between the models' nodes (none: one node)."""
    models = [m.name for m in config.models]
    gpu = device_preset(device)
    if kv_efficiency:
        gpu = gpu.replace(kv_efficiency=kv_efficiency, source=gpu.source + f"; KV efficiency {kv_efficiency:g} given")
    shapes = {m.name: shape_of(m.source) for m in config.models}
    groups = _groups(config)
    infos = worker_infos(config, shapes, gpu, groups)
    # NOTE: under process / ray, models sharing a GPU step at once (CUDA MPS or time-slicing), slowed by contention;
    # models on GPUs of their own never contend
    shared = len(set(groups.values())) < len(groups)
    mps = config.placement != "local" and shared
    slowdown = mps_slowdown() if mps else 0.0
    link = network_preset(network) if network else None
    replay = Replay(trace, models[-1])
    devices = {name: SimulatedDevice(name, mps, slowdown) for name in set(groups.values())}
    executors, sources, latencies = {}, {}, {}
    for m in config.models:
        model, sources[m.name] = latency_model(m, shapes[m.name], latency, gpu, profile, trace)
        latencies[m.name] = HandoffLink(model, link) if link else model
        executors[m.name] = SimulatedExecutor(m.name, infos[m.name], latencies[m.name], devices[groups[m.name]], replay)
    context = int(statistics.fmean(r.prompt_tokens + r.output_tokens / 2 for r in trace.requests))
    throughput = None
    if len(models) > 1:
        small, large = (step_profile(latencies[n], context) for n in (models[0], models[-1]))
        together = groups[models[0]] == groups[models[-1]]
        if together and mps:
            small.slowdown = large.slowdown = slowdown
        throughput = ThroughputModel(small, large, max_batch=config.scheduler.max_num_seqs,
                                     shared_device=together and not mps)
    svc = Service(config, executors=executors, tokenizer=SimTokenizer(), loop=VirtualLoop(),
                  throughput_model=throughput)
    uses_gpu = any(m.device != "cpu" for m in config.models)
    sim = Simulation(replay, latency, gpu if uses_gpu else None, groups, mps and uses_gpu, slowdown, link, infos, sources)
    replay.policy = svc.policy(structural_policy(trace))
    return svc, sim


def structural_policy(trace: Trace) -> str:
    """The policy the runtime runs for the trace's requests: what decides is the trace, so only the policy's
    structure matters (a token-level policy sends and comes back; a verifying one drafts and is judged). A
    token-level trace runs as `random` (any token-level policy's structure); a verifying one as recorded."""
    name, params = split_policy(trace.policy)
    if name == "verify":
        return trace.policy
    return f"random:share={trace.large_share:.6f}"


def run_trace(svc: Service, sim: Simulation, concurrency: int, policy: str = "", progress=None) -> list:
    """Every request of the trace through the simulated engine at `concurrency` (closed loop). `policy`: the
    trace's routing (default), or `all-small`, `all-large`, `query` (each request wholly on one model: the large
    one for the share of requests the trace's large share gives, chosen by seeded draw)."""
    trace = sim.replay.trace
    requests = [{"prompt": r.prompt(), "max_tokens": r.output_tokens, "seed": i, "ignore_eos": True}
                for i, r in enumerate(trace.requests)]
    if policy == "query":
        for r, large in zip(requests, query_choice(trace)):
            r["policy"] = "all-large" if large else "all-small"
        policy = ""
    chosen = svc.policy(policy) if policy else sim.replay.policy
    with fewer_collections():
        return svc.generate_batch(requests, concurrency, on_output=progress, policy=chosen)


@contextmanager
def fewer_collections():
    """NOTE: a simulated run allocates several tracked objects per token (its record, the step's rows) and keeps the
    records to its end: at the default threshold (700) the cyclic collector ran every few steps and its older
    generations traversed the run's records again and again, a tenth of the run's time. Nothing of the run waits on
    a collection; cycles are still collected, less often. At the end, what the run left goes to the oldest generation
    at once (`gc.freeze`, then `gc.unfreeze`: two list splices), where the records would end anyway, instead of
    being traversed by a young collection and again by the middle one (about 0.1 s after the bench's run)."""
    threshold = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if not gc.get_freeze_count():  # NOTE: unfreeze would also release what someone else froze
            gc.freeze()
            gc.unfreeze()


def query_choice(trace: Trace, seed: int = 0) -> list[bool]:
    """A query-level router at the trace's large share: which requests go wholly to the large model. The share of
    *tokens* matches: in a seeded random order, each request is taken while it brings the total nearer the share."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(trace.requests))
    target, total, chosen = trace.large_share * trace.output_tokens, 0, [False] * len(trace.requests)
    for i in order:
        n = trace.requests[i].output_tokens
        if abs(total + n - target) < abs(total - target):  # NOTE: the nearest share one request at a time can reach
            chosen[i] = True
            total += n
    return chosen
