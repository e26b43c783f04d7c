"""What a newcomer meets: the README demo command's install time from a fresh clone, then the app's first start
(assemble, convert, quantize, time kernels, profile steps) until its ready line, with its peak resident memory.

    python -m tokenrouter.bench first-start                  # first start here, on an empty cache
    python -m tokenrouter.bench first-start --install        # clone this checkout, run the README's install, then start

The first start runs `python -m app` (the README's demo) with a fresh cache directory (`TOKENROUTER_CACHE`, so
nothing converted, quantized or timed before counts), samples the resident memory of the app and its worker
processes every 50 ms, and stops the app once it prints its ready line. The kernel's own peak of each process
(`ru_maxrss`) is reported beside the sampled peak of them all together. NOTE: a child forked from the app (the
compiler of the native kernels) counts the app's resident pages as its own until it execs, so the sum can read
high for a moment; the app's `ru_maxrss` includes its children's peaks, each such a copy at most.
"""
from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tokenrouter.bench import write_json
from tokenrouter.bench.machine import announce
from tokenrouter.bench.progress import rss_bytes

REPO = Path(__file__).resolve().parents[2]
SAMPLE_SECONDS = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--install", action="store_true",
                   help="first clone this checkout into --workdir and time the README demo command's install there")
    p.add_argument("--workdir", default="", help="where the clone and its cache go (default: a new temporary dir)")
    p.add_argument("--cache", default="", help="the cache the start uses (default: an empty one under --workdir); "
                                               "a filled cache measures a later start instead")
    p.add_argument("--config", default="", help="start the app on this config (default: the app's own)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up on a start after this many seconds")
    p.add_argument("--json", default="")


def check_args(args: argparse.Namespace) -> None:
    if args.timeout <= 0:
        raise ValueError(f"--timeout: must be positive, got {args.timeout}")
    if args.config and not Path(args.config).is_file():
        raise ValueError(f"--config: no such file: {args.config}")


def readme_demo_command(readme: Path) -> str:
    """The README's demo command: the line of the code block after the `ci:demo` marker."""
    lines = readme.read_text().splitlines()
    try:
        at = lines.index("<!-- ci:demo -->")
    except ValueError:
        raise ValueError(f"{readme}: no <!-- ci:demo --> marker") from None
    return next(line for line in lines[at + 1:] if line.strip() and not line.startswith("```"))


def split_demo_command(command: str) -> tuple[str, list[str]]:
    """(the install part, the start's argv): the README's command ends `&& .venv/bin/python -m app`."""
    install, sep, start = command.rpartition("&&")
    if not sep or "-m app" not in start:
        raise ValueError(f"the README's demo command does not end with starting the app: {command!r}")
    return install.strip(), shlex.split(start)


def install(workdir: Path) -> tuple[Path, float, str]:
    """Clone this checkout into `workdir` and run the README's install there: (the clone, seconds, command)."""
    clone = workdir / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    command, _ = split_demo_command(readme_demo_command(clone / "README.md"))
    print(f"+ {command}", flush=True)
    start = time.perf_counter()
    subprocess.run(["bash", "-c", command], cwd=clone, check=True, stdout=subprocess.DEVNULL)
    return clone, time.perf_counter() - start, command


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (the worker processes of a process placement)."""
    found, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        found += children
        frontier += children
    return found


class Sampler(threading.Thread):
    """The peak of the summed resident memory of a process tree, sampled every SAMPLE_SECONDS, overall and per
    step of the start (`step` names the one under way: the last line the start printed)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.step, self.peaks = "(before the first step line)", {}

    def run(self) -> None:
        while not self.done.wait(SAMPLE_SECONDS):
            rss, step = sum(rss_bytes(p) for p in descendants(self.pid)), self.step
            self.peak = max(self.peak, rss)
            self.peaks[step] = max(self.peaks.get(step, 0), rss)


