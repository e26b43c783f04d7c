"""`bench runner`'s GPU measurement, run on the CPU (no graphs there): rows by context and batch, the floor from
the weights and KV bytes, transformers at the smallest context."""
from __future__ import annotations

import math

from tokenrouter.bench.runner import streamed_bytes
from tokenrouter.bench.runner_cuda import bench_cuda_model, print_cuda_table
from tokenrouter.config import ModelSpec


def test_rows_by_context_and_batch_with_their_floor(capsys):
    spec = ModelSpec("m", "tiny:qwen3", block_size=16)
    rate = 1e9
    seen = []  # what the runner would write to its JSON after each row and each transformers figure
    rows = bench_cuda_model(spec, [1, 3], [8, 40], steps=2, with_hf=True, weights_bytes=streamed_bytes, rate=rate,
                            measured=lambda so_far: seen.append([dict(r) for r in so_far]))
    assert [(r["context"], r["batch"]) for r in rows] == [(8, 1), (8, 3), (40, 1), (40, 3)]
    assert [len(s) for s in seen] == [1, 2, 3, 4, 4, 4] and "hf_ms" not in seen[3][0] and seen[-1] == rows
    kv_token = 2 * 2 * 2 * 32 * 4  # layers x (k, v) x kv heads x head_dim x fp32
    weights = rows[0]["floor_ms"] / 1e3 * rate - 8 * kv_token
    for r in rows:
        assert r["eager_ms"] > 0 and math.isnan(r["graph_ms"])  # no CUDA: no graph
        assert math.isclose(r["floor_ms"] / 1e3 * rate, weights + r["batch"] * r["context"] * kv_token)
        assert ("hf_ms" in r) == (r["context"] == 8)
        assert r["catch_up32_ms"] > 0 and r["catch_up8_ms"] > 0  # rows of several tokens, as bench simulate reads
        assert r["verify5_eager_ms"] > 0 and "verify5_graph_ms" not in r  # verifying steps: eager alone here
    print_cuda_table(rows, rate)
    out = capsys.readouterr().out
    assert "| m | 3 | 40 |" in out and "verifying steps (5 tokens" in out


def test_graph_agreement_compares_replayed_and_eager_steps_on_the_same_inputs():
    from tokenrouter.bench.runner_cuda import graph_agreement
    from tokenrouter.engine.model_runner import ModelRunner
    from tokenrouter.models.sources import resolve_model_dir

    runner = ModelRunner(ModelSpec("m", "tiny:qwen3", block_size=16, num_kv_blocks=64, max_model_len=256,
                                   attention_backend="torch"),  # a backend the graph stand-in can take
                         resolve_model_dir("tiny:qwen3"))
    runner.use_cuda_graphs(4, capture=False)  # the static-buffer stand-in: fp32 on a CPU agrees everywhere
    graphs = runner.graphs
    found = graph_agreement(runner, graphs, [list(range(i * 4, i * 4 + 4)) for i in range(3)], 20, steps=3)
    assert found["graph_token_agreement"] == 1.0 and 0 <= found["graph_max_logit_diff"] < 1e-4
    assert runner.graphs is graphs
