"""Engine configuration: YAML mapped 1:1 onto slotted dataclasses, validated on load."""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("float32", "bfloat16", "float16", "int8", "int4", "auto")  # int8 / int4: weight-only, CPU
CPU_ONLY_DTYPES = ("int8", "int4")
# The engine `python -m app`, the terminal demo and tokenrouter.serve() start without a config: the embedded pair
# in `dtype: auto` (int4 / int8 where their greedy agreement with fp32 was measured at >= 97%, about a quarter of
# fp32's memory); config/embedded/qwen2.5-coder-0.5b_1.5b.yaml (fp32) stays the reference runs' config.
DEFAULT_CONFIG = "config/embedded/qwen2.5-coder-0.5b_1.5b-auto.yaml"


def default_config() -> str:
    """DEFAULT_CONFIG where it is: under the working directory, else in the source checkout (an editable install)."""
    if Path(DEFAULT_CONFIG).is_file():
        return DEFAULT_CONFIG
    checkout = Path(__file__).resolve().parents[1] / DEFAULT_CONFIG
    return str(checkout) if checkout.is_file() else DEFAULT_CONFIG


KERNELS = ("auto", "mkl", "w@x.T", "x@Wt", "onednn", "int8-bf16", "int8-fp32", "int4-bf16", "int4-fp32", "int4-vnni",
           "int4-vnni-a8", "int4-avx2", "int4-avx2-a8", "int4-avxvnni", "int4-avxvnni-a8",
           "int8-vnni", "int8-avx2", "int8-avxvnni", "int4-a8")
# a kernel by its arithmetic rather than its name: our int4 kernels with one int8 digit per activation, whichever of
# them this machine builds and times fastest (calibration.OUR_INT4)
KERNEL_FAMILIES = ("int4-a8",)
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "flash")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("local", "process", "ray")


class ConfigError(ValueError):
    """A config problem; the message names the file and the key."""


@dataclass(slots=True)
class ModelSpec:
    name: str
    source: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 0.0  # per rank; 0: 1 GiB on CPU, on CUDA what gpu_memory_utilization leaves
    gpu_memory_utilization: float = 0.9  # share of a GPU's memory all in use may fill when the KV pool is sized from it
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    attention_backend: str = "auto"  # auto: triton on CUDA, cpu (C++) on a CPU where it builds, else torch
    cuda_graphs: bool = True  # CUDA: decode steps replay graphs captured per batch bucket at start-up
    cuda_graph_max_batch: int = 0  # largest captured batch; 0: the scheduler's max_num_seqs
    # tokens per row of the captured steps: 1, decode; the config's verify:every=k policy adds k + 1 to the large
    # model's (its verifying steps)
    cuda_graph_query_lens: list[int] = field(default_factory=lambda: [1])
    # the largest step whose activations the KV budget leaves room for; 0: the scheduler's (a config sets them)
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    torch_threads: int = 0  # 0: all cores (local) or the pinned cores (process, ray)
    price_per_hour: float = 0.0
    tensor_parallel_size: int = 1  # ranks the model is split over (placement process or ray)
    devices: list[str] = field(default_factory=list)  # one per rank; default: `device`, then the next GPUs
    cpus: list[int] = field(default_factory=list)  # cores the worker's threads are pinned to (process, ray)
    group_size: int = 32  # dtype int4: input columns sharing one scale and zero (32, 64, 128 or 256)
    kernel: str = "auto"  # CPU projections: auto (the fastest timed on this machine, cached), one by name, or int4-a8

    def __post_init__(self):
        _check(self.name != "", "name", "must not be empty")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        self.device = _device(self.device, "device")
        _check(self.dtype not in CPU_ONLY_DTYPES or self.device == "cpu", "dtype",
               f"{self.dtype} (weight-only quantized) runs on the CPU only, got device {self.device}")
        _check(self.group_size in (32, 64, 128, 256), "group_size", f"must be 32, 64, 128 or 256, got {self.group_size}")
        _check(self.kernel in KERNELS, "kernel", f"must be one of {KERNELS}, got {self.kernel!r}")
        _check(self.kernel not in KERNEL_FAMILIES or self.dtype in ("int4", "auto"), "kernel",
               f"{self.kernel} (our int4 kernels of that arithmetic) needs dtype int4 or auto, got {self.dtype}")
        _check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size", "must be an integer >= 1")
        if not self.devices:
            self.devices = _default_devices(self.device, self.tensor_parallel_size)
        self.devices = [_device(d, "devices") for d in self.devices]
        _check(len(self.devices) == self.tensor_parallel_size, "devices",
               f"needs one device per rank: {self.tensor_parallel_size}, got {self.devices}")
        _check(len(set(self.devices)) == len(self.devices) or self.devices[0] == "cpu", "devices",
               f"each rank needs its own GPU, got {self.devices}")
        self.device = self.devices[0]
        _check(all(isinstance(c, int) and c >= 0 for c in self.cpus) and len(set(self.cpus)) == len(self.cpus),
               "cpus", f"must be distinct core numbers, got {self.cpus}")
        _check(not self.cpus or len(self.cpus) % self.tensor_parallel_size == 0, "cpus",
               f"{len(self.cpus)} cores cannot be split evenly over {self.tensor_parallel_size} ranks")
        _check(self.block_size >= 1, "block_size", "must be >= 1")
        _check(self.num_kv_blocks >= 0, "num_kv_blocks", "must be >= 0")
        _check(self.kv_cache_memory_gib >= 0, "kv_cache_memory_gib", "must be >= 0 (0: sized automatically)")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        _check(self.max_model_len >= 0, "max_model_len", "must be >= 0")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _check(self.torch_threads >= 0, "torch_threads", "must be >= 0")
        _check(isinstance(self.cuda_graphs, bool), "cuda_graphs", f"must be true or false, got {self.cuda_graphs!r}")
        _check(isinstance(self.cuda_graph_max_batch, int) and self.cuda_graph_max_batch >= 0, "cuda_graph_max_batch",
               "must be an integer >= 0 (0: the scheduler's max_num_seqs)")
        lens = self.cuda_graph_query_lens
        _check(isinstance(lens, list) and lens != [] and all(isinstance(q, int) and not isinstance(q, bool) and q >= 1
                                                            for q in lens), "cuda_graph_query_lens",
               f"must be a list of integers >= 1 (tokens per row of the captured steps), got {lens!r}")
        _check(self.price_per_hour >= 0, "price_per_hour", "must be >= 0")
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            _check(isinstance(getattr(self, key), int) and getattr(self, key) >= 0, key,
                   "must be an integer >= 0 (0: the scheduler's)")


