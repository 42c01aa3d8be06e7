"""How busy other programs kept this host's CPUs while we measured (Linux; elsewhere unknown).

Calibration and CPU runs time work on cores that other processes may share
(a laptop's browser, other jobs on a shared VM). :class:`ForeignLoad` reads
the kernel's CPU counters (``/proc/stat``) before and after, takes out the
CPU time of this process and of every process it started (the ranks, their
fork server and the ranks that server forked, running or finished), and says
how many cores' worth the rest of the host used meanwhile; measurements taken
under such load read slow, and the tools print a warning.
"""

from __future__ import annotations

import os
import resource
import time

WARN_CORES = 0.25  # print a warning from this much foreign load on


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks over all CPUs since boot, or None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(fields) - fields[3] - fields[4], sum(fields)  # idle and iowait are not busy


def _own_seconds() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime + _running_descendants_seconds()


def _running_descendants_seconds() -> float:
    """CPU seconds of this process's running descendants, each with its finished children's: a rank forked
    from a fork server is the server's child, and the server lives on, so neither reaches
    ``RUSAGE_CHILDREN``. 0 where ``/proc`` does not tell."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    total, todo = 0, list(children.get(os.getpid(), ()))
    while todo:
        pid = todo.pop()
        total += ticks[pid]
        todo.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """``with ForeignLoad() as load: ...``; then ``load.cores``: the average number of cores other
    processes kept busy during the block (None where the host does not tell)."""

    cores: float | None = None

    def __enter__(self) -> "ForeignLoad":
        self._ticks, self._own, self._wall = _cpu_ticks(), _own_seconds(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        after = _cpu_ticks()
        wall = time.monotonic() - self._wall
        if self._ticks is None or after is None or wall <= 0:
            return
        tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        busy_s = (after[0] - self._ticks[0]) * tick_s
        self.cores = max(0.0, (busy_s - (_own_seconds() - self._own)) / wall)

    def warning(self, what: str) -> str | None:
        """A line to print when the load was high enough to slow ``what`` down, else None."""
        if self.cores is None or self.cores < WARN_CORES:
            return None
        return (f"warning: other processes kept {self.cores:.1f} of {os.cpu_count()} cores busy during {what}; "
                f"its timings read slow (run it again on a quiet host)")
