"""The simulated engine: virtual time, trace replay token for token, the runtime's invariants (blocks, aborts,
preemption, verification rollback) on simulated workers, latency models, KV sizing, synthetic traces, and
`bench simulate` end to end."""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import yaml

from tokenrouter.bench.per_request import generate_one
from tokenrouter.config import load_config
from tokenrouter.engine.clock import VirtualLoop, now
from tokenrouter.engine.sequence import SamplingParams
from tokenrouter.simulate.devices import DEVICES
from tokenrouter.simulate.fit import h200_fit, mps_slowdown
from tokenrouter.simulate.latency import ProfiledLatency, RooflineLatency
from tokenrouter.simulate.service import query_choice, run_trace, simulated_service, worker_infos
from tokenrouter.simulate.shapes import KNOWN, shape_of
from tokenrouter.simulate.traces import Trace, TraceRequest, from_outputs, synthetic

GPU_PAIR = "config/gpu-check/qwen3-0.6b_8b-shapes.yaml"


def gpu_pair(tmp_path, **overrides):
    data = yaml.safe_load(open(GPU_PAIR))
    for m in data["models"]:
        m.update(overrides.pop("models", {}))
    data.update(overrides)
    path = tmp_path / "pair.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def recorded_trace(n: int = 12, seed: int = 0, verify: bool = False) -> Trace:
    """Requests with token ids of their own, sends (or rejected drafts) at random positions."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(n):
        p, k = int(rng.integers(3, 40)), int(rng.integers(2, 30))
        marks = sorted({int(x) for x in rng.integers(0, k, 3)})
        requests.append(TraceRequest(p, k, [] if verify else marks, marks if verify else [],
                                     [int(x) for x in rng.integers(300, 1000, p)],
                                     [int(x) for x in rng.integers(300, 1000, k)]))
    return Trace(requests, "verify:every=4" if verify else "random:share=0.1", "test")


def assert_no_blocks_held(svc):
    for name, s in svc.stats().items():
        if name != "active_requests":
            assert s["free_blocks"] == s["total_blocks"], (name, s)
            assert s["waiting"] == s["running"] == s["parked"] == 0


# ---- virtual time ------------------------------------------------------------------------------------------------
def test_virtual_loop_jumps_to_the_next_timer():
    async def main():
        async def at(t):
            await asyncio.sleep(t)
            return now()

        times = await asyncio.gather(*(at(60.0 * i) for i in range(60)))
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 7200)
        except TimeoutError:
            pass
        return times, now()

    loop = VirtualLoop()
    start = time.perf_counter()
    try:
        times, end = loop.run_until_complete(main())
    finally:
        loop.close()
    assert times == [60.0 * i for i in range(60)]
    assert end == pytest.approx(3540 + 7200)
    assert time.perf_counter() - start < 30  # three simulated hours, not slept


def test_a_trace_gives_the_same_report_twice(tmp_path):
    config, trace = gpu_pair(tmp_path), synthetic("short", 24, 0.2, seed=3)
    reports = []
    for _ in range(2):
        svc, sim = simulated_service(config, trace)
        try:
            outs = run_trace(svc, sim, 8)
            reports.append(([(r.token_id, r.model, r.t) for o in outs for r in o.tokens], svc.clock(), svc.stats()))
        finally:
            svc.close()
    assert reports[0] == reports[1]
    assert reports[0][1] > 0


# ---- replay and the runtime's invariants on simulated workers ----------------------------------------------------
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_recorded_trace_replays_token_for_token(tmp_path, concurrency):
    trace = recorded_trace()
    svc, sim = simulated_service(gpu_pair(tmp_path), trace)
    try:
        outs = run_trace(svc, sim, concurrency)
        for request, out in zip(trace.requests, outs):
            assert out.token_ids == request.output_ids
            assert [i for i, r in enumerate(out.tokens) if r.model == "large"] == request.sent
        # the per-request loop on the same simulated workers writes the same tokens with the same models
        subs = svc.runtime.subservers
        for i, request in enumerate(trace.requests[:4]):
            ref = generate_one({m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models},
                               set(), request.prompt_ids,
                               SamplingParams(max_tokens=request.output_tokens, seed=i, ignore_eos=True),
                               sim.replay.policy)
            assert ref.output_ids == outs[i].token_ids
            assert [r.model for r in ref.records] == [r.model for r in outs[i].tokens]
        assert_no_blocks_held(svc)
    finally:
        svc.close()


def test_verification_rolls_back_at_the_rejected_drafts(tmp_path):
    trace = recorded_trace(verify=True)
    svc, sim = simulated_service(gpu_pair(tmp_path), trace)
    try:
        outs = run_trace(svc, sim, 4)
        for request, out in zip(trace.requests, outs):
            assert out.token_ids == request.output_ids  # all-large's output, as verification guarantees
            corrected = [i for i, r in enumerate(out.tokens) if r.correction]
            # a rejected draft is corrected by the large model; a "rejected" position the home model never drafted
            # (the large model's own token after k accepted drafts) is the large model's anyway
            assert set(corrected) <= set(request.rejected) and corrected
            assert all(out.tokens[i].model == "large" for i in request.rejected)
            assert out.metrics.drafted > out.metrics.accepted
        assert_no_blocks_held(svc)
        # recorded from this run, the trace replays to the same corrections
        again = from_outputs([r.prompt_ids for r in trace.requests], outs, "large", trace.policy, "replay", verifies=True)
        assert [r.rejected for r in again.requests] == [[i for i, t in enumerate(o.tokens) if t.correction] for o in outs]
        svc2, sim2 = simulated_service(gpu_pair(tmp_path), again)
        try:
            replayed = run_trace(svc2, sim2, 4)
            assert [[t.correction for t in o.tokens] for o in replayed] == [[t.correction for t in o.tokens] for o in outs]
        finally:
            svc2.close()
    finally:
        svc.close()


def test_preemption_on_a_small_kv_pool_keeps_the_tokens(tmp_path):
    trace = recorded_trace(16, seed=1)
    config = gpu_pair(tmp_path, models={"num_kv_blocks": 20, "block_size": 4})  # 80 tokens: each fits alone
    svc, sim = simulated_service(config, trace)
    try:
        outs = run_trace(svc, sim, 16)
        assert [o.token_ids for o in outs] == [r.output_ids for r in trace.requests]
        stats = svc.stats()
        assert stats["small"]["preemptions"] + stats["large"]["preemptions"] > 0
        assert_no_blocks_held(svc)
    finally:
        svc.close()


def test_an_abandoned_stream_frees_its_blocks(tmp_path):
    trace = synthetic("short", 2, 0.3, seed=0)
    svc, sim = simulated_service(gpu_pair(tmp_path), trace)

    async def consume():
        got = []
        async for record in svc.stream(trace.requests[0].prompt(), sim.replay.policy, max_tokens=48, seed=0,
                                       ignore_eos=True):
            got.append(record)
            if len(got) == 20:
                break
        return got

    try:
        assert len(asyncio.run(consume())) == 20
        run_trace(svc, sim, 2)  # more requests pass step boundaries in both subservers
        assert_no_blocks_held(svc)
    finally:
        svc.close()


def test_models_on_one_device_take_turns_and_process_placement_overlaps(tmp_path):
    trace = synthetic("short", 16, 0.3, seed=1)
    both = {}
    for placement in ("local", "process"):
        svc, sim = simulated_service(gpu_pair(tmp_path, placement=placement), trace)
        try:
            run_trace(svc, sim, 16)
            small, large = (svc.runtime.subservers[m].stats.intervals for m in ("small", "large"))
            both[placement] = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in small for b0, b1 in large)
        finally:
            svc.close()
    assert both["local"] == 0
    assert both["process"] > 0


# ---- latency models ----------------------------------------------------------------------------------------------
def test_roofline_grows_with_batch_context_and_prefill():
    r = RooflineLatency(KNOWN["qwen3-8b"], DEVICES["h100"])
    one = r.step_seconds([1], [512], 1)
    assert r.step_seconds([1] * 64, [512] * 64, 64) > one
    assert r.step_seconds([1], [8192], 1) > one
    prefill = r.step_seconds([4096], [4096], 1)
    compute, memory, _ = r.parts([4096], [4096], 1)
    assert compute > memory and prefill > 10 * one  # a long prefill is compute-bound
    # tensor parallelism splits the weight reads and pays all-reduces on top
    tp = RooflineLatency(KNOWN["qwen3-32b"], DEVICES["h100"], tensor_parallel=2)
    single = RooflineLatency(KNOWN["qwen3-32b"], DEVICES["h100"])
    assert tp.step_seconds([1], [512], 1) < single.step_seconds([1], [512], 1)
    assert tp.parts([1], [512], 1)[2] > single.parts([1], [512], 1)[2]


def test_h200_fit_reproduces_the_measured_steps():
    device, rows = h200_fit()
    assert len(rows) == 10 and all(abs(r["error"]) < 0.15 for r in rows), rows
    assert 0 < device.kv_efficiency < device.memory_efficiency <= 1
    assert 0 <= mps_slowdown() < 1


def test_profiled_latency_from_points_interpolates_and_fits_the_context_slope():
    points = [(1, 512, 0.004), (16, 512, 0.008), (64, 512, 0.018), (16, 4096, 0.008 + 16 * 3584 * 1e-7)]
    p = ProfiledLatency.from_points(points)
    assert p.step_seconds([1] * 16, [512] * 16, 16) == pytest.approx(0.008)
    assert p.step_seconds([1] * 16, [4096] * 16, 16) == pytest.approx(points[-1][2])
    assert p.context_slope == pytest.approx(1e-7)
    assert p.step_seconds([1] * 8, [512] * 8, 8) == pytest.approx(0.004 + (0.008 - 0.004) * 7 / 15)


# ---- shapes and KV sizing ----------------------------------------------------------------------------------------
def test_shapes_and_kv_pools_sized_from_device_memory(tmp_path):
    assert KNOWN["qwen3-8b"].num_parameters == pytest.approx(8.19e9, rel=0.01)
    assert shape_of("Qwen/Qwen3-32B") is KNOWN["qwen3-32b"]
    assert shape_of("tiny:qwen2-large").layers == 4
    with pytest.raises(ValueError, match="no shape known"):
        shape_of("someone/unknown-model")
    config = gpu_pair(tmp_path, models={"kv_cache_memory_gib": 0})
    groups = {m.name: "cuda:0" for m in config.models}
    shapes = {m.name: shape_of(m.source) for m in config.models}
    infos = worker_infos(config, shapes, DEVICES["h200"], groups)
    weights = sum(i.weight_bytes for i in infos.values())
    kv = sum(i.num_blocks * i.block_size * shapes[n].kv_bytes_per_token(2) for n, i in infos.items())
    assert weights + kv == pytest.approx(141 * 2**30 * 0.9, rel=0.01)
    with pytest.raises(ValueError, match="does not fit"):
        worker_infos(config, shapes, DEVICES["a100-80g"].replace(memory_gib=10), groups)


# ---- traces ------------------------------------------------------------------------------------------------------
def test_synthetic_share_and_bursts(tmp_path):
    trace = synthetic("reasoning", 40, 0.2, burst=4, seed=5)
    assert trace.large_share == pytest.approx(0.2, abs=0.02)
    runs = [len(run) for r in trace.requests for run in np.split(r.sent, np.where(np.diff(r.sent) != 1)[0] + 1)
            if len(run)]
    assert np.mean(runs) == pytest.approx(4, rel=0.15)
    assert max(r.output_tokens for r in trace.requests) <= 8192
    assert synthetic("reasoning", 40, 0.2, burst=4, seed=5) == trace
    path = tmp_path / "t.json"
    trace.save(path)
    assert Trace.load(path) == trace
    with pytest.raises(ValueError, match="--burst"):
        synthetic("short", 4, 0.6, burst=1)
    bad = json.loads(path.read_text())
    bad["requests"][0]["sent"] = [10**6]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"requests\[0\]"):
        Trace.load(path)


def test_query_level_router_takes_the_nearest_share():
    trace = Trace([TraceRequest(5, 10, list(range(3))) for _ in range(10)], "random:share=0.3", "test")
    chosen = query_choice(trace)
    assert sum(chosen) == 3  # 30 of 100 tokens


# ---- bench simulate ----------------------------------------------------------------------------------------------
def test_bench_simulate_reports_every_level_and_the_query_router(tmp_path, capsys):
    from tokenrouter.bench.__main__ import main

    out = tmp_path / "sim.json"
    main(["simulate", "--config", GPU_PAIR, "--workload", "short", "--requests", "8", "--concurrency", "1,4",
          "--baselines", "lockstep,per-request,all-large,query", "--json", str(out), "--placement", "local"])
    result = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert result["simulated"] and "SIMULATED" in text and "h200" in text
    rows = result["results"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["query_tokens_per_s"] > 0 and r["lockstep_identical"] == r["per_request_identical"] == "8/8"
        assert f"C={r['concurrency']}: " in text
    bad = [["--config", GPU_PAIR, "--device", "tpu"], ["--config", GPU_PAIR, "--trace", str(tmp_path / "none.json")],
           ["--config", "config/tiny/pair.yaml"], ["--config", GPU_PAIR, "--latency", "profiled"],
           ["--config", GPU_PAIR, "--concurrency", "0"], ["--config", GPU_PAIR, "--baselines", "oracle"]]
    for argv in bad:  # each refused with one line, before anything runs
        with pytest.raises(SystemExit) as refused:
            main(["simulate", *argv])
        assert refused.value.code == 2
    assert capsys.readouterr().err.count("error:") == len(bad)


# ---- recorded from a real run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["random:share=0.3", "verify:every=3"])
def test_a_real_run_recorded_replays_its_tokens_and_routes(tmp_path, policy):
    import tokenrouter
    from tokenrouter.bench import serve

    with tokenrouter.serve("config/tiny/pair.yaml") as real:
        pol = real.policy(policy)
        prompts = [real.prepare(p, pol, max_tokens=12)[0] for p in serve.PROMPTS[:6]]
        row, outs = serve.measure_engine(real, prompts, pol, 3, 12)
        trace = serve.trace_of(real, prompts, outs, pol, "test", row)
    trace.save(tmp_path / "trace.json")
    trace = Trace.load(tmp_path / "trace.json")
    assert set(trace.profiles) == set(trace.overheads) == {"small", "large"}
    svc, sim = simulated_service(load_config("config/tiny/pair.yaml"), trace, latency="profiled")
    try:
        replayed = run_trace(svc, sim, 3)
    finally:
        svc.close()
    assert [o.token_ids for o in replayed] == [o.token_ids for o in outs]
    assert [[(r.model, r.correction) for r in o.tokens] for o in replayed] == \
        [[(r.model, r.correction) for r in o.tokens] for o in outs]
    with pytest.raises(ValueError, match="roofline"):
        simulated_service(load_config("config/tiny/pair.yaml"), trace, latency="roofline")


def test_bench_runner_tables_are_profiles(tmp_path):
    """`bench runner --json` on a CPU (one context, each dtype) and on CUDA (eager and graph by batch and context)."""
    from tokenrouter.simulate.fit import runner_points

    cpu = {"prompt_len": 32, "results": [{"model": "small", "batch": b, "ours": {"float32": {"ms": 2.0 * b},
                                                                                 "int8=int8": {"ms": 1.0 * b}}}
                                         for b in (1, 4)]}
    (tmp_path / "cpu.json").write_text(json.dumps(cpu))
    assert runner_points(tmp_path / "cpu.json", "small", dtype="int8") == [(1, 32, 0.001), (4, 32, 0.004)]
    assert runner_points(tmp_path / "cpu.json", ["large", "small"]) == [(1, 32, 0.002), (4, 32, 0.008)]
    gpu = {"results": [{"model": "large", "batch": 1, "context": 512, "eager_ms": 20.0, "graph_ms": 5.0}]}
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    assert runner_points(tmp_path / "gpu.json", "large", "eager") == [(1, 512, 0.02)]
    with pytest.raises(ValueError, match="no graph decode steps of 'small'"):
        runner_points(tmp_path / "gpu.json", "small")
    gpu["results"][0]["graph_ms"] = None  # a model run without graphs: NaN, which the runner's JSON writes as null
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    with pytest.raises(ValueError, match="no graph decode steps of 'large'"):
        runner_points(tmp_path / "gpu.json", "large")
    # a table as --profile: the simulator steps the model at its measured times
    trace = synthetic("short", 4, 0.2)
    config = gpu_pair(tmp_path)
    path = tmp_path / "both.json"
    path.write_text(json.dumps({"results": [{"model": m, "batch": b, "context": 64, "graph_ms": t * b, "eager_ms": 1,
                                             "catch_up8_ms": 10 * t * b}
                                            for m, t in (("small", 1.0), ("large", 3.0)) for b in (1, 8)]}))
    svc, sim = simulated_service(config, trace, latency="profiled", profile=str(path))
    try:
        latency = svc.runtime.subservers["large"].executor.latency
        assert latency.step_seconds([1], [64], 1) == pytest.approx(0.003)
        assert latency.step_seconds([8], [72], 1) == pytest.approx(0.03)  # a catch-up row of 8 tokens, as measured
        assert latency.step_seconds([4, 4], [68, 68], 2) == pytest.approx(0.006 + (0.06 - 0.006) * 3 / 7)
        assert "profiled" in sim.sources["small"] and "catch-up" in sim.sources["small"]
    finally:
        svc.close()


def test_a_cuda_table_s_verifying_steps_price_verifying_rows(tmp_path):
    """`bench runner` on CUDA times verifying steps (rows of 5 tokens, a logit row at each), replayed where a graph
    was captured: a verifying step is priced from them, a catch-up of as many tokens from the catch-up steps."""
    from tokenrouter.simulate.fit import verify_points

    def row(b, graph):
        return {"model": "large", "batch": b, "context": 64, "graph_ms": 3.0 * b, "eager_ms": 9.0 * b,
                "catch_up8_ms": 30.0 * b, "verify5_graph_ms": graph, "verify5_eager_ms": 40.0 * b}

    path = tmp_path / "runner.json"
    small = [{"model": "small", "batch": b, "context": 64, "graph_ms": 1.0 * b} for b in (1, 8)]
    path.write_text(json.dumps({"results": [row(1, 5.0), row(8, None), {**row(1, 1.0), "context": 512}, *small]}))
    # the graph where one was captured, the eager step where none was; at the smallest context only
    assert verify_points(path, "large") == {5: {1: 0.005, 8: 0.32}}
    assert verify_points(path, ["qwen3-8b", "large"], "eager") == {5: {1: 0.04, 8: 0.32}}
    assert verify_points(path, "small") == {} and verify_points(path, "medium") == {}
    with pytest.raises(ValueError, match="mode"):
        verify_points(path, "large", "replayed")
    trace = synthetic("short", 4, 0.2)
    svc, sim = simulated_service(gpu_pair(tmp_path), trace, latency="profiled", profile=str(path))
    try:
        latency = svc.runtime.subservers["large"].executor.latency
        assert latency.step_seconds([5], [69], 5) == pytest.approx(0.005)  # verifying: the replayed graph
        assert latency.step_seconds([5], [69], 1) == pytest.approx(0.003 + (0.03 - 0.003) * 4 / 7)  # a catch-up
        assert latency.step_seconds([3], [67], 3) == pytest.approx(0.003 + (0.005 - 0.003) / 2)  # 3 of 1 and 5
        assert "verifying steps of 5 tokens" in sim.sources["large"]
    finally:
        svc.close()


def test_a_network_between_the_models_costs_each_catch_up(tmp_path):
    trace = synthetic("short", 8, 0.3, seed=2)
    seconds = {}
    for network in ("", "roce-3.7"):
        svc, sim = simulated_service(gpu_pair(tmp_path), trace, network=network)
        try:
            run_trace(svc, sim, 4)
            seconds[network] = svc.stats()["large"]["busy_seconds"]
        finally:
            svc.close()
    assert seconds["roce-3.7"] > seconds[""]


def test_h200_calibration_simulates_every_shipped_run():
    from tokenrouter.bench.simulate import h200_calibration

    rows = h200_calibration()
    assert [(r["run"].split(" (")[0], r["concurrency"]) for r in rows] == \
        [("H200 local", 1), ("H200 local", 16), ("H200 local", 16), ("H200 process", 16)]
    assert all(r["simulated_tokens_per_s"] > 0 and np.isfinite(r["tokens_per_s_error"]) for r in rows)
