"""Placement `process`: each rank of a model in its own OS process, pinned to its cores or its GPU.

The driver talks to every rank over a pipe: one (method, args) message in, one (status, value) answer out.
All ranks get every step (so they run the same forward pass, meeting in its all-reduces); the driver waits
for all of them and returns rank 0's result. A rank that raises or dies fails the step at once.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from tokenrouter.config import ModelSpec
from tokenrouter.engine.device_thread import DeviceThread
from tokenrouter.engine.executor import Executor, WorkerFailed
from tokenrouter.engine.messages import StepRequest, StepResult

ENTRY = "import sys; from tokenrouter.engine.worker_process import serve_fd; serve_fd(int(sys.argv[1]))"
START_TIMEOUT = 1800.0  # seconds a rank may take to load its weights (a first GGUF conversion is slow)


@dataclass(slots=True)
class RankSpec:
    """What one rank needs to start: its model, its device, its cores and its process group."""
    name: str
    models: list[str]
    spec: ModelSpec  # with `device` set to this rank's device
    model_dir: str
    rank: int = 0
    size: int = 1
    init_method: str = ""  # tcp://host:port of rank 0's rendezvous (size > 1)
    cpus: list[int] = dataclasses.field(default_factory=list)
    threads: int = 0


def rank_specs(name: str, models: list[str], spec: ModelSpec, model_dir: Path | str, host: str = "127.0.0.1",
               port: int = 0, threads: int = 0) -> list[RankSpec]:
    """One RankSpec per tensor-parallel rank: its device, and its even share of the model's pinned cores.
    Threads per rank: `torch_threads`, else one per pinned core, else `threads`, else every core."""
    size = spec.tensor_parallel_size
    init = f"tcp://{host}:{port or free_port(host)}" if size > 1 else ""
    per = len(spec.cpus) // size
    out = []
    for rank in range(size):
        cpus = list(spec.cpus[rank * per:(rank + 1) * per])
        n = spec.torch_threads or len(cpus) or threads or os.cpu_count() or 1
        out.append(RankSpec(name, models, dataclasses.replace(spec, device=spec.devices[rank]), str(model_dir),
                            rank, size, init, cpus, n))
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_rank(rank: RankSpec):
    """Everything a rank does before it serves: pin, set threads, join the group, load the model."""
    if rank.cpus:
        os.sched_setaffinity(0, rank.cpus)
    from tokenrouter.engine.load_threads import use_threads
    from tokenrouter.engine.worker import Worker
    from tokenrouter.models.parallel import init_tensor_parallel

    use_threads(rank.threads, rank.spec.device == "cpu")
    tp = init_tensor_parallel(rank.rank, rank.size, rank.init_method, rank.spec.device) if rank.size > 1 else None
    return Worker(rank.name, rank.models, rank.spec, rank.model_dir, tp)


class WorkerProcess:
    """A worker's OS process: a fresh interpreter (`python -m tokenrouter.engine.worker_process`), never a
    fork of the driver (which runs torch threads) and never a re-import of the driver's main script (as
    multiprocessing's spawn does, which a notebook or an unguarded script cannot survive)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)  # readable once the process has exited

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def spawn(rank: RankSpec) -> tuple[WorkerProcess, Connection]:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        popen = subprocess.Popen([sys.executable, "-c", ENTRY, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                 stdin=subprocess.DEVNULL)
        conn = Connection(os.dup(ours.fileno()))
    conn.send(rank)
    return WorkerProcess(popen), conn


def worker_main(conn, rank: RankSpec) -> None:
    """The body of a worker process: start, then answer messages until `close` or the driver is gone."""
    try:
        worker = start_rank(rank)
        conn.send(("ok", worker.info()))
    except BaseException as e:
        conn.send(("error", _describe(e)))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the driver is gone: nothing may outlive it
            break
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as e:
            conn.send(("error", _describe(e)))
        if method == "close":
            break


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e)[-6:])}"


class ProcessExecutor(Executor):
    def __init__(self, name: str, models: list[str], spec: ModelSpec, model_dir: Path | str, threads: int = 0):
        super().__init__(name)
        self.procs, self.conns = [], []
        self.failed = ""
        for rank in rank_specs(name, models, spec, model_dir, threads=threads):
            proc, conn = spawn(rank)
            self.procs.append(proc)
            self.conns.append(conn)
        self._lock = threading.Lock()
        self._io = DeviceThread(f"io-{name}")

    def wait_ready(self) -> None:
        """Block until every rank has loaded its part of the model (the processes load in parallel)."""
        try:
            self.info = self._gather(START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def step(self, request: StepRequest) -> StepResult:
        return await self._io.run(self.call, "execute", request)

    def call(self, method: str, *args):
        with self._lock:
            if self.failed:
                raise WorkerFailed(self.failed)
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send((method, args))
                except OSError:
                    self._died(rank)
            return self._gather()

    def _gather(self, timeout: float | None = None):
        """Every rank's answer; rank 0's value. Any rank's error or death fails the call at once."""
        pending = dict(enumerate(self.conns))
        answers = {}
        while pending:
            sentinels = {self.procs[r].sentinel: r for r in pending}
            ready = wait([*pending.values(), *sentinels], timeout)
            if not ready:
                self._fail(f"{self.name}: no answer from ranks {sorted(pending)} within {timeout:.0f} s")
            for obj in ready:
                rank = sentinels.get(obj)
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is obj)
                elif pending[rank].poll():
                    continue  # it answered before it exited: read the answer first
                if rank not in pending:
                    continue
                try:
                    status, value = pending[rank].recv()
                except (EOFError, OSError):
                    self._died(rank)
                del pending[rank]
                if status == "error":
                    message = f"{self.name}: worker rank {rank} raised {value}"
                    if pending:  # other ranks may still be inside the step: the channels are out of step
                        self._fail(message)
                    raise WorkerFailed(message)
                answers[rank] = value
        return answers[0]

    def _fail(self, message: str):
        self.failed = message
        raise WorkerFailed(message)

    def _died(self, rank: int):
        proc = self.procs[rank]
        proc.join(timeout=5)
        code = proc.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        self._fail(f"{self.name}: worker rank {rank} (pid {proc.pid}) died ({how})")

    def close(self) -> None:
        """Ask every rank to stop, then make sure: no process outlives the executor."""
        idle = self._lock.acquire(timeout=30)  # a step still running finishes first, unless it hangs
        try:
            for conn, proc in zip(self.conns, self.procs):
                if idle and proc.is_alive() and not self.failed:
                    try:
                        conn.send(("close", ()))
                    except (BrokenPipeError, OSError):
                        pass
            for proc in self.procs:
                proc.join(timeout=10 if idle else 0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            self.failed = self.failed or f"{self.name}: worker closed"
        finally:
            if idle:
                for conn in self.conns:
                    conn.close()
                for proc in self.procs:
                    proc.close()
                self._lock.release()
        self._io.shutdown(wait=False, cancel_futures=True)



def serve_fd(fd: int) -> None:
    """The entry of a worker process: its channel to the driver is the inherited socket `fd`."""
    channel = Connection(fd)
    worker_main(channel, channel.recv())
