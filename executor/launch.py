"""Run one function on N ranks of torch.distributed, and never leave a mess.

Two ways in, one worker path:

- :func:`launch` starts N local processes itself (forked from a server that
  has imported torch once, a free TCP port on 127.0.0.1), calls
  ``fn(rank, world_size, *args)`` in each and returns every rank's return
  value to the caller.
- :func:`run_in_job` is for processes that ``torchrun`` started (multi-node
  runs): the environment already names RANK/WORLD_SIZE/MASTER_ADDR, and this
  process is one rank of that job.

A distributed run fails in ways a single process does not: one rank raises and
its peers wait for it forever inside a collective, or one rank hangs and the
others wait with it. :func:`launch` therefore watches all ranks from the
parent. The first rank to fail, or the ranks still running when the timeout
ends, are named in a :class:`RankFailure`; every other rank is terminated and
reaped, so no orphan processes survive the run.
"""

from __future__ import annotations

import ctypes
import faulthandler
import math
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from parsim.errors import ParsimError
from parsim.sim.pool import usable_cores as process_cores

from ._torch import require_distributed, require_torch
from .gloo_threads import policy, prepare_groups

DEFAULT_TIMEOUT_S = 120.0
MAX_LOCAL_RANKS = 1024  # processes one machine spawns: beyond any node's GPUs, and a CPU's cores many times over
BACKENDS = ("auto", "gloo", "nccl")
MASTER_ADDR = "127.0.0.1"

# After the first failure, wait this long for other ranks' reports: a rank's
# own error reaches us before the "connection closed" errors it causes in its
# peers, but not always in the same wake-up, so blame goes to the earliest.
_BLAME_GRACE_S = 1.0
# How long a finished rank may take to exit before it is terminated.
_EXIT_GRACE_S = 5.0
# How long hung ranks get to write their Python stacks (faulthandler) to disk.
_STACK_DUMP_WAIT_S = 1.0

RankFn = Callable[..., Any]

# glibc's malloc hands tensors over 128 KiB back to the kernel when they are freed, so every step's
# fresh gradients and AdamW temporaries fault their pages in again (about half of a CPU AdamW step on
# a VM). A rank keeps what it freed instead, as CUDA's caching allocator does on a GPU and as
# PyTorch's CPU tuning guide advises (a caching malloc): blocks up to 32 MiB (glibc's ceiling for this
# setting) come from the heap, and the heap is not trimmed below 4 GiB. A value the user exported wins.
# glibc reads these only as a process starts, and a rank forks from a server started earlier, so each rank
# sets them again through mallopt (glibc's malloc.h: M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), whose int holds
# at most 2 GiB: there the trim threshold is 2 GiB.
RANK_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
_INT_MAX = (1 << 31) - 1
# Ranks fork from a server that imported these once (multiprocessing's forkserver), where a fresh interpreter
# per rank (spawn) imports torch in each: 2.7 s a rank on the 2-core VM, 3-7 s of wall time per launch of 2-4
# ranks before any rank runs (2026-12-01). The server imports torch, starts no thread and touches no device.
RANK_SERVER_PRELOAD = ("torch", "torch.distributed", "executor.train.runner", "executor.compute_bench")
# Set inside a gloo rank bound to one core: how many cores the job's ranks were bound from.
HOST_CORES_ENV = "PARSIM_HOST_CORES"


class RankFailure(ParsimError):
    """One or more ranks raised, died or hung.

    ``ranks`` are the ranks blamed; ``details`` holds their remote tracebacks
    (or, for hung ranks, the Python stacks they were stuck in), printed by
    ``--verbose``.
    """

    def __init__(self, message: str, ranks: Sequence[int], details: str = ""):
        super().__init__(message)
        self.ranks = list(ranks)
        self.details = details


def resolve_backend(backend: str, nproc: int) -> str:
    """``"auto"`` -> ``"nccl"`` when there is one CUDA GPU per rank, else ``"gloo"``."""
    if backend not in BACKENDS:
        raise ParsimError(f"backend {backend!r} is not known (expected one of: {', '.join(BACKENDS)})")
    torch = require_torch()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= nproc else "gloo"
    if backend == "nccl" and gpus < nproc:
        raise ParsimError(f"backend nccl needs one CUDA GPU per rank: {nproc} ranks, {gpus} GPU(s) found")
    return backend


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now.

    The port is released before rank 0's store binds it again, so another
    program could take it in between; that window is milliseconds wide.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((MASTER_ADDR, 0))
        return sock.getsockname()[1]


