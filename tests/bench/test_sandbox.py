"""The sandbox: verdicts for passing and failing programs, and the limits it promises."""
from __future__ import annotations

import os
import select

import pytest

from tokenrouter.bench.sandbox import run_python


def test_a_program_that_runs_to_the_end_passes():
    r = run_python("def f(x):\n    return x + 1\n\nassert f(1) == 2\n")
    assert r.passed and r.status == "passed"
    assert r.network in ("namespace", "socket-guard")


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
    r = run_python("block = bytearray(2 * 1024 ** 3)\n", memory_mb=256)
    assert r.status == "memory_limit"


@pytest.mark.parametrize("source", ["import sys\nsys.exit(0)\n", "raise SystemExit\n", "import os\nos._exit(0)\n",
                                    "quit()\n", "print('passed')\nimport os\nos._exit(0)\n"])
def test_exiting_early_never_passes(source):
    r = run_python(source)
    assert r.status == "exited" and not r.passed


def test_no_network():
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n")
    assert r.status == "failed" and ("PermissionError" in r.detail or "OSError" in r.detail)


def test_the_network_namespace_cuts_even_raw_sockets():
    r = run_python("import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', 9))\n")
    if r.network != "namespace":
        pytest.skip("this kernel allows no new network namespace; only the socket guard applies")
    assert r.status == "failed" and "OSError" in r.detail


def test_runs_in_a_fresh_temporary_directory_with_a_minimal_environment():
    source = ("import os, sys\n"
              "assert os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR']\n"
              "assert os.path.basename(os.getcwd()).startswith('tokenrouter-sandbox-')\n"
              "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE'}, sorted(os.environ)\n"
              "assert sys.flags.isolated == 1\n"
              "open('scratch.txt', 'w').write('x')\n")
    assert run_python(source).passed
    assert run_python("import os\nassert not os.path.exists('scratch.txt')\n").passed


def test_children_are_killed_with_the_program(tmp_path):
    pid_file = tmp_path / "child.pid"
    r = run_python("import subprocess, sys, time\n"
                   "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                   f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                   "time.sleep(60)\n", timeout=1.5)
    assert r.status == "timeout"
    assert not alive(int(pid_file.read_text()))


def alive(pid: int) -> bool:
    """Whether the process still runs 10 s from now (a pidfd turns readable when the process exits)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        readable, _, _ = select.select([fd], [], [], 10)
        return not readable
    finally:
        os.close(fd)


def test_bad_limits_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="timeout"):
        run_python("pass\n", timeout=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass\n", memory_mb=1)
