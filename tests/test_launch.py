"""The launcher: ranks return values; a failing or hung rank ends the whole run, leaving no processes."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from pathlib import Path

import pytest

from parsim.errors import ParsimError

from executor.launch import (HOST_CORES_ENV, RANK_ALLOCATOR_ENV, RankFailure, in_torchrun_job, launch,
                             resolve_backend, run_in_job, start_rank_server, usable_cores)

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# Rank functions live at module level: spawned ranks import them by name.

def sum_of_ranks(rank: int, world: int, offset: int) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank + offset, world, total.item()


def allocator_settings(rank: int, world: int) -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in RANK_ALLOCATOR_ENV}


def mmapped_blocks_for_one_mib(rank: int, world: int) -> int:
    """How many more blocks glibc's malloc maps from the kernel (mallinfo2's ``hblks``) while 1 MiB is held."""
    libc = ctypes.CDLL(None)

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = MallInfo2, ctypes.c_void_p, [ctypes.c_void_p]
    before = libc.mallinfo2().hblks
    block = libc.malloc(1 << 20)
    held = libc.mallinfo2().hblks
    libc.free(block)
    return held - before


def says_hello(rank: int, world: int) -> None:
    for fd, stream in ((1, "out"), (2, "err")):
        os.write(fd, f"rank {rank} {stream}\n".encode())  # one write a line: the ranks write at once


def binding(rank: int, world: int) -> tuple[list[int], int]:
    return sorted(os.sched_getaffinity(0)), usable_cores()


def rank_one_raises(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one is broken\nsecond line of the message")
    dist.all_reduce(torch.ones(4))  # rank 0 waits for rank 1 here, like a real peer would
    return rank


def rank_one_hangs(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(4))  # both ranks are up and past their imports
    if rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(4))
    return rank


def rank_zero_dies(rank: int, world: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def child_processes() -> set[tuple[int, str]]:
    """Live children of this process, without multiprocessing's shared resource tracker.

    The tracker is started by the first ``spawn`` and stays for the life of
    the parent by design; it is not a rank.
    """
    children = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == os.getpid() and state != "Z" and "resource_tracker" not in cmdline:
            children.add((int(entry.name), cmdline))
    return children


@pytest.fixture
def no_leftover_ranks():
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc to list child processes")
    start_rank_server()  # the fork server ranks come from lives as long as this process: not a leftover
    before = child_processes()
    yield
    assert child_processes() <= before


@needs_torch
@pytest.mark.multiproc
def test_every_rank_returns_its_value_in_rank_order(no_leftover_ranks):
    values = launch(sum_of_ranks, 2, args=(10,), backend="gloo", timeout_s=60)
    assert values == [(10, 2, 1.0), (11, 2, 1.0)]


@needs_torch
@pytest.mark.multiproc
def test_ranks_keep_freed_memory_unless_the_user_set_the_allocator(no_leftover_ranks, monkeypatch):
    """Spawned ranks get glibc settings that keep freed blocks (no page faults each step); a value the
    user exported wins, and the parent's own environment is left as it was."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    values = launch(allocator_settings, 2, backend="gloo", timeout_s=60)
    assert values == [{"MALLOC_MMAP_THRESHOLD_": RANK_ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"],
                       "MALLOC_TRIM_THRESHOLD_": "12345"}] * 2
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ and os.environ["MALLOC_TRIM_THRESHOLD_"] == "12345"


