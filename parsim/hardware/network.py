"""Flow-level network model on simpy: concurrent transfers share link bandwidth.

Every active flow follows a fixed route of links. Rates are max-min fair
(progressive filling): the most contended link splits its capacity evenly
among its flows, those flows are frozen at that rate, and the rest share
what is left. Rates are recomputed whenever a flow starts or finishes, so
two collectives running at once on the same NICs slow each other down, and
speed up again when one ends. This is the fluid model used by flow-level
network simulators (e.g. SimGrid's), far cheaper than packets and exact for
the steady streams that collectives produce.

Two things keep a training step with hundreds of thousands of transfers cheap
(see ``docs/engine.md``):

* **Contention is resolved per component.** Transfers (batches of flows) that
  share no link cannot change each other's max-min rates, so a start or a
  finish only re-solves the batches connected to it through shared links. A
  batch alone on its links follows its memoized solo :class:`Trajectory`: one
  wake-up for its whole life. Flows that end without having held a saturated
  link that a moving flow crosses leave everyone's rates as they were.
* **Solutions are memoized.** A batch started with a ``key`` (the caller's
  name for its routes and sizes) contributes that key to the component's
  signature; the same set of transfers always has the same rates, so the
  tenth microbatch's all-reduce next to the same send reuses the first one's
  solution instead of solving again.

Time cannot freeze: a flow finishes at the time computed when its rate was
last set (``fin``), and every wake-up finishes at least the flows due at the
time it was scheduled for, whatever bytes are left after rounding. Each
wake-up ends at least one flow, so a simulation always terminates.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import simpy

_FEW_LINKS = 64  # below this many links, a transfer's link sets are relabelled in plain Python
# Flows due within this relative distance of the earliest finish end together:
# they differ only by floating-point rounding of the same arithmetic.
_SAME_TIME = 1e-12


def unique_links(ids: np.ndarray, bound: int, inverse: bool = False):
    """``np.unique(ids)`` (with ``return_inverse``) of non-negative ids below ``bound`` (links, interned sets).
    Many ids against few possible ones are marked in a table rather than sorted: numpy's unique takes 1.6 ms
    on a 20,000-hop all-to-all over 8,577 links, the table 0.08 ms. Identical results."""
    if ids.size * 128 < bound:  # few ids in a large range: sorting them is the cheaper
        return np.unique(ids, return_inverse=inverse)
    present = np.zeros(bound, dtype=bool)
    present[ids] = True
    used = np.flatnonzero(present)
    if not inverse:
        return used
    index = np.empty(bound, dtype=np.int64)
    index[used] = np.arange(used.size)
    return used, index[ids]


def max_min_rates(routes: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rate (bytes/s) of each flow; ``routes`` is flows x hops, -1 padded."""
    hop_mask = routes >= 0
    return fair_rates(routes[hop_mask], np.nonzero(hop_mask)[0], routes.shape[0], capacity)


