"""The graph path's static buffers, bucketing and padding, on the CPU stand-in (the same static-buffer forward, run
without capture) against the plain eager path: decode steps, and the verifying steps of verify:every=k (rows of
k + 1 tokens, under the Triton kernel, interpreted on a CPU). Capture itself is checked in tests/gpu."""
from __future__ import annotations

import logging

import pytest
import torch

import tokenrouter
from tokenrouter.config import EngineConfig, ModelSpec, PolicySpec
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.cuda_graphs import buckets
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.tiny import VOCAB_SIZE, build_tiny_model_dir


def runner(source: str = "qwen2-large", block_size: int = 4, backend: str = "torch") -> ModelRunner:
    # NOTE: the torch backend by default: it captures decode steps (the CPU's own backend, `cpu`, never captures)
    return ModelRunner(ModelSpec("m", f"tiny:{source}", block_size=block_size, num_kv_blocks=256, max_model_len=160,
                                 attention_backend=backend), build_tiny_model_dir(source))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, VOCAB_SIZE, (3 + 5 * i % 17,), generator=g).tolist() for i in range(n)]


def greedy(r: ModelRunner, batch: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill each prompt alone, then decode the whole batch greedily; every step's logits, stacked."""
    blocks = BlockManager(r.num_blocks, r.block_size)
    kvs = [KVState() for _ in batch]
    seqs = [list(p) for p in batch]
    for kv, s in zip(kvs, seqs):
        blocks.allocate(kv, len(s))
        s.append(int(r.run([Chunk(list(s), 0, kv.block_table)]).logits[0].argmax()))
    logits = []
    for _ in range(steps):
        for kv, s in zip(kvs, seqs):
            blocks.allocate(kv, len(s))
        out = r.run([Chunk([s[-1]], len(s) - 1, kv.block_table) for kv, s in zip(kvs, seqs)])
        logits.append(out.logits)
        for s, t in zip(seqs, out.logits.argmax(-1).tolist()):
            s.append(t)
    return seqs, torch.stack(logits)


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(20) == [1, 2, 4, 8, 16, 32]
    for top in (1, 7, 16, 33, 100):
        assert all(any(b <= x for x in buckets(top)) for b in range(1, top + 1))


@pytest.mark.parametrize("batch", [1, 3, 5, 16])
@pytest.mark.parametrize("source", ["qwen2-large", "qwen3"])
def test_static_buffer_decode_writes_the_eager_paths_tokens(batch, source):
    plain, graphed = runner(source), runner(source)
    graphed.use_cuda_graphs(16, capture=False)
    calls = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda host: calls.append(len(host.query_lens)) or run(host)
    want, want_logits = greedy(plain, prompts(batch), steps=12)
    got, got_logits = greedy(graphed, prompts(batch), steps=12)
    assert got == want
    assert (got_logits - want_logits).abs().max().item() <= 1e-4
    assert calls == [batch] * 12  # every decode step took the static-buffer path, no prefill did


def test_padded_rows_write_only_the_scratch_block():
    plain, graphed = runner(), runner()
    graphed.use_cuda_graphs(16, capture=False)
    greedy(plain, prompts(3), steps=5)
    greedy(graphed, prompts(3), steps=5)  # 3 rows in a bucket of 4: one padded row a step
    scratch = graphed.scratch_block
    # NOTE: the same keys and values up to rounding: the padded step multiplies 4 rows where the plain one multiplies
    # 3, and the GEMM kernel timed fastest on this machine may round the two differently (a fresh cache chose MKL for
    # three of the tiny model's projections: 1.3e-5 apart, on values up to 8.5)
    assert torch.allclose(graphed.kv_cache[:, :, :scratch], plain.kv_cache[:, :, :scratch], rtol=1e-5, atol=1e-4)
    assert graphed.kv_cache[:, :, scratch].abs().sum() > 0 and plain.kv_cache[:, :, scratch].abs().sum() == 0


def test_steps_the_graphs_cannot_take_run_eagerly():
    r = runner()
    r.use_cuda_graphs(4, capture=False)
    blocks = BlockManager(r.num_blocks, r.block_size)
    kvs = [KVState() for _ in range(6)]
    for kv in kvs:
        blocks.allocate(kv, 10)
    r.run([Chunk(list(range(9)), 0, kv.block_table) for kv in kvs])
    host_steps = []
    r.graphs.run = lambda host: host_steps.append(host)
    too_many = r.run([Chunk([1], 9, kv.block_table) for kv in kvs])  # 6 rows > the largest bucket (4)
    verifying = r.run([Chunk([1], 9, kvs[0].block_table, 1), Chunk([1, 2], 8, kvs[1].block_table, 2)])
    assert host_steps == [] and too_many.logits.shape[0] == 6 and verifying.logits.shape[0] == 3


def test_bad_chunks_are_refused_before_the_graph_path():
    r = runner()
    r.use_cuda_graphs(4, capture=False)
    with pytest.raises(ValueError, match="exceeds max_model_len=160"):
        r.run([Chunk([1], 160, list(range(41)))])
    with pytest.raises(ValueError, match="block table holds 4 slots, chunk needs 5"):
        r.run([Chunk([1], 4, [0])])


def test_a_dry_run_writes_only_the_scratch_block():
    """The capture's warm-up and the KV budget's graph estimate run the largest bucket on padding rows alone."""
    r = runner()
    r.use_cuda_graphs(16, capture=False)
    greedy(r, prompts(3), steps=2)
    before = r.kv_cache.clone()
    with torch.inference_mode():
        hidden = r.graphs.dry_run()
    scratch = r.scratch_block
    assert hidden.shape[0] == 16 and bool(hidden.isfinite().all())
    assert torch.equal(r.kv_cache[:, :, :scratch], before[:, :, :scratch])


# ---- verifying steps: every row k + 1 tokens ---------------------------------------------------------------------
def prefilled(r: ModelRunner, rows: int, context: int = 13) -> tuple[list[list[int]], list[list[int]]]:
    """`rows` sequences of different lengths prefilled (the last token of each not yet cached); their tables."""
    blocks = BlockManager(r.num_blocks, r.block_size)
    seqs = [p + [5] * (context + i % 3 - len(p)) for i, p in enumerate(prompts(rows))]
    tables = []
    for s in seqs:
        kv = KVState()
        blocks.allocate(kv, len(s) + 12)
        r.run([Chunk(s[:-1], 0, kv.block_table)])
        tables.append(kv.block_table)
    return seqs, tables


def verifying_chunks(seqs, tables, q: int, outputs: int = 0) -> list[Chunk]:
    """Each row: its uncached last token and q - 1 drafts, logits at the last `outputs` (0: all q) positions."""
    return [Chunk([s[-1]] + [(11 * i + j) % VOCAB_SIZE for j in range(q - 1)], len(s) - 1, t, outputs or q)
            for i, (s, t) in enumerate(zip(seqs, tables))]


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("outputs", [0, 2])
def test_verifying_steps_replay_the_static_buffer_forward_with_the_eager_paths_logits(rows, outputs):
    """Rows of 5 tokens (verify:every=4) in buckets of 1, 4 and 8 (padded rows), every output or the last two."""
    plain, graphed = runner(backend="torch"), runner(backend="triton")
    graphed.use_cuda_graphs(16, capture=False, query_lens=(1, 5))
    assert graphed.graphs.buckets == {1: [1, 2, 4, 8, 16], 5: [1, 2, 4, 8, 16]}
    calls = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda host: calls.append(host.query_lens.tolist()) or run(host)
    for r in (plain, graphed):
        seqs, tables = prefilled(r, rows)
        r.out = r.run(verifying_chunks(seqs, tables, 5, outputs))
    assert calls == [[5] * rows]  # the verifying step took the graph path, no prefill did
    assert plain.out.offsets == graphed.out.offsets
    assert graphed.out.logits.shape == plain.out.logits.shape == (rows * (outputs or 5), VOCAB_SIZE)
    assert (graphed.out.logits - plain.out.logits).abs().max().item() <= 1e-4
    assert (graphed.out.hidden - plain.out.hidden).abs().max().item() <= 1e-4
    scratch = graphed.scratch_block  # the padded rows wrote the scratch block alone (the backends differ by 1e-5)
    assert torch.allclose(graphed.kv_cache[:, :, :scratch], plain.kv_cache[:, :, :scratch], atol=1e-4)


def test_rows_of_other_lengths_and_mixed_steps_run_eagerly():
    r = runner(backend="triton")
    r.use_cuda_graphs(4, capture=False, query_lens=(1, 5))
    seqs, tables = prefilled(r, 3)
    taken = []
    run = r.graphs.run
    r.graphs.run = lambda host: taken.append(host.query_lens.tolist()) or run(host)
    r.run(verifying_chunks(seqs, tables, 4))  # 4 tokens a row: no graph for them
    mixed = verifying_chunks(seqs, tables, 5)
    mixed[1] = Chunk(mixed[1].token_ids[:3], mixed[1].start, mixed[1].block_table, 3)
    r.run(mixed)
    r.run(verifying_chunks(seqs, tables, 5))
    assert taken == [[5, 5, 5]]


def test_the_longest_rows_get_the_batches_the_step_limit_allows():
    """The buckets of q-token rows go up to max_num_batched_tokens // q rows (rounded up to a bucket, as decode
    rows' go up to max_num_seqs), and the dry run (the KV budget's estimate of graph memory) runs the shape with
    the most tokens."""
    r = ModelRunner(ModelSpec("m", "tiny:qwen2-large", block_size=4, num_kv_blocks=256, max_model_len=160,
                              attention_backend="triton", max_num_seqs=64, max_num_batched_tokens=100),
                    build_tiny_model_dir("qwen2-large"))
    r.use_cuda_graphs(64, capture=False, query_lens=(1, 9))
    assert r.graphs.buckets == {1: [1, 2, 4, 8, 16, 32, 48, 64], 9: [1, 2, 4, 8, 16]}  # 100 // 9 = 11 rows
    assert r.graphs.shapes[0] == (9, 16)  # 144 tokens, more than 64 decode rows
    with torch.inference_mode():
        assert r.graphs.dry_run().shape[0] == 144


def test_a_backend_that_reads_host_metadata_for_chunks_captures_decode_steps_alone(caplog):
    r = runner(backend="torch")
    with caplog.at_level(logging.INFO, "tokenrouter.engine.cuda_graphs"):
        r.use_cuda_graphs(4, capture=False, query_lens=(1, 5))
    assert r.graphs.buckets == {1: [1, 2, 4]}
    assert "steps of 5 tokens a row run eagerly: attention_backend 'torch'" in caplog.text


def test_the_configs_verify_policy_gives_the_large_model_its_verifying_steps():
    def lens(policy: PolicySpec, **large) -> list[list[int]]:
        config = EngineConfig([ModelSpec("small", "s"), ModelSpec("large", "s", **large)], policy=policy)
        return [m.cuda_graph_query_lens for m in config.models]

    assert lens(PolicySpec("verify", {"every": 3})) == [[1], [1, 4]]
    assert lens(PolicySpec("verify")) == [[1], [1, 5]]  # plain verify: k = 4
    assert lens(PolicySpec("verify", {"of": "entropy"})) == [[1], [1]]  # sends after any count: no uniform rows
    assert lens(PolicySpec("random", {"share": 0.2})) == [[1], [1]]
    assert lens(PolicySpec("verify", {"every": 3}), cuda_graph_query_lens=[1, 4]) == [[1], [1, 4]]
    with pytest.raises(ValueError, match="cuda_graph_query_lens: must be a list of integers >= 1"):
        ModelSpec("m", "s", cuda_graph_query_lens=[0])


def test_verify_every_k_through_the_verifying_graphs_writes_all_large_output():
    """The engine end to end: the large model's verifying steps on the graph stand-in (Triton kernel, rows of
    k + 1 tokens) write all-large's tokens, as the plain path does, and leave no block held."""
    triton = [{"name": "small", "source": "tiny:qwen2-small", "block_size": 4, "num_kv_blocks": 512,
               "max_model_len": 1024},
              {"name": "large", "source": "tiny:qwen2-large", "block_size": 4, "num_kv_blocks": 512,
               "max_model_len": 1024, "attention_backend": "triton"}]
    texts = ["def add(a, b):", "hello there", "x = [1, 2", "print("]
    with tokenrouter.serve("config/tiny/pair.yaml", policy={"name": "verify", "params": {"every": 3}},
                           models=triton) as svc:
        large = svc.executors["large"].runner
        assert large.spec.cuda_graph_query_lens == [1, 4]
        large.use_cuda_graphs(4, capture=False)
        shapes = []
        run = large.graphs.run
        large.graphs.run = lambda host: shapes.append(int(host.query_lens[0])) or run(host)
        want = svc.generate_batch(texts, concurrency=4, policy="all-large", max_tokens=16, ignore_eos=True)
        got = svc.generate_batch(texts, concurrency=4, policy="verify:every=3", max_tokens=16, ignore_eos=True)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert 4 in shapes and 1 in shapes
        for name, s in svc.stats().items():
            if name != "active_requests":
                assert s["free_blocks"] == s["total_blocks"], (name, s)


def test_a_runner_captures_nothing_where_no_shape_can_be_captured():
    from tokenrouter.engine.model_runner import graphs_unavailable
    from tokenrouter.models.attention import BACKENDS

    torch_backend, triton_backend = BACKENDS["torch"](), BACKENDS["triton"]()
    assert graphs_unavailable(torch_backend, 1, [1, 5]) == "" and graphs_unavailable(triton_backend, 1, [5]) == ""
    assert "reads host metadata for steps of [5] tokens a row" in graphs_unavailable(torch_backend, 1, [5])
    assert graphs_unavailable(triton_backend, 2, [1]) == "tensor_parallel_size > 1"
