"""Device and link presets for the roofline latency model.

Peak figures are the vendors' public datasheet numbers (dense bf16 tensor-core FLOP/s, HBM bandwidth, NVLink
bandwidth per direction); the efficiencies and the per-layer launch floor are assumptions, printed beside every
result, except where a preset was fitted to measurements (`fit.py`: the H200's, to this project's H200 tables).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16
    memory_gbps: float  # HBM (or DRAM) bandwidth, GB/s
    link_gbps: float  # GPU-to-GPU bandwidth per direction inside a node (NVLink), GB/s
    link_latency_us: float = 5.0  # per all-reduce inside a node
    compute_efficiency: float = 0.5  # share of peak FLOP/s a prefill chunk reaches (assumed)
    memory_efficiency: float = 0.8  # share of peak bandwidth a step's weight reads reach
    kv_efficiency: float = 0.8  # share of peak bandwidth attention's KV reads and writes reach
    layer_floor_us: float = 20.0  # per layer and step: kernel launches and small kernels (CUDA graphs)
    source: str = "datasheet peaks; efficiencies and floor assumed"

    def assumptions(self) -> str:
        return (f"{self.name}: {self.memory_gib:g} GiB, {self.peak_tflops:g} TFLOP/s bf16 x {self.compute_efficiency:.2f}, "
                f"{self.memory_gbps:g} GB/s x {self.memory_efficiency:.2f} (weights) x {self.kv_efficiency:.3f} (KV), "
                f"{self.layer_floor_us:.1f} us per layer per "
                f"step, NVLink {self.link_gbps:g} GB/s + {self.link_latency_us:g} us per all-reduce ({self.source})")

    def replace(self, **changes) -> Device:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Network:
    """The link between nodes, crossed by a hand-off when the two models live on different nodes."""
    name: str
    gbps: float
    latency_us: float

    def assumptions(self) -> str:
        return f"network {self.name}: {self.gbps:g} GB/s, {self.latency_us:g} us per transfer"


DEVICES: dict[str, Device] = {d.name: d for d in [
    Device("a100-80g", 80, 312, 2039, 300),
    Device("h100", 80, 989, 3350, 450),
    Device("h200", 141, 989, 4800, 450),
]}
NETWORKS: dict[str, Network] = {n.name: n for n in [
    Network("nvlink", 450, 5),  # both models in one node: a hand-off moves only a few ids
    Network("roce-3.7", 3.7, 20),  # the published multi-node setup's RoCE link
    Network("ib-400", 50, 5),
]}


def device(name: str) -> Device:
    from tokenrouter.simulate.fit import fitted_devices

    found = {**DEVICES, **fitted_devices()}
    if name not in found:
        raise ValueError(f"--device: unknown {name!r}; known: {', '.join(sorted(found))}")
    return found[name]


def network(name: str) -> Network:
    if name not in NETWORKS:
        raise ValueError(f"--network: unknown {name!r}; known: {', '.join(sorted(NETWORKS))}")
    return NETWORKS[name]
