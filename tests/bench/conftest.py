"""One tiny routed pair for the whole bench test package (it loads in about a second)."""
from __future__ import annotations

import pytest

import tokenrouter

PAIR = "config/tiny/pair.yaml"


@pytest.fixture(scope="package")
def svc():
    service = tokenrouter.serve(PAIR)
    yield service
    service.close()
