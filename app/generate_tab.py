"""Routed generation: a chat prompt through one policy, streamed with every token coloured by the model
that wrote it, and live tokens/s, TTFT, large-model share, hand-offs, elapsed time and cost; Stop aborts it
and shows what was written, its token records and its cost so far."""
from __future__ import annotations

from contextlib import aclosing

import gradio as gr

from app.controls import policy_controls, sampling_controls, stop_control
from app.errors import user_message
from app.live import LiveRequest
from app.policies import resolve
from app.pricing import prompt_tokens
from app.render import message_html, metrics_html, tokens_html
from app.stream import run_stream, throttled


def build(service, models: list[str], policy: str) -> None:
    """The tab's components and events (call inside a gr.Tab), starting at policy spec `policy`."""
    with gr.Row():
        with gr.Column(scale=3):
            prompt = gr.Textbox(label="Prompt (sent as a user chat message)", lines=5, elem_id="prompt",
                                placeholder="Write a Python function that reverses a list.")
            with gr.Row():
                button = gr.Button("Generate", variant="primary", elem_id="generate")
                stop = gr.Button("Stop", variant="stop", elem_id="generate-stop")
        with gr.Column(scale=2):
            controls = policy_controls("Policy", policy, "generate")
            max_tokens, temperature = sampling_controls("generate")
    metrics = gr.HTML(elem_id="generate-metrics")
    output = gr.HTML(elem_id="generate-output")
    with gr.Accordion("Token records (provenance)", open=False):
        records = gr.JSON(elem_id="generate-records")
    running = gr.State({})  # this page's request, for the Stop button

    async def generate(prompt_text, policy, params, threshold, max_tokens, temperature, state):
        try:
            spec, policy_obj = resolve(policy, params, threshold)
            if not prompt_text or not prompt_text.strip():
                raise ValueError("prompt: type a prompt first")
        except ValueError as e:
            gr.Warning(user_message(e))
            yield "", message_html(user_message(e)), None
            return
        request = LiveRequest(models, policy_obj, prompt_tokens(service, prompt_text), spec)
        state["requests"] = [request]
        sampling = {"max_tokens": int(max_tokens), "temperature": float(temperature)}
        async with aclosing(throttled(run_stream(service, prompt_text, spec, request, **sampling))) as updates:
            async for _ in updates:
                yield tokens_html(request), metrics_html(request), gr.skip()
        if request.error:
            gr.Warning(request.error)
        yield shown([request])

    def shown(requests: list[LiveRequest]) -> tuple:
        request, = requests
        return (tokens_html(request), metrics_html(request),
                {"policy": request.spec, **request.summary(), "records": request.provenance()})

    inputs = [prompt, *controls.inputs, max_tokens, temperature, running]
    events = [button.click(generate, inputs, [output, metrics, records], api_name="generate"),
              prompt.submit(generate, inputs, [output, metrics, records], api_name=False)]
    stop_control(stop, running, events, [output, metrics, records], shown, service, api_name="generate_stop")
