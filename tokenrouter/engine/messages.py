"""What crosses between the driver and a model's worker: one small step request, one small step result.

Plain Python data only (ints, floats, bools, short lists): no tensor ever crosses, so a worker may live in
this process, in another one, or in a Ray actor on another node, behind the same two messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenrouter.engine.sequence import SamplingParams


@dataclass(slots=True)
class PolicyRef:
    """How a worker builds its own copy of a driver's policy: by name and parameters (`make_policy`), or,
    for a policy object built by hand, the object itself (pickled once, when first sent)."""
    key: int
    name: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    obj: Any = None


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen (or forgot): what its policy and sampler read besides the tokens."""
    seq_id: int
    num_prompt_tokens: int
    params: SamplingParams
    policy: int  # PolicyRef.key


@dataclass(slots=True)
class Row:
    """One scheduled chunk: tokens at positions `start ..` of sequence `seq_id`, written into `block_table`."""
    seq_id: int
    token_ids: list[int]
    start: int  # the sequence's KV watermark in this model before the step
    block_table: list[int]
    complete: bool  # the chunk reaches the sequence's last token: its output predicts the next one
    route: bool  # run the sequence's policy on this row (complete, at its home, not decided for good)
    verify_from: int = 0  # > 0: judge the drafted tokens from this index on (engine/verification.py)


@dataclass(slots=True)
class StepRequest:
    rows: list[Row]
    new: list[NewSequence] = field(default_factory=list)
    policies: list[PolicyRef] = field(default_factory=list)  # policies this worker has not been sent yet
    forget: list[int] = field(default_factory=list)  # sequences finished since the last request
    forget_policies: list[int] = field(default_factory=list)  # policies the driver no longer holds


@dataclass(slots=True)
class StepResult:
    """Per row: the token this model wrote (None: not complete, or sent on), whether the policy sends the
    position to its target model, and the router score (nan where no policy ran). A verifying row also
    says how many of the drafts it judged it accepted; its token then follows the accepted ones."""
    tokens: list[int | None]
    send: list[bool]
    scores: list[float]
    seconds: float
    started: float = 0.0  # time.perf_counter() at the worker when the step began (one clock per machine)
    accepted: list[int] = field(default_factory=list)  # per row (empty: no row verified)
    errors: list[str] = field(default_factory=list)  # per row, why its request must end ("" or empty: none)
    tolerated: list[list[int]] = field(default_factory=list)  # per row, accepted drafts unlike the verifier's own
    forward_seconds: float = 0.0  # of `seconds`, the forward pass and logits (the device's work; the rest is host)


@dataclass(slots=True)
class WorkerInfo:
    """What the driver's schedulers and reports need to know about a loaded model."""
    num_blocks: int
    block_size: int
    max_model_len: int
    num_parameters: int
    weight_bytes: int
    vocab_size: int
    device: str
    tensor_parallel_size: int = 1
    pid: int = 0
