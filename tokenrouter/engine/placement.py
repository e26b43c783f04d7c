"""Placement: where each model's worker lives, from the engine config's `placement`.

- `local`: a Worker per model in this process; the models on one device share that device's thread, so
  their steps take turns as they would on one GPU.
- `process`: every rank of every model in its own OS process, on its own GPU or pinned cores.
- `ray`: every rank a Ray actor in the model's placement group, on a local instance or a cluster.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from tokenrouter.config import EngineConfig, ModelSpec
from tokenrouter.engine.device_thread import DeviceThread
from tokenrouter.engine.executor import Executor, LocalExecutor
from tokenrouter.engine.load_threads import use_threads

log = logging.getLogger(__name__)
CLEAR_GAIN = 0.9  # one core fewer wins only below this share of the all-cores time


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
        # start every process first, so they load their weights in parallel, except where one must wait for another
        for i, m in enumerate(config.models):
            for earlier in config.models[:i]:
                if sizes_after(m, earlier):
                    executors[earlier.name].wait_ready()
            executors[m.name] = ProcessExecutor(m.name, models, m, dirs[m.name], unpinned_threads(config))
        for executor in executors.values():
            executor.wait_ready()
    except BaseException:
        close_all(executors)
        raise
    return executors


def sizes_after(m: ModelSpec, earlier: ModelSpec) -> bool:
    """Whether m's process may start only once `earlier`'s is ready: they share a GPU and one of them sizes its KV
    pool from the memory it finds there, which the other's loading would change while it measures (both would
    count the same free memory). Started in turn, the later one sees the earlier one's weights and pool in use, as
    two models of one process do."""
    shared = {d for d in m.devices if d != "cpu"} & set(earlier.devices)
    return bool(shared) and (auto_sized(m) or auto_sized(earlier))


def auto_sized(m: ModelSpec) -> bool:
    """A KV pool sized from the device's free memory (CUDA, no size given in the config)."""
    return m.device != "cpu" and not (m.kv_cache_memory_gib or m.num_kv_blocks)


def unpinned_threads(config: EngineConfig) -> int:
    """Threads of a CPU rank that has no cores of its own: an even share of the cores left to the unpinned
    ones (every thread that runs torch ops spins an OpenMP pool, and pools on the same cores fight)."""
    ranks = [m for m in config.models if m.device == "cpu" for _ in range(m.tensor_parallel_size)]
    pinned = {c for m in config.models for c in m.cpus}
    free = max(1, (os.cpu_count() or 1) - len(pinned))
    unpinned = sum(1 for m in ranks if not m.cpus) or 1
    return max(1, free // unpinned)


def _local(config: EngineConfig, dirs: dict[str, Path], models: list[str]) -> dict[str, Executor]:
    """NOTE: one worker thread per device, which also loads its models. On CPU this is also what keeps the
    machine fast: every thread that runs torch ops on several threads keeps an OpenMP team, and two teams on the
    same cores made each step about 2x slower (measured)."""
    from tokenrouter.engine.worker import Worker

    caller_threads = torch.get_num_threads()
    threads: dict[str, DeviceThread] = {}
    for m in config.models:
        if m.device not in threads:
            n = max(s.torch_threads for s in config.models if s.device == m.device) or os.cpu_count() or 1
            threads[m.device] = DeviceThread(f"device-{m.device}", use_threads, (n, m.device == "cpu"))
    try:
        # NOTE: each model loads (reads, quantizes, times its kernels) on its device's thread, never on the
        # caller's: every thread whose torch ops run on several threads keeps an OpenMP team, and once a process
        # has more team threads than cores, libgomp's idle threads stop spinning and sleep, so each parallel op
        # waits for a futex wake. Loading on the caller left its team behind, and the device thread's decode
        # steps on two threads ran no faster than on one (the 0.5B's int4 projection: 255 us against 128 us).
        workers = {m.name: threads[m.device].submit(Worker, m.name, models, m, dirs[m.name]).result()
                   for m in config.models}
        if "cpu" in threads and not any(m.torch_threads for m in config.models if m.device == "cpu"):
            cpu_models = [m for m in config.models if m.device == "cpu"]
            n = cpu_threads(threads["cpu"], [workers[m.name] for m in cpu_models], [dirs[m.name] for m in cpu_models],
                            cpu_models)
            threads["cpu"].submit(use_threads, n).result()
    except BaseException:
        for thread in threads.values():
            thread.shutdown()
        raise
    finally:
        torch.set_num_threads(caller_threads)
    return {m.name: LocalExecutor(workers[m.name], threads[m.device]) for m in config.models}


def cpu_threads(thread: DeviceThread, workers: list, dirs: list[Path], specs: list) -> int:
    """`torch_threads: 0` on a CPU: all cores, or one fewer where that steps these models faster, measured once per
    machine and set of models (cached). NOTE: the driver's event loop shares the cores with the device thread,
    and for small models OpenMP's fork and join, and its idle threads spinning for the next region, cost more
    than a second core gives: the tiny pair's small model stepped in 0.61 ms on one thread against 1.10 ms on
    both cores of a 2-core machine (2026-12-04), while a 1.5B model streams its weights faster on all cores."""
    from tokenrouter.bench.machine import cpu_info
    from tokenrouter.models.sources import cache_dir

    cores = os.cpu_count() or 1
    if cores < 2:
        return cores
    # NOTE: "loaded on the device thread": choices measured while the caller's OpenMP team slowed it are taken again
    key = json.dumps(["loaded on the device thread", cpu_info()[0], cores, torch.__version__,
                      [str(d.resolve()) for d in dirs], [(s.dtype, s.kernel, s.group_size) for s in specs]])
    path = cache_dir() / "threads" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())["threads"]
    from tokenrouter.bench.progress import step
    from tokenrouter.models.kernels_timing import BUSY, cpu_sample, others_share

    seconds = {}
    before = cpu_sample()
    with step(f"time decode steps on {cores} and {cores - 1} threads (once per machine)", 2, "setting") as line:
        for n in (cores, cores - 1):
            thread.submit(use_threads, n).result()
            seconds[n] = sum(thread.submit(w.time_decode, batch).result() for w in workers for batch in (1, 4))
            line.update()
    busy = others_share(before, cpu_sample())
    if busy is not None and busy > BUSY:
        # NOTE: beside another process two threads wait for each other at every op, so the comparison would pick one
        # thread for good; all cores now, fewer while the load lasts (load_threads), and the choice is made again at
        # the next start
        log.warning("CPU thread choice not kept: other processes used %.0f%% of the CPU while it was timed; "
                    "stepping on %d threads, fewer while they stay busy", 100 * busy, cores)
        return cores
    # NOTE: fewer cores only for a clear gain: timing noise must not take a core from a model that needs it
    chosen = cores - 1 if seconds[cores - 1] < CLEAR_GAIN * seconds[cores] else cores
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"threads": chosen, "seconds": seconds, "key": key}))
    log.info("CPU models step on %d thread(s): decode steps took %s s", chosen, seconds)
    return chosen


def close_all(executors: dict[str, Executor]) -> None:
    for executor in executors.values():
        try:
            executor.close()
        except Exception:  # closing the others matters more than why one would not close
            pass
