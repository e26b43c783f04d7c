"""Run untrusted Python (model-written code plus its tests) in a separate, limited process.

By default the program runs under bubblewrap (`bench/bwrap.py`: new user, mount, pid, network, ipc and uts
namespaces, uid 65534 without capabilities, an empty environment, the interpreter and system libraries
read-only, the run's temporary directory the only writable host path). A first stage sets the limits
(address space, CPU seconds, file size, process count) and then `exec`s the interpreter on the program, so
no harness code or state is left in the program's process. Whatever it leaves running dies with its pid
namespace when the program ends or times out.

The verdict: a per-run nonce waits in a pipe the program never reads until its last line (appended by the
harness) copies it to a second pipe; the parent accepts exactly that nonce, read with a deadline, and
judges everything else by the exit status and stderr. Exiting early (`sys.exit(0)`, `os._exit(0)`),
printing "passed" or writing anything else to the verdict pipe therefore never passes. What this does not
stop (docs/pilot.md): code written against this harness can copy the nonce itself, and code can subvert
its own tests in-process (an `__eq__` that is always true); either only changes that task's verdict.

Where bubblewrap is missing, `run_python` refuses unless `unsafe_no_sandbox=True`: then the program runs
as the caller's user with the same limits but no file system, process or uid isolation."""
from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokenrouter.bench import bwrap

PASSED = "passed"
OUTPUT_LIMIT_BYTES = 16 << 20
DETAIL_CHARS = 2000
MAX_PROCESSES = 64
VERDICT_DEADLINE = 2.0  # seconds the parent waits for the verdict pipe after the program ended
SANDBOXED, UNSANDBOXED = "bwrap", "none (--unsafe-no-sandbox)"

# The first stage: in the sandbox it gives up root (uid 0 of the sandbox's own user namespace) and every
# capability; then the limits; then it becomes the program (nothing of it stays in the program's memory).
STAGE = r'''
import ctypes, os, resource, sys
memory, cpu, output, nproc, uid, unshare_net, verdict, nonce = map(int, sys.argv[1:9])
low, high = sorted((verdict, nonce))
os.closerange(3, low)  # whatever else bwrap passed on (as root: the user namespace's fd)
os.closerange(low + 1, high)
os.closerange(high + 1, 1 << 16)
libc = ctypes.CDLL(None, use_errno=True)
if os.getuid() == 0 and uid:
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # clears the permitted and effective sets; then the inheritable one:
    libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
os.chdir(os.environ["HOME"])
os.environ.pop("PWD", None)  # bwrap's
for which, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, output),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
    if value >= 0:
        resource.setrlimit(which, (value, value))
if unshare_net and libc.unshare(0x40000000) != 0:  # CLONE_NEWNET, unsandboxed runs only
    libc.unshare(0x10000000 | 0x40000000)
os.execv(sys.executable, [sys.executable, "-I", "solution.py"])
'''


class SandboxUnavailable(RuntimeError):
    """Generated code was about to run without the sandbox, and nobody allowed that."""


@dataclass(slots=True)
class SandboxResult:
    status: str  # passed, failed, syntax_error, timeout, memory_limit, output_limit, exited, killed, bad_verdict
    detail: str  # the end of the traceback or of stderr, or why the verdict is missing
    seconds: float
    network: str = ""  # how the network was cut: "namespace" or "none"
    sandbox: str = ""  # "bwrap", or "none (--unsafe-no-sandbox)"

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def add_sandbox_argument(p) -> None:
    """`--unsafe-no-sandbox` for the commands that check generated code."""
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="where bubblewrap is missing, run generated code as your own user, unisolated (unsafe)")


def isolation(unsafe_no_sandbox: bool = False) -> str:
    """The isolation generated code will run under; raises SandboxUnavailable where bubblewrap does not work
    and `unsafe_no_sandbox` is not set."""
    why = bwrap.unavailable()
    if not why:
        return SANDBOXED
    if unsafe_no_sandbox:
        return UNSANDBOXED
    raise SandboxUnavailable(f"refusing to run generated code without a sandbox: {why}. Install bubblewrap, or "
                             "pass --unsafe-no-sandbox (unsafe_no_sandbox=True) to run it as your own user.")


