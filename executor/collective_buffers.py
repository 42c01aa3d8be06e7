"""One collective's buffers, the call that runs it, and the check of its result, as nccl-tests does.

nccl-tests times each operation twice: *out-of-place* (the result lands in a
buffer apart from the input) and *in-place* (the result overwrites the
input: all-gather's input is this rank's slice of the output, reduce-scatter's
output is this rank's slice of the input). torch.distributed has no
out-of-place all_reduce, broadcast or reduce, so those have the in-place form
alone; all-to-all has the out-of-place form alone (:func:`forms_of`).

Timing runs on zeros (repeated sums stay zero: no overflow, no denormals).
The check then fills every rank's input with a pattern of small whole
numbers that differs per rank, fills the outputs with NaN (a value the call
never wrote counts as wrong), runs the call once and counts the elements that
differ from the result computed locally; float32 sums of such numbers are
exact, so any difference is an error, not rounding. Like nccl-tests' #wrong,
the count is over every rank's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ._torch import require_distributed, require_torch

ROOT = 0  # root of broadcast, reduce, gather and scatter, as in nccl-tests
FORMS = ("out_of_place", "in_place")
IN_PLACE_ONLY = frozenset({"all_reduce", "broadcast", "reduce"})  # torch.distributed's API has no other form
# all_to_all_single takes one tensor as both input and output without complaint, but gloo's pairwise
# exchange then overwrites chunks before it sends them: the check counted a quarter of the elements wrong.
OUT_OF_PLACE_ONLY = frozenset({"all_to_all"})
CHUNKED_OPS = frozenset({"all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"})
ROOTED_OPS = frozenset({"broadcast", "reduce", "gather", "scatter"})
REDUCING_OPS = frozenset({"all_reduce", "reduce_scatter", "reduce"})


def forms_of(op: str) -> tuple[str, ...]:
    """The forms torch.distributed can run ``op`` in; the first is the one a single figure reports."""
    if op in IN_PLACE_ONLY:
        return ("in_place",)
    return ("out_of_place",) if op in OUT_OF_PLACE_ONLY else FORMS


@dataclass
class CollectiveBuffers:
    """``run()`` calls the collective once; ``check()`` runs it on the pattern and returns this rank's
    wrong elements."""

    run: Callable[[], None]
    api: str
    fill: Callable[[], None]  # the pattern into the inputs, NaN into the outputs
    outputs: Callable[[], list[tuple[Any, Any]]]  # (output, expected) pairs this rank checks

    def check(self) -> int:
        self.fill()
        self.run()
        return sum(int((out != want).sum().item()) for out, want in self.outputs())


def pattern(rank: int, start: int, count: int, device: Any) -> Any:
    """Rank ``rank``'s input elements ``start .. start+count``: whole numbers in -6..6, as float32."""
    torch = require_torch()
    index = torch.int32 if start + count < 2**31 else torch.int64  # half the memory where it suffices
    values = (torch.arange(start, start + count, dtype=index, device=device) + 7 * (rank + 1)) % 13 - 6
    return values.to(torch.float32)


