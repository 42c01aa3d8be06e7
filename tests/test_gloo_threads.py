"""gloo's device loops in a CPU rank: collectives' batched, the transfers' group's left to preempt."""

from __future__ import annotations

import importlib.util
import os

import pytest

from parsim.errors import ParsimError

from executor.gloo_threads import POLICY_ENV, loop_threads, policy
from executor.launch import launch, run_in_job

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
linux_threads = os.path.isdir("/proc/self/task") and hasattr(os, "SCHED_BATCH")
needs_linux_threads = pytest.mark.skipif(not linux_threads, reason="reads and sets threads' policies through Linux")


def loop_policies(rank: int, world: int) -> dict[str, list[int]]:
    """The device loops' policies: the job's (the default group's and the transfers' group's) before and after a
    transfer first used its group, and a collective group's."""
    import torch
    import torch.distributed as dist

    from executor.gloo_threads import collective_group, transfer_group

    started = loop_threads()
    group = collective_group(range(world))
    made = loop_threads() - started
    ones = torch.ones(2)
    dist.all_reduce(ones, group=group)  # the group works
    unused = sorted(os.sched_getscheduler(t) for t in started)
    if rank == 0:  # and so does the transfers' group
        dist.send(ones, 1, group=transfer_group())
    else:
        dist.recv(ones, 0, group=transfer_group())
    return {"unused": unused, "used": sorted(os.sched_getscheduler(t) for t in started),
            "collective": sorted(os.sched_getscheduler(t) for t in made), "sum": ones.tolist()}


@needs_torch
@needs_linux_threads
@pytest.mark.multiproc
@pytest.mark.parametrize("chosen", ["split", "preempt", "batch"])
def test_collective_loops_are_batched_and_the_transfer_groups_loop_preempts_once_used(chosen, monkeypatch):
    """By default the default group's loop and a collective group's are SCHED_BATCH (they never preempt the
    worker they wait for); the transfers' group's loop is too until a transfer uses the group, then
    SCHED_OTHER. The other policies leave every loop as gloo starts it, or batch every one."""
    monkeypatch.setenv(POLICY_ENV, chosen)
    batch, other = os.SCHED_BATCH, os.SCHED_OTHER
    unused = {"split": [batch, batch], "preempt": [other, other], "batch": [batch, batch]}[chosen]
    used = {"split": [other, batch], "preempt": [other, other], "batch": [batch, batch]}[chosen]
    made = {"split": [batch], "preempt": [other], "batch": [batch]}[chosen]
    for values in launch(loop_policies, 2, backend="gloo", timeout_s=60):
        assert values == {"unused": sorted(unused), "used": sorted(used), "collective": made, "sum": [2.0, 2.0]}


def test_an_unknown_policy_is_a_user_error(monkeypatch):
    monkeypatch.setenv(POLICY_ENV, "fast")
    with pytest.raises(ParsimError, match="PARSIM_GLOO_LOOPS='fast': expected one of split, preempt, batch"):
        policy()


def test_a_bad_policy_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv(POLICY_ENV, "fast")
    with pytest.raises(ParsimError, match="PARSIM_GLOO_LOOPS='fast'"):
        launch(loop_policies, 2, backend="gloo", timeout_s=60)


def test_a_torchrun_rank_refuses_a_bad_policy_before_joining_the_job(monkeypatch):
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1"),
                       (POLICY_ENV, "fast")):
        monkeypatch.setenv(key, value)
    with pytest.raises(ParsimError, match="PARSIM_GLOO_LOOPS='fast'"):  # no rendezvous is tried (port 1)
        run_in_job(loop_policies, backend="gloo")