def _device(name: str, key: str) -> str:
    """The canonical name of a device: `cuda` and `cuda:0` are one GPU."""
    kind, _, index = str(name).partition(":")
    _check(kind in DEVICES and (index == "" or index.isdigit()) and not (kind == "cpu" and index), key,
           f"must be cpu or cuda[:N], got {name!r}")
    return f"cuda:{index or 0}" if kind == "cuda" else "cpu"


def _default_devices(device: str, ranks: int) -> list[str]:
    if device == "cpu":
        return ["cpu"] * ranks
    first = int(device.partition(":")[2])
    return [f"cuda:{first + r}" for r in range(ranks)]


@dataclass(slots=True)
class PolicySpec:
    name: str = "all-small"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SchedulerSpec:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 256
    delay_tau_ms: float = -1.0  # < 0: chosen by the throughput model
    max_delay_latency_ms: float = 0.0  # 0: no latency bound when choosing tau

    def __post_init__(self):
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.max_queued_requests >= 1, "max_queued_requests", "must be >= 1")
        _check(self.max_delay_latency_ms >= 0, "max_delay_latency_ms", "must be >= 0")


@dataclass(slots=True)
class EngineConfig:
    models: list[ModelSpec]
    policy: PolicySpec = field(default_factory=PolicySpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    seed: int = 0
    placement: str = "local"  # where workers live: this process, a process per rank, or Ray actors
    ray_address: str = ""  # placement ray: an existing cluster ("auto", "ray://host:10001"); "": a local instance
    path: str = ""

    def __post_init__(self):
        _check(len(self.models) >= 1, "models", "needs at least one model")
        names = [m.name for m in self.models]
        _check(len(set(names)) == len(names), "models", f"model names must be unique, got {names}")
        _check(self.placement in PLACEMENTS, "placement", f"must be one of {PLACEMENTS}, got {self.placement!r}")
        verifying = verifying_query_len(self.policy)
        if verifying and verifying not in self.models[-1].cuda_graph_query_lens:
            self.models[-1].cuda_graph_query_lens = [*self.models[-1].cuda_graph_query_lens, verifying]
        for i, m in enumerate(self.models):
            m.cuda_graph_max_batch = m.cuda_graph_max_batch or self.scheduler.max_num_seqs
            for key in ("max_num_seqs", "max_num_batched_tokens"):  # NOTE: the KV budget's profile step reads them
                limit, own = getattr(self.scheduler, key), getattr(m, key)
                _check(own == 0 or own >= limit, f"models[{i}].{key}",
                       f"sizes the KV budget for the scheduler's steps: 0 or at least scheduler.{key}={limit}")
                setattr(m, key, own or limit)
        if self.placement == "local":
            for i, m in enumerate(self.models):
                _check(m.tensor_parallel_size == 1, f"models[{i}].tensor_parallel_size",
                       "> 1 needs placement process or ray (each rank is its own process)")
                _check(not m.cpus, f"models[{i}].cpus", "pinning cores needs placement process or ray")

    def model(self, name: str) -> ModelSpec:
        for spec in self.models:
            if spec.name == name:
                return spec
        raise KeyError(f"no model named {name!r}; the config has {[m.name for m in self.models]}")


def verifying_query_len(policy: PolicySpec) -> int:
    """Tokens per row of the large model's verifying steps under `policy`: k + 1 for verify:every=k (the token
    it wrote last, then k drafts), else 0 (no uniform verifying step: verify:of=... sends after any count)."""
    if policy.name != "verify" or "of" in policy.params:
        return 0
    from tokenrouter.policies.verify import DEFAULT_EVERY

    every = policy.params.get("every", DEFAULT_EVERY)
    return every + 1 if isinstance(every, int) and not isinstance(every, bool) and every >= 1 else 0


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


PROJECT_ROOT = Path(__file__).resolve().parents[1]


def load_config(path: str | Path, **overrides: Any) -> EngineConfig:
    """Read a YAML config; `overrides` replace top-level keys (dicts are merged one level deep). A relative
    path not found from the working directory is looked up in the project checkout (so `config/...` works
    from a notebook in notebooks/ too)."""
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (PROJECT_ROOT / path).is_file():
        path = PROJECT_ROOT / path
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    data["path"] = str(path)
    try:
        return from_dict(EngineConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from plain data, naming the key path of any unknown key or wrong type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{_join(where, unknown[0])}: unknown key (known keys: {sorted(names)})")
    kwargs = {k: _convert(hints[k], v, _join(where, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_join(where, str(e))) from None
    except TypeError as e:  # a missing required key
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        raise ConfigError(f"{_join(where, missing[0]) if missing else where}: required key missing") from e


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _convert(option, value, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: expected {tp}, got {type(value).__name__} {value!r}")
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__} {value!r}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
