"""Committed notebooks are clean (no saved widget state, no widget views, no progress-bar streams, each under
1 MB; notebooks/save.py), and its cleaning keeps what a reader wants: text, tables, figures with their PNGs."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("notebook_save", ROOT / "notebooks" / "save.py")
save = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(save)

WIDGET = {save.WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0}, "text/plain": "HBox()"}
FIGURE = {"application/vnd.plotly.v1+json": {"data": [], "layout": {}}, "image/png": "iVBORw0KGgo="}


def noisy_notebook() -> nbformat.NotebookNode:
    bar = ["\n", "\rall-small answering:   0%|          | 0/24 [00:00<?, ?req/s]", "\x1b[A", "\n",
           "\rall-small answering: 100%|██████████| 24/24 [01:15<00:00,  3.15s/req, tok/s=62.5]", "\x1b[A", "\n"]
    outputs = [new_output("display_data", data=WIDGET),
               *[new_output("stream", name="stderr", text=t) for t in bar],
               new_output("stream", name="stderr", text="WARNING: a real warning\n"),
               new_output("stream", name="stdout", text="9375 positions\n"),
               new_output("display_data", data=FIGURE)]
    nb = new_notebook(cells=[new_code_cell("run()", outputs=outputs)])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"abc": {}}}}
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_is_clean(path):
    found = save.problems(nbformat.read(path, as_version=4), path.stat().st_size)
    assert not found, f"{path.name}: {found}; run `python notebooks/save.py {path.relative_to(ROOT)}`"


def test_check_finds_widget_state_widget_views_progress_bars_and_size():
    nb = noisy_notebook()
    found = save.problems(nb)
    assert "saved widget state (metadata.widgets)" in found
    assert "code cell 0: a widget view" in found and "code cell 0: progress-bar output in stderr" in found
    assert any("limit" in f for f in save.problems(nb, size=save.MAX_BYTES + 1))


def test_clean_keeps_text_warnings_and_figures():
    nb = save.clean(noisy_notebook())
    assert save.problems(nb) == []
    outputs = nb.cells[0].outputs
    assert [(o.output_type, o.get("name")) for o in outputs] == [
        ("stream", "stderr"), ("stream", "stdout"), ("display_data", None)]
    assert outputs[0].text == "WARNING: a real warning\n" and outputs[1].text == "9375 positions\n"
    assert set(outputs[2].data) == set(FIGURE)


def test_clean_leaves_a_clean_notebook_as_it_was():
    nb = save.clean(noisy_notebook())
    again = nbformat.writes(save.clean(nbformat.reads(nbformat.writes(nb), as_version=4)))
    assert again == nbformat.writes(nb)


def test_check_command_exits_1_on_a_noisy_notebook(tmp_path, capsys):
    path = tmp_path / "noisy.ipynb"
    nbformat.write(noisy_notebook(), path)
    assert save.main(["--check", str(path)]) == 1
    assert save.main([str(path)]) == 0 and save.main(["--check", str(path)]) == 0
    assert "clean" in capsys.readouterr().out
