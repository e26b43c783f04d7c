"""Every figure of the committed, executed notebooks carries a static image: converted with nbconvert to HTML
(what repository viewers and readers without the plotly extension see), each figure cell shows an <img>.
No kernel, no browser: this reads the committed outputs."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from bs4 import BeautifulSoup
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"
# NOTE: at the top level of a cell: a figure shown inside a function (a button's callback) appears only when the
# reader clicks, and a top-level call that shows one leaves a plotly output, which counts below
MAKES_FIGURE = re.compile(r"^\S.*(\.show\(\)|FigureWidget\(|figures\.live\()", re.MULTILINE)


def figure_cells(nb) -> list[int]:
    """Indices among the code cells of those that make a figure: a plotly output, or source that shows one."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    return [i for i, c in enumerate(code)
            if MAKES_FIGURE.search(c.source) or any(PLOTLY in o.get("data", {}) for o in c.get("outputs", []))]


def has_image(cell_html) -> bool:
    return any(img.get("src", "").startswith(("data:image/png;base64,", "data:image/svg+xml"))
               for img in cell_html.find_all("img")) or cell_html.find("svg") is not None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_figure_has_a_static_image_in_html(path):
    nb = nbformat.read(path, as_version=4)
    html, _ = HTMLExporter().from_notebook_node(nb)
    cells = BeautifulSoup(html, "html.parser").select("div.jp-CodeCell")
    assert len(cells) == sum(c.cell_type == "code" for c in nb.cells)
    missing = [i for i in figure_cells(nb) if not has_image(cells[i])]
    assert not missing, f"code cells {missing} of {path.name} show a figure without a static image"


def test_a_figure_without_an_image_is_caught():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("fig.show()", outputs=[
        nbformat.v4.new_output("display_data", data={PLOTLY: {"data": [], "layout": {}}})])])
    html, _ = HTMLExporter().from_notebook_node(nb)
    cells = BeautifulSoup(html, "html.parser").select("div.jp-CodeCell")
    assert figure_cells(nb) == [0] and not has_image(cells[0])


def test_a_figure_shown_only_by_a_callback_needs_no_image_but_a_top_level_one_does():
    callback = "def on_click(_):\n    with out:\n        plot(frame).show()\n\nbutton.on_click(on_click)"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(callback),
                                         nbformat.v4.new_code_cell("plot(frame).show()")])
    assert figure_cells(nb) == [1]


def test_notebooks_with_figures_are_found():
    with_figures = {p.stem for p in NOTEBOOKS if figure_cells(nbformat.read(p, as_version=4))}
    assert {"02_token_vs_query_pilot", "03_delayed_batching", "04_train_a_router"} <= with_figures
