"""`bench runner` on a CPU, end to end on the tiny pair: decode steps and `--prefill`'s prompts (a prompt longer
than the config's max_num_batched_tokens prefilled in chunks, as the engine sends it), beside transformers."""
from __future__ import annotations

import json

from tokenrouter.bench.__main__ import main as bench


def test_runner_times_prefills_beside_transformers(tmp_path, capsys):
    out = tmp_path / "runner.json"
    bench(["runner", "--config", "config/tiny/pair.yaml", "--models", "small", "--batch", "1", "--steps", "1",
           "--no-llama-cpp", "--prefill", "7,300", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(r["model"], r["prompt"]) for r in result["prefill"]] == [("small", 7), ("small", 300)]
    for row in result["prefill"]:
        assert list(row["ours"]) == ["float32"] and row["ours"]["float32"]["ms"] > 0 and row["hf_ms"] > 0
    assert [(r["model"], r["batch"]) for r in result["results"]] == [("small", 1)]
    printed = capsys.readouterr().out
    assert "| small | 300 |" in printed and "prefill, ms from an empty cache" in printed
