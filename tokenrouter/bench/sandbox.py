"""Run untrusted Python (model-written code plus its tests) in a separate, limited process.

Each run gets a fresh temporary directory as its working directory and home, a minimal environment, an
isolated interpreter (`python -I`: no user site, no PYTHON* variables, no script directory on the path),
limits on address space, CPU seconds and file size (`resource.setrlimit`), no network (a new network
namespace where the kernel allows one, and in every case a `socket` module that refuses to open
sockets), and a wall-clock timeout after which its whole process group is killed. The verdict travels on
a private pipe with a per-run nonce, so a program that exits early (`sys.exit(0)`, `os._exit(0)`) or
prints "passed" does not pass."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PASSED = "passed"
OUTPUT_LIMIT_BYTES = 16 << 20
DETAIL_CHARS = 2000

BOOTSTRAP = r'''
import ctypes, json, os, resource, socket, sys, traceback

def main(verdict_fd, memory_bytes, cpu_seconds, output_bytes):
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    network = isolate_network()
    channel = os.fdopen(verdict_fd, "w")
    os.set_inheritable(verdict_fd, False)

    def verdict(status, detail=""):
        channel.write(json.dumps({"nonce": nonce, "status": status, "detail": detail[-2000:], "network": network}))
        channel.flush()
        os._exit(0)

    try:
        with open("solution.py") as f:
            code = compile(f.read(), "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        verdict("syntax_error", f"{type(e).__name__}: {e}")
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        verdict("memory_limit", "MemoryError")
    except SystemExit as e:
        verdict("exited", f"SystemExit({e.code!r}) before the tests finished")
    except BaseException as e:
        verdict("failed", "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)))
    verdict("passed")

def isolate_network():
    """A new, empty network namespace: directly as root, else inside a new user namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWNET) == 0:
        level = "namespace"
    elif libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            try:
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
            except OSError:
                pass
        level = "namespace"
    else:
        level = "socket-guard"

    class NoNetwork(socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the sandbox")

    socket.socket = NoNetwork
    socket.create_connection = NoNetwork
    socket.socketpair = NoNetwork
    return level

main(*map(int, sys.argv[1:5]))
'''


@dataclass(slots=True)
class SandboxResult:
    status: str  # passed, failed, syntax_error, timeout, memory_limit, output_limit, exited, killed
    detail: str  # the end of the traceback or of stderr, or why the verdict is missing
    seconds: float
    network: str = ""  # how the network was cut: "namespace" or "socket-guard"

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def run_python(source: str, timeout: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
    """Run `source` as a program in the sandbox; it passes when it runs to the end without an exception."""
    if timeout <= 0:
        raise ValueError(f"timeout: must be > 0, got {timeout}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb: must be >= 64, got {memory_mb}")
    with tempfile.TemporaryDirectory(prefix="tokenrouter-sandbox-") as tmp:
        work = Path(tmp)
        (work / "solution.py").write_text(source)
        (work / "bootstrap.py").write_text(BOOTSTRAP)
        read_end, write_end = os.pipe()
        nonce = secrets.token_hex(16)
        args = [sys.executable, "-I", "bootstrap.py", str(write_end), str(memory_mb << 20),
                str(int(timeout) + 1), str(OUTPUT_LIMIT_BYTES)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        start = time.perf_counter()
        with open(work / "stdout.txt", "wb") as out, open(work / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(args, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    pass_fds=(write_end,), start_new_session=True)
        os.close(write_end)
        try:
            proc.stdin.write(f"{nonce}\n".encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = _wait(proc, timeout)
        seconds = time.perf_counter() - start
        with os.fdopen(read_end, "rb") as channel:
            message = channel.read(1 << 16)
        stderr = (work / "stderr.txt").read_bytes()[-DETAIL_CHARS:].decode(errors="replace")
    return _result(message, nonce, proc.returncode, timed_out, stderr, seconds)


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the program; on timeout kill its whole process group (children included)."""
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children it left behind
        except ProcessLookupError:
            pass


def _result(message: bytes, nonce: str, returncode: int, timed_out: bool, stderr: str,
            seconds: float) -> SandboxResult:
    if timed_out or returncode == -signal.SIGXCPU:
        return SandboxResult("timeout", f"killed after {seconds:.1f} s", seconds)
    if returncode == -signal.SIGXFSZ:
        return SandboxResult("output_limit", f"wrote more than {OUTPUT_LIMIT_BYTES} bytes", seconds)
    try:
        verdict = json.loads(message)
    except ValueError:
        verdict = {}
    if verdict.get("nonce") != nonce:
        why = f"exit code {returncode}" if returncode >= 0 else f"signal {-returncode}"
        status = "exited" if returncode >= 0 else "killed"
        return SandboxResult(status, f"no verdict from the sandbox ({why}); stderr: {stderr}", seconds)
    return SandboxResult(verdict["status"], verdict["detail"], seconds, verdict["network"])
