"""The sandbox: verdicts for passing and failing programs, and the limits it promises."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tokenrouter.bench import bwrap, sandbox
from tokenrouter.bench.humaneval import Task
from tokenrouter.bench.quality import check
from tokenrouter.bench.sandbox import (CGROUP_ENV, CGROUP_PROCESSES, DISK_MB, MAX_FILES, MAX_OPEN_FILES, SANDBOXED,
                                      UNSANDBOXED, SandboxUnavailable, delegated_cgroup, processes_for, run_python)


def test_a_program_that_runs_to_the_end_passes():
    r = run_python("def f(x):\n    return x + 1\n\nassert f(1) == 2\n")
    assert r.passed and r.status == "passed"
    assert r.network == "namespace" and r.sandbox == SANDBOXED


def test_a_failing_assertion_fails_with_its_traceback():
    r = run_python("assert 1 + 1 == 3, 'arithmetic'\n")
    assert r.status == "failed" and "AssertionError: arithmetic" in r.detail
    assert "bootstrap" not in r.detail  # the traceback starts at the program, not the harness


def test_syntax_error_is_reported_as_such():
    r = run_python("def f(:\n    pass\n")
    assert r.status == "syntax_error" and "SyntaxError" in r.detail


@pytest.mark.parametrize("source", ["while True:\n    pass\n", "import time\ntime.sleep(60)\n"])
def test_infinite_loops_and_sleeps_time_out(source):
    r = run_python(source, timeout=1.5)
    assert r.status == "timeout" and not r.passed


def test_memory_limit_stops_a_huge_allocation():
    """A plain failure: its MemoryError is text the program could have written itself (see below)."""
    r = run_python("block = bytearray(2 * 1024 ** 3)\n", memory_mb=256)
    assert r.status == "failed" and "MemoryError" in r.detail


def test_output_over_the_limit_is_measured_by_the_harness():
    r = run_python("import sys\nsys.stderr.write('x' * (17 << 20))\n")
    assert r.status == "output_limit" and not r.passed


def test_a_file_over_the_limit_fails_where_the_harness_cannot_see_it():
    """The working directory is the sandbox's own tmpfs, gone with it: the file size limit stops the write, and the
    harness records a plain failure (it cannot measure the file, so it does not claim `output_limit`)."""
    r = run_python("open('big', 'wb').write(b'x' * (17 << 20))\n")
    assert r.status == "failed" and "File too large" in r.detail


def held_mib(detail: str, word: str) -> int:
    found = re.search(rf"{word} (\d+) MiB", detail)
    assert found, detail
    return int(found.group(1))


MEMORY_HOG = """
import os
r, w = os.pipe()
go_r, go_w = os.pipe()
children = 0
for _ in range(12):
    try:
        pid = os.fork()
    except OSError:  # the process limit
        break
    if pid == 0:  # NOTE: a child must never return into the harness's server loop: os._exit whatever happens
        os.close(go_w)
        held = []
        try:
            reserve = bytearray(4 << 20)  # freed to report after a MemoryError
            while len(held) < 256:
                held.append(bytes(range(256)) * 4096)  # 1 MiB, every page touched
        except MemoryError:
            reserve = None
        try:
            os.write(w, len(held).to_bytes(4, "little"))
            os.read(go_r, 1)  # hold it until every child has reported
        finally:
            os._exit(0)
    children += 1
os.close(w)
reports = [os.read(r, 4) for _ in range(children)]  # b"" once every child is gone
total = sum(int.from_bytes(x, "little") for x in reports)
os.close(go_w)
for _ in range(children):
    os.wait()
