"""Weight-only int8 / int4: the codes, the kernels on them, and the logit error they cost against fp32."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.config import ConfigError, ModelSpec
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models import kernels
from tokenrouter.models.kernels import KernelChoice, candidates, fastest
from tokenrouter.models.kernels_timing import Timing
from tokenrouter.models.layers import Linear
from tokenrouter.models.safetensors_io import SafetensorsReader
from tokenrouter.models.quant import dequantize, from_tensors, int4_group, quantize_int4, quantize_int8, to_tensors
from tokenrouter.models.tiny import VOCAB_SIZE, build_tiny_model_dir

FAMILIES = ["llama", "qwen2", "qwen3"]
QUANTIZED = ["int8", "int4"]


def grid_weight(n: int, k: int, group: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4 GGUF dequantizes them: per group, 4-bit codes times a step plus an offset."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // group, group), generator=gen).float()
    step = torch.rand(n, k // group, 1, generator=gen) * 0.02 + 1e-3
    low = -8 * step + torch.randn(n, k // group, 1, generator=gen) * 1e-3
    return (codes * step + low).reshape(n, k)


def test_int4_keeps_weights_already_on_a_4bit_grid_exactly():
    w = grid_weight(48, 256, 32)
    q = quantize_int4(w, 32)
    assert q.exact == 1.0
    assert torch.allclose(dequantize(q), w, rtol=0, atol=1e-6)


def test_int4_finds_a_grid_of_any_number_of_levels_and_none_of_more_than_sixteen():
    """A group on a grid of c + 1 levels (c = 1..15: its codes span 0..c, as a Q4 group using part of its range
    does) is kept exactly; one on a 5-bit grid (a Q5_0 group) is not taken for one."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for c in range(1, 16):
        codes = torch.randint(0, c + 1, (4, 32), generator=gen)
        codes[:, 0], codes[:, 1] = 0, c
        rows.append(codes.float() * (0.013 * c) - 0.1)
    w = torch.cat(rows).reshape(-1, 64)
    q = quantize_int4(w, 32)
    assert q.exact == 1.0
    assert torch.allclose(dequantize(q), w, rtol=0, atol=1e-6)
    five_bit = torch.randperm(32, generator=gen).float().reshape(1, 32) * 0.01
    assert quantize_int4(five_bit, 32).exact == 0.0


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantization_error_is_at_most_half_a_step(group):
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(group))
    q4 = quantize_int4(w, group)
    step4 = q4.scale.repeat_interleave(group, dim=1)
    inside = (w >= q4.low.repeat_interleave(group, dim=1)) & (w <= (q4.low + 15 * q4.scale).repeat_interleave(group, 1))
    assert ((dequantize(q4) - w).abs() <= step4 / 2 + 1e-6)[inside].all()  # values clipped off lie outside
    q8 = quantize_int8(w)
    assert ((dequantize(q8) - w).abs() <= q8.scale[:, None] / 2 + 1e-6).all()


def test_int4_off_grid_groups_lose_less_than_the_min_max_fit():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    g = w.reshape(64, -1, 32)
    low = g.amin(-1, keepdim=True)
    step = (g.amax(-1, keepdim=True) - low) / 15
    min_max = ((((g - low) / step).round().clamp(0, 15) * step + low - g).square().sum(-1))
    clipped = (dequantize(quantize_int4(w, 32)) - w).reshape(64, -1, 32).square().sum(-1)
    assert (clipped <= min_max + 1e-6).all()
    assert clipped.sum() < 0.95 * min_max.sum()


def test_cached_codes_round_trip():
    w = torch.randn(32, 64)
    for q in (quantize_int8(w), quantize_int4(w, 32)):
        back = from_tensors("p", to_tensors("p", q))
        assert torch.equal(dequantize(back), dequantize(q))


