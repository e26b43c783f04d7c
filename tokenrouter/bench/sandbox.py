"""Run untrusted Python (model-written code) and its tests, each in a separate, limited process.

By default each process runs under bubblewrap (`bench/bwrap.py`: new user, mount, pid, network, ipc and uts
namespaces, uid 65534 without capabilities, an empty environment, the interpreter and system libraries
read-only, nothing of the host writable: its working directory lies in a tmpfs of `DISK_MB`). A first stage
sets the limits (address space, CPU seconds, file size, open files, process count) and then `exec`s the
interpreter, so no harness code or state is left in the process. Whatever a process leaves running dies with
its pid namespace.

`memory_mb` bounds a sandbox in all, not one process of it: where a cgroup v2 directory is delegated to the
harness (`TOKENROUTER_SANDBOX_CGROUP`), each sandbox runs in a cgroup of its own with that `memory.max` (swap
off); elsewhere the budget is divided over a small process limit (`processes_for`: 8 processes x 128 MiB for
1 GiB), RLIMIT_AS each, so its processes together stay within it. Each result says which (`memory`).

The generated code and the tests never share a process (`bench/remote.py`): the candidate's sandbox runs the
generated program and answers requests about its objects; the checker's sandbox, in namespaces of its own, runs
the task's tests against proxies of them, with only plain data crossing over. Only the checker holds the
verdict pipe and the pipe holding the run's nonce, and it copies the nonce to the verdict pipe when every test
returned; the parent accepts exactly that nonce, read with a deadline. Every other status also comes from what
the harness itself observes (`Observed`: its own timer, the checker's exit status, the sizes of the files it
measures); the candidate's exit status and stderr are recorded in the detail, never read for the status.
Generated code therefore cannot write or forge the verdict, choose the status of its failure, read the nonce,
or subvert the tests' comparisons; it can only answer the tests' calls, rightly or wrongly.

Where bubblewrap is missing, `run_python` and `run_tests` refuse unless `unsafe_no_sandbox=True`: then both
processes run as the caller's user with the same limits but no file system, process or uid isolation (and
so nothing keeps the candidate's process from the checker's)."""
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

from tokenrouter.bench import bwrap, remote

PASSED = "passed"
HARNESS_ERROR = "harness_error"  # the harness failed on this one task (quality.check); the run goes on
OUTPUT_LIMIT_BYTES = 16 << 20
DETAIL_CHARS = 2000
MAX_PROCESSES = 8  # processes (and threads) one sandbox may have at once, where no cgroup bounds its memory
CGROUP_PROCESSES = 64  # pids.max where a cgroup does
MIN_PROCESS_MB = 64  # the least address space a process of the budget gets (the interpreter needs ~30 MiB)
DISK_MB = 64  # the tmpfs holding the sandbox's /tmp and working directory
MAX_OPEN_FILES = 64
MAX_FILES = 1024  # inodes of that tmpfs (files, directories, links), where the first stage can remount it
CGROUP_ENV = "TOKENROUTER_SANDBOX_CGROUP"  # a delegated cgroup v2 directory (memory and pids controllers on)
VERDICT_DEADLINE = 2.0  # seconds the parent waits for the verdict pipe after the program ended
SANDBOXED, UNSANDBOXED = "bwrap", "none (--unsafe-no-sandbox)"

REMOTE = Path(__file__).with_name("remote.py")

