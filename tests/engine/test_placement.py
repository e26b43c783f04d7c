"""Placements `process` and `ray` against `local`: the same tokens, the same provenance, tensor-parallel
logits, failing workers, and no process left behind."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

import tokenrouter
from tokenrouter.config import ModelSpec
from tokenrouter.engine.executor import WorkerFailed
from tokenrouter.engine.messages import Row, StepRequest
from tokenrouter.engine.runtime import EngineFailed
from tokenrouter.engine.worker import Worker
from tokenrouter.engine.worker_process import ProcessExecutor
from tokenrouter.models import kernels_timing
from tokenrouter.models.sources import resolve_model_dir
from tests.engine.placements import PROMPTS, TP_LARGE, alive, run

PAIR = "config/tiny/pair.yaml"
# deterministic policies, with per-sequence state (rolling window, query-level decision, decides_after)
POLICIES = ["schedule:every=3", "random:share=0.3", "rolling:of=random,window=3,threshold=0.55",
            "query-random:share=0.4", "query-confidence:threshold=0.1", "query-confidence:threshold=0.1,tokens=3"]
VERIFYING = ["verify:every=3", "verify:of=random,share=0.3,hold=4"]  # rollbacks in the workers' views


@pytest.fixture(scope="module")
def local():
    svc = tokenrouter.serve(PAIR)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def process():
    svc = tokenrouter.serve(PAIR, placement="process")
    pids = [pid for e in svc.executors.values() for pid in e.pids]
    assert len(pids) == 2 and os.getpid() not in pids and all(alive(p) for p in pids)
    yield svc
    svc.close()
    assert not any(alive(p) for p in pids)  # close() reaped every worker process


def assert_no_blocks_held(svc):
    stats = svc.stats()
    for m in svc.models:
        assert stats[m]["free_blocks"] == stats[m]["total_blocks"], (m, stats[m])


@pytest.mark.parametrize("concurrency", [1, 4, 16])
@pytest.mark.parametrize("policy", POLICIES + VERIFYING)
def test_process_placement_writes_what_local_writes(local, process, policy, concurrency):
    ours, ref = run(process, policy, concurrency), run(local, policy, concurrency)
    assert ours == ref
    assert_no_blocks_held(process)


def test_the_policies_route_both_ways(local):
    # the comparison above means something only if the policies send some requests or tokens and keep others
    for policy in POLICIES:
        models = {m for _, ms, _, _ in run(local, policy, 4) for m in ms}
        assert models == {"small", "large"}, policy


def test_process_workers_forget_finished_requests(process):
    process.generate_batch(PROMPTS[:6], policy="rolling:of=random,window=3,threshold=0.55", max_tokens=6)
    process.generate("hi", policy="schedule:every=2", max_tokens=4)  # delivers the forgets to both workers
    for executor in process.executors.values():
        views, _ = executor.call("num_known")
        assert views == len(executor._forget) and not executor.known


def test_stream_abort_frees_blocks_in_both_models(process):
    async def consume():
        got = []
        async for record in process.stream("tell me more", policy="schedule:every=2", max_tokens=200,
                                           ignore_eos=True):
            got.append(record)
            if len(got) == 6:
                break
        return got

    got = asyncio.run(consume())
    assert {r.model for r in got} == {"small", "large"}
    process.generate("hi", policy="schedule:every=2", max_tokens=3)  # passes step boundaries in both
    assert_no_blocks_held(process)


def test_a_killed_worker_aborts_its_requests_and_fails_the_engine():
    svc = tokenrouter.serve(PAIR, placement="process")
    pids = [pid for e in svc.executors.values() for pid in e.pids]
    try:
        os.kill(svc.executors["large"].pids[0], signal.SIGKILL)
        outs = svc.generate_batch(PROMPTS[:4], concurrency=4, policy="schedule:every=2", max_tokens=12)
        assert all(o.finish_reason == "abort" for o in outs)
        assert svc.error.startswith("large:") and "died" in svc.error
        with pytest.raises(EngineFailed, match="died"):
            svc.generate("hi", max_tokens=2)
        for m in svc.models:
            blocks = svc.runtime.subservers[m].blocks
            assert blocks.num_free_blocks == blocks.num_blocks
    finally:
        svc.close()
    assert not any(alive(p) for p in pids)


def test_a_raising_worker_names_the_error_and_keeps_its_channel():
    spec = ModelSpec("m", "tiny:qwen2-small", block_size=4, num_kv_blocks=16)
    executor = ProcessExecutor("m", ["m"], spec, resolve_model_dir(spec.source))
    try:
        executor.wait_ready()
        with pytest.raises(WorkerFailed, match="KeyError"):  # a row of a sequence it was never told about
            executor.call("execute", StepRequest([Row(7, [1, 2], 0, [0], True, False)]))
        assert executor.call("num_known") == (0, 0)  # still answering, in step
    finally:
        executor.close()
    assert not alive(executor.pids[0])


@pytest.mark.parametrize("source", ["tiny:llama", "tiny:qwen2", "tiny:qwen3", "tiny:qwen2-large"])
def test_tensor_parallel_logits_equal_one_rank(source):
    import torch

    spec = ModelSpec("m", source, block_size=4, num_kv_blocks=16)
    model_dir = resolve_model_dir(source)
    prompt = list(range(3, 40, 3))
    ref = torch.tensor(Worker("m", ["m"], spec, model_dir).prompt_logits(prompt))
    tp = ProcessExecutor("m", ["m"], ModelSpec("m", source, block_size=4, num_kv_blocks=16, tensor_parallel_size=2,
                                               cpus=[0, 1]), model_dir)
    try:
        tp.wait_ready()
        assert tp.info.tensor_parallel_size == 2 and len(tp.pids) == 2
        logits = torch.tensor(tp.call("prompt_logits", prompt))
    finally:
        tp.close()
    assert (logits - ref).abs().max().item() < 1e-4
    assert not any(alive(p) for p in tp.pids)


def test_tensor_parallel_engine_writes_what_one_rank_writes(local):
    svc = tokenrouter.serve(PAIR, placement="process", models=TP_LARGE)
    try:
        assert len(svc.executors["large"].pids) == 2
        for policy in ("all-large", "schedule:every=2"):
            assert run(svc, policy, 4) == run(local, policy, 4)
    finally:
        svc.close()


def test_tensor_parallel_needs_a_separate_process():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tokenrouter.serve(PAIR, models=[{"name": "small", "source": "tiny:qwen2-small", "tensor_parallel_size": 2}])


class TimedWorker:
    """time_decode answers as a model whose step costs `seconds[n]` on n threads."""

    def __init__(self, seconds: dict[int, float]):
        self.seconds, self.calls = seconds, 0

    def time_decode(self, batch: int) -> float:
        import torch

        self.calls += 1
        return self.seconds[torch.get_num_threads()]


@pytest.mark.parametrize("one_core_fewer,expected", [(0.5, 1), (0.95, 2)])
def test_cpu_models_step_on_one_core_fewer_only_where_that_is_clearly_faster(tmp_path, monkeypatch,
                                                                            one_core_fewer, expected):
    from concurrent.futures import ThreadPoolExecutor

    from tokenrouter.engine import placement

    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernels_timing, "others_share", lambda *a: 0.0)  # an idle machine, whatever runs beside
    spec = ModelSpec("m", "tiny:qwen2-small")
    worker = TimedWorker({2: 1.0, 1: one_core_fewer})
    with ThreadPoolExecutor(1) as thread:
        assert placement.cpu_threads(thread, [worker], [tmp_path], [spec]) == expected
        calls = worker.calls
        assert placement.cpu_threads(thread, [worker], [tmp_path], [spec]) == expected
    assert calls == 4 and worker.calls == calls  # measured once (batch 1 and 4 on each count), then cached


def test_a_thread_choice_timed_beside_other_work_steps_on_all_cores_and_is_not_kept(tmp_path, monkeypatch):
    """Beside a busy process two threads wait for each other at every op: that comparison would pick one thread for
    good. All cores then (load_threads takes them down while the load lasts), and the next start times it again."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenrouter.engine import placement

    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernels_timing, "others_share", lambda *a: 0.6)
    worker = TimedWorker({2: 1.0, 1: 0.3})
    with ThreadPoolExecutor(1) as thread:
        assert placement.cpu_threads(thread, [worker], [tmp_path], [ModelSpec("m", "tiny:qwen2-small")]) == 2
    assert worker.calls == 4 and not (tmp_path / "threads").exists()


