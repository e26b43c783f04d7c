"""TokenRouter Workbench: token-level routing between language models, served efficiently."""
from __future__ import annotations

__version__ = "0.1.0"


def serve(config_path=None, **overrides):
    """Start the engine of a YAML config (default: the embedded pair, `dtype: auto`) on a background thread;
    returns a `Service`."""
    from tokenrouter.config import default_config
    from tokenrouter.service.inprocess import serve as _serve

    return _serve(config_path or default_config(), **overrides)


def connect(url: str, api_key: str | None = None, timeout: float | None = None):
    """A client of a running `tokenrouter.launch_server` with the Service's interface; see docs/server.md."""
    from tokenrouter.service.client import connect as _connect

    return _connect(url, api_key, timeout)