raise AssertionError(f"HELD {total} MiB in {children} children")
"""


def test_forked_children_cannot_hold_more_than_the_budget_together():
    """Issue 26: the limit was per process, so 6 children of 700 MB each held 4.3 GB at once. Each child here tries
    for 256 MiB and holds what it got until all have reported."""
    r = run_python(MEMORY_HOG, memory_mb=512, timeout=60)
    assert r.status == "failed", r.detail
    total = held_mib(r.detail, "HELD")
    assert 0 < total <= 512, r.detail
    if delegated_cgroup() is None:
        assert r.memory.startswith("8 processes x 64 MiB (RLIMIT_NPROC x RLIMIT_AS); "), r.memory
    else:
        assert r.memory.startswith("cgroup memory.max 512 MiB; "), r.memory


def test_a_budget_is_divided_over_fewer_processes_rather_than_starving_each():
    assert [processes_for(mb) for mb in (128, 256, 512, 1024, 2048)] == [2, 4, 8, 8, 8]
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass\n", memory_mb=127)


DISK_HOG = """
written, error = 0, None
try:
    for i in range(60):  # the issue's payload: 60 files of 15 MiB
        with open(f"f{i}", "wb", buffering=0) as f:
            for _ in range(15):
                written += f.write(b"x" * (1 << 20))
except OSError as e:
    error = e.strerror
raise AssertionError(f"WROTE {written >> 20} MiB, then {error}")
"""


def test_the_disk_payload_stops_at_the_tmpfs_size():
    """Issue 26: 60 files of 15 MiB landed on the host's disk in 2 s; the working directory is now a tmpfs."""
    r = run_python(DISK_HOG, timeout=60)
    assert r.status == "failed" and "No space left on device" in r.detail, r.detail
    assert DISK_MB // 2 <= held_mib(r.detail, "WROTE") <= DISK_MB


FILE_HOG = """
import os
n, error = 0, None
try:
    while n < 100_000:
        os.close(os.open(f"e{n}", os.O_CREAT | os.O_WRONLY))
        n += 1
except OSError as e:
    error = e.strerror
raise AssertionError(f"CREATED {n} files, then {error}")
"""


def test_open_files_and_files_in_the_tmpfs_are_bounded():
    """Empty files cost the tmpfs no size, only inodes (kernel memory): as an ordinary user the payload made
    100,000 of 100,000 (the tmpfs's default limit, half the machine's pages: 3 million here), 1,020 now."""
    r = run_python(f"handles = [open(f'f{{i}}', 'w') for i in range({MAX_OPEN_FILES} + 1)]\n")
    assert r.status == "failed" and "Too many open files" in r.detail, r.detail
    r = run_python(FILE_HOG, timeout=30)
    created = int(re.search(r"CREATED (\d+) files", r.detail).group(1))
    if not bwrap.files_bounded():  # the fallback (bubblewrap's own user namespace) says so in every result
        assert r.memory.endswith(f"tmpfs {DISK_MB} MiB, inodes unbounded (bwrap's own user namespace)"), r.memory
        pytest.skip(f"the harness cannot prepare a user namespace here: {created} files created")
    assert r.memory.endswith(f"tmpfs {DISK_MB} MiB, {MAX_FILES} inodes"), r.memory
    assert "No space left on device" in r.detail and MAX_FILES - 8 <= created < MAX_FILES, r.detail


def unprivileged_harness() -> list[str]:
    """As root: a command prefix running Python as uid 65534 that can import the sandbox (the venv's
    interpreter may lie in root's home, out of that user's reach); skips where there is none."""
    if os.geteuid() != 0:
        pytest.skip("not root: every test here runs the harness as an ordinary user already")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run the harness as another user")
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                   "env", f"PYTHONPATH={ROOT}", python, "-c"]
        done = subprocess.run([*command, "import tokenrouter.bench.sandbox"], cwd="/", capture_output=True)
        if done.returncode == 0:
            return command
    pytest.skip("no interpreter uid 65534 may run that imports tokenrouter.bench.sandbox")


