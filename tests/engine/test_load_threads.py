"""Device threads that step on fewer torch threads while other processes load the cores, and on all again after."""
from __future__ import annotations

import threading

import torch

from tokenrouter.engine import load_threads
from tokenrouter.engine.load_threads import PERIOD_S, LoadThreads, threads_for
from tokenrouter.models.kernels_timing import CpuSample, cpu_sample


def test_threads_leave_the_cores_others_took():
    assert threads_for(0.0, 2, 2) == 2
    assert threads_for(0.4, 2, 2) == 2  # a driver's share of a core does not take one
    assert threads_for(1.0, 2, 2) == 1  # one busy process on a 2-core machine
    assert threads_for(2.0, 2, 2) == 1  # never below one
    assert threads_for(1.0, 4, 8) == 4  # cores enough left for the ceiling
    assert threads_for(5.6, 4, 8) == 2


class FakeMachine:
    """CPU samples of a machine whose other processes keep `others` cores busy, on a clock the test moves."""

    def __init__(self):
        self.wall = self.busy = self.own = 0.0
        self.others = 0.0
        self.samples = 0

    def advance(self, seconds: float, own_cores: float = 1.0) -> None:
        self.wall += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + self.others) * seconds

    def __call__(self, cores):
        self.samples += 1
        return CpuSample(self.wall, self.busy, self.own, len(cores))

    def clock(self) -> float:
        return self.wall


def test_a_device_thread_drops_a_thread_under_load_and_takes_it_back():
    machine = FakeMachine()
    result = {}

    def device_thread():  # torch's thread count is per thread: follow it on a thread of its own
        torch.set_num_threads(2)
        follower = LoadThreads(2, frozenset({0, 1}), sample=machine, clock=machine.clock)
        seen = []
        for others in (0.0, 1.0, 1.0, 0.0):
            machine.others = others
            machine.advance(PERIOD_S / 2)
            seen.append(follower.follow())  # within the period: no new reading
            machine.advance(PERIOD_S)
            seen.append((follower.follow(), torch.get_num_threads()))
        result.update(seen=seen, changes=follower.changes, samples=machine.samples)

    thread = threading.Thread(target=device_thread)
    thread.start()
    thread.join()
    assert result["seen"] == [2, (2, 2), 2, (1, 1), 1, (1, 1), 1, (2, 2)]
    assert result["changes"] == 2
    assert result["samples"] == 1 + 4  # at the start, then once a period: a step within one reads no /proc/stat


def test_own_threads_are_not_others_load():
    machine = FakeMachine()
    follower = LoadThreads(2, frozenset({0, 1}), sample=machine, clock=machine.clock)
    machine.advance(1.0, own_cores=2.0)  # this process alone keeps both cores busy
    assert follower.follow() == 2 and follower.changes == 0


def test_use_threads_follows_only_where_asked(monkeypatch):
    found = {}

    def on_thread(follow: bool):
        load_threads.use_threads(1, follow)
        found[follow] = (torch.get_num_threads(), load_threads.follow())

    for follow in (True, False):
        thread = threading.Thread(target=on_thread, args=(follow,))
        thread.start()
        thread.join()
    assert found[True] == (1, 1) and found[False] == (1, None)
    monkeypatch.setenv("TOKENROUTER_FOLLOW_LOAD", "0")
    thread = threading.Thread(target=on_thread, args=(True,))
    thread.start()
    thread.join()
    assert found[True] == (1, None)
    assert load_threads.follow() is None  # a thread that never set one up (this test's own)


def test_a_sample_of_some_cores_counts_only_theirs():
    first = cpu_sample(frozenset({0}))
    whole = cpu_sample()  # read after: the whole machine's busy time covers core 0's up to then
    if whole is None:  # no /proc/stat (macOS): following is off there
        return
    assert first.cpus == 1 and whole.cpus >= 1 and 0 < first.busy <= whole.busy and first.own > 0

