"""One tiny routed pair for the app tests, and the app launched on it (in-process, on a free port)."""
from __future__ import annotations

import os

import pytest

import tokenrouter
from tests.ports import free_port

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

PAIR = "config/tiny/pair.yaml"
BOTH_MODELS = "schedule:every=2"  # every other token from the large model, so both models write


@pytest.fixture(scope="package")
def svc():
    service = tokenrouter.serve(PAIR)
    yield service
    service.close()


@pytest.fixture(scope="package")
def app_url(svc):
    demo = svc.launch_app(policy=BOTH_MODELS, server_name="127.0.0.1", server_port=free_port(),
                          prevent_thread_lock=True, quiet=True)
    yield demo.local_url
    demo.close()


@pytest.fixture(scope="package")
def client(app_url):
    from gradio_client import Client

    return Client(app_url, verbose=False)
