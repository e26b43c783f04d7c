"""Every notebook runs top to bottom on the tiny pair (TOKENROUTER_CONFIG), as a reader would run it, every
figure it shows carries a PNG where kaleido and Chromium are installed (CI: the test extra and .ci/run), and
the save step (notebooks/save.py) leaves its outputs without widget state or progress bars."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.notebooks.test_saved_notebooks import save

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"
STATIC_IMAGES = importlib.util.find_spec("kaleido") is not None and any(
    shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    monkeypatch.setenv("TOKENROUTER_CONFIG", "config/tiny/pair.yaml")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    figures = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
               if PLOTLY in o.get("data", {})]
    if STATIC_IMAGES:
        assert all("image/png" in o["data"] for o in figures)
    assert save.problems(save.clean(nb)) == []
