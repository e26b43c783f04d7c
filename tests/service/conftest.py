"""Servers for the service tests: one `launch_server` subprocess on the tiny pair (with an API key) shared by
the tests that only talk HTTP, and in-process engines served with `Service.serve_http` where a test needs
to reach inside (stall the device, fail a step, shrink the queue)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

import tokenrouter
from tests.ports import free_port
from tokenrouter.service.metrics import stats_from_text

PAIR = "config/tiny/pair.yaml"
API_KEY = "test-key"
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120  # seconds: a cold start on a busy 2-core machine


class Server:
    def __init__(self, url: str, api_key: str | None = None):
        self.url, self.api_key = url, api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=self.headers, timeout=60)

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs)

    def stats(self, models=("small", "large")) -> dict:
        response = self.http.get("/metrics")
        response.raise_for_status()
        return stats_from_text(response.text, list(models))

    def wait_idle(self, timeout: float = 60) -> dict:
        """Poll /metrics until no request is in the engine and every KV block is free (bounded)."""
        seen = {}

        def idle() -> bool:
            # NOTE: requests the client has let go of count against the server's in-flight limit until their
            # handlers end; a scrape refused for that (503) means "not idle yet"
            response = self.http.get("/metrics")
            if response.status_code == 503:
                return False
            response.raise_for_status()
            seen.update(stats_from_text(response.text, ["small", "large"]))
            return seen["active_requests"] == 0 and all(seen[m]["free_blocks"] == seen[m]["total_blocks"]
                                                        for m in ("small", "large"))

        self.wait_for(idle, timeout, lambda: f"engine not idle: {seen}")
        return seen

    @staticmethod
    def wait_for(condition, timeout: float = 60, what=lambda: "condition") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what()} not met after {timeout} s"
            time.sleep(0.05)


@pytest.fixture(scope="session")
def server():
    """`python -m tokenrouter.launch_server` in a subprocess, waited on through /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenrouter.launch_server", "--config_path", PAIR, "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENROUTER_API_KEY": API_KEY})
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{''.join(output)}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server not healthy after {START_TIMEOUT} s:\n{''.join(output)}"
        time.sleep(0.2)
    yield Server(url, API_KEY)
    proc.terminate()
    assert proc.wait(timeout=30) == 0, "".join(output)


@contextmanager
def served(http_options: dict | None = None, **overrides):
    """An in-process engine on the tiny pair behind `serve_http` on a free port."""
    svc = tokenrouter.serve(PAIR, **overrides)
    http = svc.serve_http(port=0, **(http_options or {}))
    try:
        yield svc, http, Server(http.url)
    finally:
        http.stop()
        svc.close()


@contextmanager
def stalled(svc):
    """Hold the device's worker thread: no model step runs until the block exits."""
    release = threading.Event()
    thread = svc.runtime.subservers[svc.models[0]].executor.thread
    busy = thread.submit(release.wait)
    try:
        yield
    finally:
        release.set()
        busy.result(timeout=30)


@pytest.fixture(scope="session")
def serve_inprocess():
    return served


@pytest.fixture(scope="session")
def stall():
    return stalled
