"""A fake worker: scripted tokens and send decisions in place of a model, behind the same step messages, so
the runtime, the subservers and the schedulers can be tested without any model. It records every row it
was asked to compute."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from tokenrouter.engine.device_thread import DeviceThread
from tokenrouter.engine.executor import LocalExecutor
from tokenrouter.engine.messages import Row, StepRequest, StepResult, WorkerInfo
from tokenrouter.engine.verification import judge, num_outputs
from tokenrouter.engine.worker import SeqView, Views


def default_token(view: SeqView, model: str) -> int:
    """A token that depends only on the sequence's tokens so far (as a greedy model's would)."""
    return 3 + (sum(view.token_ids) * 31 + len(view.token_ids)) % 200


class FakeWorker(Views):
    def __init__(self, name: str, models: list[str], num_blocks: int = 64, block_size: int = 4,
                 max_model_len: int = 512, token: Callable[[SeqView, str], int] = default_token,
                 send: Callable[[SeqView, str], bool] = lambda view, model: False, info: WorkerInfo | None = None,
                 record: bool = True):
        super().__init__(name, models)
        self._info = info or WorkerInfo(num_blocks, block_size, max_model_len, 0, 0, 256, "fake")
        self.token, self.send = token, send
        self.record = record
        self.rows: list[Row] = []  # every row computed, in order (if `record`)

    def info(self) -> WorkerInfo:
        return self._info

    def execute(self, request: StepRequest) -> StepResult:
        views = self.apply(request)
        if self.record:
            self.rows.extend(request.rows)
        rows, name = request.rows, self.name
        tokens: list[int | None] = [None] * len(rows)
        send, scores, accepted = [False] * len(rows), [math.nan] * len(rows), [0] * len(rows)
        for i, (row, view) in enumerate(zip(rows, views)):
            sent = False
            if row.route:
                sent = send[i] = self.send(view, name)
                scores[i] = float(sent)
            if not row.complete or sent:
                continue
            m = num_outputs(row.verify_from, row.start, len(row.token_ids), True) if row.verify_from else 1
            if m == 1:  # no drafts to judge: the token after the last
                tokens[i] = self.token(view, name)
                continue
            n = len(view.token_ids)
            accepted[i], tokens[i] = judge(view.token_ids[n - m + 1:],
                                           [self.token(_prefix(view, k), name) for k in range(n - m + 1, n + 1)])
        return StepResult(tokens, send, scores, 1e-3, time.perf_counter(), accepted)


def _prefix(view: SeqView, n: int) -> SeqView:
    """`view` as it was when the sequence held `n` tokens."""
    if n == len(view.token_ids):
        return view
    copy = SeqView(view.seq_id, view.num_prompt_tokens, view.params, view.policy)
    copy.token_ids = view.token_ids[:n]
    return copy


def fake_executors(models: list[str], **kwargs) -> dict[str, LocalExecutor]:
    """One fake worker per model, all on one thread (as models sharing a device)."""
    thread = DeviceThread("fake-device")
    return {m: LocalExecutor(FakeWorker(m, models, **kwargs), thread) for m in models}
