"""Flow-level network model on simpy: concurrent transfers share link bandwidth.

Every active flow follows a fixed route of links. Rates are max-min fair
(progressive filling): the most contended link splits its capacity evenly
among its flows, those flows are frozen at that rate, and the rest share
what is left. Rates are recomputed whenever a flow starts or finishes, so
two collectives running at once on the same NICs slow each other down, and
speed up again when one ends. This is the fluid model used by flow-level
network simulators (e.g. SimGrid's), far cheaper than packets and exact for
the steady streams that collectives produce.
"""

from __future__ import annotations

import numpy as np
import simpy

_DONE_BYTES = 1e-6  # a flow with less left than this (bytes) is finished


def max_min_rates(routes: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rate (bytes/s) of each flow; ``routes`` is flows x hops, -1 padded."""
    flows = routes.shape[0]
    rates = np.zeros(flows)
    if flows == 0:
        return rates
    hop_mask = routes >= 0
    # A flow with an empty route (source == destination) is instantaneous.
    empty = ~hop_mask.any(axis=1)
    rates[empty] = np.inf
    active = ~empty
    # Work on the links in use only: a big cluster has far more links than busy ones.
    used, local = np.unique(routes[hop_mask], return_inverse=True)
    routes = np.full(routes.shape, -1, dtype=np.int64)
    routes[hop_mask] = local
    remaining = capacity[used].astype(float)
    while active.any():
        live = hop_mask & active[:, None]
        counts = np.bincount(routes[live], minlength=used.size)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(counts > 0, remaining / counts, np.inf)
        level = share.min()
        bottleneck = share <= level * (1 + 1e-12)
        # Flows crossing a bottleneck link are frozen at the fair level.
        frozen = active & (live & bottleneck[np.maximum(routes, 0)]).any(axis=1)
        rates[frozen] = level
        np.subtract.at(remaining, routes[hop_mask & frozen[:, None]], level)
        np.maximum(remaining, 0.0, out=remaining)
        active &= ~frozen
    return rates


class Network:
    """Links with capacities; ``transfer`` starts a batch of flows and returns a simpy event.

    The event fires when every flow of the batch has arrived. Byte counts per link
    are accumulated in ``link_bytes`` for bottleneck reports.
    """

    def __init__(self, env: simpy.Environment, capacity_Bps: np.ndarray):
        self.env = env
        self.capacity = np.asarray(capacity_Bps, dtype=float)
        self.link_bytes = np.zeros_like(self.capacity)
        self._routes = np.empty((0, 1), dtype=np.int64)
        self._left = np.empty(0)
        self._rate = np.empty(0)
        self._batch = np.empty(0, dtype=np.int64)
        self._pending: dict[int, list] = {}  # batch id -> [event, flows not yet done]
        self._next_batch = 0
        self._last_update = 0.0
        self._generation = 0

    def transfer(self, routes: np.ndarray, nbytes) -> simpy.Event:
        """Start one flow per row of ``routes`` carrying ``nbytes`` (scalar or per flow)."""
        routes = np.asarray(routes, dtype=np.int64)
        sizes = np.broadcast_to(np.asarray(nbytes, dtype=float), (routes.shape[0],)).copy()
        done = self.env.event()
        keep = sizes > _DONE_BYTES
        routes, sizes = routes[keep], sizes[keep]
        valid = routes >= 0
        np.add.at(self.link_bytes, routes[valid], np.repeat(sizes, valid.sum(axis=1)))
        if routes.shape[0] == 0:
            done.succeed()
            return done
        self._advance()
        batch = self._next_batch
        self._next_batch += 1
        self._pending[batch] = [done, routes.shape[0]]
        width = max(self._routes.shape[1], routes.shape[1])
        self._routes = np.vstack([_pad(self._routes, width), _pad(routes, width)])
        self._left = np.concatenate([self._left, sizes])
        self._batch = np.concatenate([self._batch, np.full(routes.shape[0], batch)])
        self._reschedule()
        return done

    def _advance(self) -> None:
        """Drain bytes at the current rates up to now."""
        elapsed = self.env.now - self._last_update
        if elapsed > 0 and self._left.size:
            self._left -= np.minimum(self._rate * elapsed, self._left)
        self._last_update = self.env.now

    def _reschedule(self) -> None:
        self._rate = max_min_rates(self._routes, self.capacity)
        self._generation += 1
        if not self._left.size:
            return
        with np.errstate(divide="ignore"):
            wait = float(np.min(self._left / self._rate))
        generation = self._generation
        wake = self.env.timeout(max(wait, 0.0))
        wake.callbacks.append(lambda _event: self._on_wake(generation))

    def _on_wake(self, generation: int) -> None:
        if generation != self._generation:
            return  # superseded by a later change of the flow set
        self._advance()
        # Finished: nothing left, or less than a rounding error of what the rate moves.
        finished = (self._left <= _DONE_BYTES) | (self._left <= self._rate * 1e-15)
        for batch, count in zip(*np.unique(self._batch[finished], return_counts=True)):
            entry = self._pending[int(batch)]
            entry[1] -= int(count)
            if entry[1] == 0:
                del self._pending[int(batch)]
                entry[0].succeed()
        keep = ~finished
        self._routes, self._left, self._batch = self._routes[keep], self._left[keep], self._batch[keep]
        self._reschedule()


def _pad(routes: np.ndarray, width: int) -> np.ndarray:
    if routes.shape[1] == width:
        return routes
    pad = np.full((routes.shape[0], width - routes.shape[1]), -1, dtype=np.int64)
    return np.hstack([routes, pad])
