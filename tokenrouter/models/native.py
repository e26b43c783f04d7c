"""Kernels of our own in C++, built with the compiler at hand the first time they are needed and cached per
machine (`~/.cache/tokenrouter/native/`); a machine without what they need simply does not offer them.

- `int4_vnni` (`csrc/int4_vnni.cpp`): int4 weights times activations split into two int8 digits, with
  AVX512-VNNI integer dot products; the int4 kernel candidate `int4-vnni`. Needs a CPU with AVX512-VNNI, a C++
  compiler and ninja (`pip install ninja`, a dependency).

`TOKENROUTER_NATIVE=0` turns them off.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sysconfig
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "int4_vnni.cpp"
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"}


def enabled() -> bool:
    return os.environ.get("TOKENROUTER_NATIVE", "1") not in ("0", "false", "no", "off")


def int4_vnni_missing() -> str:
    """Why the int4-vnni kernel cannot be built here ("" when it can)."""
    from tokenrouter.bench.machine import cpu_info
    if not enabled():
        return "TOKENROUTER_NATIVE=0"
    lacking = CPU_FLAGS - cpu_info()[1]
    if lacking:
        return f"the CPU lacks {' '.join(sorted(lacking))}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler})"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"no Python headers ({headers}; e.g. apt install python3-dev)"
    _ninja_on_path()
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return "no ninja (pip install ninja)"
    return ""


def _ninja_on_path() -> None:
    """torch builds with the `ninja` on PATH; the pip package's sits in an environment's bin directory, which
    is not on PATH when that environment's python runs without being activated."""
    try:
        import ninja
    except ImportError:
        return
    directory = getattr(ninja, "BIN_DIR", "")
    path = os.environ.get("PATH", "")
    if directory and directory not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([directory, path]) if path else directory


@functools.cache
def int4_vnni():
    """The built module (its `int4_mm(x, codes, scale, low, n)`), or None where it cannot be built: said once."""
    missing = int4_vnni_missing()
    if missing:
        log.info("int4-vnni kernel not offered: %s", missing)
        return None
    from tokenrouter.models.sources import cache_dir
    source = SOURCE.read_text()
    key = hashlib.sha256("|".join([source, *FLAGS, torch.__version__]).encode()).hexdigest()[:16]
    build = cache_dir() / "native" / f"int4_vnni-{key}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils.cpp_extension import load
        return load(name=f"tokenrouter_int4_vnni_{key}", sources=[str(SOURCE)], extra_cflags=FLAGS,
                    build_directory=str(build), verbose=False)
    except Exception as e:  # a broken toolchain means the other int4 kernels, not a failed load
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        log.warning("int4-vnni kernel not offered: building %s failed: %s", SOURCE.name, last)
        return None
