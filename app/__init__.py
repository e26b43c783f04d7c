"""The Gradio app: routed generation coloured per token, query-level vs token-level side by side, and
pilot charts. `python -m app`, or `svc.launch_app()` on a running engine."""
from __future__ import annotations

import gradio as gr

from app import generate_tab, pilot_tab, side_by_side_tab
from app.policies import starting_policy

TITLE = "TokenRouter Workbench"
CSS = ".tr-tok{border-radius:2px} #generate-output pre, #left-output pre, #right-output pre{font-size:0.95em}"


def build_app(service, policy: str | None = None) -> gr.Blocks:
    """The app's Blocks on a service: an in-process `tokenrouter.serve(...)` or a `tokenrouter.connect(url)`.
    `policy` is the spec the generation tab starts with (default: the engine config's policy)."""
    models = list(service.models)
    start = starting_policy(service, policy)
    with gr.Blocks(title=TITLE, analytics_enabled=False) as demo:
        gr.Markdown(f"## {TITLE}\nModels: {', '.join(f'`{m}`' for m in models)}. Every token is coloured by the "
                    "model that wrote it; hover a token for the router's score.")
        with gr.Tab("Routed generation", elem_id="tab-generate"):
            generate_tab.build(service, models, start)
        with gr.Tab("Side by side", elem_id="tab-side-by-side"):
            side_by_side_tab.build(service, models, start)
        with gr.Tab("Pilot", elem_id="tab-pilot"):
            pilot_tab.build(service)
    return demo


def launch(service, *, policy: str | None = None, concurrency: int = 16, **kwargs) -> gr.Blocks:
    """Build and launch the app; other keyword arguments go to `gr.Blocks.launch` (server_name,
    server_port, inline, prevent_thread_lock, ...). Up to `concurrency` events run at once: the engine
    batches them."""
    demo = build_app(service, policy)
    demo.queue(default_concurrency_limit=concurrency)
    demo.launch(css=CSS, **kwargs)
    return demo
