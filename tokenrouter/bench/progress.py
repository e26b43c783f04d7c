"""Progress of long commands on stderr, so the JSON lines and tables on stdout stay clean: a tqdm bar per
policy or concurrency level with requests done, output tokens/s so far and the time left. Shown whether or
not stderr is a terminal (a log file of a long run then says how far it got)."""
from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from tokenrouter.service.output import RoutedOutput


def bar(total: int, desc: str, unit: str = "req", iterable=None) -> tqdm:
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


class Requests:
    """A bar of finished requests whose postfix is the output tokens/s of those finished so far."""

    def __init__(self, total: int, desc: str):
        self.bar = bar(total, desc)
        self.tokens = 0
        self.failed = 0
        self.start = time.perf_counter()

    def done(self, tokens: int, failed: bool = False) -> None:
        self.tokens += tokens
        self.failed += failed
        seconds = time.perf_counter() - self.start
        postfix = {"tok/s": f"{self.tokens / seconds:.1f}" if seconds > 0 else "-"}
        if self.failed:
            postfix["failed"] = self.failed
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Requests:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate_batch(svc, requests: list, concurrency: int, desc: str, bar: Requests | None = None,
                   **common: Any) -> list[RoutedOutput]:
    """`svc.generate_batch(requests, concurrency, **common)` on an in-process Service, with a bar: the same
    requests (each a prompt or a dict of generate() arguments, all validated before the first is sent), at
    most `concurrency` in flight on the engine's loop, outputs in request order, a request the engine
    refused coming back with `finish_reason == "error"`. `bar`: count on this one (left open) instead."""
    progress = bar or Requests(len(requests), desc)
    try:
        return svc.generate_batch(requests, concurrency,
                                  on_output=lambda out: progress.done(len(out.tokens), bool(out.error)), **common)
    finally:
        if bar is None:
            progress.close()
