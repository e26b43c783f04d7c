"""Bubblewrap (`bwrap`) command lines for the sandbox: every namespace new (user, mount, pid, network, ipc,
uts, cgroup), no environment, a root file system holding only the interpreter and the system libraries
(read-only), a fresh /proc and /dev, and /tmp a tmpfs of a fixed size holding the working directory (the task's
files bound into it read-only): no host path is writable, and what it writes stops at the tmpfs's size. Inside,
the program runs as uid/gid 65534 with no capabilities.

Run as root, bwrap cannot map the sandbox to an unprivileged uid itself, and a process whose real uid is
root is exempt from RLIMIT_NPROC; so a helper makes a user namespace mapping 0 -> 0 and 65534 -> 65534
(nested user namespaces off), bwrap joins it (`--userns`), and the sandbox's first stage remounts /tmp with an
inode limit, then gives up root and every capability before the program starts (see `sandbox.STAGE`). Run as
any other user, bwrap maps that user to 65534 in a new user namespace (`--unshare-user --uid 65534`), and /tmp
keeps the tmpfs's default inode limit."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

UID = GID = 65534
# as root, what the first stage needs before it drops every capability: to change uid and gid, to empty the
# bounding set, and to remount /tmp with an inode limit (bwrap's --size sets only the size)
FIRST_STAGE_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_SYS_ADMIN")
HOLDER = r'''
import ctypes, os
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000):  # CLONE_NEWUSER
    raise SystemExit(f"unshare(CLONE_NEWUSER): errno {ctypes.get_errno()}")
with open("/proc/sys/user/max_user_namespaces", "w") as f:  # this namespace's own limit: no nested ones
    f.write("0")
os.write(1, b"ready")
os.read(0, 1)
'''


def interpreter() -> tuple[str, list[str]]:
    """The real interpreter binary (not a venv's link) and the directories it needs outside /usr."""
    exe = os.path.realpath(sys.executable)
    roots = {os.path.realpath(sys.base_prefix), str(Path(exe).parent)}
    return exe, sorted(r for r in roots if not r.startswith("/usr/") and r != "/usr")


def command(files: dict[str, Path], inside: str, userns_fd: int | None, info_fd: int, disk_bytes: int) -> list[str]:
    """bwrap's arguments up to `--`: /tmp a tmpfs of `disk_bytes`, `inside` a directory in it anyone there may
    write (also HOME; the command changes into it once it runs as the sandbox's user), each of `files` (name:
    host path) bound read-only into it; nothing of the host is writable."""
    if userns_fd is not None:  # root: join the prepared user namespace; the first stage drops root
        identity = ["--userns", str(userns_fd), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                    "--unshare-cgroup-try", "--cap-drop", "ALL",
                    *(a for cap in FIRST_STAGE_CAPS for a in ("--cap-add", cap))]
    else:
        identity = ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(UID), "--gid", str(GID),
                    "--cap-drop", "ALL"]
    fs = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        top = Path("/") / name
        if top.is_symlink():
            fs += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            fs += ["--ro-bind", str(top), str(top)]
    for root in interpreter()[1]:  # NOTE: at its own path (libpython is found by an absolute RPATH); the
        for parent in reversed(Path(root).parents[:-1]):  # directories above it searchable (the host's may not be)
            fs += ["--perms", "0755", "--dir", str(parent)]
        fs += ["--ro-bind", root, root]
    env = ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
           "--setenv", "HOME", inside, "--setenv", "TMPDIR", inside]
    return [shutil.which("bwrap") or "bwrap", *identity, "--die-with-parent", "--new-session", "--hostname", "sandbox",
            *env, *fs, "--proc", "/proc", "--dev", "/dev", "--size", str(disk_bytes), "--tmpfs", "/tmp",
            "--perms", "0777", "--dir", inside,
            *(a for name, path in files.items() for a in ("--ro-bind", str(path), f"{inside}/{name}")),
            "--info-fd", str(info_fd), "--"]


@contextmanager
def user_namespace():
    """As root: an fd of a fresh user namespace mapping 0 and 65534 to themselves (None otherwise). The fd
    keeps the namespace alive after its helper exits; close it once bwrap has joined."""
    if os.geteuid() != 0:
        yield None
        return
    helper = subprocess.Popen([sys.executable, "-I", "-S", "-c", HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if helper.stdout.read(5) != b"ready":
            raise OSError(f"user namespace helper failed: {helper.stderr.read().decode(errors='replace')}")
        maps = f"0 0 1\n{UID} {UID} 1\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{helper.pid}/{name}", "w") as f:
                f.write(maps)
        fd = os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.stdin.close()
        helper.wait()
        helper.stdout.close()
        helper.stderr.close()
    try:
        yield fd
    finally:
        os.close(fd)


@functools.cache
def unavailable() -> str:
    """Why bubblewrap cannot run the sandbox here ('' when it can): checked once per process by running
    the interpreter inside it."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tokenrouter-sandbox-probe-") as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text("pass\n")
        read_info, write_info = os.pipe()
        try:
            with user_namespace() as ns:
                args = command({"probe.py": probe}, "/tmp/work", ns, write_info, 1 << 20) + [
                    interpreter()[0], "-I", "-S", "/tmp/work/probe.py"]
                fds = (write_info,) if ns is None else (write_info, ns)
                done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, pass_fds=fds, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            return f"bubblewrap does not start here: {e}"
        finally:
            os.close(read_info)
            os.close(write_info)
    if done.returncode != 0:
        return f"bubblewrap does not start here: {done.stderr.decode(errors='replace').strip()}"
    return ""
