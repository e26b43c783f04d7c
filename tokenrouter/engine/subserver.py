"""One model's subserver: an asyncio task that schedules, runs each step on its device's worker thread,
and hands the step's small results back to the runtime on the event loop."""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenrouter.config import SchedulerSpec
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.model_runner import ModelRunner, StepOutput
from tokenrouter.engine.sampler import sample
from tokenrouter.engine.scheduler import Scheduled, Scheduler
from tokenrouter.policies import StepFeatures


@dataclass(slots=True)
class StepResult:
    """Per scheduled row: the token this model wrote (None: not decided or sent on), whether the policy
    sends the position to its target model, and the router score."""
    tokens: list[int | None]
    send: list[bool]
    scores: list[float]
    seconds: float


STATS_WINDOW = 4096  # recent steps kept for statistics, so a long-running server does not grow without bound


@dataclass(slots=True)
class StepStats:
    steps: int = 0
    busy_seconds: float = 0.0
    tokens: int = 0
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))


class Subserver:
    def __init__(self, name: str, runner: ModelRunner, spec: SchedulerSpec, models: list[str],
                 executor: ThreadPoolExecutor):
        self.name = name
        self.runner = runner
        self.models = models
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(name, self.blocks, spec.max_num_seqs, spec.max_num_batched_tokens)
        self.executor = executor  # the worker thread of this model's device, shared by the models on it
        self.wakeup = asyncio.Event()
        self.tau = 0.0  # delayed batching: seconds a step may wait for more hand-offs
        self.stats = StepStats()
        self.waited: deque[float] = deque(maxlen=STATS_WINDOW)  # per delayed step, how long it held its oldest request

    def wake(self) -> None:
        self.wakeup.set()

    async def run(self, runtime) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.scheduler.num_ready == 0:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            await self._delay(runtime)
            runtime.apply_aborts(self)
            batch = self.scheduler.schedule()
            if not batch:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            try:
                result = await loop.run_in_executor(self.executor, self.step, batch)
                runtime.postprocess(self, batch, result)
            except Exception as e:  # a failed step leaves the engine unusable: fail every request fast
                runtime.fail(self, e)
                return

    async def _delay(self, runtime) -> None:
        """Delayed batching: while fewer sequences are ready here than could come, and some are running at
        peers that may hand off, wait for them, but never hold the oldest ready one beyond tau."""
        if self.tau <= 0:
            return
        start = time.perf_counter()
        while self.scheduler.num_ready < self.scheduler.max_num_seqs and runtime.active_elsewhere(self.name) > 0:
            remaining = self.tau - (time.perf_counter() - start)
            if remaining <= 0:
                break
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), remaining)
            except TimeoutError:
                break
        self.waited.append(time.perf_counter() - start)

    def step(self, batch: list[Scheduled]) -> StepResult:
        """Runs on the worker thread: the model step, the policy for sequences at home, sampling."""
        t = time.perf_counter()
        out = self.runner.run([item.chunk for item in batch])
        tokens: list[int | None] = [None] * len(batch)
        send, scores = [False] * len(batch), [math.nan] * len(batch)
        done = [i for i, item in enumerate(batch) if item.complete]
        at_home = [i for i in done if batch[i].seq.home == self.name]
        for policy, rows in _group_by_policy(batch, at_home).items():
            decisions, values = policy.route(_features(out, batch, rows, self.runner.model.embed_tokens))
            for i, decision, value in zip(rows, decisions, values):
                send[i], scores[i] = decision and policy.target(self.models) != self.name, value
        keep = [i for i in done if not send[i]]
        if keep:
            seqs = [batch[i].seq for i in keep]
            rows = [out.offsets[i] for i in keep]
            sampled = sample(out.logits[rows], [s.params for s in seqs], [len(s.token_ids) for s in seqs])
            for i, token in zip(keep, sampled):
                tokens[i] = token
        return StepResult(tokens, send, scores, time.perf_counter() - t)


def _group_by_policy(batch: list[Scheduled], rows: list[int]) -> dict:
    groups: dict = {}
    for i in rows:
        groups.setdefault(batch[i].seq.policy, []).append(i)
    return groups


def _features(out: StepOutput, batch: list[Scheduled], rows: list[int], embed) -> StepFeatures:
    index = [out.offsets[i] for i in rows]
    return StepFeatures(out.logits[index], out.hidden[index], [batch[i].seq for i in rows], embed)
