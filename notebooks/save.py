"""Execute and save the notebooks without noise: no saved widget state, no widget views, no progress bars.

    python notebooks/save.py --execute notebooks/02_token_vs_query_pilot.ipynb   # run top to bottom, save clean
    python notebooks/save.py notebooks/*.ipynb                                  # clean the saved outputs only
    python notebooks/save.py --check notebooks/*.ipynb                          # exit 1 if any is noisy

`TOKENROUTER_CONFIG` picks the model pair as in the notebooks themselves. A committed notebook keeps its text,
tables and figures (each plotly figure with its PNG); widget state (a FigureWidget's saved state ran to 5 MB)
and tqdm progress lines (thousands per sweep) are dropped, and each file stays under MAX_BYTES.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

MAX_BYTES = 1_000_000
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# A tqdm bar ("desc:  42%|████▏ | 10/24 [00:35<00:58, ...]") or its closing line, and the cursor moves of nested bars.
PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\[\d+:\d\d(?::\d\d)?<\d+:\d\d")
CURSOR = re.compile(r"\x1b\[\d*[ABCDEFGJK]")


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop widget state and widget views, and progress bars from stream outputs, in place; returns `nb`."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = _clean_outputs(cell.outputs)
    return nb


def problems(nb: nbformat.NotebookNode, size: int | None = None) -> list[str]:
    """What makes a saved notebook noisy: widget state, widget views, progress bars, its size in bytes."""
    found = []
    if "widgets" in nb.metadata:
        found.append("saved widget state (metadata.widgets)")
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        for output in cell.get("outputs", []):
            if WIDGET_VIEW in output.get("data", {}):
                found.append(f"code cell {i}: a widget view")
            if output.get("output_type") == "stream" and _noisy(output.text):
                found.append(f"code cell {i}: progress-bar output in {output.name}")
    size = len(nbformat.writes(nb).encode()) if size is None else size
    if size > MAX_BYTES:
        found.append(f"{size:,} bytes (limit {MAX_BYTES:,})")
    return list(dict.fromkeys(found))  # a cell's hundreds of bar pieces: one line


def execute(path: Path) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=None, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def _clean_outputs(outputs: list) -> list:
    kept: list = []
    for output in outputs:
        if WIDGET_VIEW in output.get("data", {}):
            continue
        if output.get("output_type") == "stream":
            if kept and kept[-1].get("output_type") == "stream" and kept[-1].name == output.name:
                kept[-1].text += output.text  # a bar's pieces arrive as many small outputs: judge them joined
                continue
            output.text = str(output.text)
        kept.append(output)
    for output in kept:
        if output.get("output_type") == "stream":
            output.text = _without_progress(output.text)
    return [o for o in kept if o.get("output_type") != "stream" or o.text.strip()]


def _without_progress(text: str) -> str:
    """The lines a reader wants: what a terminal would show of each line, less the progress bars."""
    lines = []
    for raw in CURSOR.sub("", text).split("\n"):
        line = raw.rsplit("\r", 1)[-1]
        if PROGRESS.search(line) or ("\r" in raw and not line.strip()):
            continue
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines).lstrip("\n"))


def _noisy(text: str) -> bool:
    return "\r" in text or bool(CURSOR.search(text)) or any(PROGRESS.search(line) for line in text.split("\n"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python notebooks/save.py", description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="+", type=Path, help="notebook files (.ipynb)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--execute", action="store_true", help="run each notebook top to bottom first, then save it clean")
    mode.add_argument("--check", action="store_true", help="change nothing; exit 1 if any notebook is noisy")
    args = p.parse_args(argv)
    failed = False
    for path in args.notebooks:
        if args.check:
            found = problems(nbformat.read(path, as_version=4), path.stat().st_size)
            failed |= bool(found)
            print(f"{path}: {'; '.join(found) if found else 'clean'}")
            continue
        nb = clean(execute(path) if args.execute else nbformat.read(path, as_version=4))
        nbformat.write(nb, path)
        found = problems(nb, path.stat().st_size)
        failed |= bool(found)
        print(f"{path}: saved, {path.stat().st_size:,} bytes" + (f"; still {'; '.join(found)}" if found else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
