"""A pipeline runtime that executes parsim's schedule action lists, action by action.

The schedule (``parsim.schedules.make_schedule``) is the one the simulator
times; this module runs each rank's list in order, so the measured order is
the predicted order by construction. Per action:

- ``F``: receive the stage input (activations of the previous stage, unless
  this is stage 0), run the stage, send its output on (unless it is the last
  stage, which computes the loss instead).
- ``B``: receive the output gradient (unless last stage), back-propagate
  through the stage, send the input gradient back (unless stage 0). A stage
  sharded by FSDP2 keeps its weights gathered and its gradients unsharded
  through every backward but its last, which reduce-scatters them, as
  ``torch.distributed.pipelining`` drives FSDP2 (``backward_maybe_with_nosync``);
  it reduces each unit as its backward ends, through FSDP2's public switches,
  where torch's ``perform_reduce_grad`` reduces them all after the last
  backward by FSDP2's private post-backward.
- ``I`` / ``W``: zero-bubble's split backward (Qi et al. 2023). ``I``
  computes the gradients of the stage input and of every parameter-owning
  module's output, keeping the graph (``retain_graph``), and sends the input
  gradient at once; ``W`` later turns each module's saved output gradient into
  its weight gradient with ``autograd.backward(out, grad, inputs=weights)``,
  which runs only that module's own backward node: its cost is the weight-
  gradient matmuls, and no collective runs again.

Transfers are ``isend`` / ``irecv`` between the stages' owners, tagged by
(producing stage, microbatch, direction) so gloo matches them whatever the
order. A receive is timed from when the rank starts to wait until the data is
there (transfer plus bubble). A send is timed from its issue until its
``wait()`` returns, in a watcher thread: gloo only learns that a send is done
inside ``wait()``, and waiting in the main thread could deadlock two ranks
that send to each other before receiving. Sends are waited for in issue
order, so a send's end is never before an earlier send's. Two stages on one
rank hand tensors over directly, still recorded, with zero bytes, as the
simulator does.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from parsim.report.trace import compute_name, p2p_name
from parsim.schedules import Action, Schedule

from .._torch import require_distributed, require_torch
from ..gloo_threads import transfer_group
from .models import Piece
from .trace_recorder import Recorder, annotation

torch = require_torch()
dist = require_distributed()
nn = torch.nn

PHASES = {"F": "forward", "B": "backward", "I": "backward", "W": "weight-grad"}


class Stage(nn.Module):
    """One pipeline stage: its pieces in order, and the loss if it is the last stage."""

    def __init__(self, pieces: list[Piece], loss: Any = None):
        super().__init__()
        self.pieces = nn.ModuleList(p.module for p in pieces)
        self.loss = loss

    def forward(self, x, targets=None):
        for piece in self.pieces:
            x = piece(x)
        return self.loss(x, targets) if self.loss is not None else x

    def weight_modules(self) -> list:
        """Modules that own parameters directly: the units of the ``W`` pass."""
        return [m for m in self.pieces.modules() if any(True for _ in m.parameters(recurse=False))]


class PipelineRuntime:
    """Runs ``schedule.actions[pp_rank]`` for this rank's stages.

    ``owners[s]`` is the global rank that runs stage ``s`` in this rank's
    data- and tensor-parallel slice; ``shape`` is the activation shape of one
    microbatch between stages. The loss of each microbatch is scaled by
    ``1 / num_microbatches`` so the accumulated gradients are those of the
    mean over the local batch (times ``loss_scale`` in fp16).
    """

    def __init__(self, schedule: Schedule, pp_rank: int, stages: dict[int, Stage], owners: dict[int, int],
                 rank: int, recorder: Recorder, shape: tuple[int, ...], dtype: Any, device: Any):
        self.schedule, self.actions = schedule, schedule.actions[pp_rank]
        self.stages, self.owners, self.rank = stages, owners, rank
        self.recorder, self.shape, self.dtype, self.device = recorder, shape, dtype, device
        self.last_stage = schedule.num_stages - 1
        self.m = schedule.num_microbatches
        self.loss_scale = 1.0  # fp16: the loss scaler's current scale, by which the backward starts
        self._capturing: list | None = None
        self._sends = SendWatcher(recorder)
        if schedule.split_backward:
            for stage in stages.values():
                for module in stage.weight_modules():
                    module.register_forward_hook(self._capture)

    def run(self, inputs: list, targets: list) -> float | None:
        """One step's actions on microbatches ``inputs[i]`` (``targets[i]``); the mean loss on the last stage."""
        self._inputs: dict = {}
        self._outputs: dict = {}
        self._ops: dict = {}
        self._op_grads: dict = {}
        self._local: dict = {}
        self._batch = (inputs, targets)
        self._loss = 0.0
        for action in self.actions:
            self.recorder.begin_action(action.microbatch)
            getattr(self, f"_{action.kind}")(action)
        self._sends.drain()
        return self._loss if self.last_stage in self.stages else None

    # -- compute -------------------------------------------------------------------
    def _span(self, action: Action):
        return self.recorder.span(compute_name(action.kind, action.stage, action.microbatch), "compute", "compute",
                                  phase=PHASES[action.kind])

    def _F(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        if s == 0:
            x = self._batch[0][mb]
        else:
            x = self._recv("act", s - 1, mb).requires_grad_(True)
        targets = self._batch[1][mb] if s == self.last_stage else None
        self._capturing = [] if self.schedule.split_backward else None
        with self._span(a):
            out = self.stages[s](x, targets)
            if s == self.last_stage:
                self._loss += out.item() / self.m
                out = out * (self.loss_scale / self.m)
        self._inputs[s, mb], self._outputs[s, mb] = x, out
        if self._capturing is not None:
            self._ops[s, mb], self._capturing = self._capturing, None
        if s < self.last_stage:
            self._send("act", s, mb, out.detach())

    def _B(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        grad = self._recv("grad", s + 1, mb) if s < self.last_stage else None
        x, out = self._inputs.pop((s, mb)), self._outputs.pop((s, mb))
        from torch.distributed.fsdp import FSDPModule

        stage = self.stages[s]
        if self.schedule.pp > 1 and isinstance(stage, FSDPModule):  # synced and resharded after the last backward
            last = mb == self.m - 1
            stage.set_requires_gradient_sync(last)
            stage.set_reshard_after_backward(last)
            stage.set_is_last_backward(last)
        with self._span(a):
            torch.autograd.backward(out, grad)
        if s > 0:
            self._send("grad", s, mb, x.grad)

    def _I(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        grad = self._recv("grad", s + 1, mb) if s < self.last_stage else None
        x, out = self._inputs.pop((s, mb)), self._outputs.pop((s, mb))
        ops = self._ops[s, mb]
        wrt = ([x] if s > 0 else []) + [o for _, o in ops]
        with self._span(a):
            grads = torch.autograd.grad(out, wrt, grad, retain_graph=True, allow_unused=True)
        self._op_grads[s, mb] = grads[len(wrt) - len(ops):]
        if s > 0:
            self._send("grad", s, mb, grads[0])

    def _W(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        ops, grads = self._ops.pop((s, mb)), self._op_grads.pop((s, mb))
        with self._span(a):
            for (module, out), grad in zip(ops, grads):
                if grad is not None:
                    torch.autograd.backward(out, grad, inputs=list(module.parameters(recurse=False)))

    def _capture(self, module, args, output) -> None:
        if self._capturing is not None:
            self._capturing.append((module, output))

    # -- transfers -----------------------------------------------------------------
    def _tag(self, what: str, stage: int, mb: int) -> int:
        return (stage * self.m + mb) * 2 + (what == "grad")

    def _send(self, what: str, stage: int, mb: int, tensor) -> None:
        peer = self.owners[stage + 1 if what == "act" else stage - 1]
        name = p2p_name("send", what, stage, mb, peer)
        if peer == self.rank:
            with self.recorder.span(name, "send", "p2p", phase="pp", bytes=0):
                self._local[what, stage, mb] = tensor.detach()
            return
        tensor = tensor.contiguous()
        start = self.recorder.now()
        with annotation(name):  # a profiler sees the issue; the watcher times completion
            work = dist.isend(tensor, peer, group=transfer_group(), tag=self._tag(what, stage, mb))
        self._sends.watch(work, tensor, name, start)

    def _recv(self, what: str, stage: int, mb: int):
        peer = self.owners[stage]
        name = p2p_name("recv", what, stage, mb, peer)
        if peer == self.rank:
            with self.recorder.span(name, "recv", "p2p", phase="pp", bytes=0):
                return self._local.pop((what, stage, mb)).detach()
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        with self.recorder.span(name, "recv", "p2p", phase="pp", bytes=buffer.numel() * buffer.element_size()):
            dist.irecv(buffer, peer, group=transfer_group(), tag=self._tag(what, stage, mb)).wait()
        return buffer


class SendWatcher:
    """Waits for sends in a background thread and records each as an event when its wait returns."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._watch, name="parsim-send-watcher", daemon=True).start()

    def watch(self, work: Any, tensor: Any, name: str, start_s: float) -> None:
        """Record ``work`` (a send of ``tensor``, kept alive until done) once it completes."""
        self._queue.put((work, tensor, name, start_s))

    def drain(self) -> None:
        """Block until every watched send has completed and been recorded."""
        self._queue.join()

    def _watch(self) -> None:
        while True:
            work, tensor, name, start = self._queue.get()
            try:
                work.wait()
                self.recorder.add(name, "send", "p2p", start, self.recorder.now(), phase="pp",
                                  bytes=tensor.numel() * tensor.element_size())
            finally:
                self._queue.task_done()