# The first stage: in a user namespace the harness prepared, it remounts /tmp with an inode limit and gives up
# every capability (as root, uid 0 of that namespace too); then the limits; then it becomes the program
# (nothing of it stays in the program's memory).
STAGE = r'''
import ctypes, json, os, resource, sys
spec = json.loads(sys.argv[1])
start = 3
for fd in sorted(spec["keep"]):  # whatever else bwrap passed on (as root: the user namespace's fd)
    os.closerange(start, fd)
    start = fd + 1
os.closerange(start, 1 << 16)
libc = ctypes.CDLL(None, use_errno=True)
uid = spec["uid"]
if spec["tmpfs"]:  # NOTE: the prepared user namespace owns bwrap's tmpfs, so CAP_SYS_ADMIN here reaches it
    if libc.mount(None, b"/tmp", None, 32 | 2 | 4, spec["tmpfs"].encode()) != 0:  # MS_REMOUNT|MS_NOSUID|MS_NODEV
        raise SystemExit(f"remounting /tmp with {spec['tmpfs']}: errno {ctypes.get_errno()}")
    # NOTE: as an ordinary user, bwrap's pid 1 in the sandbox is that user too, without capabilities, so the
    # program could read its environment and write its memory (ptrace's checks); from a user namespace below
    # it, it cannot. It maps the same uid, and allows none nested in it.
    if os.getuid() != 0:
        if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
            raise SystemExit(f"unshare(CLONE_NEWUSER): errno {ctypes.get_errno()}")
        for path, text in (("/proc/self/uid_map", f"{uid} {uid} 1"), ("/proc/self/setgroups", "deny"),
                           ("/proc/self/gid_map", f"{uid} {uid} 1"), ("/proc/sys/user/max_user_namespaces", "0")):
            with open(path, "w") as f:
                f.write(text)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    if os.getuid() == 0:  # as root
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL (bwrap raised them for a uid other than 0)
    libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())  # the other sets, empty
    if any(int(line.split()[1], 16) for line in open("/proc/self/status") if line.startswith("Cap")):
        raise SystemExit("the first stage kept a capability")
os.chdir(os.environ["HOME"])
os.environ.pop("PWD", None)  # bwrap's
memory, cpu, output = spec["limits"]
for which, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, output),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, spec["nproc"]),
                     (resource.RLIMIT_NOFILE, spec["nofile"])):
    if value >= 0:
        resource.setrlimit(which, (value, value))
if spec["unshare_net"] and libc.unshare(0x40000000) != 0:  # CLONE_NEWNET, unsandboxed runs only
    libc.unshare(0x10000000 | 0x40000000)
os.execv(sys.executable, [sys.executable, "-I", *spec["argv"]])
'''


class SandboxUnavailable(RuntimeError):
    """Generated code was about to run without the sandbox, and nobody allowed that."""


@dataclass(slots=True)
class SandboxResult:
    status: str  # passed, failed, syntax_error, timeout, output_limit, exited, killed, bad_verdict, harness_error
    detail: str  # the end of the traceback or of stderr, or why the verdict is missing
    seconds: float
    network: str = ""  # how the network was cut: "namespace" or "none"
    sandbox: str = ""  # "bwrap", or "none (--unsafe-no-sandbox)"
    memory: str = ""  # how the sandbox's memory was bounded in all (`MemoryBound.describe`)

    @property
    def passed(self) -> bool:
        return self.status == PASSED


@dataclass(slots=True)
class Observed:
    """What the harness itself saw of one run: the only inputs of its status."""
    timed_out: bool  # its own wall timer fired (and it killed both sandboxes)
    verdict: bytes  # what the verdict pipe held (only the checker holds its write end)
    checker: int  # the checker's exit status (harness code, in a sandbox of its own)
    candidate: int  # the candidate's exit status: the program's own choice, so recorded as data only
    largest_output: int  # bytes: the largest file it measured (the stderr files; unsandboxed, its directory)
    seconds: float


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


