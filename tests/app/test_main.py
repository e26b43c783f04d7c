"""`python -m app` as users start it: on a config (an in-process engine) and on a running server
(`--server URL`), each in a subprocess on a free port, waited on through its own start-up line; and bad
arguments refused before the engine loads."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from gradio_client import Client

import tokenrouter
from tests.app.conftest import BOTH_MODELS, PAIR
from tests.ports import free_port
from tests.app.test_gradio_client import spans

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 180  # seconds: a cold start (torch, gradio, the engine) on a busy 2-core machine


@contextmanager
def app_process(*args: str):
    """The app in a subprocess; yields its URL once it printed it, stops it with Ctrl-C afterwards."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "-m", "app", *args, "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] and None, daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not any("Running on local URL" in line for line in seen):
            assert proc.poll() is None, f"the app exited with {proc.returncode}:\n{''.join(seen)}"
            try:
                seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                raise AssertionError(f"no start-up line after {START_TIMEOUT} s:\n{''.join(seen)}") from None
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def generate(client: Client, max_tokens: int = 12) -> tuple[str, str, dict | None]:
    return client.predict("hello", "schedule", "every=2", 0.5, max_tokens, 0, api_name="/generate")


def test_python_m_app_on_a_config():
    with app_process("--config", PAIR, "--policy", BOTH_MODELS) as url:
        client = Client(url, verbose=False)
        html, metrics, final = generate(client)
        assert {cls for cls, _ in spans(html)} == {"small", "large"} and len(final["records"]) == 12
        assert final["cost"] > 0


def test_python_m_app_on_a_server_and_losing_it(svc):
    server = svc.serve_http(port=0)
    try:
        with app_process("--server", server.url) as url:
            client = Client(url, verbose=False)
            html, metrics, final = generate(client)
            assert [cls for cls, _ in spans(html)] == ["small", "large"] * 6
            assert [r["model"] for r in final["records"]] == ["small", "large"] * 6
            assert final["cost"] > 0  # the server publishes its prices in /v1/models
            server.stop()
            html, metrics, final = generate(client)
            assert "Lost the server" in metrics and "Traceback" not in metrics and final["finish"] == "error"
    finally:
        server.stop()


def test_a_bad_policy_or_config_exits_before_the_engine_loads(monkeypatch, capsys):
    from app.__main__ import main

    monkeypatch.setattr(tokenrouter, "serve", lambda *a, **k: pytest.fail("the engine loaded"))
    for argv, message in ((["--config", PAIR, "--policy", "confidence:1.5"], "--policy: 'confidence:1.5'"),
                          (["--config", "config/tiny/nope.yaml"], "--config: config/tiny/nope.yaml")):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 2 and message in capsys.readouterr().err
