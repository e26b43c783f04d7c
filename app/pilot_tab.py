"""Pilot: run a small sweep on this engine, or load saved results, and chart them."""
from __future__ import annotations

import json
import tempfile

import gradio as gr
import pandas as pd

from app import charts
from app.errors import user_message
from app.pilot import default_prompts, load_results, parse_levels, sweep
from app.policies import resolve
from app.pricing import rounded
from app.render import message_html

DEFAULT_POLICIES = "all-small\nconfidence:threshold=0.9\nrandom:share=0.3\nall-large"
TABLE_COLUMNS = ["policy", "concurrency", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
                 "large_share", "failed", "cost_per_request", "cost_per_completed", "pass@1"]


def build(service) -> None:
    """The tab's components and events (call inside a gr.Tab)."""
    with gr.Row():
        with gr.Column():
            gr.Markdown("**Run a sweep** on this engine: every policy at every concurrency on the same prompts.")
            policies = gr.Textbox(DEFAULT_POLICIES, lines=4, label="Policies (one spec per line)",
                                  elem_id="pilot-policies")
            levels = gr.Textbox("1,4", label="Concurrency levels", elem_id="pilot-levels")
            with gr.Row():
                prompts = gr.Number(8, precision=0, minimum=1, label="Prompts", elem_id="pilot-prompts")
                max_tokens = gr.Number(32, precision=0, minimum=1, label="Max tokens", elem_id="pilot-max-tokens")
            run = gr.Button("Run sweep", variant="primary", elem_id="pilot-run")
        with gr.Column():
            gr.Markdown("**Or load saved results**: JSON from `python -m tokenrouter.bench serve --json` or "
                        "`python -m tokenrouter.bench quality --json` (which carries pass@1), a list of such "
                        "runs, or a sweep saved here.")
            upload = gr.File(label="Results JSON", file_types=[".json"], type="filepath", elem_id="pilot-upload")
            saved = gr.File(label="This sweep as JSON", interactive=False, elem_id="pilot-saved")
    status = gr.HTML(elem_id="pilot-status")
    # NOTE: the table and charts stay hidden until there are results (an empty Dataframe shows "1 2 3" headers)
    with gr.Column(visible=False) as results:
        table = gr.Dataframe(label="Results", interactive=False, elem_id="pilot-table")
        quality = gr.Plot(label="Quality against cost")
        throughput = gr.Plot(label="Throughput against concurrency")
        latency = gr.Plot(label="Latency percentiles")
    views = [status, table, quality, throughput, latency, results]

    def run_sweep(policies_text, levels_text, n_prompts, n_tokens, progress=gr.Progress()):
        try:
            specs = [resolve(line.strip())[0] for line in policies_text.splitlines() if line.strip()]
            result = sweep(service, specs, parse_levels(levels_text), default_prompts(int(n_prompts or 0)),
                           int(n_tokens or 0), progress=lambda f, what: progress(f, desc=what))
        except Exception as e:  # noqa: BLE001 -- every failure becomes a message in the UI
            return *failed(e), gr.skip()
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="pilot-", delete=False) as f:
            json.dump(result, f, indent=2)
        return *shown(result["results"], f"Swept {len(specs)} policies x {len(result['results']) // len(specs)} "
                                         f"concurrency levels on {result['requests']} prompts."), f.name

    def load(path):
        if not path:
            return (gr.skip(),) * len(views)
        try:
            rows = load_results(path)
        except ValueError as e:
            return failed(e)
        return shown(rows, f"Loaded {len(rows)} result rows.")

    # one progress bar, on the status line (Gradio draws one on every output otherwise)
    run.click(run_sweep, [policies, levels, prompts, max_tokens], [*views, saved], api_name="pilot_sweep",
              show_progress_on=[status])
    upload.change(load, upload, views, api_name="pilot_load", show_progress_on=[status])


def shown(rows: list[dict], note: str) -> tuple:
    colours = charts.policy_colours(rows)
    return (message_html(note, error=False), table(rows), charts.quality_cost(rows, colours),
            charts.throughput(rows, colours), charts.latency_percentiles(rows, colours), gr.Column(visible=True))


def table(rows: list[dict]) -> pd.DataFrame:
    """The rows as the table shows them: its columns, each rounded to what it can tell (costs as the app writes
    them everywhere, app/pricing.py)."""
    frame = pd.DataFrame(rows)
    frame = frame[[c for c in TABLE_COLUMNS if c in frame.columns]]
    digits = {c: 1 if c == "tokens_per_s" else 3 for c in frame.columns
              if c not in ("policy", "concurrency", "failed") and not c.endswith("_ms") and not c.startswith("cost")}
    frame = frame.round(digits)
    for c in frame.columns:
        if c.endswith("_ms"):
            frame[c] = frame[c].round().astype("Int64")
        elif c.startswith("cost"):
            frame[c] = frame[c].map(rounded)
    return frame


def failed(error: Exception) -> tuple:
    message = user_message(error)
    gr.Warning(message)
    return message_html(message), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