@dataclass(frozen=True, slots=True)
class MemoryBound:
    """How one sandbox's `budget_mb` is enforced: a cgroup's memory.max (`cgroup` set), or `processes`
    processes of `process_mb` address space each; and its tmpfs: DISK_MB, `inodes` files at most (0: the
    tmpfs's default, half the machine's pages, where the first stage cannot remount it)."""
    budget_mb: int
    processes: int
    process_mb: int
    cgroup: Path | None = None
    inodes: int = 0

    @classmethod
    def of(cls, budget_mb: int, cgroup: Path | None = None, inodes: int = 0) -> MemoryBound:
        if cgroup is not None:
            return cls(budget_mb, CGROUP_PROCESSES, budget_mb, cgroup, inodes)
        processes = processes_for(budget_mb)
        return cls(budget_mb, processes, budget_mb // processes, None, inodes)

    def describe(self) -> str:
        if self.cgroup is not None:
            memory = f"cgroup memory.max {self.budget_mb} MiB"
        else:
            memory = f"{self.processes} processes x {self.process_mb} MiB (RLIMIT_NPROC x RLIMIT_AS)"
        files = f"{self.inodes} inodes" if self.inodes else "inodes unbounded (bwrap's own user namespace)"
        return f"{memory}; tmpfs {DISK_MB} MiB, {files}"


def processes_for(budget_mb: int) -> int:
    """The process limit a budget is divided over: MAX_PROCESSES, fewer where each would get under
    MIN_PROCESS_MB (at least 2: the program and one child, or, as root, the program and the checker)."""
    return max(2, min(MAX_PROCESSES, budget_mb // MIN_PROCESS_MB))


def delegated_cgroup() -> Path | None:
    """The cgroup v2 directory named by $TOKENROUTER_SANDBOX_CGROUP where it can hold sandboxes (writable,
    memory and pids in its cgroup.subtree_control); None elsewhere (the process-limit division then holds)."""
    path = os.environ.get(CGROUP_ENV)
    if not path:
        return None
    try:
        enabled = (Path(path) / "cgroup.subtree_control").read_text().split()
    except OSError:
        return None
    return Path(path) if {"memory", "pids"} <= set(enabled) and os.access(path, os.W_OK) else None


def run_python(source: str, timeout: float = 10.0, memory_mb: int = 1024,
               unsafe_no_sandbox: bool = False) -> SandboxResult:
    """Run `source` as a program in the sandbox; it passes when it runs to the end without an exception."""
    return run_tests(source, "", "", "", timeout, memory_mb, unsafe_no_sandbox)


def run_tests(source: str, test: str, entry_point: str, helpers: str = "", timeout: float = 10.0,
              memory_mb: int = 1024, unsafe_no_sandbox: bool = False) -> SandboxResult:
    """Run the program `source` in one sandbox and, once it has run to the end, `test` (a HumanEval `check`)
    against its `entry_point` in another; `helpers` (the task's prompt, trusted) is run before the tests, for
    the helpers they call. It passes when `check(entry_point)` returns; with no `entry_point`, when `source`
    runs to the end without an exception. `memory_mb` bounds each sandbox, all its processes together. Raises
    on what it cannot run (a text not encodable as UTF-8 raises UnicodeEncodeError before any process starts);
    `quality.check` makes that one task's `harness_error`."""
    check_limits(timeout, memory_mb)
    mode = isolation(unsafe_no_sandbox)
    with tempfile.TemporaryDirectory(prefix="tokenrouter-sandbox-") as tmp:
        tmp = Path(tmp)
        work, checker = tmp / "work", tmp / "checker"
        for directory, files in ((work, {"solution.py": source}),  # the checker compiles the program, never runs it
                                 (checker, {"solution.py": source, "test.py": test, "prompt.py": helpers})):
            directory.mkdir()
            (directory / "remote.py").write_bytes(REMOTE.read_bytes())
            for name, text in files.items():
                (directory / name).write_text(text, encoding="utf-8")
        requests, answers, verdict, nonce_pipe = os.pipe(), os.pipe(), os.pipe(), os.pipe()
        nonce = secrets.token_hex(16).encode()
        os.write(nonce_pipe[1], nonce)
        os.close(nonce_pipe[1])
        candidate_fds, checker_fds = (requests[0], answers[1]), (answers[0], requests[1], verdict[1], nonce_pipe[0])
        sandboxed = mode == SANDBOXED
        bound = MemoryBound.of(memory_mb, delegated_cgroup() if sandboxed else None,
                               MAX_FILES if sandboxed and bwrap.files_bounded() else 0)
        limits = [(bound.process_mb if sandboxed else memory_mb) << 20, int(timeout) + 1, OUTPUT_LIMIT_BYTES]
        programs = [(work, tmp.name, ["remote.py", "serve", "solution.py", *map(str, candidate_fds)],
                     list(candidate_fds)),
                    (checker, f"{tmp.name}-checker", ["remote.py", "check", "solution.py", "test.py", "prompt.py",
                                                      entry_point, *map(str, checker_fds)], list(checker_fds))]
        start = time.perf_counter()
        with open(tmp / "stderr.txt", "wb+") as err, open(tmp / "candidate-stderr.txt", "wb+") as candidate_err:
            try:
                run = _run_sandboxed if sandboxed else _run_unsandboxed
                timed_out, (candidate_code, checker_code) = run(programs, limits, bound, (candidate_err, err),
                                                                timeout)
                seconds = time.perf_counter() - start
                message = _read(verdict[0], VERDICT_DEADLINE)
            finally:
                _close_children_fds(programs)
                os.close(verdict[0])
            largest = max(os.fstat(err.fileno()).st_size, os.fstat(candidate_err.fileno()).st_size, _largest_file(work))
            seen = Observed(timed_out, message, checker_code, candidate_code, largest, seconds)
            stderr, candidate_stderr = _tail(err), _tail(candidate_err)
    result = _result(seen, nonce, timeout, stderr, candidate_stderr)
    result.network, result.sandbox = ("namespace" if sandboxed else "none"), mode
    result.memory = bound.describe() if sandboxed else f"RLIMIT_AS {memory_mb} MiB per process"
    return result


def check_limits(timeout: float, memory_mb: int) -> None:
    """Raises ValueError naming a limit the sandbox cannot run under."""
    if not timeout > 0:
        raise ValueError(f"timeout: must be > 0, got {timeout}")
    if memory_mb < 2 * MIN_PROCESS_MB:
        raise ValueError(f"memory_mb: must be >= {2 * MIN_PROCESS_MB} (the whole sandbox's budget), got {memory_mb}")


def _close_children_fds(programs) -> None:
    """Close the parent's copies of the pipe ends the two processes hold (once)."""
    for program in programs:
        fds, program[3][:] = list(program[3]), []
        for fd in fds:
            os.close(fd)


def _largest_file(directory: Path, budget: int = 10_000) -> int:
    """The size of the largest regular file under `directory`, symlinks not followed, looking at `budget`
    entries at most (the program chose how many there are)."""
    largest, todo = 0, [directory]
    while todo and budget > 0:
        try:
            with os.scandir(todo.pop()) as entries:
                for entry in entries:
                    budget -= 1
                    if budget < 0:
                        break
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        largest = max(largest, entry.stat(follow_symlinks=False).st_size)
        except OSError:
            continue
    return largest


def _tail(f) -> str:
    f.seek(max(0, f.seek(0, os.SEEK_END) - DETAIL_CHARS))
    return f.read().decode(errors="replace")


def _run_sandboxed(programs, limits: list[int], bound: MemoryBound, errs, timeout: float):
    """The candidate's program and the checker, each under its own bwrap (in a cgroup of its own where `bound`
    has one); returns (timed out, the exit status of each as bwrap reports it: the program's own, or 128 + the
    signal that ended it, which a program can also choose)."""
    procs, infos, groups = [], [], []
    try:
        with bwrap.user_namespace(bound.inodes > 0) as ns:
            exe = bwrap.interpreter()[0]
            for (work, name, argv, fds), err in zip(programs, errs):
                info_read, info_write = os.pipe()
                infos.append(info_read)
                spec = {"limits": limits, "nproc": bound.processes, "nofile": MAX_OPEN_FILES, "uid": bwrap.UID,
                        "unshare_net": 0, "keep": list(fds), "argv": argv,
                        "tmpfs": f"size={DISK_MB << 20},nr_inodes={bound.inodes}" if bound.inodes else ""}
                files = {f.name: f for f in sorted(work.iterdir())}
                args = bwrap.command(files, f"/tmp/{name}", ns, info_write, DISK_MB << 20) + [
                    exe, "-I", "-S", "-c", STAGE, json.dumps(spec)]
                if bound.cgroup is not None:
                    groups.append(_cgroup(bound, name))
                    args = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(groups[-1]), *args]
                extra = (info_write,) if ns is None else (info_write, ns)
                try:  # NOTE: bwrap with no environment: its pid 1 in the sandbox shows its own to whoever may look
                    procs.append(subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=err, pass_fds=(*fds, *extra), start_new_session=True, env={}))
                finally:
                    os.close(info_write)
        _close_children_fds(programs)  # NOTE: the candidate's requests pipe ends when the checker's copy does
        timed_out = _wait(procs, timeout, lambda i: _kill_sandbox(procs[i], _read(infos[i], 0.0)))
    finally:
        for p, info in zip(procs, infos):
            if p.poll() is None:
                _kill_sandbox(p, _read(info, 0.0))
        for info in infos:
            os.close(info)
        for group in groups:
            _remove_cgroup(group)
    return timed_out, [p.returncode for p in procs]


def _cgroup(bound: MemoryBound, name: str) -> Path:
    """A fresh cgroup under the delegated one, its limits set."""
    group = bound.cgroup / name
    group.mkdir()
    set_cgroup_limits(group, bound.budget_mb)
    return group


def set_cgroup_limits(group: Path, budget_mb: int) -> None:
    """memory.max the budget, no swap (where the kernel accounts swap), at most CGROUP_PROCESSES pids.
    NOTE: the files are written, never created: the kernel makes them with the controllers, so a controller
    missing is an error here rather than a sandbox the result would call bounded."""
    for key, value in (("memory.max", budget_mb << 20), ("memory.swap.max", 0), ("pids.max", CGROUP_PROCESSES)):
        if key == "memory.swap.max" and not (group / key).exists():
            continue
        fd = os.open(group / key, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)


def _remove_cgroup(group: Path) -> None:
    """Remove a sandbox's cgroup once its processes are gone (killing any left first)."""
    if (group / "cgroup.kill").exists():
        (group / "cgroup.kill").write_text("1")
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.01)