def test_models_load_on_their_device_thread_not_the_callers(monkeypatch):
    """A thread that runs torch ops on several threads keeps an OpenMP team; with more team threads than cores,
    libgomp's idle threads sleep between ops and a two-thread step ran no faster than a one-thread one. Loading
    on the caller's thread left its team behind: the models load on the thread that steps them."""
    import threading

    from tokenrouter.engine import worker as worker_module

    loaded_on = []

    class Recording(worker_module.Worker):
        def __init__(self, *args, **kwargs):
            loaded_on.append(threading.get_ident())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(worker_module, "Worker", Recording)
    with tokenrouter.serve(PAIR) as svc:
        thread = svc.runtime.subservers["small"].executor.thread
        assert loaded_on == [thread.submit(threading.get_ident).result()] * 2 != [threading.get_ident()] * 2


def test_the_device_thread_runs_on_the_threads_chosen_for_it_and_the_caller_keeps_its_own():
    import torch

    models = [{"name": n, "source": f"tiny:qwen2-{n}", "block_size": 4, "num_kv_blocks": 64, "torch_threads": 1}
              for n in ("small", "large")]
    caller = torch.get_num_threads()
    with tokenrouter.serve(PAIR, models=models) as svc:
        executor = svc.runtime.subservers["small"].executor
        assert executor.thread.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == caller