def first_start(cwd: Path, python: str, cache: Path, config: str, timeout: float) -> dict:
    """Start the app in `cwd`, on an empty `cache`, until its ready line; its time, steps and peak memory."""
    argv = [python, "-m", "app"]
    if config:
        argv += ["--config", config]
    env = {**os.environ, "TOKENROUTER_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    print(f"+ TOKENROUTER_CACHE={cache} {shlex.join(argv)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = Sampler(proc.pid)
    sampler.start()
    log, decoder = StartLog(), codecs.getincrementaldecoder("utf-8")(errors="replace")
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        while not log.ready and (chunk := os.read(proc.stderr.fileno(), 1 << 16)):
            log.feed(decoder.decode(chunk))
            if log.last:
                sampler.step = _step_key(log.last)
    finally:
        seconds = time.perf_counter() - start
        killer.cancel()
        sampler.done.set()
        sampler.join()
        # NOTE: signalled and reaped by pid: Popen.terminate() polls first, and a child it reaps has no rusage left
        os.kill(proc.pid, signal.SIGTERM)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if not log.ready:
        raise RuntimeError(f"the app ended (status {status}) before its ready line; last line: {log.last!r}")
    return {"seconds": seconds, "peak_bytes": sampler.peak, "step_peak_bytes": sampler.peaks,
            "app_maxrss_bytes": usage.ru_maxrss * 1024,
            "children_maxrss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "ready": log.ready, "steps": log.steps, "step_started_s": [t - start for t in log.started],
            "step_ended_s": [t - start for t in log.ended],
            "ready_s": log.ready_at - start, "command": shlex.join(argv)}


class StartLog:
    """A start's stderr as it arrives: the step under way (from the first draw of its line), each step's last
    state and when it was first and last drawn, and the ready line. NOTE: a progress bar redraws its line after
    a carriage return and ends it only when it closes, so the state drawn now is the text after the last line
    end (a bar writes each state whole); that text counts once it shows progress, so a line cut short never
    names a step. Steps may run side by side (two models converted at once, a build in the background): a
    line of a step already seen updates that step."""

    def __init__(self):
        self.tail, self.last, self.ready, self.steps = "", "", "", []
        self.started: list[float] = []  # perf_counter() at the first and the last sight of each step
        self.ended: list[float] = []
        self.ready_at = 0.0
        self._index: dict[str, int] = {}

    def feed(self, text: str) -> None:
        *done, self.tail = re.split(r"[\r\n]", self.tail + text)
        for segment in done + ([self.tail] if _step_key(self.tail) != self.tail else []):
            # NOTE: a line may follow a bar that did not end its own
            for line in re.split(r"(?=\[tokenrouter\] )", segment):
                if line.startswith("[tokenrouter]"):
                    self._line(line.rstrip())

    def _line(self, line: str) -> None:
        self.last, at, key = line, time.perf_counter(), _step_key(line)
        if line.startswith("[tokenrouter] ready:"):
            self.ready, self.ready_at = (self.ready, self.ready_at) if self.ready else (line, at)
        elif key in self._index:
            i = self._index[key]
            self.steps[i], self.ended[i] = line, at
        else:
            self._index[key] = len(self.steps)
            self.steps.append(line)
            self.started.append(at)
            self.ended.append(at)


def _step_key(line: str) -> str:
    """A step's line without its progress: what stays the same while its bar moves."""
    return re.split(r":\s+\d+%|\s\d+(?:\.\d+)?s$|\s(?:\d+:)?\d\d:\d\d(?:\s.*)?$", line)[0]


def run(args: argparse.Namespace) -> dict:
    host = announce()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tokenrouter-first-start-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": host, "workdir": str(workdir)}
    cwd, python = REPO, sys.executable
    if args.install:
        cwd, seconds, command = install(workdir)
        python = str(cwd / ".venv" / "bin" / "python")
        result["install"] = {"seconds": seconds, "command": command}
        print(f"install: {seconds / 60:.1f} min", flush=True)
    cache = Path(args.cache) if args.cache else workdir / "cache"
    if not args.cache and cache.exists():
        shutil.rmtree(cache)
    result["start"] = start = first_start(cwd, python, cache, args.config, args.timeout)
    peaks = start["step_peak_bytes"]
    print("  began  took   step (its last state)")
    for line, began, ended in zip(start["steps"], start["step_started_s"], start["step_ended_s"]):
        peak = peaks.get(_step_key(line))
        print(f"  {began:5.1f} s {ended - began:5.1f} s  {line}" + (f"   [peak {peak / 2**30:.2f} GiB]" if peak else ""))
    print(start["ready"])
    print(f"first start: {start['seconds']:.0f} s to the ready line; peak resident {start['peak_bytes'] / 2**30:.2f} GiB "
          f"(sampled, all processes), {start['app_maxrss_bytes'] / 2**30:.2f} GiB the app's own peak (ru_maxrss)")
    write_json(args.json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "start"}), flush=True)
    return result