def test_a_harness_run_as_an_ordinary_user_bounds_files_and_capabilities_too():
    """Gaps left by issue 26: run by an ordinary user, bwrap's own user namespace changes uid in a second, nested
    one, where no capability reaches the tmpfs, so only root's runs had an inode limit; and bwrap's pid 1, the
    same user without capabilities in the program's namespace, showed it the harness's environment (and its
    memory, read-write). The harness now prepares the namespace for any user (mapping itself to 65534), the
    first stage remounts the tmpfs there, and the program runs in a user namespace below bwrap's pid 1."""
    secret = f"s3cret-{uuid.uuid4().hex}"
    program = ("import ctypes, os\n"
               "assert os.getuid() == os.getgid() == 65534, (os.getuid(), os.getgid())\n"
               "caps = dict(line.split(':') for line in open('/proc/self/status') if line.startswith('Cap'))\n"
               "assert all(int(v, 16) == 0 for v in caps.values()), caps\n"
               "assert ctypes.CDLL(None).unshare(0x10000000) != 0, 'made a nested user namespace'\n"
               + reaching_for(secret) + FILE_HOG)
    run = (f"import json\nfrom tokenrouter.bench.sandbox import run_python\n"
           f"r = run_python({program!r}, timeout=30)\nprint(json.dumps([r.status, r.detail, r.memory]))\n")
    harness = unprivileged_harness()
    harness.insert(harness.index("env") + 1, f"TOKENROUTER_PROBE={secret}")
    done = subprocess.run([*harness, run], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status, detail, memory = json.loads(done.stdout)
    assert status == "failed" and memory.endswith(f"{MAX_FILES} inodes"), (status, detail, memory)
    assert re.search(rf"CREATED 10\d\d files, then No space left on device", detail), detail


# ---- the cgroup v2 path, where a cgroup is delegated to the harness ----------------------------------------
CGROUP_FILES = ("memory.max", "memory.swap.max", "pids.max", "cgroup.procs")  # as the kernel makes them


def fake_cgroup(path: Path, controllers: str) -> Path:
    path.mkdir()
    (path / "cgroup.subtree_control").write_text(controllers + "\n")
    return path


def test_a_cgroup_is_used_only_where_memory_and_pids_are_delegated(tmp_path, monkeypatch):
    monkeypatch.delenv(CGROUP_ENV, raising=False)
    assert delegated_cgroup() is None
    for controllers, expected in (("cpu memory pids", True), ("memory", False), ("pids", False), ("", False)):
        monkeypatch.setenv(CGROUP_ENV, str(fake_cgroup(tmp_path / f"g{len(controllers)}", controllers)))
        assert (delegated_cgroup() is not None) == expected, controllers
    monkeypatch.setenv(CGROUP_ENV, str(tmp_path / "missing"))
    assert delegated_cgroup() is None


def test_a_cgroup_without_a_controllers_file_is_an_error_not_an_unbounded_sandbox(tmp_path):
    group = tmp_path / "g"
    group.mkdir()
    (group / "pids.max").write_text("max\n")
    with pytest.raises(FileNotFoundError, match="memory.max"):
        sandbox.set_cgroup_limits(group, 512)
    (group / "memory.max").write_text("max\n")
    sandbox.set_cgroup_limits(group, 512)  # memory.swap.max is absent where the kernel does not account swap
    assert (group / "memory.max").read_text() == str(512 << 20) and not (group / "memory.swap.max").exists()


def test_each_sandbox_runs_in_its_own_cgroup_with_the_budget_as_memory_max(tmp_path, monkeypatch):
    """NOTE: a fake delegated directory (this CI host mounts cgroup v1, whose hierarchy holds the memory
    controller): what the harness decides and writes, not what the kernel enforces."""
    monkeypatch.setenv(CGROUP_ENV, str(fake_cgroup(tmp_path / "delegated", "memory pids")))
    real, seen = sandbox.set_cgroup_limits, {}

    def kernel(group: Path, budget_mb: int) -> None:
        for key in CGROUP_FILES:
            (group / key).write_text("max\n")
        real(group, budget_mb)

    def remove(group: Path) -> None:
        seen[group.name] = {key: (group / key).read_text().strip() for key in CGROUP_FILES}
        shutil.rmtree(group)

    monkeypatch.setattr(sandbox, "set_cgroup_limits", kernel)
    monkeypatch.setattr(sandbox, "_remove_cgroup", remove)
    r = run_python("import resource\n"
                   "assert resource.getrlimit(resource.RLIMIT_AS)[0] == 512 << 20\n"
                   f"assert resource.getrlimit(resource.RLIMIT_NPROC)[0] == {CGROUP_PROCESSES}\n", memory_mb=512)
    assert r.passed, r.detail
    assert r.memory.startswith("cgroup memory.max 512 MiB; "), r.memory
    assert len(seen) == 2  # the candidate's sandbox and the checker's
    for files in seen.values():
        assert files["memory.max"] == str(512 << 20) and files["memory.swap.max"] == "0", files
        assert files["pids.max"] == str(CGROUP_PROCESSES) and files["cgroup.procs"].isdigit(), files


FORGED = {  # each was recorded as the status named (issue 26, item 7)
    "timeout": "import os\nos._exit(152)\n",  # what bwrap reports for a death by SIGXCPU
    "timeout by signal": "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)\n",
    "output_limit": "import os\nos._exit(153)\n",  # SIGXFSZ
    "output_limit by signal": "import os, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
                              "os.kill(os.getpid(), signal.SIGXFSZ)\n",
    "memory_limit": "raise MemoryError('out of memory, honestly')\n",
    "syntax_error": ("import json, os\n"  # a failure message on every pipe it holds, as its own process would send
                     "for fd in sorted(int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2):\n"
                     "    try:\n"
                     "        os.write(fd, json.dumps({'failed': 'SyntaxError: forged'}).encode() + b'\\n')\n"
                     "    except OSError:\n"
                     "        pass\n"
                     "os._exit(0)\n"),
}


@pytest.mark.parametrize("forged", FORGED)
def test_generated_code_cannot_choose_its_failure_status(forged):
    """Statuses come from what the harness observes (its timer, the checker, the files it measures); the
    program's exit status and text are only recorded in the detail."""
    r = run_python(FORGED[forged])
    assert r.status in ("exited", "failed") and not r.passed, r
    if forged in ("timeout", "output_limit"):
        assert r.status == "exited" and f"exit status {152 if forged == 'timeout' else 153}" in r.detail


@pytest.mark.parametrize("source", ["import sys\nsys.exit(0)\n", "raise SystemExit\n", "import os\nos._exit(0)\n",
                                    "quit()\n", "print('passed')\nimport os\nos._exit(0)\n"])
def test_exiting_early_never_passes(source):
    r = run_python(source)
    assert r.status == "exited" and not r.passed


def test_no_network():
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n")
    assert r.status == "failed" and any(e in r.detail for e in ("PermissionError", "OSError", "ConnectionRefused"))


def test_the_network_namespace_cuts_even_raw_sockets():
    r = run_python("import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', 9))\n")
    assert r.network == "namespace"
    assert r.status == "failed" and any(e in r.detail for e in ("OSError", "ConnectionRefused"))


def test_runs_in_a_fresh_temporary_directory_with_a_minimal_environment():
    source = ("import os, sys\n"
              "assert os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR']\n"
              "assert os.path.basename(os.getcwd()).startswith('tokenrouter-sandbox-')\n"
              "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE'}, sorted(os.environ)\n"
              "assert sys.flags.isolated == 1\n"
              "open('scratch.txt', 'w').write('x')\n")
    assert run_python(source).passed
    assert run_python("import os\nassert not os.path.exists('scratch.txt')\n").passed


def test_children_are_killed_with_the_program():
    marker = f"tokenrouter-test-child-{uuid.uuid4().hex}"
    r = run_python("import subprocess, sys, time\n"
                   f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
                   "time.sleep(60)\n", timeout=1.5)
    assert r.status == "timeout"
    assert not processes_with(marker)


def test_a_child_in_a_new_session_holding_the_verdict_pipe_dies_with_the_program():
    """`setsid` used to escape the group kill, and a child holding the verdict pipe kept the parent's read
    waiting: the pid namespace ends with the program, and the verdict is read with a deadline."""
    marker = f"tokenrouter-test-child-{uuid.uuid4().hex}"
    source = ("import os, subprocess, sys\n"
              "fds = [fd for fd in range(3, 64) if os.path.exists(f'/proc/self/fd/{fd}')]\n"
              f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}],\n"
              "                 start_new_session=True, pass_fds=fds)\n")
    r = run_python(source, timeout=30)
    assert r.passed
    assert not processes_with(marker)


