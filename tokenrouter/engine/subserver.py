"""One model's subserver: an asyncio task that schedules, hands each step to the model's executor (its
worker computes wherever placement put it), and gives the step's small results back to the runtime."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from tokenrouter.config import SchedulerSpec
from tokenrouter.engine.clock import clock, now
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.executor import Executor
from tokenrouter.engine.scheduler import Scheduler

STATS_WINDOW = 4096  # recent steps kept for statistics, so a long-running server does not grow without bound


@dataclass(slots=True)
class StepStats:
    steps: int = 0
    busy_seconds: float = 0.0  # in the worker's steps
    forward_seconds: float = 0.0  # of busy_seconds, in the forward pass and logits
    driver_seconds: float = 0.0  # on the event loop: scheduling, the step message, processing the result
    tokens: int = 0
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    intervals: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))  # (start, end)
    step_tokens: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))  # computed, per step

    @property
    def step_seconds(self) -> list[float]:
        return [end - start for start, end in self.intervals]


class Subserver:
    def __init__(self, name: str, executor: Executor, spec: SchedulerSpec):
        self.name = name
        self.executor = executor
        info = executor.info
        self.blocks = BlockManager(info.num_blocks, info.block_size)
        self.scheduler = Scheduler(name, self.blocks, spec.max_num_seqs, spec.max_num_batched_tokens)
        self.wakeup = asyncio.Event()
        self.tau = 0.0  # delayed batching: seconds a step may wait for more hand-offs
        self.stats = StepStats()
        self.waited: deque[float] = deque(maxlen=STATS_WINDOW)  # per delayed step, how long it held its oldest request

    def wake(self) -> None:
        self.wakeup.set()

    async def run(self, runtime) -> None:
        now = clock()
        while True:
            if self.scheduler.num_ready == 0:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            if self.tau > 0:
                await self._delay(runtime)
            runtime.apply_aborts(self)
            t = now()
            batch = self.scheduler.schedule()
            if not batch:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            try:
                request = self.executor.request(batch)
                driver = now() - t
                result = await self.executor.step(request)
                t = now()
                runtime.postprocess(self, batch, result)
                self.stats.driver_seconds += driver + now() - t
            except Exception as e:  # a failed step leaves the engine unusable: fail every request fast
                runtime.fail(self, e)
                return

    async def _delay(self, runtime) -> None:
        """Delayed batching: while fewer sequences are ready here than could come, and some are running at
        peers that may hand off, wait for them, but never hold the oldest ready one beyond tau (> 0)."""
        start = now()
        while self.scheduler.num_ready < self.scheduler.max_num_seqs and runtime.active_elsewhere(self.name) > 0:
            remaining = self.tau - (now() - start)
            if remaining <= 0:
                break
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), remaining)
            except TimeoutError:
                break
        self.waited.append(now() - start)
