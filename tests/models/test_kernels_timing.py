"""Kernel timings that hold: the load they were taken under, their consistency, one candidate at a time."""
from __future__ import annotations

import torch

from tokenrouter.models import kernels_timing
from tokenrouter.models.kernels import Kernel
from tokenrouter.models.kernels_timing import CpuSample, Timing, agree, non_monotonic, others_share, time_kernels


def test_others_share_is_the_machine_time_this_process_did_not_use():
    before = CpuSample(wall=10.0, busy=100.0, own=5.0, cpus=2)
    after = CpuSample(wall=12.0, busy=103.0, own=7.0, cpus=2)  # 3 CPU-s busy in 4 available, 2 of them ours
    assert others_share(before, after) == 0.25
    assert others_share(before, CpuSample(12.0, 102.0, 7.5, 2)) == 0.0  # rounding never goes negative
    assert others_share(None, after) is None


def test_cpu_sample_counts_this_process_time():
    before = kernels_timing.cpu_sample()
    if before is None:  # no /proc/stat (macOS)
        return
    x = torch.randn(256, 256)
    for _ in range(200):
        x = torch.tanh(x @ x)
    after = kernels_timing.cpu_sample()
    assert after.own > before.own and after.busy >= before.busy and after.cpus >= 1


def test_busy_or_inconsistent_sets_have_a_problem():
    assert Timing({"a": [1.0, 2.0, 4.0]}, others=0.05).problem() == ""
    assert Timing({"a": [1.0, 2.0, 4.0]}, others=None).problem() == ""  # load unknown: judged on consistency
    assert "busy" in Timing({"a": [1.0, 2.0, 4.0]}, others=0.4).problem()
    # mkl 2048x1536 as cached on a busy machine: 14.6 ms at 4 rows, 7.6 at 16
    assert "mkl" in Timing({"mkl": [0.9, 14.6, 7.6], "b": [1.0, 1.1, 1.2]}, others=0.0).problem()


def test_non_monotonic_allows_noise_only():
    assert non_monotonic({"a": [1.0, 0.9, 2.0], "b": [0.010, 0.012, 0.001]}) == []  # 10%; microseconds
    assert non_monotonic({"a": [1.0, 0.7, 2.0], "b": [3.0]}) == ["a"]


def test_agree_needs_the_same_figures_within_noise():
    assert agree({"a": [1.0, 4.0, 2.0]}, {"a": [1.1, 4.2, 2.1], "b": [9.0]})
    assert not agree({"a": [1.0, 4.0, 2.0]}, {"a": [1.0, 8.0, 2.0]})
    assert not agree({"a": [1.0]}, {"a": [1.0]})  # nothing fully timed to compare


class Counted(Kernel):
    alive = 0
    most = 0

    def __init__(self, seconds_per_row: float):
        super().__init__(None)
        self.seconds_per_row = seconds_per_row
        Counted.alive += 1
        Counted.most = max(Counted.most, Counted.alive)

    def matmul(self, x):
        return x

    def __del__(self):
        Counted.alive -= 1


def test_time_kernels_holds_one_candidate_at_a_time():
    Counted.alive = Counted.most = 0
    layers = 3
    builds = [{name: (lambda: Counted(1.0)) for name in ("a", "b", "c")} for _ in range(layers)]
    timing = time_kernels(builds, 8, torch.float32, (1, 4, 16))
    assert set(timing.ms) == {"a", "b", "c"} and all(len(t) == 3 for t in timing.ms.values())
    assert Counted.most == layers  # never two candidates' copies of the weights at once
    assert Counted.alive == 0
    assert timing.taken.endswith("Z")