def test_int4_group_falls_back_to_a_size_that_divides_the_inputs():
    assert int4_group(896, 32) == 32
    assert int4_group(160, 64) == 32
    assert int4_group(512, 128) == 128
    assert int4_group(48, 32) is None


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_every_kernel_computes_its_weights_product(fmt, rows):
    # 72 output rows: int4 packs rows in sixteens, so this one is padded
    gen = torch.Generator().manual_seed(rows)
    w, bias, x = torch.randn(72, 96, generator=gen), torch.randn(72, generator=gen), torch.randn(rows, 96, generator=gen)
    q = {"int8": quantize_int8(w), "int4": quantize_int4(w, 32)}.get(fmt)
    exact = x @ (dequantize(q) if q is not None else w).T + bias
    for name, build in candidates(fmt, w, bias, q).items():
        out = build()(x)
        assert out.shape == (rows, 72) and out.dtype == x.dtype, name
        tol = 0.0 if fmt == "float32" else 0.05
        assert (out - exact).abs().max() <= tol * exact.abs().max() + 1e-4, name


def test_kernel_choice_times_once_and_then_reads_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "kernels.json"
    w = torch.randn(64, 64)
    builds = [candidates("float32", w, None)]
    calls = []
    real = kernels.time_kernels

    def timed(*args, **kwargs):
        calls.append(1)
        timing = real(*args, **kwargs)
        # an idle machine and monotone figures, whatever this shared machine's load did to the real ones
        return Timing({n: sorted(t) for n, t in timing.ms.items()}, 0.0, [], timing.taken)

    monkeypatch.setattr(kernels, "time_kernels", timed)
    first = KernelChoice(path).choose("float32", (64, 64), builds, torch.float32)
    again = KernelChoice(path).choose("float32", (64, 64), builds, torch.float32)
    assert first == again and len(calls) == 1
    timed_ms = KernelChoice(path).entries["float32|64x64"]["ms"]  # a candidate 4x slower at batch 1 stops there
    assert first in timed_ms and set(timed_ms) <= set(builds[0])
    assert KernelChoice(path, forced="mkl").choose("float32", (64, 64), builds, torch.float32) == "mkl"
    with pytest.raises(ValueError, match="int4-bf16"):
        KernelChoice(path, forced="int4-bf16").choose("float32", (64, 64), builds, torch.float32)


def test_fastest_weighs_every_batch_size_alike():
    assert fastest({"a": [1.0, 10.0], "b": [2.0, 4.0], "pruned": [0.5]}) == "b"


def test_fastest_is_never_slower_than_f_linear():
    # oneDNN's mean is best, but it loses to F.linear (transformers' kernel) at one row: x@Wt wins nowhere by
    # as much, and is nowhere slower; within 2% counts as not slower
    timings = {"mkl": [3.4, 7.2, 9.6], "onednn": [3.75, 3.75, 5.5], "x@Wt": [3.1, 5.3, 6.8]}
    assert fastest(timings) == "x@Wt"
    assert fastest({**timings, "x@Wt": [3.6, 5.3, 6.8]}) == "mkl"
    assert fastest({**timings, "onednn": [3.45, 3.75, 5.5]}) == "onednn"
    assert fastest({"mkl": [40.0], "onednn": [3.75, 3.75, 5.5]}) == "onednn"  # a pruned reference binds nothing


def test_config_checks_the_new_keys():
    with pytest.raises(ConfigError, match="group_size"):
        ModelSpec(name="m", source="tiny:qwen2", group_size=48)
    with pytest.raises(ConfigError, match="kernel"):
        ModelSpec(name="m", source="tiny:qwen2", kernel="fast")
    with pytest.raises(ConfigError, match="CPU only"):
        ModelSpec(name="m", source="tiny:qwen2", dtype="int4", device="cuda")


def logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    blocks, kv = BlockManager(runner.num_blocks, runner.block_size), KVState()
    blocks.allocate(kv, len(tokens))
    return runner.run([Chunk(tokens, 0, kv.block_table, len(tokens))]).logits


def spec(family: str, dtype: str, **kw) -> ModelSpec:
    return ModelSpec(name=family, source=f"tiny:{family}", block_size=4, num_kv_blocks=32, dtype=dtype, **kw)


