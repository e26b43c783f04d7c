"""Kernels of our own in C++, built with the compiler at hand the first time they are needed and cached per
machine (`~/.cache/tokenrouter/native/`); a machine without what they need simply does not offer them.

- `vnni` (`csrc/vnni_gemm.cpp`): int4 and int8 weights times activations split into int8 digits (two, or one
  for int4-vnni-a8), with AVX512-VNNI integer dot products; the kernel candidates `int4-vnni`, `int4-vnni-a8` and
  `int8-vnni`. Needs a CPU with AVX512-VNNI.
- `avx2` (`csrc/avx2_gemm.cpp`): the same activations times int4 weights (int4-vnni's layout, and each
  arithmetic's floats bit for bit) and int8 weights, with AVX2 integer dot products, built with AVX2-level flags
  only; the candidates `int4-avx2`, `int4-avx2-a8` and `int8-avx2`. Needs a CPU with AVX2, FMA and F16C.
- `avxvnni` (the same source built with -mavxvnni): avx2's kernels with AVX-VNNI's 256-bit dot products, the same
  floats in fewer instructions; the candidates `int4-avxvnni`, `int4-avxvnni-a8` and `int8-avxvnni`. Needs AVX-VNNI
  as well (Intel's cores since Alder Lake, laptops' included, which mostly lack AVX-512; AMD's since Zen 5).

Each needs a C++ compiler, Python's headers and ninja (`pip install ninja`, a dependency).
`TOKENROUTER_NATIVE=0` turns them off. `TOKENROUTER_ISA=avx2` makes the kernel choice see the CPU as one with
AVX2 and nothing above (no AVX-512, AVX-VNNI or AMX): what an AVX2 laptop runs, on a machine that has more;
`TOKENROUTER_ISA=avxvnni` as one with AVX2 and AVX-VNNI (what an Intel laptop since Alder Lake runs).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")


@dataclass(frozen=True, slots=True)
class Native:
    name: str  # the kernel family in messages
    source: str  # a file of csrc/
    flags: tuple[str, ...]  # the compiler's
    cpu_flags: frozenset[str]  # what the CPU must have (as /proc/cpuinfo names them)


VNNI = Native("vnni", "vnni_gemm.cpp",
              ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"),
              frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"}))
# NOTE: AVX2-level flags only (no -march=native): the object must run on an AVX2-only CPU
AVX2 = Native("avx2", "avx2_gemm.cpp", ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"),
              frozenset({"avx2", "fma", "f16c"}))
# NOTE: -fno-trapping-math lets GCC vectorize the loops that call exp_approx (SiLU, softmax): it would not turn
# `std::floor` into a vector rounding while floating-point exceptions may trap. The values are the same; silu_mul of
# the 1.5B's 8960 columns took 29.5-44.7 us a row without (scalar), 14.0 with (AMD EPYC Zen 4, 2026-12-06).
# NOTE: the avx2 kernels' source again, where each pair or triple of instructions that AVX-VNNI does in one compiles
# to that one (csrc/avx2_gemm.cpp); the other AVX2 flags as avx2's, so it runs on a CPU without AVX-512
AVXVNNI = Native("avxvnni", AVX2.source, AVX2.flags + ("-mavxvnni",), AVX2.cpu_flags | {"avx_vnni"})
CPU_OPS = Native("cpu-ops", "cpu_ops.cpp", AVX2.flags + ("-fno-trapping-math",), AVX2.cpu_flags)


# what TOKENROUTER_ISA=avx2 hides: the instruction sets above AVX2 (/proc/cpuinfo's names begin so)
ABOVE_AVX2 = ("avx512", "avx_vnni", "avx_ifma", "avx_ne_convert", "amx")
# what each TOKENROUTER_ISA hides (=avxvnni: all of them but AVX-VNNI)
HIDDEN = {"avx2": ABOVE_AVX2, "avxvnni": tuple(f for f in ABOVE_AVX2 if f != "avx_vnni")}


def isa_limit() -> str:
    """TOKENROUTER_ISA: "" (all the CPU has), "avx2" or "avxvnni"."""
    limit = os.environ.get("TOKENROUTER_ISA", "").strip().lower()
    if limit and limit not in HIDDEN:
        raise ValueError(f"TOKENROUTER_ISA={limit!r}: only {' or '.join(map(repr, HIDDEN))} (or unset) is known")
    return limit


def cpu_flags() -> set[str]:
    """The CPU's flags as the kernel choice sees them: /proc/cpuinfo's, less those TOKENROUTER_ISA hides."""
    from tokenrouter.bench.machine import cpu_info
    flags = cpu_info()[1]
    if isa_limit():
        flags = {f for f in flags if not f.startswith(HIDDEN[isa_limit()])}
    return flags


def enabled() -> bool:
    return os.environ.get("TOKENROUTER_NATIVE", "1") not in ("0", "false", "no", "off")


def missing(native: Native) -> str:
    """Why `native` cannot be built here ("" when it can)."""
    if not enabled():
        return "TOKENROUTER_NATIVE=0"
    lacking = native.cpu_flags - cpu_flags()
    if lacking:
        limit = f" (TOKENROUTER_ISA={isa_limit()})" if isa_limit() else ""
        return f"the CPU lacks {' '.join(sorted(lacking))}{limit}"
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


NATIVES = (VNNI, AVX2, AVXVNNI, CPU_OPS)
BY_NAME = {native.name: native for native in NATIVES}
_LOCKS = {native: threading.Lock() for native in NATIVES}  # one build of a module at a time in a process
_BUILT: dict[tuple[Native, str], object] = {}  # (native, TOKENROUTER_ISA) -> the module, or None: built once


def build(native: Native):
    """The built module, or None where it cannot be built (or TOKENROUTER_ISA hides what it needs): said once.
    Where a build is under way in the background (build_in_background), waits for it."""
    key = (native, isa_limit())
    if key in _BUILT:
        return _BUILT[key]
    lock = _LOCKS[native]
    if not lock.acquire(blocking=False):
        from tokenrouter.bench import progress
        with progress.step(f"wait for the {native.name} kernels' build (once per machine)"):
            lock.acquire()
    try:
        if key not in _BUILT:
            reason = missing(native)
            if reason:
                log.info("%s kernels not offered: %s", native.name, reason)
                _BUILT[key] = None
            elif _module_file(native).is_file():
                _BUILT[key] = _build(native)
            else:
                from tokenrouter.bench import progress
                # NOTE: a build compiles for seconds to minutes; a start says so (loading a built one takes ms)
                with progress.step(f"build {native.name} kernels from {native.source} (once per machine)"):
                    _BUILT[key] = _build(native)
        return _BUILT[key]
    finally:
        lock.release()


# a build whose kernels another gives with the same floats in fewer instructions, where the CPU has what it needs
SUCCESSOR = {AVX2: AVXVNNI}


def superseded(native: Native, built: bool = False) -> bool:
    """Whether the machine's kernel choice passes `native` over for its successor: one this machine can build
    (`built`: one built here), so that `native` is neither built ahead (build_in_background) nor, where the
    successor was built, timed (kernels.superseded); it is built where a config names one of its kernels."""
    successor = SUCCESSOR.get(native)
    if successor is None:
        return False
    return build(successor) is not None if built else not missing(successor)


def build_in_background() -> None:
    """Start building the native kernels this machine can use and has not built, each in a thread of its own:
    a first start compiles them (about 20 s each on 2 cores) while it converts and quantizes the models, instead
    of after. A later build() of one waits for it."""
    for native in NATIVES:
        if not missing(native) and not superseded(native) and not _module_file(native).is_file():
            threading.Thread(target=_build_quietly, args=(native,), name=f"build-{native.name}", daemon=True).start()


def _build_quietly(native: Native) -> None:
    from tqdm import tqdm
    start, key = time.perf_counter(), (native, isa_limit())
    with _LOCKS[native]:
        if key in _BUILT:
            return
        _BUILT[key] = _build(native)
    # NOTE: tqdm.write keeps the bar of the step in the foreground whole
    done = "built" if _BUILT[key] is not None else "could not build"
    tqdm.write(f"[tokenrouter] {done} {native.name} kernels from {native.source} in the background (once per "
               f"machine) in {time.perf_counter() - start:.0f} s", file=sys.stderr)


@functools.cache
def _key(native: Native) -> str:
    """A hash of the module's source, the headers of csrc/ it may include, its flags and torch's version."""
    texts = [(CSRC / native.source).read_text(), *(h.read_text() for h in sorted(CSRC.glob("*.h")))]
    return hashlib.sha256("|".join([*texts, *native.flags, torch.__version__]).encode()).hexdigest()[:16]


KERNELS = (VNNI, AVX2, AVXVNNI)  # the projections' kernels (tokenrouter.models.kernels)


def version(natives: tuple[Native, ...] = NATIVES) -> str:
    """The versions of native code (a hash of its source, flags and torch's version each): what cached kernel
    timings (`KERNELS`) and step profiles (all of them) were taken with, so that changed code is timed again."""
    return ",".join(f"{n.name}={_key(n)}" for n in natives)


def _directory(native: Native) -> Path:
    from tokenrouter.models.sources import cache_dir
    return cache_dir() / "native" / f"{Path(native.source).stem}-{_key(native)}"


def _module_file(native: Native) -> Path:
    """Where the built module lies (torch's extension loader names it after the module)."""
    return _directory(native) / f"tokenrouter_{Path(native.source).stem}_{_key(native)}.so"


def _build(native: Native):
    """Compile (or load, where built) `native`, which can be built here (`missing` said so); None on failure."""
    directory, module = _directory(native), _module_file(native)
    directory.mkdir(parents=True, exist_ok=True)
    source = CSRC / native.source
    try:
        from torch.utils.cpp_extension import load
        with open(directory / "build.flock", "w") as held:
            # NOTE: torch's own lock (a file named `lock`) stays behind when a build is killed (a start stopped
            # while it builds in the background), and the next build then waits for it forever; a flock is let go
            # with its process, and every build here holds it, so a `lock` found under it is stale
            fcntl.flock(held, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            return load(name=module.name.removesuffix(".so"), sources=[str(source)],
                        extra_cflags=list(native.flags), build_directory=str(directory), verbose=False)
    except Exception as e:  # a broken toolchain means the other kernels, not a failed load
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        log.warning("%s kernels not offered: building %s failed: %s", native.name, source.name, last)
        return None


def vnni_missing() -> str:
    """Why the AVX512-VNNI kernels cannot be built here ("" when they can)."""
    return missing(VNNI)


def vnni():
    """The built module (its `int4_mm(x, codes, scale, low, n)`, `int4_mm_a8` and `int8_mm(x, codes, scale, n)`),
    or None where it cannot be built."""
    return build(VNNI)


def avx2_missing() -> str:
    """Why the AVX2 kernels cannot be built here ("" when they can)."""
    return missing(AVX2)


def avx2():
    """The built module (its `int4_mm(x, codes, scale, low, n)` and `int8_mm(x, codes, scale)`), or None."""
    return build(AVX2)


def avxvnni_missing() -> str:
    """Why the AVX-VNNI build of the AVX2 kernels cannot be made here ("" when it can)."""
    return missing(AVXVNNI)


def avxvnni():
    """The AVX2 kernels' module built with AVX-VNNI (avx2()'s functions, the same floats), or None."""
    return build(AVXVNNI)


def cpu_ops_missing() -> str:
    """Why the CPU ops cannot be built here ("" when they can)."""
    return missing(CPU_OPS)


def cpu_ops():
    """The built module (rms_norm, add_rms_norm, silu_mul, rope_store_, paged_attention_: csrc/cpu_ops.cpp), or
    None where it cannot be built."""
    return build(CPU_OPS)