def in_torchrun_job() -> bool:
    """Whether this process is one rank of a job that torchrun (or similar) started."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def job_rank() -> int | None:
    """This process's rank in a torchrun job, or None outside one."""
    return int(os.environ["RANK"]) if in_torchrun_job() else None


def rank_device() -> Any:
    """The device this rank's tensors belong on: its GPU under NCCL, else the CPU."""
    torch, dist = require_torch(), require_distributed()
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_in_job(fn: RankFn, args: Sequence[Any] = (), backend: str = "auto",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Run ``fn(rank, world_size, *args)`` as this process's rank of a torchrun job.

    torchrun, not this function, stops the other ranks when one fails; the
    process-group ``timeout_s`` bounds how long a collective waits for a peer.
    """
    if not in_torchrun_job():
        raise ParsimError("not inside a torchrun job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not all set)")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = resolve_backend(backend, local_world)
    if backend == "gloo":
        policy()  # a bad PARSIM_GLOO_LOOPS is refused before this rank joins the job
    return _run_rank(fn, args, backend, timeout_s)


def check_request(nproc: int, timeout_s: float) -> None:
    """Refuse, before anything starts, a rank count or a time limit no run can have."""
    if not 1 <= nproc <= MAX_LOCAL_RANKS:
        raise ParsimError(f"--nproc {nproc}: between 1 and {MAX_LOCAL_RANKS} ranks on one machine")
    if not 0 < timeout_s < math.inf:
        raise ParsimError(f"--timeout {timeout_s:g}: a positive number of seconds")


def launch(fn: RankFn, nproc: int, args: Sequence[Any] = (), backend: str = "auto",
           timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` local ranks; each rank's return value, in rank order.

    ``fn`` must be importable by name (defined at module level), and its
    arguments and return value picklable: ranks are processes of their own (:func:`rank_context`), each
    given this process's environment as it is now.
    Raises :class:`RankFailure` naming the rank that failed first, or the
    ranks still running after ``timeout_s`` seconds (the whole run's budget).
    """
    check_request(nproc, timeout_s)
    backend = resolve_backend(backend, nproc)
    if backend == "gloo":
        policy()  # a bad PARSIM_GLOO_LOOPS is refused here, before any rank starts
    # Collectives inside the ranks time out later than the parent's watchdog,
    # so a hang is diagnosed here (with stacks) rather than as a peer's error.
    collective_timeout_s = 2 * timeout_s
    ctx = rank_context()
    port = free_port()
    ranks: list[_Rank] = []
    finished = False
    with tempfile.TemporaryDirectory(prefix="parsim-ranks-") as tmp, _rank_environment():
        try:
            for rank in range(nproc):
                reader, writer = ctx.Pipe(duplex=False)
                stack_path = Path(tmp) / f"rank{rank}.stack"
                process = ctx.Process(
                    target=_rank_main, name=f"parsim-rank-{rank}", daemon=True,
                    args=(rank, nproc, port, backend, collective_timeout_s, fn, tuple(args), writer, str(stack_path),
                          dict(os.environ), _StandardStreams()),
                )
                process.start()
                writer.close()  # the child's copy is the only writer: EOF now means the child is gone
                ranks.append(_Rank(rank, process, reader, stack_path))
            values = _collect(ranks, timeout_s)
            finished = True
            return values
        finally:
            _stop([r.process for r in ranks], _EXIT_GRACE_S if finished else 0.0)


def rank_context() -> Any:
    """How ranks start: forked from multiprocessing's fork server, which imports :data:`RANK_SERVER_PRELOAD`
    once (started, with this process's environment, by the first launch; it lives until this process ends),
    where the platform has one; else as fresh interpreters (``spawn``)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_SERVER_PRELOAD))
    return ctx


def start_rank_server() -> None:
    """Start the fork server ranks come from (:func:`rank_context`) now, rather than at the first launch."""
    if rank_context().get_start_method() == "forkserver":
        with _rank_environment():
            multiprocessing.forkserver.ensure_running()


@contextmanager
def _rank_environment() -> Iterator[None]:
    """The parent's environment while it starts ranks (and the fork server), plus :data:`RANK_ALLOCATOR_ENV`
    (restored after)."""
    added = {k: v for k, v in RANK_ALLOCATOR_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


# ----------------------------------------------------------------------------- ranks


class _StandardStreams:
    """The caller's standard output and error as they are at a launch, for a rank to write to: a rank forked
    from the fork server would otherwise inherit the server's, as they were when it started (a terminal,
    where the caller now writes to a file or a pipe)."""

    def __init__(self, wrappers: tuple = ()):
        self.wrappers = wrappers  # in a rank: (fd, its descriptor passed along) for each stream the caller had

    def __reduce__(self) -> tuple:  # pickled as a rank starts: the descriptors travel with it
        return _StandardStreams, (tuple((fd, reduction.DupFd(fd)) for fd in (1, 2) if _is_open(fd)),)

    def attach(self) -> None:
        for fd, wrapper in self.wrappers:
            inherited = wrapper.detach()
            os.dup2(inherited, fd)
            os.close(inherited)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _rank_main(rank: int, nproc: int, port: int, backend: str, timeout_s: float, fn: RankFn,
               args: tuple, conn: Connection, stack_path: str, environment: dict[str, str],
               streams: _StandardStreams) -> None:
    """Body of a rank: take the caller's standard streams and ``environment``, run, then report ``("ok",
    value)`` or an error to the parent."""
    streams.attach()
    _dump_stacks_on_sigusr1(stack_path)
    os.environ.clear()  # a forked rank has the fork server's, as it was when the server started
    os.environ.update(environment)
    _set_allocator(environment)
    os.environ.update(
        MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
    )
    if backend == "gloo":  # a torchrun job's ranks are bound (or not) by whoever launched them
        _pin_to_core(rank)
    try:
        conn.send(("ok", _run_rank(fn, args, backend, timeout_s)))
    except BaseException as err:  # noqa: BLE001 - every failure must reach the parent
        conn.send(("error", time.time(), _first_line(err), traceback.format_exc()))
    finally:
        conn.close()


def _run_rank(fn: RankFn, args: Sequence[Any], backend: str, timeout_s: float) -> Any:
    """Join the process group named by the environment, run ``fn``, leave cleanly."""
    torch, dist = require_torch(), require_distributed()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # one core per rank, as one GPU per rank: ranks must not fight over cores
    # Under NCCL each rank binds its GPU, and tells the process group which (device_id): barriers and the
    # communicator then use it rather than guessing from the rank, which hangs when ranks and GPUs differ.
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if backend == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), device_id=device)
    if backend == "gloo":
        prepare_groups()
    value = fn(rank, world, *args)
    dist.destroy_process_group()
    return value


def _set_allocator(environment: dict[str, str]) -> None:
    """Give glibc's malloc the :data:`RANK_ALLOCATOR_ENV` settings ``environment`` names (glibc read the fork
    server's as the server started)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    for key, param in _MALLOPT.items():
        if environment.get(key, "").isdigit():
            mallopt(param, min(int(environment[key]), _INT_MAX))


