"""One rank's measured events of one training step, in parsim's trace schema.

Every span the executor times goes through :class:`Recorder`, so measured
events carry exactly the names the simulator writes (``F stage=1 mb=3``,
``all_reduce tp layer=layer.0 mb=0 dir=fwd1``, ...) and ``parsim compare`` can
join the two traces by name. Each span is also a
``torch.profiler.record_function`` of the same name while a profiler runs: a
run under ``torch.profiler`` then shows these names as user annotations, which
:mod:`parsim.kineto.read` reads back. Without a profiler the annotation is
left out: entering and leaving one costs 5 us with warm caches and 25-50 us
between a step's large kernels (course DDP on a 2-core VM), time the
measured step would show as idle that no training loop spends.

Times are seconds since :meth:`Recorder.start_step`, which the runner calls
right after a barrier; ``time.perf_counter`` is one system-wide monotonic
clock on Linux, so the ranks' zeros agree to within the barrier's exit skew
(milliseconds where ranks share cores: :func:`executor.train.measure.step_events`
moves a host's ranks onto the first one's zero).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

from parsim.report.trace import Event

from .._torch import require_torch


class Recorder:
    """Collects the events of one rank; ``sync`` waits for queued device work (CUDA) before reading the clock.

    The tensor-parallel collectives inside an action are numbered per
    (layer, direction) in the order they run, as the simulator numbers them;
    :meth:`begin_action` resets the count and names the microbatch.
    """

    def __init__(self, rank: int, sync: Callable[[], None] | None = None):
        self.rank = rank
        self.sync = sync or (lambda: None)
        self.events: list[Event] = []
        self.microbatch = 0
        self._t0 = time.perf_counter()
        self._counts: dict[tuple[str, str], int] = {}
        self._recomputing = 0  # depth of recomputation contexts entered
        self._gaps: list[tuple[float, float]] = []  # waits of the compute stream inside the open compute span

    def start_step(self) -> None:
        """Forget earlier events; t = 0 is now."""
        self.events = []
        self._t0 = time.perf_counter()

    @property
    def origin_s(self) -> float:
        """The step's t = 0 on ``time.perf_counter``'s clock: other ranks' events compare exactly after adding it."""
        return self._t0

    def now(self) -> float:
        """Seconds since the step started (device work finished first)."""
        self.sync()
        return time.perf_counter() - self._t0

    def begin_action(self, microbatch: int) -> None:
        self.microbatch = microbatch
        self._counts = {}

    def recomputing(self) -> "_Recomputing":
        """A context for a recomputed layer's forward re-run: its forward collectives are named ``rec``.

        Reusable and re-entrant (checkpointing may enter it more than once)."""
        return _Recomputing(self)

    def direction(self, direction: str) -> str:
        """The name of a collective's direction: ``fwd`` inside a recomputation is ``rec``."""
        return "rec" if direction == "fwd" and self._recomputing else direction

    def next_index(self, layer: str, direction: str) -> int:
        """0, 1, ... for successive collectives of ``layer`` in ``direction`` within this action."""
        key = (layer, direction)
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        return index

    def add(self, name: str, kind: str, stream: str, start_s: float, end_s: float, **args: Any) -> Event:
        event = Event(name, self.rank, stream, kind, start_s, max(end_s - start_s, 0.0), dict(args))
        self.events.append(event)
        return event

    def waited(self, start_s: float, end_s: float) -> None:
        """The compute stream waited from ``start_s`` to ``end_s`` for a collective beside it: the compute span
        around it keeps the wait as a gap (``args["gaps"]``, as the simulator's merged spans do), so the wait
        counts towards that collective, not towards compute."""
        if end_s > start_s:
            self._gaps.append((start_s, end_s))

    @contextmanager
    def span(self, name: str, kind: str, stream: str, **args: Any) -> Iterator[None]:
        """Time the body as one event (and, under a profiler, as a ``torch.profiler.record_function`` of the
        same name)."""
        first = len(self._gaps)
        with annotation(name):
            start = self.now()
            yield
            end = self.now()
        gaps = self._gaps[first:]
        del self._gaps[first:]
        if gaps and kind == "compute":
            args["gaps"] = gaps
        self.add(name, kind, stream, start, end, **args)


def annotation(name: str) -> Any:
    """A ``torch.profiler.record_function`` of ``name`` while a profiler runs, else nothing (see the module's
    docstring: outside a profiler it only costs time)."""
    torch = require_torch()
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class _Recomputing:
    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def __enter__(self) -> None:
        self.recorder._recomputing += 1

    def __exit__(self, *exc: object) -> None:
        self.recorder._recomputing -= 1
