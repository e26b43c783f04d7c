"""A free loopback port for servers the tests start (the engine's own helper, which rendezvous use)."""
from __future__ import annotations

from tokenrouter.engine.worker_process import free_port

__all__ = ["free_port"]
