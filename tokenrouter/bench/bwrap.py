"""Bubblewrap (`bwrap`) command lines for the sandbox: every namespace new (user, mount, pid, network, ipc,
uts, cgroup), no environment, a root file system holding only the interpreter and the system libraries
(read-only), a fresh /proc and /dev, and /tmp a tmpfs of a fixed size holding the working directory (the task's
files bound into it read-only): no host path is writable, and what it writes stops at the tmpfs's size. Inside,
the program runs as uid/gid 65534 with no capabilities.

The harness prepares the sandbox's user namespace itself (`user_namespace`) and bwrap joins it (`--userns`):
as root it maps 0 -> 0 and 65534 -> 65534 (a process whose real uid is root is exempt from RLIMIT_NPROC, so the
first stage must really become 65534), none nested in it; as any other user it maps that user to 65534 (an
unprivileged user may map itself), and the first stage makes the namespace the program runs in below it (bwrap's
pid 1 is that user too), none nested in that. The tmpfs belongs to the prepared namespace, so the first stage,
which bwrap leaves a few capabilities there, can remount /tmp with an inode limit (bwrap's --size sets only the
size) before it gives up every capability (and, as root, uid 0) and the program starts (see `sandbox.STAGE`).
bwrap's own `--unshare-user --uid 65534` cannot serve: it changes uid in a second, nested
namespace, where no capability reaches the tmpfs. That form is kept as a fallback for an ordinary user where
the harness cannot prepare a namespace (a setuid bwrap, a kernel that lets only bwrap create one); /tmp then
keeps the tmpfs's default inode limit, and every result says so (`files_bounded`)."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

UID = GID = 65534
# user namespaces that may be nested in an ordinary user's prepared one: one for each sandbox joining it (the
# candidate's and the checker's first stages each make one, which allows none below it)
NESTED = 2
# what the first stage needs before it drops every capability: (as root) to change uid and gid, to empty the
# bounding set, and to remount /tmp with an inode limit (bwrap's --size sets only the size)
FIRST_STAGE_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_SYS_ADMIN")
HOLDER = r'''
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000):  # CLONE_NEWUSER
    raise SystemExit(f"unshare(CLONE_NEWUSER): errno {ctypes.get_errno()}")
with open("/proc/sys/user/max_user_namespaces", "w") as f:  # how many may be nested in it, in all
    f.write(sys.argv[1])
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
    if userns_fd is not None:  # join the prepared user namespace; the first stage drops the capabilities (and root)
        identity = ["--userns", str(userns_fd), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                    "--unshare-cgroup-try", "--cap-drop", "ALL",
                    *(a for cap in FIRST_STAGE_CAPS for a in ("--cap-add", cap))]
    else:  # the fallback: no capability reaches the tmpfs from bwrap's second, nested user namespace
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
def user_namespace(prepare: bool = True):
    """An fd of a fresh user namespace (None where `prepare` is false and the caller is not root): as root
    mapping 0 and 65534 to themselves, nested namespaces off; otherwise the caller's uid and gid to 65534, at
    most NESTED nested in it. The fd keeps the namespace alive after its helper exits; close it once bwrap has
    joined."""
    root = os.geteuid() == 0
    if not (prepare or root):
        yield None
        return
    nested = "0" if root else str(NESTED)
    helper = subprocess.Popen([sys.executable, "-I", "-S", "-c", HOLDER, nested], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if helper.stdout.read(5) != b"ready":
            raise OSError(f"user namespace helper failed: {helper.stderr.read().decode(errors='replace')}")
        if root:
            maps = {"uid_map": f"0 0 1\n{UID} {UID} 1\n", "gid_map": f"0 0 1\n{GID} {GID} 1\n"}
        else:  # NOTE: one line, the caller's own ids; its gid only once setgroups is denied in the namespace
            maps = {"uid_map": f"{UID} {os.geteuid()} 1\n", "setgroups": "deny", "gid_map": f"{GID} {os.getegid()} 1\n"}
        for name, text in maps.items():
            with open(f"/proc/{helper.pid}/{name}", "w") as f:
                f.write(text)
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


# the probe's program: the first stage's remount, at the least inode limit
REMOUNT = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
           "if libc.mount(None, b'/tmp', None, 32 | 2 | 4, b'nr_inodes=64'):\n"  # MS_REMOUNT|MS_NOSUID|MS_NODEV
           "    raise SystemExit(f'remounting /tmp: errno {ctypes.get_errno()}')\n")


def unavailable() -> str:
    """Why bubblewrap cannot run the sandbox here ('' when it can)."""
    return setup()[0]


def files_bounded() -> bool:
    """Whether the sandbox's first stage can remount its tmpfs with an inode limit (in a user namespace the
    harness prepared); false on the fallback."""
    return setup()[1]


@functools.cache
def setup() -> tuple[str, bool]:
    """(why bubblewrap cannot run the sandbox here, or ''; whether it runs in a prepared user namespace):
    checked once per process by running the interpreter inside it, the prepared namespace first (remounting
    /tmp there), then, for an ordinary user, bwrap's own."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)", False
    why = _probe(prepare=True)
    if not why or os.geteuid() == 0:
        return why, not why
    fallback = _probe(prepare=False)
    return (f"{fallback} (and in a prepared user namespace: {why})" if fallback else ""), False


def _probe(prepare: bool) -> str:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tokenrouter-sandbox-probe-") as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text(REMOUNT if prepare else "pass\n")
        read_info, write_info = os.pipe()
        try:
            with user_namespace(prepare) as ns:
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
