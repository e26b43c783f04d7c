"""Router checkpoints: the network (weights in float16, standardisation in float32) and metadata (kind,
pair, features, threshold, held-out score quantiles and metrics, data statistics, the command)."""
from __future__ import annotations

from pathlib import Path

import torch

from tokenrouter.policies.router_net import FEATURES, RouterNet

FORMAT = "tokenrouter-router/1"
ROUTERS_DIR = Path(__file__).parent / "routers"
DEFAULT_PAIR = "qwen2.5-coder-0.5b_1.5b"


def default_router_path(kind: str) -> Path:
    """The router shipped for the embedded pair."""
    return ROUTERS_DIR / f"{DEFAULT_PAIR}-{kind}.pt"


def save_router(path: str | Path, net: RouterNet, meta: dict) -> None:
    state = {k: v.half() if k in _params(net) else v.float() for k, v in net.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "config": net.config(), "state_dict": state, "meta": meta}, path)


def load_router(path: str | Path, kind: str | None = None) -> tuple[RouterNet, dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: router checkpoint {str(path)!r} not found")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError(f"path: {str(path)!r} is not a router checkpoint ({FORMAT})")
    meta = blob["meta"]
    if kind is not None and meta.get("kind") != kind:
        raise ValueError(f"path: {str(path)!r} holds a {meta.get('kind')!r} router, expected {kind!r}")
    net = RouterNet(**blob["config"])
    net.load_state_dict({k: v.float() for k, v in blob["state_dict"].items()})
    return net.eval(), meta


def round_to_saved_precision(net: RouterNet) -> None:
    """Round the weights as `save_router` will, so a threshold calibrated afterwards holds for the file."""
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.half().float())


def _params(net: RouterNet) -> set[str]:
    return {name for name, _ in net.named_parameters()}


def check_features(kind: str) -> tuple[str, ...]:
    if kind not in FEATURES:
        raise ValueError(f"kind: must be one of {sorted(FEATURES)}, got {kind!r}")
    return FEATURES[kind]
