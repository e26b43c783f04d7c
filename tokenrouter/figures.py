"""Plotly figures that render everywhere: every `fig.show()` in a notebook carries the interactive figure
(`application/vnd.plotly.v1+json`, what JupyterLab draws) and a static PNG of it in the same output, so
`jupyter nbconvert --to html`, repository viewers and any reader without the plotly extension show it too.

    from tokenrouter import figures
    figures.use()                      # fig.show() now writes both
    live = figures.live(go.FigureWidget(...))   # a widget that fills in while a sweep runs ...
    live.finish()                      # ... then stands in the saved notebook as a figure with its image

`python -m tokenrouter.figures NOTEBOOK...` adds the PNG to the plotly outputs of notebooks executed before.

The PNG comes from kaleido (the `test` extra) driving a system Chromium (Debian's `chromium`, which `.ci/run`
installs). Where either is missing the figure is still shown, interactive only, with one warning naming why.
"""
from __future__ import annotations

import base64
import warnings

import plotly.graph_objects as go
import plotly.io as pio
from plotly.io._base_renderers import MimetypeRenderer, PlotlyRenderer

NAME = "tokenrouter"
PLOTLY = "application/vnd.plotly.v1+json"
PNG = "image/png"


class InteractiveAndStatic(MimetypeRenderer):
    """The plotly mimetype and a PNG of the same figure in one bundle (the PNG at `width` layout pixels unless
    the figure sets its own width, times `scale`)."""

    def __init__(self, width: int = 960, scale: float = 1.0):
        self.width, self.scale = width, scale
        self.warned = False

    def to_mimebundle(self, fig_dict: dict) -> dict:
        bundle = PlotlyRenderer().to_mimebundle(fig_dict)
        try:
            width = fig_dict.get("layout", {}).get("width") or self.width
            png = pio.to_image(fig_dict, format="png", width=width, scale=self.scale, validate=False)
        except Exception as e:  # no kaleido, no Chromium: the interactive figure alone
            if not self.warned:
                self.warned = True
                warnings.warn(f"figures are interactive only, without a static image: {type(e).__name__}: {e}. "
                              "Static images need kaleido (pip install -e '.[test]') and Chromium "
                              "(apt-get install chromium).", stacklevel=2)
            return bundle
        bundle[PNG] = base64.b64encode(png).decode("ascii")
        return bundle


def use(width: int = 960, scale: float = 1.0) -> None:
    """Make every `fig.show()` in this kernel write the interactive figure and its PNG."""
    pio.renderers[NAME] = InteractiveAndStatic(width, scale)
    pio.renderers.default = NAME


def bundle(fig: go.Figure | dict) -> dict:
    """The mime bundle `fig.show()` would display, for `display(bundle, raw=True)`."""
    renderer = pio.renderers[NAME] if NAME in pio.renderers else InteractiveAndStatic()
    fig_dict = fig if isinstance(fig, dict) else fig.to_dict()
    return renderer.to_mimebundle(fig_dict)


class LiveFigure:
    """A FigureWidget displayed where it can fill in live, and replaced by its final state as a plain figure
    (interactive and PNG) when `finish()` is called: a widget alone is blank outside a live kernel."""

    def __init__(self, widget: go.FigureWidget):
        from IPython.display import display

        self.widget = widget
        self.handle = display(widget, display_id=True)

    def finish(self) -> None:
        self.handle.update(bundle(go.Figure(self.widget)), raw=True)


def live(widget: go.FigureWidget) -> LiveFigure:
    return LiveFigure(widget)


def add_images(nb) -> int:
    """Give every plotly output of an executed notebook (an nbformat node) that lacks one its PNG, drawn from
    the figure the output already holds; returns how many it added. For notebooks executed before `use()`."""
    added = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY in data and PNG not in data:
                png = bundle(dict(data[PLOTLY])).get(PNG)
                if png:
                    data[PNG] = png
                    added += 1
    return added


if __name__ == "__main__":
    import sys

    import nbformat

    for path in sys.argv[1:]:
        notebook = nbformat.read(path, as_version=4)
        print(f"{path}: {add_images(notebook)} images added")
        nbformat.write(notebook, path)