def _wait(procs: list[subprocess.Popen], timeout: float, kill) -> bool:
    """Wait for the checker (the last process) up to `timeout`; then give the candidate's process (which ends
    when the checker closes its pipe, or has ended already) the verdict deadline. True when the checker ran
    out of time: then both are killed."""
    candidate, checker = procs
    try:
        checker.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(1)
        kill(0)
        return True
    try:
        candidate.wait(timeout=VERDICT_DEADLINE)
    except subprocess.TimeoutExpired:
        kill(0)
    return False


def _kill_sandbox(proc: subprocess.Popen, info: bytes) -> None:
    """Kill the sandbox's pid 1: the kernel then kills every process in its pid namespace before bwrap,
    which waits for it, exits. (Killing bwrap alone would leave that to happen later.)"""
    if proc.poll() is not None:
        return
    try:
        os.kill(int(json.loads(info)["child-pid"]), signal.SIGKILL)
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_unsandboxed(programs, limits: list[int], bound: MemoryBound, errs, timeout: float):
    """Both processes as the caller's user with the limits only (no process limit: it counts all of the
    user's processes); their process groups are killed at the end, which a child in a new session escapes."""
    procs = []
    try:
        for (work, _, argv, fds), err in zip(programs, errs):
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
            spec = {"limits": limits, "nproc": -1, "nofile": MAX_OPEN_FILES, "uid": 0, "unshare_net": 1,
                    "keep": list(fds), "argv": argv, "tmpfs": ""}
            procs.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", STAGE, json.dumps(spec)], cwd=work,
                                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                          pass_fds=fds, start_new_session=True))

        _close_children_fds(programs)

        def kill(i: int) -> None:
            try:
                os.killpg(procs[i].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            procs[i].wait()

        timed_out = _wait(procs, timeout, kill)
        return timed_out, [p.returncode for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # children left behind in its group
            except ProcessLookupError:
                pass
            p.wait()


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


def _result(seen: Observed, nonce: bytes, timeout: float, stderr: str, candidate_stderr: str) -> SandboxResult:
    """The status from what the harness observed; stderr only describes the failure (the checker's, which
    carries the candidate's tracebacks, and the candidate's own where it ended early).
    NOTE: the candidate's exit status and its text never choose a status: an `os._exit(152)` (what bwrap
    reports for a death by SIGXCPU) is no timeout, an `os._exit(153)` (SIGXFSZ) no output limit, a `raise
    MemoryError` a plain failure, a "SyntaxError" it writes a plain failure."""
    s = seen.seconds
    if seen.timed_out:
        return SandboxResult("timeout", f"killed by the harness after {s:.1f} s (limit {timeout:g} s)", s)
    if seen.verdict == nonce and seen.checker == 0:
        return SandboxResult(PASSED, "", s)
    if seen.verdict and seen.verdict != nonce:
        return SandboxResult("bad_verdict", f"the verdict pipe held {seen.verdict[:100]!r}, not the run's nonce", s)
    if seen.checker == remote.BAD_MESSAGE:
        return SandboxResult("bad_verdict", stderr.strip(), s)
    if seen.checker == remote.SYNTAX_ERROR:  # the checker's own compile of the program
        return SandboxResult("syntax_error", stderr, s)
    ended = _ending(seen.candidate)
    if seen.largest_output >= OUTPUT_LIMIT_BYTES:
        return SandboxResult("output_limit", f"a file it wrote reached the limit of {OUTPUT_LIMIT_BYTES} bytes "
                             f"(the program's {ended}); stderr: {candidate_stderr}", s)
    if seen.checker == remote.CANDIDATE_ENDED:
        return SandboxResult("exited", f"{stderr.strip()} ({ended}); stderr: {candidate_stderr}", s)
    if seen.checker == 1:  # a test failed, or the program raised (its traceback in the detail)
        return SandboxResult("failed", stderr, s)
    if seen.checker < 0 or seen.checker > 128:
        return SandboxResult("killed", f"the checker was killed ({_ending(seen.checker)}); stderr: {stderr}", s)
    return SandboxResult("exited", f"the checker ended with {_ending(seen.checker)} (the program's {ended}); "
                         f"stderr: {stderr}", s)


def _ending(code: int) -> str:
    return f"exit status {code}" if code >= 0 else f"signal {-code}"
