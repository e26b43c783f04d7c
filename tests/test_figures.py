"""tokenrouter/figures.py: a shown figure carries the interactive plotly JSON and a PNG; without kaleido or
Chromium it stays interactive, with one warning."""
from __future__ import annotations

import base64
import importlib.util
import shutil
import warnings

import nbformat
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from tokenrouter import figures

STATIC = importlib.util.find_spec("kaleido") is not None and shutil.which("chromium") is not None


@pytest.mark.skipif(not STATIC, reason="needs kaleido and Chromium")
def test_a_figure_bundle_holds_the_interactive_figure_and_its_png():
    b = figures.bundle(go.Figure(go.Scatter(x=[1, 2], y=[2, 1])))
    assert b[figures.PLOTLY]["data"][0]["x"] == [1, 2]
    assert base64.b64decode(b[figures.PNG]).startswith(b"\x89PNG")


def test_without_a_renderer_the_figure_is_interactive_only_with_one_warning(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no Chrome")

    monkeypatch.setattr(pio, "to_image", fail)
    renderer = figures.InteractiveAndStatic()
    with pytest.warns(UserWarning, match="interactive only"):
        b = renderer.to_mimebundle(go.Figure().to_dict())
    assert figures.PLOTLY in b and figures.PNG not in b
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        renderer.to_mimebundle(go.Figure().to_dict())


def test_use_makes_it_the_default_renderer():
    before = pio.renderers.default
    try:
        figures.use()
        assert pio.renderers.default == figures.NAME
    finally:
        pio.renderers.default = before


@pytest.mark.skipif(not STATIC, reason="needs kaleido and Chromium")
def test_add_images_fills_in_the_plotly_outputs_of_an_older_notebook():
    fig = go.Figure(go.Bar(y=[1, 3])).to_plotly_json()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("fig.show()", outputs=[
        nbformat.v4.new_output("display_data", data={figures.PLOTLY: fig})])])
    assert figures.add_images(nb) == 1 and figures.PNG in nb.cells[0].outputs[0]["data"]
    assert figures.add_images(nb) == 0
