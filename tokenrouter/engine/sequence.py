"""Per-request state: a Sequence owns its tokens, its KV state in every model and its token records."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from tokenrouter.engine.block_manager import KVState
from tokenrouter.engine.clock import now


class SeqStatus(Enum):
    WAITING = auto()  # queued at a model, nothing computed there since it arrived
    RUNNING = auto()  # in a model's running batch
    FINISHED = auto()


@dataclass(slots=True, frozen=True)
class FinishReason:
    """Why a sequence ended; `str()` is the OpenAI `finish_reason`."""
    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return self.kind


STOP, LENGTH = FinishReason("stop"), FinishReason("length")


def abort(detail: str) -> FinishReason:
    return FinishReason("abort", detail)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                 f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 100
                 and math.isfinite(self.temperature), "temperature", f"must be in [0, 100], got {self.temperature!r}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be an integer >= 0, got {self.top_k!r}")
        _require(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        _require(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(slots=True)
class TokenRecord:
    """One generated token: the data every view (HTML, Gradio, SSE, CSV) renders."""
    token_id: int
    text: str
    model: str
    score: float  # the router's score for this position (nan where no router ran)
    t: float  # seconds from the request's arrival to the token's release to its reader
    verified: bool = False  # a draft of the home model that the verifier judged and accepted
    correction: bool = False  # the verifier's token in place of a draft it rejected
    tolerated: bool = False  # verified, though not the verifier's own choice (a policy's `tolerance` kept it)


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    policy: object  # tokenrouter.policies.Policy
    home: str  # the model whose step output the policy reads before every token
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    kv: dict[str, KVState] = field(default_factory=dict)
    records: list[TokenRecord] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    model: str = ""  # the model that holds the sequence now
    arrival: float = field(default_factory=now)
    pending_score: float = math.nan  # router score of the position being decided
    handoffs: int = 0
    aborted: str = ""  # set anywhere; applied at the next step boundary
    decided: float | None = None  # a query-level send moved its home for good (with this score): no more routing
    tokens_computed: dict[str, int] = field(default_factory=dict)  # tokens each model ran forward
    streamed: int = 0  # records released to the reader
    held: int = 0  # output tokens held back from the reader until the policy decides (its decides_after)
    discarded: int = 0  # tokens written, then dropped when a query-level decision restarted the response
    stream: Any = None  # asyncio.Queue of released TokenRecords, then None at the finish (the runtime's; None: no reader)
    ended: Any = None  # asyncio.Event set at the finish, for a reader that wants only the end (the runtime's)
    detok: Any = None  # the Detokenizer of its output (the runtime's)
    # verification (engine/verification.py): tokens before `settled` can never be rolled back; the home
    # model's tokens after it are drafts, held from the reader until `verifier` judges them
    settled: int = 0
    verifier: str = ""  # the model that judges the drafts ("" for a policy that does not verify)
    verify_now: bool = False  # go to the verifier before the home model writes another draft
    pending_finish: FinishReason | None = None  # a draft would finish the sequence: it finishes once accepted
    drafted: int = 0  # drafts the verifier judged
    accepted: int = 0  # of them, accepted

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.settled = max(self.settled, len(self.token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def text(self) -> str:
        """The output text so far, cut at a stop string."""
        return self.detok.final_text(self.params.stop) if self.detok is not None else ""

    @property
    def num_drafts(self) -> int:
        """Tokens written since the last settled one, waiting for the verifier."""
        return len(self.token_ids) - self.settled

    def cut(self, num_tokens: int) -> None:
        """Drop the tokens from `num_tokens` on with their records and text (never tokens already settled).
        The KV watermarks are moved by `engine.verification.apply`."""
        assert num_tokens >= self.settled, f"seq {self.seq_id}: cut at {num_tokens} below settled {self.settled}"
        del self.token_ids[num_tokens:]
        del self.records[num_tokens - self.num_prompt_tokens:]
        if self.detok is not None:
            self.detok.truncate(num_tokens)
        self.pending_finish = None

    def kv_at(self, model: str) -> KVState:
        kv = self.kv.get(model)
        if kv is None:  # NOTE: not setdefault, which would build a KVState on every call (several per token)
            kv = self.kv[model] = KVState()
        return kv