def test_a_tensor_parallel_model_spins_and_stops_on_every_rank_together():
    """measure_slowdown keeps a model decoding (spin_start) while it times the other: the ranks of a
    tensor-parallel model must stop after the same step, however late one hears of the stop, or the other waits
    in an all-reduce for good (a start hung so on a busy machine). Here rank 1 is told, and answers, first."""
    spec = ModelSpec("m", "tiny:qwen2", block_size=4, num_kv_blocks=16, tensor_parallel_size=2, cpus=[0, 1])
    tp = ProcessExecutor("m", ["m"], spec, resolve_model_dir("tiny:qwen2"))
    try:
        tp.wait_ready()
        for _ in range(3):
            tp.call("spin_start", 2)
            with tp._lock:
                tp.conns[1].send(("spin_stop", ()))
                assert tp.conns[1].poll(60) and tp.conns[1].recv()[0] == "ok"
                tp.conns[0].send(("spin_stop", ()))
                assert tp.conns[0].poll(20), "rank 0 was left spinning in an all-reduce"
                assert tp.conns[0].recv()[0] == "ok"
        assert tp.call("time_decode", 2) > 0
    finally:
        tp.close()


def test_processes_sharing_a_gpu_start_in_turn_where_one_sizes_its_pool_from_free_memory(monkeypatch):
    """Two processes measuring one GPU's free memory at once would both count the same memory; a model that sizes
    its KV pool from it starts once the models before it on that GPU are ready. Other processes load in parallel."""
    from tokenrouter.config import EngineConfig
    from tokenrouter.engine import placement, worker_process

    events = []

    class Recorder:
        def __init__(self, name, models, spec, model_dir, threads):
            self.name = name
            events.append(("start", name))

        def wait_ready(self):
            if ("ready", self.name) not in events:
                events.append(("ready", self.name))

        def close(self):
            pass

    monkeypatch.setattr(worker_process, "ProcessExecutor", Recorder)

    def start(*models):
        events.clear()
        config = EngineConfig(list(models), placement="process")
        placement.start_executors(config, {m.name: "unused" for m in models})
        return list(events)

    auto_small, auto_large = ModelSpec("small", "s", device="cuda:0"), ModelSpec("large", "l", device="cuda:0")
    sized_small = ModelSpec("small", "s", device="cuda:0", kv_cache_memory_gib=4)
    sized_large = ModelSpec("large", "l", device="cuda:0", kv_cache_memory_gib=20)
    other_gpu = ModelSpec("large", "l", device="cuda:1", tensor_parallel_size=2)  # cuda:1 and cuda:2
    in_turn = [("start", "small"), ("ready", "small"), ("start", "large"), ("ready", "large")]
    parallel = [("start", "small"), ("start", "large"), ("ready", "small"), ("ready", "large")]
    assert start(auto_small, auto_large) == in_turn
    assert start(sized_small, auto_large) == in_turn  # the later one measures: the earlier must be in place
    assert start(auto_small, sized_large) == in_turn  # the earlier one measures: the later must not load meanwhile
    assert start(sized_small, sized_large) == parallel
    assert start(auto_small, other_gpu) == parallel
    assert start(ModelSpec("small", "s"), ModelSpec("large", "l")) == parallel  # CPU pools are sized from the config
