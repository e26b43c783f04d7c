"""TokenRouter Workbench: token-level routing between language models, served efficiently."""
from __future__ import annotations

__version__ = "0.1.0"


def serve(config_path, **overrides):
    """Start the engine of a YAML config on a background thread; returns a `Service`."""
    from tokenrouter.service.inprocess import serve as _serve

    return _serve(config_path, **overrides)
