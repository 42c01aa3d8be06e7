"""Every rank its own program: a representative program (:func:`parsim.lowering.lower.lower`) copied onto each replica.

Lowering simulates one representative rank per pipeline rank, which is exact
while the replicas run alike. Ranks that take turns on a shared CPU core do
not: one runs its pass while its twin waits for the core, so they drift apart
by up to a pass (``docs/calibration.md``, "Ranks taking turns on a core").
Timing that needs each replica in its own right, so this copies the program
once per replica position ``j`` (the same ``[dp, cp, tp]`` index on every
pipeline rank, :attr:`Program.replicas` order):

* each op moves to the ``j``-th replica of its rank;
* a collective's group becomes the one of its groups (the representative's or
  a mirror's) that holds that replica; the copies of one collective that land
  on the same group are one collective over simulated ranks (:attr:`Op.joins`);
* a send's pair becomes the mirror pair leaving that replica, a receive's
  peer the ``j``-th replica of its peer; ``deps`` and a receive's ``match``
  stay within the copy;
* mirrors are dropped: every rank they stood for now runs its own flows.

Without ranks sharing cores the copies run alike, and the unfolded program
times exactly as the representative one (``tests/test_unfold.py``).
"""

from __future__ import annotations

import dataclasses

from ..errors import ParsimError
from ..sim.program import Op, Program


def unfold(program: Program) -> Program:
    """``program`` with every replica of each simulated rank simulated in its own right."""
    representatives = program.ranks
    copies = {len(program.replicas.get(r, (r,))) for r in representatives}
    if len(copies) != 1:
        raise ParsimError(f"cannot unfold a program whose ranks stand for different numbers of replicas {copies}")
    count = copies.pop()
    n = len(program.ops)
    out = Program(program.world_size)
    for j in range(count):
        replica = {r: program.replicas.get(r, (r,))[j] for r in representatives}
        for op in program.ops:
            out.add(replica[op.rank], _copy(op, j * n, replica))
        for r in representatives:
            out.replicas[replica[r]] = (replica[r],)
            if r in program.gradients:
                out.gradients[replica[r]] = program.gradients[r]
    _join_collectives(out)
    return out


def _copy(op: Op, offset: int, replica: dict[int, int]) -> Op:
    """``op`` on its rank's replica (``replica``: representative -> this copy's rank); ids shifted by ``offset``."""
    rank = replica[op.rank]
    copy = dataclasses.replace(op, deps=tuple(d + offset for d in op.deps), mirrors=(), joins=(), id=-1, rank=-1,
                               beside_of=op.beside_of + offset if op.beside_of >= 0 else -1)
    if op.kind == "recv":
        copy.peer = replica[op.peer]
        copy.match = op.match + offset if op.match >= 0 else -1
        copy.name = _with_peer(op.name, copy.peer)
    elif op.kind == "send":
        if op.ranks == (op.rank, op.rank):  # both stages on one rank: nothing moves
            copy.ranks = (rank, rank)
        else:
            copy.ranks = next((pair for pair in (op.ranks, *op.mirrors) if pair[0] == rank), None)
            if copy.ranks is None:
                raise ParsimError(f"op {op.name!r}: no transfer from rank {op.rank}'s replica {rank}")
        copy.peer = copy.ranks[1]
        copy.name = _with_peer(op.name, copy.peer)
    elif op.kind == "collective":
        copy.ranks = next((g for g in (op.ranks, *op.mirrors) if rank in g), None)
        if copy.ranks is None:
            raise ParsimError(f"op {op.name!r}: no group of rank {op.rank}'s replica {rank}")
    return copy


def _with_peer(name: str, peer: int) -> str:
    """A pipeline transfer's name (``send act stage=0 mb=3 peer=1``) with another peer."""
    head, found, _ = name.rpartition(" peer=")
    return f"{head} peer={peer}" if found else name


def _join_collectives(program: Program) -> None:
    """The ops of one collective on the ranks of its group (the same name and group, the same turn among those
    on each rank) run once, when all have reached it (:attr:`Op.joins`)."""
    seen: dict[tuple, int] = {}
    members: dict[tuple, list[int]] = {}
    for op in program.ops:
        if op.kind != "collective" or len(set(op.ranks)) < 2:
            continue
        group = tuple(sorted(set(op.ranks)))
        turn = seen[(op.rank, op.name, group)] = seen.get((op.rank, op.name, group), -1) + 1
        members.setdefault((op.name, group, turn), []).append(op.id)
    for (name, group, _), ids in members.items():
        if len(ids) != len(group):
            raise ParsimError(f"collective {name!r} over ranks {group}: {len(ids)} of its {len(group)} ranks run it")
        for i in ids:
            program.ops[i].joins = tuple(k for k in ids if k != i)