@pytest.fixture(scope="module")
def quant_cache(tmp_path_factory):
    """One cache for this module's runners (their quantized codes and kernel timings), not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENROUTER_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_logit_error_is_the_quantization_s_own(family, dtype, quant_cache):
    """The quantized runner's logits differ from fp32 by what its rounded weights imply and little more: an fp32
    model holding the dequantized weights lands within 2% of the logits' range of the quantized runner, and
    the quantized runner's error against fp32 is bounded (int8 5% of the range, int4 75% on these random weights,
    where a Q4 GGUF's weights lose nothing, see the test above)."""
    model_dir = build_tiny_model_dir(family)
    tokens = torch.randint(0, VOCAB_SIZE, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    exact = logits(ModelRunner(spec(family, "float32"), model_dir), tokens)
    quantized = ModelRunner(spec(family, dtype), model_dir)
    assert quantized.weight_dtype == dtype and quantized.dtype == torch.float32
    ours = logits(quantized, tokens)
    reference = ModelRunner(spec(family, "float32", kernel="mkl"), model_dir)  # dense weights, to round here
    for module in reference.model.modules():
        if isinstance(module, Linear):
            w = module.kernel.weight
            module.kernel.weight = dequantize(quantize_int8(w) if dtype == "int8" else quantize_int4(w, 32))
    dequantized = logits(reference, tokens)
    span = exact.max() - exact.min()
    assert (ours - dequantized).abs().max() <= 0.02 * span
    assert (ours - exact).abs().max() <= (0.05 if dtype == "int8" else 0.75) * span



@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_runner_loaded_from_the_cached_codes_computes_the_same(dtype, quant_cache):
    # the cached file's tensors are unaligned; the kernels crashed (SIGSEGV) on them before they were copied out.
    # NOTE: one kernel forced: on a busy machine the timings are not cached, and a second start may pick another
    model_dir = build_tiny_model_dir("qwen2")
    tokens = list(range(20))
    first, cached = (logits(ModelRunner(spec("qwen2", dtype, kernel=f"{dtype}-fp32"), model_dir), tokens)
                     for _ in range(2))
    assert torch.equal(first, cached)


def test_a_projection_missing_from_the_weights_is_an_error_not_garbage_codes(tmp_path):
    """A projection (or one shard of a fused one) absent from the files raises, naming it: its parameter was
    never written, and quantizing it would give codes of uninitialised memory."""
    import shutil

    from safetensors.torch import save_file

    from tokenrouter.models.decoder import DecoderConfig, DecoderLM
    from tokenrouter.models.prepare import load_quantized

    model_dir = tmp_path / "model"
    shutil.copytree(build_tiny_model_dir("qwen2"), model_dir)
    (file,) = model_dir.glob("*.safetensors")
    with SafetensorsReader(file) as f:
        tensors = {key: f.read(key) for key in f.keys() if key != "model.layers.1.self_attn.v_proj.weight"}
    save_file(tensors, file)
    with pytest.raises(KeyError, match="layers.1.self_attn.qkv_proj"):
        load_quantized(DecoderLM(DecoderConfig.from_dir(model_dir), 64), model_dir, "int4", 32, None)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_projections_quantized_as_they_load_equal_the_whole_fp32_model_s(family, dtype, tmp_path, monkeypatch):
    """load_quantized quantizes each projection once all its shards (q, k, v; gate, up) are in and frees its fp32
    weight: the codes equal those of the whole loaded model's weights; a second load takes them from the cache
    and reads no projection weight at all."""
    from tokenrouter.models import decoder
    from tokenrouter.models.decoder import DecoderConfig, DecoderLM, load_weights
    from tokenrouter.models.prepare import load_quantized, quantize

    model_dir = build_tiny_model_dir(family)
    cfg = DecoderConfig.from_dir(model_dir)
    whole = DecoderLM(cfg, 64)
    load_weights(whole, model_dir)
    expected = {name: to_tensors(name, quantize(m.weight, dtype, 32))
                for name, m in whole.named_modules() if isinstance(m, Linear)}
    cache = tmp_path / "codes.safetensors"
    read: list[str] = []
    reader_read = SafetensorsReader.read
    monkeypatch.setattr(decoder.SafetensorsReader, "read",
                        lambda self, name, out=None: read.append(name) or reader_read(self, name, out))
    for attempt in ("quantized", "cached"):
        read.clear()
        model = DecoderLM(cfg, 64)
        codes = load_quantized(model, model_dir, dtype, 32, cache)
        assert set(codes) == set(expected)
        for name, q in codes.items():
            got = to_tensors(name, q)
            assert all(torch.equal(got[k], v) for k, v in expected[name].items()), (attempt, name)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.weight.numel() == 0 for m in linears)
        assert torch.equal(model.embed_tokens.weight, whole.embed_tokens.weight)
        projections = [n for n in read if n.endswith("_proj.weight") or n == "lm_head.weight"]
        assert read, "the spy saw no read"
        assert projections if attempt == "quantized" else not projections