def _pin_to_core(local_rank: int) -> None:
    """Bind this CPU rank, and the threads it starts (gloo's), to one of the cores it may use, round robin.

    Unbound, the scheduler may wake a rank's communication thread on the core where another rank computes
    (the one whose write woke it) while its own core idles: on a 2-core VM that delayed tensor-parallel
    collectives by up to 5 ms and left ranks 1-2 ms apart at each one. CPU training launchers bind too
    (``torch.backends.xeon.run_cpu``, Intel's guide to PyTorch on CPUs)."""
    if not hasattr(os, "sched_getaffinity"):  # not on Linux
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ[HOST_CORES_ENV] = str(len(cores))
    os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def usable_cores() -> int:
    """The cores this job's ranks may run on: a container's share, not the whole machine's (inside a rank
    bound to one core, the share it was bound from)."""
    if HOST_CORES_ENV in os.environ:
        return int(os.environ[HOST_CORES_ENV])
    return process_cores()


def host_memory_bytes() -> int:
    """This host's physical memory, which every local rank shares."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_stack_file = None  # kept open for faulthandler, which writes to its file descriptor


def _dump_stacks_on_sigusr1(path: str) -> None:
    """Make SIGUSR1 write this rank's Python stacks to ``path`` (how the parent sees a hang)."""
    global _stack_file
    if hasattr(signal, "SIGUSR1"):
        _stack_file = open(path, "w")  # noqa: SIM115 - must outlive this function
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


