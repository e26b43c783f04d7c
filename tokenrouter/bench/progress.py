"""Progress of long commands and of a start on stderr, so the JSON lines and tables on stdout stay clean: a
tqdm bar per policy or concurrency level with requests done, output tokens/s so far and the time left; a line
per step of a start and one ready line. Shown whether or not stderr is a terminal (a log file of a long run
then says how far it got)."""
from __future__ import annotations

import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    from tokenrouter.service.output import RoutedOutput

LOG_INTERVAL = 5.0  # seconds between a bar's redraws when stderr is a file, not a terminal


def bar(total: int | None, desc: str, unit: str = "req", iterable=None, bar_format: str | None = None) -> tqdm:
    interval = 0.5 if sys.stderr.isatty() else LOG_INTERVAL
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                dynamic_ncols=True, mininterval=interval, bar_format=bar_format)


def step(what: str, total: int | None = None, unit: str = "it") -> tqdm:
    """One step of a start (assemble, verify, convert, quantize, time kernels, profile): its line is written to
    stderr before the step begins, so a start the system kills (the OOM killer) leaves in the log what it was
    doing; the line becomes a bar when `total` is known and shows the step's time when it closes."""
    return bar(total, f"[tokenrouter] {what}", unit, bar_format=None if total else "{desc} {elapsed}{postfix}")


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (this one by default); 0 where /proc cannot tell."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_port(host: str, port: int | None, tries: int = 100) -> int:
    """`port`, or the first free one from 7860 (as Gradio looks for one)."""
    if port:
        return port
    for candidate in range(7860, 7860 + tries):
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return candidate
    raise OSError(f"no free port in 7860..{7860 + tries - 1} on {host}")


def ready(service, host: str, port: int | None) -> int:
    """Print the one ready line of a start (each model's dtype, kernels and memory, the process's resident
    memory, the URL) and return the port the URL names."""
    port = free_port(host, port)
    print(ready_line(service, f"http://{host}:{port}"), file=sys.stderr, flush=True)
    return port


def ready_line(service, url: str = "") -> str:
    """The ready line of an in-process engine (a client of a server: its models, which load there)."""
    parts, pids = [], {os.getpid()}
    if not hasattr(service, "executors"):
        models = ", ".join(getattr(service, "models", []) or [])
        return f"[tokenrouter] ready: {models} on {getattr(service, 'url', 'a server')}" + (f"; {url}" if url else "")
    for name in service.models:
        executor = service.executors[name]
        runner = getattr(executor, "runner", None)  # a worker in this process
        info = executor.info
        pids.add(info.pid or os.getpid())
        if runner is None:
            parts.append(f"{name} {info.weight_bytes / 1e9:.1f} GB of weights (worker pid {info.pid})")
            continue
        kernels = f" [{runner.kernels.summary()}]" if runner.kernels is not None and runner.kernels.used else ""
        memory = (runner.weight_bytes + runner.kv_cache.nbytes) / 1e9
        parts.append(f"{name} {runner.weight_dtype}{kernels} {memory:.1f} GB")
    resident = sum(rss_bytes(pid) for pid in pids) / 1e9
    return f"[tokenrouter] ready: {'; '.join(parts)}; {resident:.1f} GB resident" + (f"; {url}" if url else "")


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
