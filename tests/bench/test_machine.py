"""The machine record every benchmark writes and prints (`tokenrouter/bench/machine.py`)."""
from __future__ import annotations

import torch

from tokenrouter.bench.machine import cpu_info, describe, machine

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
"""


def test_the_cpu_model_and_flags_come_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    name, flags = cpu_info(path)
    assert name == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert {"avx512f", "avx512_bf16", "amx_tile"} <= flags and "sse2" in flags


def test_without_cpuinfo_the_platform_names_the_cpu(tmp_path):
    name, flags = cpu_info(tmp_path / "missing")
    assert name and flags == set()


def test_the_record_and_its_line():
    info = machine()
    assert info["cores"] >= 1 and info["torch"] == torch.__version__ and info["threads"] == torch.get_num_threads()
    assert set(info["flags"]) <= {"avx2", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
                                  "amx_int8"}
    line = describe({**info, "cpu": "Test CPU", "cores": 2, "flags": ["avx2", "amx_tile"], "threads": 2})
    assert line.startswith("machine: Test CPU, 2 cores (avx2 amx_tile)") and line.endswith("on 2 threads")