# ----------------------------------------------------------------------------- parent


@dataclass
class _Rank:
    index: int
    process: Any  # multiprocessing.Process
    reader: Connection
    stack_path: Path


@dataclass
class _Failure:
    at: float  # time.time() when it failed, comparable across processes on one host
    rank: int
    summary: str
    details: str


def _collect(ranks: list[_Rank], timeout_s: float) -> list[Any]:
    """Wait for every rank's report; raise :class:`RankFailure` on a failure or at the deadline."""
    deadline = time.monotonic() + timeout_s
    waiting = {r.reader: r for r in ranks}
    values: dict[int, Any] = {}
    failures: list[_Failure] = []
    blame_by = float("inf")
    while waiting:
        remaining = min(deadline, blame_by) - time.monotonic()
        if remaining <= 0:
            break
        for reader in wait(list(waiting), timeout=remaining):
            rank = waiting.pop(reader)
            report = _receive(rank)
            if isinstance(report, _Failure):
                failures.append(report)
                blame_by = min(blame_by, time.monotonic() + _BLAME_GRACE_S)
            else:
                values[rank.index] = report
    if failures:
        raise _failure_error(failures)
    if waiting:
        raise _hang_error(list(waiting.values()), sorted(values), timeout_s)
    return [values[r.index] for r in ranks]


def _receive(rank: _Rank) -> Any:
    """A rank's return value, or a :class:`_Failure` for an error or a death without report."""
    try:
        message = rank.reader.recv()
    except (EOFError, OSError):
        rank.process.join(1.0)
        return _Failure(time.time(), rank.index, _exit_reason(rank.process.exitcode), "")
    if message[0] == "ok":
        return message[1]
    _, at, summary, details = message
    return _Failure(at, rank.index, summary, details)


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return f"the process was killed by {name}{hint} before reporting"
    return f"the process exited with code {exitcode} before reporting"


def _failure_error(failures: list[_Failure]) -> RankFailure:
    failures.sort(key=lambda f: f.at)
    first = failures[0]
    message = f"rank {first.rank} failed: {first.summary}"
    if len(failures) > 1:
        message += f" (then {_ranks_text([f.rank for f in failures[1:]])} failed too)"
    details = "\n".join(f"--- rank {f.rank}: {f.summary}\n{f.details}".rstrip() for f in failures)
    return RankFailure(message, [first.rank], details)


def _hang_error(pending: list[_Rank], done: list[int], timeout_s: float) -> RankFailure:
    """Name the hung ranks; ranks blocked inside torch.distributed are only waiting for them."""
    stacks = _dump_stacks(pending)
    waiting = [r.index for r in pending if "torch/distributed" in stacks.get(r.index, "").replace("\\", "/")]
    hung = [r.index for r in pending if r.index not in waiting] or waiting
    waiting = [r for r in waiting if r not in hung]
    message = f"{_ranks_text(hung)} did not finish within {timeout_s:g} s (hung or deadlocked?)"
    if waiting:
        message += f"; {_ranks_text(waiting)} {'was' if len(waiting) == 1 else 'were'} waiting in torch.distributed"
    if done:
        message += f"; {_ranks_text(done)} finished"
    details = "\n".join(f"--- rank {i} stack:\n{s.strip()}" for i, s in sorted(stacks.items()) if s.strip())
    return RankFailure(message, hung, details)


def _dump_stacks(pending: list[_Rank]) -> dict[int, str]:
    """Ask live ranks for their Python stacks (SIGUSR1 -> faulthandler) and read them back."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    asked = []
    for rank in pending:
        if rank.process.is_alive():
            try:
                os.kill(rank.process.pid, signal.SIGUSR1)
                asked.append(rank)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _STACK_DUMP_WAIT_S
    while asked and time.monotonic() < deadline and not all(_size(r.stack_path) for r in asked):
        time.sleep(0.05)
    return {r.index: r.stack_path.read_text(errors="replace") for r in asked if _size(r.stack_path)}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _stop(processes: list[Any], grace_s: float) -> None:
    """Reap every rank: wait ``grace_s`` for a clean exit, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
