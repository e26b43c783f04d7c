"""Side by side: the same prompt through a query-level router and a token-level policy at once, both
coloured by model, each with latency, tokens/s, large-model share and cost, and one line under the answers
saying which was cheaper and faster; Stop aborts both."""
from __future__ import annotations

from contextlib import aclosing

import gradio as gr

from app.controls import policy_controls, sampling_controls, stop_control
from app.errors import user_message
from app.live import LiveRequest
from app.policies import default_choice, names, resolve
from app.pricing import prompt_tokens
from app.render import comparison_html, message_html, metrics_html, tokens_html
from app.stream import run_together, throttled

SIDES = (("left", "Query-level router"), ("right", "Token-level policy"))


def build(service, models: list[str], token_policy: str) -> None:
    """The tab's components and events (call inside a gr.Tab); the right side starts at `token_policy`."""
    if not names("query"):
        gr.Markdown("No query-level router is registered yet: pick any two policies.")
    prompt = gr.Textbox(label="Prompt (sent as a user chat message)", lines=3, elem_id="sbs-prompt")
    with gr.Row():
        max_tokens, temperature = sampling_controls("sbs")
    with gr.Row():
        button = gr.Button("Run both", variant="primary", elem_id="sbs-run")
        stop = gr.Button("Stop", variant="stop", elem_id="sbs-stop")
    running = gr.State({})  # this page's two requests, for the Stop button
    # NOTE: controls, metrics and answers each get their own row, so both answers start at the same height
    # whatever the controls (a threshold slider on one side only) or the metrics strips' wrapping.
    starts = {"left": default_choice("query", "all-small"), "right": token_policy}
    with gr.Row():
        controls = []
        for key, label in SIDES:
            with gr.Column():
                controls.append(policy_controls(label, starts[key], key))
    with gr.Row(equal_height=True):
        metrics = [gr.HTML(elem_id=f"{key}-metrics") for key, _ in SIDES]
    with gr.Row(equal_height=True):
        answers = [gr.HTML(elem_id=f"{key}-output") for key, _ in SIDES]
    comparison = gr.HTML(elem_id="sbs-comparison")

    async def run_both(prompt_text, left_policy, left_params, left_threshold, right_policy, right_params,
                       right_threshold, max_tokens, temperature, state):
        try:
            if not prompt_text or not prompt_text.strip():
                raise ValueError("prompt: type a prompt first")
            specs = [resolve(left_policy, left_params, left_threshold),
                     resolve(right_policy, right_params, right_threshold)]
        except ValueError as e:
            gr.Warning(user_message(e))
            yield message_html(user_message(e)), "", "", "", ""
            return
        n_prompt = prompt_tokens(service, prompt_text)
        requests = [LiveRequest(models, policy, n_prompt, spec) for spec, policy in specs]
        state["requests"] = requests
        jobs = [(spec, request) for (spec, _), request in zip(specs, requests)]
        sampling = {"max_tokens": int(max_tokens), "temperature": float(temperature)}
        async with aclosing(throttled(run_together(service, prompt_text, jobs, **sampling))) as updates:
            async for _ in updates:
                yield shown(requests)
        for r in requests:
            if r.error:
                gr.Warning(r.error)

    def shown(requests: list[LiveRequest]) -> tuple:
        return (*(html for r in requests for html in (metrics_html(r), tokens_html(r))), comparison_html(requests))

    inputs = [prompt, *controls[0].inputs, *controls[1].inputs, max_tokens, temperature, running]
    outputs = [metrics[0], answers[0], metrics[1], answers[1], comparison]
    event = button.click(run_both, inputs, outputs, api_name="side_by_side")
    stop_control(stop, running, [event], outputs, shown, service, api_name="side_by_side_stop")