@needs_torch
@pytest.mark.multiproc
@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="reads glibc's malloc statistics")
def test_ranks_forked_from_the_server_take_each_launch_s_allocator_settings(no_leftover_ranks, monkeypatch):
    """glibc reads the settings only as a process starts, and ranks fork from a server started once: each
    rank sets them itself, so a 1 MiB block comes from the heap by default and from the kernel (mmap) where
    the user's threshold is lower, though the server started with the default."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert launch(mmapped_blocks_for_one_mib, 2, backend="gloo", timeout_s=60) == [0, 0]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    assert launch(mmapped_blocks_for_one_mib, 2, backend="gloo", timeout_s=60) == [1, 1]


@needs_torch
@pytest.mark.multiproc
def test_ranks_write_to_the_callers_streams_as_they_are_at_the_launch(no_leftover_ranks, tmp_path):
    """The fork server started with other standard streams (the fixture started it): a rank writes where the
    caller's stdout and stderr point at its launch."""
    out, err = tmp_path / "out", tmp_path / "err"
    saved = os.dup(1), os.dup(2)
    try:
        with open(out, "a") as out_file, open(err, "a") as err_file:  # appends: the ranks share it
            os.dup2(out_file.fileno(), 1)
            os.dup2(err_file.fileno(), 2)
            launch(says_hello, 2, backend="gloo", timeout_s=60)
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    assert sorted(out.read_text().splitlines()) == ["rank 0 out", "rank 1 out"]
    assert sorted(line for line in err.read_text().splitlines() if line.startswith("rank ")) == \
        ["rank 0 err", "rank 1 err"]


@needs_torch
@pytest.mark.multiproc
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="binds cores through Linux's affinity calls")
def test_gloo_ranks_are_bound_one_per_core_round_robin(no_leftover_ranks):
    """Each CPU rank runs on one core of the parent's, in rank order, and still knows how many the job has."""
    cores = sorted(os.sched_getaffinity(0))
    values = launch(binding, 3, backend="gloo", timeout_s=60)
    assert values == [([cores[r % len(cores)]], len(cores)) for r in range(3)]
    assert HOST_CORES_ENV not in os.environ and usable_cores() == len(cores)


@needs_torch
@pytest.mark.multiproc
def test_a_rank_that_raises_is_named_with_its_error(no_leftover_ranks):
    with pytest.raises(RankFailure) as caught:
        launch(rank_one_raises, 2, backend="gloo", timeout_s=60)
    err = caught.value
    assert isinstance(err, ParsimError)
    assert str(err).startswith("rank 1 failed: ValueError: rank one is broken")
    assert "second line" not in str(err)
    assert err.ranks == [1]
    assert "Traceback" in err.details and "rank_one_raises" in err.details


@needs_torch
@pytest.mark.multiproc
def test_a_hung_rank_is_named_and_every_rank_is_stopped(no_leftover_ranks):
    with pytest.raises(RankFailure) as caught:
        launch(rank_one_hangs, 2, backend="gloo", timeout_s=8)
    err = caught.value
    assert str(err).startswith("rank 1 did not finish within 8 s")
    assert "rank 0 was waiting in torch.distributed" in str(err)
    assert err.ranks == [1]
    assert "rank_one_hangs" in err.details  # the stacks say where each rank was


@needs_torch
@pytest.mark.multiproc
def test_a_rank_that_dies_without_reporting_is_named(no_leftover_ranks):
    with pytest.raises(RankFailure, match=r"^rank 0 failed: the process exited with code 3"):
        launch(rank_zero_dies, 2, backend="gloo", timeout_s=60)


@needs_torch
def test_auto_backend_is_gloo_without_a_gpu_per_rank():
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    assert resolve_backend("auto", 2) == "gloo"
    with pytest.raises(ParsimError, match="backend nccl needs one CUDA GPU per rank"):
        resolve_backend("nccl", 2)


def test_unknown_backend_and_bad_counts_are_user_errors():
    with pytest.raises(ParsimError, match="backend 'mpi' is not known"):
        resolve_backend("mpi", 2)
    with pytest.raises(ParsimError, match="--nproc 0: between 1 and 1024 ranks"):
        launch(sum_of_ranks, 0)
    with pytest.raises(ParsimError, match="--timeout nan: a positive number of seconds"):
        launch(sum_of_ranks, 2, timeout_s=float("nan"))


def test_a_torchrun_job_is_recognised_by_its_environment(monkeypatch):
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    assert not in_torchrun_job()
    with pytest.raises(ParsimError, match="not inside a torchrun job"):
        run_in_job(sum_of_ranks, (0,))
    for key, value in zip(TORCHRUN_VARS, ("0", "2", "127.0.0.1", "29500")):
        monkeypatch.setenv(key, value)
    assert in_torchrun_job()