def run_python(source: str, timeout: float = 10.0, memory_mb: int = 1024,
               unsafe_no_sandbox: bool = False) -> SandboxResult:
    """Run `source` as a program in the sandbox; it passes when it runs to the end without an exception."""
    if timeout <= 0:
        raise ValueError(f"timeout: must be > 0, got {timeout}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb: must be >= 64, got {memory_mb}")
    mode = isolation(unsafe_no_sandbox)
    with tempfile.TemporaryDirectory(prefix="tokenrouter-sandbox-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        verdict_read, verdict_write = os.pipe()
        nonce_read, nonce_write = os.pipe()
        nonce = secrets.token_hex(16).encode()
        os.write(nonce_write, nonce)
        os.close(nonce_write)
        (work / "solution.py").write_text(f"{source}\n\n__import__('os').write({verdict_write}, "
                                          f"__import__('os').read({nonce_read}, 64))\n")
        limits = [memory_mb << 20, int(timeout) + 1, OUTPUT_LIMIT_BYTES]
        start = time.perf_counter()
        with open(Path(tmp) / "stderr.txt", "wb+") as err:
            try:
                if mode == SANDBOXED:
                    timed_out, returncode = _run_sandboxed(work, Path(tmp).name, limits, (verdict_write, nonce_read),
                                                           err, timeout)
                else:
                    timed_out, returncode = _run_unsandboxed(work, limits, (verdict_write, nonce_read), err, timeout)
            finally:
                os.close(verdict_write)
                os.close(nonce_read)
            seconds = time.perf_counter() - start
            message = _read(verdict_read, VERDICT_DEADLINE)
            err.seek(max(0, err.seek(0, os.SEEK_END) - DETAIL_CHARS))
            stderr = err.read().decode(errors="replace")
    result = _result(message, nonce, returncode, timed_out, stderr, seconds)
    result.network, result.sandbox = ("namespace" if mode == SANDBOXED else "none"), mode
    return result


def _run_sandboxed(work: Path, name: str, limits: list[int], fds: tuple[int, int], err, timeout: float):
    """The program under bwrap; returns (timed out, the program's exit status as a Popen returncode)."""
    inside = f"/tmp/{name}"
    bwrap.prepare_workdir(work)
    info_read, info_write = os.pipe()
    try:
        with bwrap.user_namespace() as ns:
            exe = bwrap.interpreter()[0]
            args = bwrap.command(work, inside, ns, info_write) + [
                exe, "-I", "-S", "-c", STAGE, *map(str, limits), str(MAX_PROCESSES), str(bwrap.UID), "0",
                *map(str, fds)]
            extra = (info_write,) if ns is None else (info_write, ns)
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    pass_fds=fds + extra, start_new_session=True)
        os.close(info_write)
        info_write = -1
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_sandbox(proc, _read(info_read, 0.0))
            timed_out = True
    finally:
        os.close(info_read)
        if info_write >= 0:
            os.close(info_write)
    code = proc.returncode  # bwrap exits with the program's status, or 128 + the signal that ended it
    return timed_out, (128 - code if code > 128 else code)


def _kill_sandbox(proc: subprocess.Popen, info: bytes) -> None:
    """Kill the sandbox's pid 1: the kernel then kills every process in its pid namespace before bwrap,
    which waits for it, exits. (Killing bwrap alone would leave that to happen later.)"""
    try:
        os.kill(int(json.loads(info)["child-pid"]), signal.SIGKILL)
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_unsandboxed(work: Path, limits: list[int], fds: tuple[int, int], err, timeout: float):
    """The program as the caller's user with the limits only (no process limit: it counts all of the user's
    processes); on timeout its process group is killed, which a child in a new session escapes."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", STAGE, *map(str, limits), "-1", "0", "1",
                             *map(str, fds)], cwd=work,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, pass_fds=fds,
                            start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        return False, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True, proc.returncode
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children it left behind in its group
        except ProcessLookupError:
            pass


def _read(fd: int, deadline: float, limit: int = 1 << 12) -> bytes:
    """What `fd` holds, up to `limit` bytes, waiting at most `deadline` seconds in all for its writers to finish."""
    data, end = b"", time.monotonic() + deadline
    while len(data) < limit:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _result(message: bytes, nonce: bytes, returncode: int, timed_out: bool, stderr: str,
            seconds: float) -> SandboxResult:
    """A verdict from the nonce and the exit status; stderr (which the program controls) only names the failure."""
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out or returncode == -signal.SIGXCPU:
        return SandboxResult("timeout", f"killed after {seconds:.1f} s", seconds)
    if returncode == -signal.SIGXFSZ:
        return SandboxResult("output_limit", f"wrote more than {OUTPUT_LIMIT_BYTES} bytes", seconds)
    if message == nonce and returncode == 0:
        return SandboxResult(PASSED, "", seconds)
    if message and message != nonce:
        return SandboxResult("bad_verdict", f"the verdict pipe held {message[:100]!r}, not the run's nonce", seconds)
    if returncode < 0:
        return SandboxResult("killed", f"no verdict from the sandbox (signal {-returncode}); stderr: {stderr}", seconds)
    if last.startswith(("SyntaxError", "IndentationError", "TabError")) and "Traceback" not in stderr:
        return SandboxResult("syntax_error", stderr, seconds)
    if "Traceback (most recent call last)" in stderr:
        return SandboxResult("memory_limit" if last.startswith("MemoryError") else "failed", stderr, seconds)
    return SandboxResult("exited", f"exited before the end of the program (exit code {returncode}); stderr: {stderr}",
                         seconds)
