"""Placement: where each model's worker lives, from the engine config's `placement`.

- `local`: a Worker per model in this process; the models on one device share that device's thread, so
  their steps take turns as they would on one GPU.
- `process`: every rank of every model in its own OS process, on its own GPU or pinned cores.
- `ray`: every rank a Ray actor in the model's placement group, on a local instance or a cluster.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tokenrouter.config import EngineConfig
from tokenrouter.engine.executor import Executor, LocalExecutor


def start_executors(config: EngineConfig, dirs: dict[str, Path]) -> dict[str, Executor]:
    """One started executor per model, in config order; on any failure none is left running."""
    models = [m.name for m in config.models]
    if config.placement == "local":
        return _local(config, dirs, models)
    if config.placement == "ray":
        from tokenrouter.engine.ray_executor import start_ray_executors

        return start_ray_executors(config, dirs, models)
    from tokenrouter.engine.worker_process import ProcessExecutor

    executors: dict[str, Executor] = {}
    try:
        for m in config.models:  # start every process first: they load their weights in parallel
            executors[m.name] = ProcessExecutor(m.name, models, m, dirs[m.name], unpinned_threads(config))
        for executor in executors.values():
            executor.wait_ready()
    except BaseException:
        close_all(executors)
        raise
    return executors


def unpinned_threads(config: EngineConfig) -> int:
    """Threads of a CPU rank that has no cores of its own: an even share of the cores left to the unpinned
    ones (every thread that runs torch ops spins an OpenMP pool, and pools on the same cores fight)."""
    ranks = [m for m in config.models if m.device == "cpu" for _ in range(m.tensor_parallel_size)]
    pinned = {c for m in config.models for c in m.cpus}
    free = max(1, (os.cpu_count() or 1) - len(pinned))
    unpinned = sum(1 for m in ranks if not m.cpus) or 1
    return max(1, free // unpinned)


def _local(config: EngineConfig, dirs: dict[str, Path], models: list[str]) -> dict[str, Executor]:
    """NOTE: one worker thread per device. On CPU this is also what keeps the machine fast: every thread
    that runs torch ops keeps a pool of OpenMP threads spinning, and two pools on the same cores made each
    step about 2x slower (measured)."""
    from tokenrouter.engine.worker import Worker

    caller_threads = torch.get_num_threads()
    threads: dict[str, ThreadPoolExecutor] = {}
    for m in config.models:
        if m.device not in threads:
            n = max(s.torch_threads for s in config.models if s.device == m.device) or os.cpu_count() or 1
            threads[m.device] = ThreadPoolExecutor(1, thread_name_prefix=f"device-{m.device}",
                                                   initializer=torch.set_num_threads, initargs=(n,))
    try:
        workers = {m.name: Worker(m.name, models, m, dirs[m.name]) for m in config.models}
        for thread in threads.values():  # start the threads now: their thread settings leak into the
            thread.submit(int).result()  # default of threads started later, the caller's included
    except BaseException:
        for thread in threads.values():
            thread.shutdown()
        raise
    finally:
        torch.set_num_threads(caller_threads)
    return {m.name: LocalExecutor(workers[m.name], threads[m.device]) for m in config.models}


def close_all(executors: dict[str, Executor]) -> None:
    for executor in executors.values():
        try:
            executor.close()
        except Exception:  # closing the others matters more than why one would not close
            pass
