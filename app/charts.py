"""Plotly charts of pilot rows: quality against cost, throughput against concurrency, latency percentiles.
A policy has one colour in every chart (`policy_colours`), whichever of them it has points in."""
from __future__ import annotations

import math
from collections import defaultdict

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.pilot import quality

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
COST_KEYS = ("cost_per_completed", "cost_per_request")


def by_policy(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r["concurrency"]):
        groups[str(row["policy"])].append(row)
    return dict(groups)


def policy_colours(rows: list[dict]) -> dict[str, str]:
    return {policy: _palette(k) for k, policy in enumerate(by_policy(rows))}


def quality_cost(rows: list[dict], colours: dict[str, str] | None = None) -> go.Figure:
    """pass@1 against dollars per completed task, one point per policy and concurrency."""
    colours = colours or policy_colours(rows)
    fig = go.Figure()
    cost_key = next((k for k in COST_KEYS if any(_number(r.get(k)) for r in rows)), None)
    for policy, group in by_policy(rows).items():
        points = [(r[cost_key], quality(r), r["concurrency"]) for r in group
                  if cost_key and _number(r.get(cost_key)) and quality(r) is not None]
        if points:
            x, y, c = zip(*points)
            fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=policy, text=[f"C={v}" for v in c],
                                     marker={"size": 11, "color": colours[policy]}))
    if not fig.data:
        _empty(fig, "These results carry no pass@1 and cost: run a quality benchmark to see this chart.")
    label = "dollars per completed task" if cost_key == "cost_per_completed" else "dollars per request"
    fig.update_xaxes(tickprefix="$")
    return fig.update_layout(title="Quality against cost", xaxis_title=label, yaxis_title="pass@1",
                             template="plotly_white", height=380)


def throughput(rows: list[dict], colours: dict[str, str] | None = None) -> go.Figure:
    colours = colours or policy_colours(rows)
    fig = go.Figure()
    for policy, group in by_policy(rows).items():
        fig.add_trace(go.Scatter(x=[r["concurrency"] for r in group], y=[r["tokens_per_s"] for r in group],
                                 mode="lines+markers", name=policy, line={"color": colours[policy]}))
    return fig.update_layout(title="Throughput against concurrency", xaxis_title="concurrency",
                             yaxis_title="output tokens/s", template="plotly_white", height=380)


def latency_percentiles(rows: list[dict], colours: dict[str, str] | None = None) -> go.Figure:
    """p50 (solid) and p99 (dotted) of TTFT, TPOT, ITL and end-to-end latency against concurrency."""
    colours = colours or policy_colours(rows)
    fig = make_subplots(rows=1, cols=len(LATENCIES), subplot_titles=[label for _, label in LATENCIES])
    for policy, group in by_policy(rows).items():
        colour = colours[policy]
        for col, (key, _) in enumerate(LATENCIES, start=1):
            for q, dash in ((50, "solid"), (99, "dot")):
                ys = [r.get(f"{key}_p{q}_ms") for r in group]
                if not any(_number(y) for y in ys):
                    continue
                fig.add_trace(go.Scatter(x=[r["concurrency"] for r in group], y=ys, mode="lines+markers",
                                         name=f"{policy} p{q}", legendgroup=policy, showlegend=col == 1,
                                         line={"color": colour, "dash": dash}), row=1, col=col)
    fig.update_yaxes(title_text="ms", col=1)
    fig.update_xaxes(title_text="concurrency")
    return fig.update_layout(title="Latency percentiles (p50 solid, p99 dotted)", template="plotly_white",
                             height=400)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value) and not math.isinf(value)


def _palette(k: int) -> str:
    colours = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
    return colours[k % len(colours)]


def _empty(fig: go.Figure, text: str) -> None:
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