def fair_rates(hops: np.ndarray, owners: np.ndarray, flows: int, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rate (bytes/s) of each of ``flows`` flows whose hops are the links ``hops``, hop ``i``
    belonging to flow ``owners[i]`` (a link crossed twice counts twice). A flow without hops (source ==
    destination) is instantaneous.

    Progressive filling on the hops still moving only: every round freezes the flows crossing the most
    contended links and drops their hops, so a round costs what is left, and no route matrix is padded to
    the widest route (a chained ring's runs to hundreds of links, a send's to a few)."""
    return fair_rates_and_bottlenecks(hops, owners, flows, capacity)[0]


def fair_rates_and_bottlenecks(hops: np.ndarray, owners: np.ndarray, flows: int,
                               capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fair_rates`, and the links that froze flows (each saturated at the level it froze them at)."""
    rates = np.full(flows, np.inf)
    if hops.size == 0:
        return rates, np.empty(0, dtype=np.int64)
    # Work on the links in use only: a big cluster has far more links than busy ones.
    used, links = unique_links(hops, capacity.size, inverse=True)
    remaining = capacity[used].astype(float)
    counts = np.bincount(links, minlength=used.size)
    frozen = np.zeros(flows, dtype=bool)
    saturated = np.zeros(used.size, dtype=bool)
    while links.size:
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(counts > 0, remaining / counts, np.inf)
        level = share.min()
        bottleneck = share <= level * (1 + 1e-12)
        saturated |= bottleneck
        # Flows crossing a bottleneck link are frozen at the fair level, and their hops leave.
        frozen[owners[bottleneck[links]]] = True
        leaving = frozen[owners]
        rates[owners[leaving]] = level
        freed = np.bincount(links[leaving], minlength=used.size)
        remaining = np.maximum(remaining - level * freed, 0.0)
        counts -= freed
        links, owners = links[~leaving], owners[~leaving]
    return rates, used[saturated]


class Trajectory:
    """How a batch of flows drains when nothing else shares its links.

    ``segments`` are ``(seconds, active flow indices, their rates)``: max-min
    rates hold until the next flow ends. Memoized per route set and sizes, it
    gives an uncontended transfer's time without simulating it, and its state
    at any instant if another transfer starts to share its links.
    """

    def __init__(self, routes: np.ndarray, sizes: np.ndarray, capacity: np.ndarray):
        self.segments: list[tuple[float, np.ndarray, np.ndarray]] = []
        left, active = sizes.astype(float, copy=True), np.arange(routes.shape[0])
        self.duration = 0.0
        while active.size:
            rates = max_min_rates(routes.take(active, axis=0), capacity)
            with np.errstate(divide="ignore", invalid="ignore"):
                due = np.where(left[active] > 0, left[active] / rates, 0.0)
            step = float(due.min())
            self.segments.append((step, active, rates))
            self.duration += step
            if not np.isfinite(step):
                break  # a link without bandwidth: never arrives
            with np.errstate(invalid="ignore"):  # a flow with no link to cross (infinite rate) in a zero step
                left[active] = np.maximum(np.nan_to_num(left[active] - rates * step, nan=0.0), 0.0)
            active = active[due > step + abs(step) * _SAME_TIME]

    def state_at(self, elapsed: float, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flows still moving ``elapsed`` seconds in (indices), and the bytes each has left."""
        left = sizes.astype(float, copy=True)
        for step, active, rates in self.segments:
            if elapsed < step:
                left[active] = np.maximum(left[active] - rates * elapsed, 0.0)
                return active, left[active]
            left[active] -= rates * step
            elapsed -= step
        return np.empty(0, dtype=np.int64), np.empty(0)


class _Batch:
    """Flows started together by one transfer; done when all have arrived.

    A batch that started alone on its links follows its memoized ``solo``
    trajectory (one wake-up at its end) until another batch comes to share a
    link; then it becomes an ordinary batch with per-flow state.
    """

    __slots__ = ("id", "routes", "sizes", "left", "rate", "fin", "active", "flows", "links", "key", "last",
                 "generation", "done", "solo", "started", "flat")

    def __init__(self, bid: int, routes: np.ndarray, sizes: np.ndarray, links: np.ndarray, key, now: float,
                 done: Callable[[], None]):
        self.id, self.routes, self.sizes, self.links, self.key = bid, routes, sizes, links, key
        self.flows = routes.shape[0]
        self.active = None  # indices (into the original flows) still moving; None: all of them
        self.left = sizes
        self.rate = self.fin = None  # set when rates are first solved
        self.last = self.started = now
        self.generation, self.done = 0, done
        self.solo: Trajectory | None = None
        self.flat: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # routes, and their hops unpadded

    def leave_solo(self, now: float) -> None:
        """Turn the memoized trajectory into per-flow state at ``now``."""
        if self.solo is None:
            return
        active, left = self.solo.state_at(now - self.started, self.sizes)
        if active.size < self.flows:
            self.routes, self.active = self.routes.take(active, axis=0), active
        self.left, self.last, self.solo = left, now, None

    def settle(self, now: float) -> None:
        """Drain bytes at the current rates up to ``now``."""
        elapsed = now - self.last
        if elapsed > 0 and self.rate is not None:
            self.left = np.maximum(self.left - self.rate * elapsed, 0.0)
        self.last = now

    def hops(self) -> tuple[np.ndarray, np.ndarray]:
        """The links of the flows in flight, hop by hop, and the flow (row of ``routes``) of each hop."""
        if self.flat is None or self.flat[0] is not self.routes:
            valid = self.routes >= 0
            self.flat = (self.routes, self.routes[valid], np.nonzero(valid)[0])
        return self.flat[1], self.flat[2]

    def signature(self) -> tuple[int, bool, bytes]:
        """The route set this batch has in flight: its key, and which flows remain if some ended."""
        if self.active is None:
            return (self.key, False, b"")
        return (self.key, True, self.active.tobytes())


class Network:
    """Links with capacities; ``transfer`` starts a batch of flows and returns a simpy event.

    The event fires when every flow of the batch has arrived (:meth:`start`
    calls a function instead). With ``track_bytes``, byte counts per link
    accumulate in ``link_bytes`` for bottleneck reports.
    """

    def __init__(self, env: simpy.Environment, capacity_Bps: np.ndarray, track_bytes: bool = True):
        self.env = env
        self.capacity = np.asarray(capacity_Bps, dtype=float)
        self.link_bytes = np.zeros_like(self.capacity) if track_bytes else None
        self._batches: dict[int, _Batch] = {}
        # Which batches are on each link, as an id into a table of interned sets of batch ids: the links
        # of one transfer mostly carry the same batches, so a start or finish updates a few sets and one
        # numpy array instead of thousands of per-link Python sets.
        self._set_of = np.zeros(self.capacity.size, dtype=np.int64)  # link -> set id (0: no batch)
        self._sets: list[frozenset[int]] = [frozenset()]
        self._set_ids: dict[frozenset[int], int] = {frozenset(): 0}
        self._neighbours: dict[int, set[int]] = {}  # batch id -> ids of the batches sharing a link with it
        self._prepared: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # key -> routes, sizes, links
        self._solutions: dict[tuple, tuple[list[np.ndarray], np.ndarray]] = {}  # signature -> rates, bottlenecks
        # Links that froze flows at the last solve of their component (the last slot stands for the -1 padding
        # of route matrices and stays False): only capacity freed on these can raise anyone's rate.
        self._bottleneck = np.zeros(self.capacity.size + 1, dtype=bool)
        self._trajectories: dict[int, Trajectory] = {}
        self._next_id = 0
        self.solves = 0  # max-min problems actually solved (the rest came from memory)

    def transfer(self, routes: np.ndarray, nbytes, key: int | None = None) -> simpy.Event:
        """Start one flow per row of ``routes`` carrying ``nbytes`` (scalar or per flow).

        ``key`` names the transfer for memoization: equal keys must mean equal
        routes and sizes. Without one, every change is solved afresh.
        """
        done = self.env.event()
        self.start(routes, nbytes, done.succeed, key)
        return done

    def start(self, routes: np.ndarray, nbytes, on_done: Callable[[], None], key: int | None = None) -> None:
        """Like :meth:`transfer`, but call ``on_done()`` when the last flow has arrived."""
        prepared = self._prepared.get(key) if key is not None else None
        if prepared is None:
            prepared = self._prepare(routes, nbytes, key)
        routes, sizes, links = prepared
        if self.link_bytes is not None:
            valid = routes >= 0
            np.add.at(self.link_bytes, routes[valid], np.repeat(sizes, valid.sum(axis=1)))
        if routes.shape[0] == 0:
            on_done()
            return
        batch = _Batch(self._next_id, routes, sizes, links, key, self.env.now, on_done)
        self._next_id += 1
        self._batches[batch.id] = batch
        alone = key is not None and not self._set_of[links].any()
        self._register(batch)
        if alone:
            batch.solo = self.trajectory(routes, sizes, key)
            self._wake_at(batch, batch.started + batch.solo.duration)
        else:
            self._resolve(self._component(batch))

    def _prepare(self, routes: np.ndarray, nbytes, key: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Routes and sizes of the flows that move bytes, and the links they use (kept per key)."""
        routes = np.asarray(routes, dtype=np.int64)
        sizes = np.broadcast_to(np.asarray(nbytes, dtype=float), (routes.shape[0],))
        moving = sizes > 0
        if not moving.all():
            routes, sizes = routes.compress(moving, axis=0), sizes[moving]
        prepared = routes, sizes.copy(), unique_links(routes[routes >= 0], self.capacity.size)
        if key is not None:
            self._prepared[key] = prepared
        return prepared

    def solo_time(self, routes: np.ndarray, nbytes, key: int) -> float:
        """Seconds transfer ``key`` takes with nothing else on its links."""
        routes, sizes, _ = self._prepared.get(key) or self._prepare(routes, nbytes, key)
        return self.trajectory(routes, sizes, key).duration if routes.shape[0] else 0.0

    def trajectory(self, routes: np.ndarray, sizes: np.ndarray, key: int) -> Trajectory:
        """The memoized :class:`Trajectory` of transfer ``key`` (``routes`` carrying ``sizes``) alone."""
        found = self._trajectories.get(key)
        if found is None:
            self.solves += 1
            found = self._trajectories[key] = Trajectory(routes, sizes, self.capacity)
        return found

    # -- which batches contend -------------------------------------------------
    def _intern(self, batches: frozenset[int]) -> int:
        found = self._set_ids.get(batches)
        if found is None:
            found = self._set_ids[batches] = len(self._sets)
            self._sets.append(batches)
        return found

    def _relabel(self, links: np.ndarray, change: Callable[[frozenset[int]], frozenset[int]]) -> list[frozenset[int]]:
        """Replace the batch set of every link in ``links`` by ``change(set)``; the distinct old sets."""
        current = self._set_of[links]
        if links.size <= _FEW_LINKS:  # a send's handful of links: plain Python beats numpy's unique
            ids = current.tolist()
            new = {i: self._intern(change(self._sets[i])) for i in dict.fromkeys(ids)}
            self._set_of[links] = [new[i] for i in ids]
            return [self._sets[i] for i in new]
        first = int(current[0])
        if (current == first).all():  # most often: every link of the transfer carries the same batches
            self._set_of[links] = self._intern(change(self._sets[first]))
            return [self._sets[first]]
        ids, where = unique_links(current, len(self._sets), inverse=True)
        old = [self._sets[i] for i in ids.tolist()]
        self._set_of[links] = np.array([self._intern(change(s)) for s in old], dtype=np.int64)[where]
        return old

    def _register(self, batch: _Batch) -> None:
        added = frozenset((batch.id,))
        neighbours = set().union(*self._relabel(batch.links, added.union))
        self._neighbours[batch.id] = neighbours
        for other in neighbours:
            self._neighbours[other].add(batch.id)

    def _unregister(self, batch: _Batch) -> set[int]:
        """Remove ``batch`` from its links; the ids of the batches it shared links with."""
        gone = frozenset((batch.id,))
        self._relabel(batch.links, lambda s: s - gone)
        neighbours = self._neighbours.pop(batch.id)
        for other in neighbours:
            self._neighbours[other].discard(batch.id)
        return neighbours

    def _component(self, batch: _Batch) -> list[_Batch]:
        """Every active batch connected to ``batch`` through shared links (itself included)."""
        seen, todo = {batch.id}, [batch.id]
        while todo:
            others = self._neighbours[todo.pop()] - seen
            seen |= others
            todo.extend(others)
        return [self._batches[i] for i in sorted(seen)]

    # -- rates and wake-ups ------------------------------------------------------
    def _resolve(self, component: list[_Batch]) -> None:
        """New max-min rates for a component of contending batches, and their next wake-ups."""
        now = self.env.now
        for b in component:
            b.leave_solo(now)
            b.settle(now)
        rates, bottlenecks = self._rates(component)
        for b in component:
            self._bottleneck[b.links] = False
        self._bottleneck[bottlenecks] = True
        for b, rate in zip(component, rates):
            b.rate = rate
            with np.errstate(divide="ignore", invalid="ignore"):
                fin = np.where(b.left > 0, now + b.left / rate, now)
            fin[np.isnan(fin)] = np.inf  # a zero-capacity link never delivers
            b.fin = fin
            self._wake_at(b, float(fin.min()) if fin.size else now)  # empty: ended just now

    def _wake_at(self, batch: _Batch, due: float) -> None:
        batch.generation += 1
        if due < np.inf:
            generation = batch.generation
            self.env.timeout(max(due - self.env.now, 0.0)).callbacks.append(
                lambda _event: self._wake(batch, generation, due))

    def _rates(self, component: list[_Batch]) -> tuple[list[np.ndarray], np.ndarray]:
        """Each batch's max-min rates, and the links that froze flows (see :func:`fair_rates_and_bottlenecks`)."""
        signature = None
        if all(b.key is not None for b in component):
            signature = tuple(sorted(b.signature() for b in component))
            order = sorted(range(len(component)), key=lambda i: component[i].signature())
            known = self._solutions.get(signature)
            if known is not None:
                rates: list[np.ndarray] = [np.empty(0)] * len(component)
                for i, rate in zip(order, known[0]):
                    rates[i] = rate
                return rates, known[1]
        self.solves += 1
        flows = [b.routes.shape[0] for b in component]
        parts = [b.hops() for b in component]
        starts = np.cumsum(flows) - flows
        hops = np.concatenate([links for links, _ in parts])
        owners = np.concatenate([owner + start for (_, owner), start in zip(parts, starts.tolist())])
        solved, bottlenecks = fair_rates_and_bottlenecks(hops, owners, sum(flows), self.capacity)
        rates = np.split(solved, np.cumsum(flows)[:-1])
        if signature is not None:
            self._solutions[signature] = ([rates[i] for i in order], bottlenecks)
        return rates, bottlenecks

    def _wake(self, batch: _Batch, generation: int, due: float) -> None:
        if generation != batch.generation:
            return  # superseded: the component's rates changed since this wake-up was set
        if batch.solo is None:
            batch.settle(self.env.now)
            finished = batch.fin <= due + abs(due) * _SAME_TIME
        else:
            finished = None  # a solo trajectory ends with every flow
        if finished is None or finished.all():
            del self._batches[batch.id]
            neighbours = self._unregister(batch)
            for component in self._components(neighbours):
                self._resolve(component)
            batch.done()
            return
        keep = ~finished
        component = self._component(batch)
        unchanged = self._rates_survive(component, batch, finished)
        active = np.arange(batch.flows) if batch.active is None else batch.active
        batch.routes, batch.left, batch.active = batch.routes.compress(keep, axis=0), batch.left[keep], active[keep]
        if unchanged:  # the flows that ended held no capacity anyone still moving could take
            batch.rate, batch.fin = batch.rate[keep], batch.fin[keep]
            self._wake_at(batch, float(batch.fin.min()))
        else:
            self._resolve(component)

    def _rates_survive(self, component: list[_Batch], batch: _Batch, finished: np.ndarray) -> bool:
        """True when the max-min rates of every flow still moving stay as they are once ``finished``
        flows of ``batch`` leave.

        Capacity a finished flow frees can raise another flow's rate only through a link that froze flows
        when the rates were solved (a bottleneck, saturated) and that the other flow crosses: elsewhere it
        only adds headroom to links that never limited anyone. If no flow still moving crosses a bottleneck
        a finished flow crossed, progressive filling freezes the same flows at the same levels again (exact,
        and far cheaper than solving again: an all-to-all's intra-node flows end before its inter-node ones).
        """
        crossed = batch.routes.compress(finished, axis=0)
        freed = crossed[self._bottleneck[crossed]]
        if freed.size == 0:
            return True
        mark = np.zeros(self._bottleneck.size, dtype=bool)
        mark[freed] = True
        if mark[batch.routes.compress(~finished, axis=0)].any():  # the batch's own flows, most often
            return False
        return not any(mark[b.routes].any() for b in component if b is not batch)

    def _components(self, ids: set[int]) -> list[list[_Batch]]:
        """The distinct components the batches ``ids`` belong to."""
        components, covered = [], set()
        for i in sorted(ids):
            if i not in covered:
                component = self._component(self._batches[i])
                covered.update(b.id for b in component)
                components.append(component)
        return components


def stack_routes(routes: list[np.ndarray]) -> np.ndarray:
    """Route matrices of different widths stacked into one, padded with -1."""
    width = max(r.shape[1] for r in routes)
    return np.vstack([r if r.shape[1] == width else
                      np.pad(r, ((0, 0), (0, width - r.shape[1])), constant_values=-1) for r in routes])


def chain_routes(routes: np.ndarray, nbytes: np.ndarray, chain: int) -> tuple[np.ndarray, np.ndarray]:
    """Flows (``routes`` flows x hops, ``nbytes`` per flow) whose every ``chain`` consecutive ones form a
    pipelined chain, as one flow per chain over all its hops' links (a link used by several hops counts
    once per hop), carrying what each hop carries.

    In a ring or a chain every hop forwards only what it has received, through a few buffer slots
    (NCCL_STEPS = 8 per channel: NCCL ``src/device/prims_simple.h``, ``waitPeer``/``postPeer``), so the
    chain moves at its slowest hop's rate. Alone on its links this times it exactly as separate flows
    do (the slowest hop sets the end either way); sharing links, a fast hop no longer runs ahead and
    takes bandwidth the chain cannot use.
    """
    if chain <= 1 or routes.shape[0] <= 1:
        return routes, nbytes
    chains = routes.reshape(-1, chain * routes.shape[1])
    chains = -np.sort(-chains, axis=1)  # each chain's links first, the -1 padding last
    return chains[:, :int((chains >= 0).sum(axis=1).max())], nbytes[::chain]
