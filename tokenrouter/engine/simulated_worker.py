"""A simulated worker: no model runs. Each step's tokens and send decisions come from callables (a routing
trace's replay, tokenrouter/simulate), as the fake worker's do, and the step takes the time a step-latency model
gives for its rows, slept on the loop's clock (virtual in a simulation, engine/clock.py). The driver, the
schedulers, the block managers and delayed batching run unchanged on top.

Models on one simulated device take turns on it, as `local` placement's models share a device's thread; with
CUDA MPS (`SimulatedDevice(mps=True)`) their steps overlap, each stretched by the measured contention while the
other model is stepping.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

from tokenrouter.engine.clock import now
from tokenrouter.engine.executor import Executor
from tokenrouter.engine.fake_worker import FakeWorker
from tokenrouter.engine.messages import StepRequest, StepResult, WorkerInfo
from tokenrouter.engine.verification import num_outputs


class StepLatency(Protocol):
    def step_seconds(self, new_tokens: list[int], contexts: list[int], logit_rows: int) -> float:
        """Seconds of one step whose rows compute `new_tokens[i]` tokens each, the last of them attending to
        `contexts[i]` tokens, with `logit_rows` rows of logits in all."""


class SimulatedDevice:
    """One device (a GPU, or a CPU's cores) that simulated workers step on."""

    def __init__(self, name: str, mps: bool = False, slowdown: float = 0.0):
        self.name, self.mps, self.slowdown = name, mps, slowdown
        self.turn = asyncio.Lock()
        self.stepping: dict[str, int] = {}  # model -> steps in flight (MPS)

    async def run(self, model: str, seconds: float) -> tuple[float, float]:
        """Hold the device for a step of `seconds`: (start, seconds taken)."""
        if not self.mps:
            async with self.turn:
                start = now()
                await asyncio.sleep(seconds)
                return start, seconds
        if any(n for m, n in self.stepping.items() if m != model):
            seconds *= 1 + self.slowdown  # NOTE: stretched only if another model steps as this one starts
        self.stepping[model] = self.stepping.get(model, 0) + 1
        try:
            start = now()
            await asyncio.sleep(seconds)
            return start, seconds
        finally:
            self.stepping[model] -= 1


class SimulatedExecutor(Executor):
    """A model's worker, simulated: `token(view, model)` and `send(view, model)` decide as the fake worker's do;
    `latency` times each step; `device` is shared by the models placed on it."""
    copies_policies = False

    def __init__(self, name: str, models: list[str], info: WorkerInfo, latency: StepLatency,
                 device: SimulatedDevice, token, send):
        super().__init__(name)
        self.worker = FakeWorker(name, models, token=token, send=send, info=info, record=False)
        self.info, self.latency, self.device = info, latency, device
        self.ran_seconds = 0.0  # modelled seconds of the steps run off the loop (`run`: the baselines' own loops)

    def step_seconds(self, request: StepRequest) -> float:
        rows = request.rows
        new_tokens = [len(r.token_ids) for r in rows]
        contexts = [r.start + n for r, n in zip(rows, new_tokens)]
        logits = sum([num_outputs(r.verify_from, r.start, n, True) if r.verify_from else 1
                      for r, n in zip(rows, new_tokens) if r.complete])
        return self.latency.step_seconds(new_tokens, contexts, logits)

    async def step(self, request: StepRequest) -> StepResult:
        result = self.worker.execute(request)
        result.started, result.seconds = await self.device.run(self.name, self.step_seconds(request))
        result.forward_seconds = result.seconds
        return result

    def run(self, request: StepRequest) -> StepResult:
        """Off the loop (the baselines' own loops): the result, with the modelled seconds and no clock."""
        result = self.worker.execute(request)
        result.seconds = result.forward_seconds = self.step_seconds(request)
        self.ran_seconds += result.seconds
        return result

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def shares_device_with(self, other: Executor) -> bool:
        return isinstance(other, SimulatedExecutor) and other.device is self.device and not self.device.mps