@pytest.mark.parametrize("source, record", [("embedded:qwen2.5-coder-1.5b-instruct", "int4-a8")])
def test_auto_int4_binds_its_projections_to_the_kernels_of_its_record(source, record, tmp_path):
    """`dtype: auto` chose int4 on the agreement one arithmetic of ours measured (one int8 digit per activation
    for the 1.5B), so its projections take that arithmetic's kernels even where another would time faster; a
    model asked for int4 by name keeps every candidate."""
    from tokenrouter.engine.model_runner import auto_kernels
    from tokenrouter.models.calibration import OUR_INT4, our_int4_built
    from tokenrouter.models.decoder import DecoderConfig, DecoderLM
    from tokenrouter.models.prepare import load_quantized, prepare_linears

    if not our_int4_built():
        pytest.skip("none of our int4 kernels builds on this machine")
    auto = ModelSpec(name="m", source=source, dtype="auto")
    assert auto_kernels(auto, "int4") == OUR_INT4[record]
    assert auto_kernels(auto, "int8") == ()
    assert auto_kernels(ModelSpec(name="m", source="tiny:qwen2", dtype="int4"), "int4") == ()
    assert auto_kernels(ModelSpec(name="m", source="tiny:qwen2", dtype="auto", kernel="int4-bf16"), "int4") == ()
    model_dir = build_tiny_model_dir("qwen2")
    model = DecoderLM(DecoderConfig.from_dir(model_dir), 64)
    codes = load_quantized(model, model_dir, "int4", 32, None)
    choice = prepare_linears(model, "int4", torch.float32, 32, KernelChoice(path=tmp_path / "k.json"), codes,
                             only=OUR_INT4[record])
    assert {entry["kernel"] for entry in choice.used.values()} <= set(OUR_INT4[record])


def test_one_digit_kernels_run_only_where_asked_for(tmp_path):
    """int4 asked for by name times weight-only kernels alone: the one-digit kernels (8-bit activations) run where
    named, or where `dtype: auto` chose on their record (above), never because they timed fastest."""
    from tokenrouter.models.calibration import OUR_INT4
    from tokenrouter.models.decoder import DecoderConfig, DecoderLM
    from tokenrouter.models.prepare import load_quantized, prepare_linears

    model_dir = build_tiny_model_dir("qwen2")
    one_digit = set(OUR_INT4["int4-a8"])
    for forced in ["", *(k for k in one_digit if k in candidates("int4", torch.zeros(4, 32), None,
                                                                  quantize_int4(torch.zeros(4, 32), 32)))]:
        model = DecoderLM(DecoderConfig.from_dir(model_dir), 64)
        codes = load_quantized(model, model_dir, "int4", 32, None)
        choice = prepare_linears(model, "int4", torch.float32, 32, KernelChoice(path=tmp_path / "k.json",
                                                                                forced=forced), codes)
        used = {entry["kernel"] for entry in choice.used.values()}
        assert used == {forced} if forced else not used & one_digit, (forced, used)
        if not forced:
            assert all(not set(e.get("candidates", [])) & one_digit for e in choice.used.values())


def test_map_on_cores_keeps_order_and_leaves_torch_s_threads_as_they_were():
    """The int4 fit's blocks run one per thread, each thread's ops on one intra-op thread; afterwards this thread
    and any new one step on torch's thread count as before (a thread's set_num_threads reaches threads made later)."""
    import threading

    from tokenrouter.models.quant import map_on_cores

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        got = map_on_cores(lambda i: seen.append(torch.get_num_threads()) or i * i, range(40))
        assert got == [i * i for i in range(40)] and set(seen) == {1}
        fresh = []
        thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert torch.get_num_threads() == 2 and fresh == [2]
    finally:
        torch.set_num_threads(before)
