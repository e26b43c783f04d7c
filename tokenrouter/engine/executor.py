"""Executors: the driver's handle on one model's worker(s), wherever placement put them.

An executor turns a scheduled batch into a StepRequest, sends it, and returns the StepResult; it also
remembers what its worker already knows (which sequences, which policies), so each message carries only
what is new. `LocalExecutor` calls a Worker on its device's thread in this process (the default; nothing is
copied or pickled); `ProcessExecutor` (worker_process.py) and `RayExecutor` (ray_executor.py) talk to
workers elsewhere through the same messages.
"""
from __future__ import annotations

import itertools
import weakref

from tokenrouter.engine.device_thread import DeviceThread
from tokenrouter.engine.messages import NewSequence, PolicyRef, StepRequest, StepResult, WorkerInfo


class WorkerFailed(RuntimeError):
    """A worker raised, died or could not start; the message says which model and why."""


_policy_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_key_counter = itertools.count()
_executors: weakref.WeakSet = weakref.WeakSet()


def policy_key(policy) -> int:
    """A number for a driver's policy object, the same for every executor, for as long as it lives."""
    key = _policy_keys.get(policy)
    if key is None:
        key = _policy_keys[policy] = next(_key_counter)
        weakref.finalize(policy, _policy_gone, key)
    return key


def _policy_gone(key: int) -> None:
    for executor in list(_executors):
        executor.forget_policy(key)


class Executor:
    name: str
    info: WorkerInfo
    copies_policies = True  # the worker builds its own policy objects (False: it shares the driver's)

    def __init__(self, name: str):
        self.name = name
        self.known: set[int] = set()  # sequences the worker holds a view of
        self.sent_policies: set[int] = set()
        self._forget: list[int] = []
        self._forget_policies: list[int] = []
        _executors.add(self)

    # ---- messages --------------------------------------------------------------------------------
    def request(self, batch) -> StepRequest:
        """`batch`: the step's rows in order, each with the sequence it belongs to (scheduler.Batch)."""
        new, policies, known = [], [], self.known
        for seq in [seq for seq in batch.seqs if seq.seq_id not in known]:
            key = policy_key(seq.policy)
            if key not in self.sent_policies:
                policies.append(self._policy_ref(key, seq.policy))
                self.sent_policies.add(key)
            new.append(NewSequence(seq.seq_id, seq.num_prompt_tokens, seq.params, key))
            known.add(seq.seq_id)
        forget, self._forget = self._forget, []
        forget_policies, self._forget_policies = self._forget_policies, []
        return StepRequest(batch.rows, new, policies, forget, forget_policies)

    def _policy_ref(self, key: int, policy) -> PolicyRef:
        spec = getattr(policy, "spec", None)
        if self.copies_policies and spec is not None:
            return PolicyRef(key, spec[0], dict(spec[1]))
        return PolicyRef(key, obj=policy)

    def forget(self, seq) -> None:
        """`seq` finished: its view (and its policy state) at the worker goes with the next request."""
        if seq.seq_id in self.known:
            self.known.discard(seq.seq_id)
            self._forget.append(seq.seq_id)

    def forget_policy(self, key: int) -> None:
        if key in self.sent_policies:
            self.sent_policies.discard(key)
            self._forget_policies.append(key)

    # ---- transport (each placement's own) ----------------------------------------------------------
    async def step(self, request: StepRequest) -> StepResult:
        """On the event loop: the step's result, without blocking the loop while the worker computes."""
        raise NotImplementedError

    def run(self, request: StepRequest) -> StepResult:
        """The same, blocking (baselines and benchmarks outside the event loop)."""
        return self.call("execute", request)

    def call(self, method: str, *args):
        """A blocking call of a Worker method on every rank; rank 0's answer."""
        raise NotImplementedError

    def shares_device_with(self, other: Executor) -> bool:
        """Steps of the two take turns on one device (so they never overlap)."""
        return False

    def close(self) -> None:
        pass


class LocalExecutor(Executor):
    """A Worker in this process, stepped on its device's thread (shared by the models on that device)."""
    copies_policies = False

    def __init__(self, worker, thread: DeviceThread):
        super().__init__(worker.name)
        self.worker, self.thread = worker, thread
        self.info = worker.info()

    @property
    def runner(self):
        return self.worker.runner

    async def step(self, request: StepRequest) -> StepResult:
        return await self.thread.run(self.worker.execute, request)

    def call(self, method: str, *args):
        return self.thread.submit(getattr(self.worker, method), *args).result()

    def shares_device_with(self, other: Executor) -> bool:
        return isinstance(other, LocalExecutor) and other.thread is self.thread

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)
        if self.worker is not None:
            self.worker.close()
            self.worker = None  # a closed engine gives its weights and KV cache back at once
