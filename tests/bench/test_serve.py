"""`bench serve` and `bench sweep` end to end on the tiny pair: a bar per level (engine and baselines) on
stderr, the machine line above the table, the machine in the JSON."""
from __future__ import annotations

import json

import pytest

from tokenrouter.bench.__main__ import main

PAIR = "config/tiny/pair.yaml"


def machine_above_table(out: str, header: str) -> bool:
    lines = [line for line in out.splitlines() if line.strip()]
    return any(a.startswith("machine: ") and b.startswith(header) for a, b in zip(lines, lines[1:]))


@pytest.mark.parametrize("command, extra, header, bars", [
    ("serve", ["--baselines", "lockstep,per-request", "--concurrency", "1,2"], "| placement | C |",
     ["engine C=1", "engine C=2", "lockstep C=2", "per-request loop"]),
    ("sweep", ["--concurrency", "2", "--tau-ms", "0,auto"], "|   concurrency |", ["C=2 tau 0 ms", "C=2 tau auto"]),
])
def test_levels_show_bars_and_the_run_records_its_machine(command, extra, header, bars, tmp_path, capsys):
    out = tmp_path / "out.json"
    main([command, "--config", PAIR, "--policy", "schedule:2", "--requests", "3", "--max-tokens", "4",
          "--json", str(out), *extra])
    printed = capsys.readouterr()
    for desc in bars:
        assert f"{desc}: 100%" in printed.err and "3/3" in printed.err, desc
    assert machine_above_table(printed.out, header), printed.out
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1 and result["results"]