def processes_with(marker: str) -> list[int]:
    """Host pids of processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


def test_bad_limits_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="timeout"):
        run_python("pass\n", timeout=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass\n", memory_mb=1)


# ---- the proofs of concept of issue 13: each passed (or crashed the harness) before bubblewrap -------------
ROOT = Path(__file__).resolve().parents[2]


def test_the_program_runs_as_an_unprivileged_user_without_capabilities():
    r = run_python("import os\n"
                   "assert os.getuid() == os.getgid() == 65534, (os.getuid(), os.getgid())\n"
                   "caps = dict(line.split(':') for line in open('/proc/self/status') if line.startswith('Cap'))\n"
                   "assert all(int(v, 16) == 0 for v in caps.values()), caps\n")
    assert r.passed, r.detail
    assert r.sandbox == SANDBOXED


def test_writes_outside_the_temporary_directory_fail(tmp_path):
    targets = [ROOT / f"sandbox-escape-{uuid.uuid4().hex}", tmp_path / "escape", Path.home() / f"escape-{uuid.uuid4().hex}"]
    source = ("written = []\n"
              f"for path in {[str(t) for t in targets]!r}:\n"
              "    try:\n"
              "        open(path, 'w').write('x')\n"
              "        written.append(path)\n"
              "    except OSError:\n"
              "        pass\n"
              "assert not written, written\n")
    r = run_python(source)
    assert r.passed, r.detail
    assert not any(t.exists() for t in targets)


def test_the_project_tree_and_home_directory_are_not_visible():
    """Only the interpreter's own directories are bound, even when they lie in the home directory."""
    interpreter_dirs = bwrap.interpreter()[1]
    hidden = [str(p) for p in Path.home().iterdir() if not any(d.startswith(f"{p}/") or d == str(p) for d in interpreter_dirs)]
    r = run_python(f"import os\nvisible = [p for p in {[str(ROOT), *hidden]!r} if os.path.exists(p)]\n"
                   "assert not visible, visible\n")
    assert r.passed, r.detail


