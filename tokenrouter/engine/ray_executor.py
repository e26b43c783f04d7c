"""Placement `ray`: every rank of a model is a Ray actor in the model's placement group, on a local Ray
instance (started here, stopped at close) or on an existing cluster (`ray_address`). Ray does membership,
scheduling and transport; the actors run the same Worker as every other placement, behind the same step
messages.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

from tokenrouter.config import EngineConfig, ModelSpec
from tokenrouter.engine.executor import Executor, WorkerFailed
from tokenrouter.engine.messages import StepRequest, StepResult
from tokenrouter.engine.worker_process import RankSpec, rank_specs

PLACEMENT_TIMEOUT = 120.0  # seconds to wait for a placement group's resources before saying they are missing
_started_ray = False  # this process started the Ray instance it uses (and stops it when its last executor closes)
_open: set = set()


class RankActor:
    """One rank of one model, in its own Ray worker process."""

    def __init__(self):
        self.worker = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for its process group's rendezvous: this node's address and a free port."""
        import ray

        from tokenrouter.engine.worker_process import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def start(self, rank: RankSpec):
        from tokenrouter.engine.worker_process import start_rank

        self.worker = start_rank(rank)
        return self.worker.info()

    def call(self, method: str, args: tuple):
        return getattr(self.worker, method)(*args)


def start_ray_executors(config: EngineConfig, dirs: dict[str, Path], models: list[str]) -> dict[str, Executor]:
    _init_ray(config.ray_address, sum(max(len(m.cpus), m.tensor_parallel_size) for m in config.models))
    executors: dict[str, Executor] = {}
    try:
        for m in config.models:  # every model's actors first, so that they load their weights in parallel
            executors[m.name] = RayExecutor(m.name, models, m, dirs[m.name])
        for executor in executors.values():
            executor.wait_ready()
    except BaseException:
        for executor in executors.values():
            executor.close()
        raise
    return executors


def _init_ray(address: str, cpus_needed: int) -> None:
    """Join the cluster at `address`, or start a local instance on loopback only, with as many logical CPUs
    as the ranks ask for (pinning, not Ray's accounting, decides which cores they run on)."""
    global _started_ray
    if not address:
        # NOTE: a local instance stays on loopback. Ray resolves "127.0.0.1" to the machine's outward address
        # unless clustering is off, which its Windows / macOS switch does; its processes read the variable.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray_constants.ENABLE_RAY_CLUSTER = False
        ray.init(num_cpus=max(os.cpu_count() or 1, cpus_needed), include_dashboard=False, log_to_driver=False)
        _started_ray = True


class RayExecutor(Executor):
    def __init__(self, name: str, models: list[str], spec: ModelSpec, model_dir: Path | str):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(name)
        self.failed = ""
        size = spec.tensor_parallel_size
        gpus = 1 if spec.device.startswith("cuda") else 0
        cpus = max(1, len(spec.cpus) // size)
        self.group = placement_group([{"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}] * size, strategy="PACK",
                                     name=f"tokenrouter-{name}-{os.getpid()}")
        _open.add(self)
        self.actors = []
        if not _wait(self.group.ready(), PLACEMENT_TIMEOUT):
            self.close()
            raise WorkerFailed(f"{name}: Ray could not place {size} rank(s) of {cpus} CPU / {gpus} GPU each within "
                               f"{PLACEMENT_TIMEOUT:.0f} s; the cluster has {ray.available_resources()}")
        actor = ray.remote(num_cpus=cpus, num_gpus=gpus)(RankActor)
        self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=r)).remote() for r in range(size)]
        host, port = ray.get(self.actors[0].address.remote()) if size > 1 else ("127.0.0.1", 0)
        ranks = rank_specs(name, models, spec, model_dir, host, port, threads=cpus)
        if gpus:  # NOTE: Ray gives each actor its GPU as the only visible one
            ranks = [dataclasses.replace(r, spec=dataclasses.replace(r.spec, device="cuda:0")) for r in ranks]
        self._starting = [a.start.remote(r) for a, r in zip(self.actors, ranks)]

    def wait_ready(self) -> None:
        import ray

        try:
            self.info = ray.get(self._starting)[0]
        except Exception as e:
            self.close()
            raise WorkerFailed(f"{self.name}: a Ray worker failed to start: {_reason(e)}") from None

    @property
    def pids(self) -> list[int]:
        import ray

        return [info.pid for info in ray.get([a.call.remote("info", ()) for a in self.actors])]

    async def step(self, request: StepRequest) -> StepResult:
        if self.failed:
            raise WorkerFailed(self.failed)
        try:
            results = await asyncio.gather(*(a.call.remote("execute", (request,)) for a in self.actors))
        except Exception as e:
            raise self._failure(e) from None
        return results[0]

    def call(self, method: str, *args):
        import ray

        if self.failed:
            raise WorkerFailed(self.failed)
        try:
            return ray.get([a.call.remote(method, args) for a in self.actors])[0]
        except Exception as e:
            raise self._failure(e) from None

    def _failure(self, e: Exception) -> WorkerFailed:
        from ray.exceptions import RayActorError

        message = f"{self.name}: {'worker died' if isinstance(e, RayActorError) else 'worker raised'}: {_reason(e)}"
        if isinstance(e, RayActorError) or len(self.actors) > 1:  # dead, or ranks out of step: for good
            self.failed = message
        return WorkerFailed(message)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        global _started_ray
        if self in _open:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(self.group)
            _open.discard(self)
            self.failed = self.failed or f"{self.name}: worker closed"
        if not _open and _started_ray:
            ray.shutdown()
            _started_ray = False


def _wait(ref, timeout: float) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)


def _reason(e: Exception) -> str:
    cause = getattr(e, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(e).__name__}: {str(e)[:500]}"
