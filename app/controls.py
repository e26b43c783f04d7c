"""Reusable control groups: a policy (dropdown, threshold slider, other parameters) and sampling."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from app.live import LiveRequest
from app.policies import PolicyInfo, names, policy_info
from tokenrouter.policies import split_policy

from tokenrouter.demo import DEFAULT_MAX_TOKENS  # the terminal demo's default too


@dataclass
class PolicyControls:
    policy: gr.Dropdown
    params: gr.Textbox
    threshold: gr.Slider

    @property
    def inputs(self) -> list:
        """In the order `app.policies.resolve` takes them."""
        return [self.policy, self.params, self.threshold]


def policy_controls(label: str, spec: str, key: str) -> PolicyControls:
    """A policy dropdown (every registered policy, its level in the label) starting at `spec` ("name" or
    "name:key=value,..."); choosing a policy resets the threshold slider (shown for policies with a
    numeric threshold) and the parameter box to its defaults."""
    name, given = split_policy(spec)
    info = policy_info(name)
    choices = [(f"{n} ({policy_info(n).level}-level)", n) for n in names()]
    policy = gr.Dropdown(choices, value=name, label=label, allow_custom_value=True, elem_id=f"{key}-policy")
    threshold = gr.Slider(**_threshold_range(info, given), step=0.01,
                          label="Threshold", visible=info.has_threshold, elem_id=f"{key}-threshold")
    params = gr.Textbox(info.params_text(given), label="Other parameters (key=value, comma-separated)",
                        info=_optional(info), elem_id=f"{key}-params")
    policy.change(_reset, policy, [threshold, params], show_progress="hidden", api_name=False)
    return PolicyControls(policy, params, threshold)


def sampling_controls(key: str) -> tuple[gr.Slider, gr.Slider]:
    max_tokens = gr.Slider(1, 2048, value=DEFAULT_MAX_TOKENS, step=1, label="Max tokens", elem_id=f"{key}-max-tokens")
    temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0: greedy)", elem_id=f"{key}-temperature")
    return max_tokens, temperature


def stop_control(button: gr.Button, running: gr.State, events: list, outputs: list,
                 shown: Callable[[list[LiveRequest]], tuple], service, api_name: str) -> None:
    """Wire a Stop button: it cancels the page's running `events` and stops the requests they registered in
    `running` (the session's {"requests": [LiveRequest, ...]}); leaving their streams aborts them in the
    engine and frees their blocks in every model. `outputs` then show `shown(requests)`: the answers so far,
    metrics saying "stopped" with the cost so far (estimated from the records), the token records."""
    async def stop(state: dict):
        requests: list[LiveRequest] = state.get("requests", [])
        if not requests:
            return tuple(gr.skip() for _ in outputs)
        for request in requests:
            request.stop()
            request.price_stopped(service)
        return shown(requests)

    button.click(stop, running, outputs, cancels=events, concurrency_limit=None, api_name=api_name)


def _reset(spec: str):
    """A typed spec ("schedule:every=2") keeps its values; a chosen name gets its defaults."""
    try:
        name, given = split_policy(spec)
        info = policy_info(name)
    except ValueError as e:
        gr.Warning(str(e))
        return gr.skip(), gr.skip()
    return (gr.update(**_threshold_range(info, given), visible=info.has_threshold),
            gr.update(value=info.params_text(given), info=_optional(info)))


def _optional(info: PolicyInfo) -> str | None:
    return f"optional: {', '.join(info.optional)}" if info.optional else None


def _threshold_range(info: PolicyInfo, given: dict) -> dict:
    """The slider at the given threshold, else the default, in a probability-like range; a policy whose
    default is above 1 (an entropy in nats, say) gets room up to twice its default."""
    default = float(info.defaults["threshold"]) if info.has_threshold else 0.5
    return {"minimum": 0.0, "maximum": 1.0 if default <= 1 else 2 * default, "value": given.get("threshold", default)}
