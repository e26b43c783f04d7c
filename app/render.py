"""HTML for a live request: the tokens coloured by model (the library's `render_html`, shared with the
notebook view) and a metrics strip."""
from __future__ import annotations

import html
import math

from app.live import LiveRequest
from tokenrouter.service.output import render_html

STATUS = "<div class='tr-status' style='font-size:0.9em;color:#555'>{}</div>"
ERROR = "<div class='tr-error' style='color:#b00020;font-weight:600'>{}</div>"


def tokens_html(request: LiveRequest) -> str:
    return render_html(request.records, request.models)


def metrics_html(request: LiveRequest) -> str:
    s = request.summary()
    counts = ", ".join(f"{html.escape(m)} {n}" for m, n in s["tokens_per_model"].items())
    items = [f"<b>{s['tokens']}</b> tokens ({counts})", f"{s['tokens_per_s']:.1f} tokens/s",
             f"TTFT {_ms(s['ttft_ms'])}", f"large share {s['large_share']:.0%}", f"hand-offs {s['handoffs']}",
             _time(request, s['latency_s']), f"cost {dollars(s['cost'])}", f"<i>{html.escape(s['finish'])}</i>"]
    corrections = sum(r.correction for r in request.records)
    verified = sum(r.verified for r in request.records)
    tolerated = sum(r.tolerated for r in request.records)
    if verified or corrections:  # a verifying policy: drafts the large model kept, and its corrections
        items.insert(5, f"verified {verified} &middot; corrections {corrections}"
                        + (f" &middot; tolerated {tolerated}" if tolerated else ""))
    strip = "<div class='tr-metrics' style='font-size:0.9em'>" + " &middot; ".join(items) + "</div>"
    return strip + (ERROR.format(html.escape(request.error)) if request.error else "")


def message_html(text: str, error: bool = True) -> str:
    return (ERROR if error else STATUS).format(html.escape(text))


def dollars(value: float | None) -> str:
    """Small dollar amounts readably: $0.0123, $1.2e-06; a dash while unknown."""
    if value is None or math.isnan(value):
        return "&ndash;"
    return f"${value:.4f}" if value >= 1e-3 or value == 0 else f"${value:.2e}"


def _time(request: LiveRequest, seconds: float) -> str:
    """The elapsed time while the request runs (redrawn even while no token arrives), its latency after."""
    return f"elapsed {seconds:.1f} s" if request.running else f"latency {seconds:.2f} s"


def _ms(value: float) -> str:
    return "&ndash;" if math.isnan(value) else f"{value:.0f} ms"