def make_buffers(op: str, form: str, elements: int, rank: int, world: int, device: Any) -> CollectiveBuffers:
    """Zeroed buffers for ``op`` of ``elements`` float32 elements in ``form``, ready to time and check."""
    torch, dist = require_torch(), require_distributed()
    in_place = form == "in_place"
    chunk = elements // world

    def zeros(n: int) -> Any:
        return torch.zeros(n, dtype=torch.float32, device=device)

    def mine(start: int, count: int) -> Any:
        return pattern(rank, start, count, device)

    def total(start: int, count: int) -> Any:
        return sum(pattern(r, start, count, device) for r in range(world))

    def each(start_of: Callable[[int], int], count: int, source: Callable[[int], int]) -> Any:
        """Chunks of every rank in rank order: chunk j is ``pattern(source(j), start_of(j), count)``."""
        return torch.cat([pattern(source(j), start_of(j), count, device) for j in range(world)])

    def load(dst: Any, values: Any) -> None:
        dst.copy_(values)

    nan = float("nan")
    if op == "all_reduce":
        buf = zeros(elements)
        return CollectiveBuffers(lambda: dist.all_reduce(buf), "all_reduce", lambda: load(buf, mine(0, elements)),
                                 lambda: [(buf, total(0, elements))])
    if op == "broadcast":
        buf = zeros(elements)
        return CollectiveBuffers(lambda: dist.broadcast(buf, src=ROOT), "broadcast",
                                 lambda: load(buf, mine(0, elements)),
                                 lambda: [(buf, pattern(ROOT, 0, elements, device))])
    if op == "reduce":
        buf = zeros(elements)
        return CollectiveBuffers(lambda: dist.reduce(buf, dst=ROOT), "reduce", lambda: load(buf, mine(0, elements)),
                                 lambda: [(buf, total(0, elements))] if rank == ROOT else [])
    if op == "all_gather":
        out = zeros(chunk * world)
        inp = out.narrow(0, rank * chunk, chunk) if in_place else zeros(chunk)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def fill() -> None:
            out.fill_(nan)
            load(inp, mine(rank * chunk, chunk))
        return CollectiveBuffers(lambda: fn(out, inp), fn.__name__, fill,
                                 lambda: [(out, each(lambda j: j * chunk, chunk, lambda j: j))])
    if op == "reduce_scatter":
        inp = zeros(chunk * world)
        out = inp.narrow(0, rank * chunk, chunk) if in_place else zeros(chunk)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def fill() -> None:
            out.fill_(nan)
            load(inp, mine(0, chunk * world))
        return CollectiveBuffers(lambda: fn(out, inp), fn.__name__, fill,
                                 lambda: [(out, total(rank * chunk, chunk))])
    if op == "all_to_all":
        inp, out = zeros(chunk * world), zeros(chunk * world)

        def fill() -> None:
            out.fill_(nan)
            load(inp, mine(0, chunk * world))
        return CollectiveBuffers(lambda: dist.all_to_all_single(out, inp), "all_to_all_single", fill,
                                 lambda: [(out, each(lambda j: rank * chunk, chunk, lambda j: j))])
    if op == "gather":
        inp = zeros(chunk)
        outs = None
        if rank == ROOT:
            outs = [inp if in_place and j == ROOT else zeros(chunk) for j in range(world)]

        def fill() -> None:
            for t in outs or []:
                t.fill_(nan)
            load(inp, mine(rank * chunk, chunk))
        return CollectiveBuffers(lambda: dist.gather(inp, gather_list=outs, dst=ROOT), "gather", fill,
                                 lambda: [(torch.cat(outs), each(lambda j: j * chunk, chunk, lambda j: j))]
                                 if outs else [])
    if op == "scatter":
        ins = [zeros(chunk) for _ in range(world)] if rank == ROOT else None
        out = ins[ROOT] if ins and in_place else zeros(chunk)

        def fill() -> None:
            out.fill_(nan)
            for j, t in enumerate(ins or []):
                load(t, mine(j * chunk, chunk))
        return CollectiveBuffers(lambda: dist.scatter(out, scatter_list=ins, src=ROOT), "scatter", fill,
                                 lambda: [(out, pattern(ROOT, rank * chunk, chunk, device))])
    if op == "send_recv":
        return _send_recv(in_place, elements, rank, zeros, load, mine, device)
    raise AssertionError(f"no benchmark for {op}")


def _send_recv(in_place: bool, elements: int, rank: int, zeros, load, mine, device) -> CollectiveBuffers:
    """Rank 0 -> 1 -> 0. In place, one buffer travels there and back, so both end with rank 0's values;
    out of place, each rank sends its input and receives the other's into its output."""
    dist = require_distributed()
    if rank > 1:  # ranks beyond 1 only attend the barriers
        return CollectiveBuffers(lambda: None, "send/recv", lambda: None, lambda: [])
    inp = zeros(elements)
    out = inp if in_place else zeros(elements)
    peer = 1 - rank

    def run() -> None:
        if rank == 0:
            dist.send(inp, dst=1)
            dist.recv(out, src=1)
        else:
            dist.recv(out, src=0)
            dist.send(out if in_place else inp, dst=0)

    def fill() -> None:
        out.fill_(float("nan"))
        load(inp, mine(0, elements))
    source = 0 if in_place else peer
    return CollectiveBuffers(run, "send/recv", fill, lambda: [(out, pattern(source, 0, elements, device))])
