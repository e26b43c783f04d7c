"""A simulated worker: no model runs. Each step's tokens and send decisions come from a script (a routing trace's
replay, tokenrouter/simulate), and the step takes the time a step-latency model gives for its rows, slept on the
loop's clock (virtual in a simulation, engine/clock.py). The driver, the schedulers, the block managers and delayed
batching run unchanged on top.

Models on one simulated device take turns on it, as `local` placement's models share a device's thread; with
CUDA MPS (`SimulatedDevice(mps=True)`) their steps overlap, each stretched by the measured contention while the
other model is stepping.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Protocol

from tokenrouter.engine.clock import now, sleep
from tokenrouter.engine.executor import Executor
from tokenrouter.engine.messages import StepRequest, StepResult, WorkerInfo
from tokenrouter.engine.verification import judge, num_outputs


class Script(Protocol):
    """What simulated steps write, by request (a sequence's sampling seed) and output position (0: the first output
    token), for a sequence of `policy` at `model`."""

    def writer(self, request: int, policy, model: str) -> tuple[list[int], Callable[[int], int], Callable[[int], bool]]:
        """By output position: (the tokens `model` writes at positions 0, 1, ... as far as known at once (any length),
        the token `model` writes there, whether the policy, run at `model` (the sequence's home), sends the position
        to its target)."""


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
        self.models = 0  # simulated executors placed here

    async def run(self, model: str, seconds: float) -> tuple[float, float]:
        """Hold the device for a step of `seconds`: (start, seconds taken)."""
        if self.models == 1:  # NOTE: a device of its own: its model's steps never overlap, so no turn to take (the
            start = now()  # lock, always free here, never yielded) and nothing to share under MPS
            await sleep(seconds)
            return start, seconds
        if not self.mps:
            async with self.turn:
                start = now()
                await sleep(seconds)
                return start, seconds
        if any(n for m, n in self.stepping.items() if m != model):
            seconds *= 1 + self.slowdown  # NOTE: stretched only if another model steps as this one starts
        self.stepping[model] = self.stepping.get(model, 0) + 1
        try:
            start = now()
            await sleep(seconds)
            return start, seconds
        finally:
            self.stepping[model] -= 1


class ScriptedWorker:
    """A simulated model's worker: each complete row gets the token (or send) its script gives at the row's end.
    It keeps, of each sequence, its prompt length and what its script writes (by its seed and policy); a row's position
    follows from its start and length. A verifying row's drafts are its last tokens, judged against the script's
    tokens at their positions (engine/verification.py)."""

    def __init__(self, name: str, script: Script):
        self.name, self.script = name, script
        self.seqs: dict[int, tuple[int, list, Callable, Callable]] = {}  # seq_id -> (prompt tokens, *Script.writer)
        self.policies: dict[int, object] = {}

    def execute(self, request: StepRequest) -> StepResult:
        return self.execute_timed(request)[0]

    def execute_timed(self, request: StepRequest) -> tuple[StepResult, list[int], list[int], int]:
        """`execute`, and what a step-latency model reads of the same rows (`StepLatency.step_seconds`): each row's new
        tokens, the context its last one attends to, and the step's logit rows."""
        for ref in request.policies:
            self.policies[ref.key] = ref.obj  # NOTE: the driver's own objects (SimulatedExecutor.copies_policies)
        for key in request.forget_policies:
            self.policies.pop(key, None)
        for seq_id in request.forget:
            self.seqs.pop(seq_id, None)
        for new in request.new:
            self.seqs[new.seq_id] = (new.num_prompt_tokens,
                                     *self.script.writer(new.params.seed, self.policies[new.policy], self.name))
        rows, seqs = request.rows, self.seqs
        tokens: list[int | None] = [None] * len(rows)
        send, scores, accepted = [False] * len(rows), [math.nan] * len(rows), [0] * len(rows)
        new_tokens, contexts, logits = [], [], 0
        add_new, add_context = new_tokens.append, contexts.append
        for i, row in enumerate(rows):
            n, start = len(row.token_ids), row.start
            add_new(n)
            add_context(start + n)
            if not row.complete:
                continue
            m = num_outputs(row.verify_from, start, n, True) if row.verify_from else 1
            logits += m
            prompt, table, token, sends = seqs[row.seq_id]
            end = start + n - prompt  # the output position the row's logits predict
            if row.route:
                sent = send[i] = sends(end)
                scores[i] = 1.0 if sent else 0.0
                if sent:
                    continue
            if m == 1:  # no drafts to judge: the token after the last
                tokens[i] = table[end] if end < len(table) else token(end)
            else:
                accepted[i], tokens[i] = judge(row.token_ids[n - m + 1:],
                                               [token(p) for p in range(end - m + 1, end + 1)])
        return StepResult(tokens, send, scores, 0.0, 0.0, accepted), new_tokens, contexts, logits


class SimulatedExecutor(Executor):
    """A model's worker, simulated: `script` decides its tokens and sends; `latency` times each step; `device` is
    shared by the models placed on it."""
    copies_policies = False

    def __init__(self, name: str, info: WorkerInfo, latency: StepLatency, device: SimulatedDevice, script: Script):
        super().__init__(name)
        self.worker = ScriptedWorker(name, script)
        self.info, self.latency, self.device = info, latency, device
        device.models += 1
        self.ran_seconds = 0.0  # modelled seconds of the steps run off the loop (`run`: the baselines' own loops)

    async def step(self, request: StepRequest) -> StepResult:
        result, new_tokens, contexts, logits = self.worker.execute_timed(request)
        seconds = self.latency.step_seconds(new_tokens, contexts, logits)
        result.started, result.seconds = await self.device.run(self.name, seconds)
        result.forward_seconds = result.seconds
        return result

    def run(self, request: StepRequest) -> StepResult:
        """Off the loop (the baselines' own loops): the result, with the modelled seconds and no clock."""
        result, new_tokens, contexts, logits = self.worker.execute_timed(request)
        result.seconds = result.forward_seconds = self.latency.step_seconds(new_tokens, contexts, logits)
        self.ran_seconds += result.seconds
        return result

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def shares_device_with(self, other: Executor) -> bool:
        return isinstance(other, SimulatedExecutor) and other.device is self.device and not self.device.mps