def reaching_for(secret: str) -> str:
    """A program that fails if it can read `secret` in any process's environment (the harness's, bwrap's) or
    open another process's memory read-write."""
    return ("import os\n"
            f"secret = {secret!r}.encode()\n"
            "assert 'TOKENROUTER_PROBE' not in os.environ\n"
            f"for pid in [{os.getpid()}, os.getppid(), *[p for p in os.listdir('/proc') if p.isdigit()]]:\n"
            "    try:\n"
            "        assert secret not in open(f'/proc/{pid}/environ', 'rb').read(), f'environ of {pid}'\n"
            "    except OSError:\n"
            "        pass\n"
            "    try:\n"
            "        open(f'/proc/{pid}/mem', 'r+b').close()\n"
            "        assert pid == str(os.getpid()), f'opened the memory of {pid} read-write'\n"
            "    except OSError:\n"
            "        pass\n")


def test_the_parents_environment_and_memory_are_out_of_reach(monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TOKENROUTER_PROBE", secret)
    r = run_python(reaching_for(secret))
    assert r.passed, r.detail


def test_rejoining_the_hosts_network_namespace_fails():
    """As root, `setns` on a host process's network namespace used to rejoin the host network, and
    `importlib.reload(socket)` undid the socket guard; a listener on the host's loopback must stay out of reach."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        source = ("import ctypes, importlib, os, socket\n"
                  "importlib.reload(socket)\n"
                  "libc = ctypes.CDLL(None, use_errno=True)\n"
                  f"for pid in ['1', {str(os.getpid())!r}, *os.listdir('/proc')]:\n"
                  "    try:\n"
                  "        fd = os.open(f'/proc/{pid}/ns/net', os.O_RDONLY)\n"
                  "        libc.setns(fd, 0x40000000)\n"
                  "    except OSError:\n"
                  "        pass\n"
                  "try:\n"
                  f"    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
                  "    raise AssertionError('reached the host network')\n"
                  "except OSError:\n"
                  "    pass\n")
        r = run_python(source)
    assert r.passed, r.detail


def test_a_fork_bomb_meets_the_process_limit():
    r = run_python("import os\nwhile True:\n    os.fork()\n", timeout=60)
    assert r.status == "failed" and "BlockingIOError" in r.detail


def test_a_verdict_forged_from_the_programs_frames_does_not_pass():
    """The old harness kept `verdict` and the nonce in the frame that ran the program."""
    source = ("import gc, re, sys\n"
              "frame = sys._getframe()\n"
              "while frame is not None:\n"
              "    for name, value in {**frame.f_globals, **frame.f_locals}.items():\n"
              "        if callable(value) and 'verdict' in name:\n"
              "            value('passed')\n"
              "    frame = frame.f_back\n"
              "nonces = [o for o in gc.get_objects() if isinstance(o, str) and re.fullmatch('[0-9a-f]{32}', o)]\n"
              "assert not nonces, 'found a nonce'\n"
              "raise AssertionError('the tests failed')\n")
    r = run_python(source)
    assert r.status == "failed" and "the tests failed" in r.detail


@pytest.mark.parametrize("message", [b"[1]", b'{"nonce": 1}', b'{"status": "passed"}', b"\xff" * 100])
def test_a_malformed_verdict_fails_that_run_only(message):
    # NOTE: every fd the program holds: the verdict pipe's number is the parent's, high in a busy test process
    source = ("import os\n"
              "for fd in sorted(int(f) for f in os.listdir('/proc/self/fd')):\n"
              "    try:\n"
              f"        os.write(fd, {message!r}) if fd > 2 else None\n"
              "    except OSError:\n"
              "        pass\n")
    r = run_python(source)
    assert r.status == "bad_verdict" and not r.passed
    assert run_python("pass\n").passed  # the next run is judged afresh


def test_without_bubblewrap_generated_code_runs_only_when_allowed(monkeypatch):
    monkeypatch.setattr(bwrap, "unavailable", lambda: "bubblewrap (bwrap) is not installed")
    with pytest.raises(SandboxUnavailable, match="--unsafe-no-sandbox"):
        run_python("pass\n")
    r = run_python("pass\n", unsafe_no_sandbox=True)
    assert r.passed and r.sandbox == UNSANDBOXED


# ---- the tests run in a process of their own (bench/remote.py) ------------------------------------------
FORGE = ("import os\n"
         "held = sorted(int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2)\n"
         "found = b''\n"
         "for fd in held:  # read every pipe it holds: the old harness left the nonce in one\n"
         "    try:\n"
         "        os.set_blocking(fd, False)\n"
         "        found += os.read(fd, 64)\n"
         "    except OSError:\n"
         "        pass\n"
         "for fd in held:  # and write it to every other: the old verdict pipe was one of them\n"
         "    try:\n"
         "        os.write(fd, found)\n"
         "    except OSError:\n"
         "        pass\n"
         "os._exit(0)\n")


def test_generated_code_cannot_forge_its_verdict_from_the_nonce_pipe():
    """Issue 13: the candidate ran in the process that held the nonce and the verdict pipe, so copying one to
    the other and exiting passed any task. The tests now run in another sandbox, which alone holds both."""
    task = Task("t/forge", "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "add",
                "def check(candidate):\n    assert candidate(1, 2) == 3\n")
    response = f"```python\n{FORGE}\ndef add(a, b):\n    return 0\n```"
    r = check(task, response)
    assert not r.passed and r.status in ("exited", "bad_verdict"), r
    assert check(task, "```python\ndef add(a, b):\n    return a + b\n```").passed


def test_an_object_whose_eq_is_always_true_does_not_pass():
    """The tests compare plain data: an object of the candidate's stays in its process as a handle, equal only
    to itself, so its `__eq__` never runs in the tests."""
    task = Task("t/eq", "def three():\n    \"\"\"3\"\"\"\n", "three", "def check(candidate):\n    assert candidate() == 3\n")
    response = ("```python\nclass Always:\n    def __eq__(self, other):\n        return True\n\n"
                "def three():\n    return Always()\n```")
    r = check(task, response)
    assert r.status == "failed" and "AssertionError" in r.detail
    subclass = "```python\nclass Int(int):\n    def __eq__(self, other):\n        return True\n\ndef three():\n    return Int(4)\n```"
    assert check(task, subclass).status == "failed"  # a subclass of int goes over as its int value


def test_the_tests_see_the_candidates_exceptions_objects_and_changes_to_arguments():
    task = Task("t/api", "class Empty(Exception):\n    pass\n\n\nclass Bag:\n    \"\"\"items\"\"\"\n", "Bag",
                "def check(candidate):\n"
                "    b = candidate()\n"
                "    assert len(b) == 0 and not b\n"
                "    b.add(3); b.add(1)\n"
                "    assert len(b) == 2 and 3 in b and b.items == [3, 1] and sorted(iter(b)) == [1, 3]\n"
                "    assert str(b) == 'Bag(2)' and b[0] == 3\n"
                "    try:\n"
                "        candidate().take()\n"
                "    except Empty:\n"
                "        pass\n"
                "    else:\n"
                "        raise AssertionError('expected Empty')\n"
                "    try:\n"
                "        b.add('x', strict=True)\n"
                "    except TypeError as e:\n"
                "        assert str(e) == 'not an int'\n"
                "    target = [[1], {'k': {2}}]\n"
                "    inner = target[0]\n"
                "    b.fill(target)\n"
                "    assert target == [[1, 9], {'k': {2, 9}}] and target[0] is inner\n")
    good = ("```python\nclass Bag:\n"
            "    def __init__(self):\n        self.items = []\n"
            "    def add(self, x, strict=False):\n"
            "        if strict and not isinstance(x, int):\n            raise TypeError('not an int')\n"
            "        self.items.append(x)\n"
            "    def take(self):\n        raise Empty()\n"
            "    def fill(self, target):\n        target[0].append(9)\n        target[1]['k'].add(9)\n"
            "    def __len__(self):\n        return len(self.items)\n"
            "    def __iter__(self):\n        return (x for x in self.items)\n"
            "    def __contains__(self, x):\n        return x in self.items\n"
            "    def __getitem__(self, i):\n        return self.items[i]\n"
            "    def __str__(self):\n        return f'Bag({len(self.items)})'\n```")
    r = check(task, good)
    assert r.passed, r.detail


def test_a_candidate_that_changes_an_argument_it_must_not_change_fails():
    task = Task("t/pure", "def first_sorted(xs):\n    \"\"\"sorted(xs)[0]; xs unchanged\"\"\"\n", "first_sorted",
                "def check(candidate):\n    xs = [3, 1, 2]\n    assert candidate(xs) == 1 and xs == [3, 1, 2]\n")
    assert check(task, "```python\ndef first_sorted(xs):\n    return sorted(xs)[0]\n```").passed
    r = check(task, "```python\ndef first_sorted(xs):\n    xs.sort()\n    return xs[0]\n```")
    assert r.status == "failed"


def test_the_tests_cannot_hand_the_candidate_their_own_functions():
    task = Task("t/fn", "def apply(f, x):\n    \"\"\"f(x)\"\"\"\n", "apply",
                "def check(candidate):\n    assert candidate(lambda v: v + 1, 1) == 2\n")
    r = check(task, "```python\ndef apply(f, x):\n    return f(x)\n```")
    assert r.status == "failed" and "cannot pass a function" in r.detail
