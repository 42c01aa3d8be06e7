"""ZeRO-3 with torch's FSDP2 (``fully_shard``): one unit per piece, every collective timed and named.

Each piece (``embedding``, ``layer.i``, ``head``) is one FSDP unit and the
stage is the root, as torchtitan wraps a model: a unit's weights are
all-gathered before its forward and, with ``reshard_after_forward``, again
before its backward; its gradients are reduce-scattered after its backward,
after every microbatch's (FSDP2 accumulates the sharded gradients, so the
sum over microbatches stays exact); under a pipeline, after the stage's last
backward only (:mod:`executor.train.pipeline`). The mesh is the shard group, or for HSDP
the 2-D (replicate, shard) mesh, whose replicas all-reduce the shards.
With bf16 or fp16 plans the parameters are fp32 and FSDP2's
``MixedPrecisionPolicy`` gathers them in the plan's dtype and reduces the
gradients in its ``reduce_dtype``, as torchtitan sets it. With
Megatron tensor parallelism (:mod:`executor.train.parallel`) the parameters
FSDP receives are already this rank's TP shards, plain tensors, so FSDP shards
the TP shards over the data-parallel ranks: the 2-D case.

Events get the lowering's names (:mod:`parsim.lowering.lower`) through FSDP2's public
extension points only: ``set_custom_all_gather`` and
``set_custom_reduce_scatter`` give each unit a comm object that times its own
collective, ``all_gather fsdp layer=L stage=S mb=M dir=fwd|bwd`` and
``reduce_scatter fsdp layer=L stage=S mb=M``. Native HSDP's all-reduce
(``all_reduce fsdp ...``) is a plain ``dist.all_reduce`` inside FSDP2's
``foreach_reduce`` with no comm hook of its own; ``set_all_reduce_hook`` runs
right after it, so the event spans from the end of the unit's reduce-scatter to
that hook: the all-reduce, as FSDP2 issues it synchronously between the two.
The comm objects meet FSDP2's ``AllGather`` / ``ReduceScatter`` interface
(``allocate`` and ``__call__``) by duck typing: the abstract classes live in a
private module, and nothing private is imported or patched.
"""

from __future__ import annotations

from typing import Any

from parsim.report.trace import collective_name

from .._torch import require_distributed, require_torch
from .comm import _all_gather, _reduce_scatter
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()


def _stream(tensor) -> str:
    """Where a unit's collective runs: on a CPU, on the thread that computes, which gloo's collective holds
    until it ends ("compute", as the simulator lowers FSDP for a CPU host); on a GPU, on FSDP2's own streams."""
    return "compute" if tensor.device.type == "cpu" else "comm"


class _Pass:
    """Whether a stage's forward is running: an all-gather outside one belongs to the backward."""

    forward = False


class TimedAllGather:
    """FSDP2's ``AllGather`` comm for one unit: the all-gather, timed as the lowering names it.

    FSDP2 asks for an asynchronous gather only when ``unshard_async_op`` is
    set, which the executor never does; the gather completes inside its span.
    """

    def __init__(self, layer: str, stage: int, recorder: Recorder, passes: _Pass):
        self.layer, self.stage, self.recorder, self.passes = layer, stage, recorder, passes

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False) -> None:
        name = collective_name("all_gather", "fsdp", layer=self.layer, stage=self.stage, mb=self.recorder.microbatch,
                               dir="fwd" if self.passes.forward else "bwd")
        with self.recorder.span(name, "collective", _stream(output_tensor), phase="fsdp",
                                bytes=output_tensor.numel() * output_tensor.element_size()):
            _all_gather(output_tensor, input_tensor, group=group)


class TimedReduceScatter:
    """FSDP2's ``ReduceScatter`` comm for one unit; under HSDP also times the replicas' all-reduce after it."""

    def __init__(self, layer: str, stage: int, recorder: Recorder):
        self.layer, self.stage, self.recorder = layer, stage, recorder
        self._end = 0.0

    def _name(self, op: str) -> str:
        return collective_name(op, "fsdp", layer=self.layer, stage=self.stage, mb=self.recorder.microbatch)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        with self.recorder.span(self._name("reduce_scatter"), "collective", _stream(input_tensor), phase="fsdp",
                                bytes=input_tensor.numel() * input_tensor.element_size()):
            _reduce_scatter(output_tensor, input_tensor, op=op, group=group)
        self._end = self.recorder.now()

    def all_reduced(self, shard) -> None:
        """``set_all_reduce_hook``: FSDP2 calls it once the HSDP all-reduce of ``shard`` has returned."""
        self.recorder.add(self._name("all_reduce"), "collective", _stream(shard), self._end, self.recorder.now(),
                          phase="fsdp", bytes=shard.numel() * shard.element_size())


def data_parallel_mesh(rows: list[list[int]], shard_group: Any, replicate_group: Any, device_type: str) -> Any:
    """The FSDP mesh over existing groups: 1-D (the shard group), or HSDP's 2-D (replicate, shard), whose
    ``rows`` are the shard groups of this rank's data-parallel group (global ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    if replicate_group is None:
        return DeviceMesh.from_group(shard_group, device_type)
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=rows,
                                 mesh_dim_names=("replicate", "shard"))


def apply_fsdp(stages: dict, names: dict[int, list[str]], mesh: Any, reshard_after_forward: bool,
               recorder: Recorder, param_dtype: Any, reduce_dtype: Any, experts_mesh: Any = None,
               replicas: int = 1) -> None:
    """``fully_shard`` every piece of every stage (``names[s]`` in order), then the stage as the root.

    A mixture of experts' routed experts are a unit of their own first, on
    ``experts_mesh`` (the ranks holding the same experts; HSDP's 2-D within the
    shard groups), named ``<piece>.experts``, as torchtitan shards them. Their
    gradients hold every expert-parallel rank's tokens, so they are divided by
    the ``replicas`` (dp x cp) whose losses they sum, not by the mesh's size
    (torchtitan's ``set_gradient_divide_factor``).

    Sharded parameters are new DTensor parameters; they keep the originals'
    ``full_name`` and tensor-parallel ``shard`` so the reference check finds
    their dense counterparts, and ``sequence_parallel`` so their gradients are
    summed over the tensor-parallel group.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .moe import RoutedExperts

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def shard(module, name: str, s: int, on: Any, passes: _Pass) -> None:
        labels = {key: (p.full_name, getattr(p, "shard", None), getattr(p, "sequence_parallel", False))
                  for key, p in module.named_parameters()}
        fully_shard(module, mesh=on, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        module.set_custom_all_gather(TimedAllGather(name, s, recorder, passes))
        reduce_scatter = TimedReduceScatter(name, s, recorder)
        module.set_custom_reduce_scatter(reduce_scatter)
        if on.ndim == 2:
            module.set_all_reduce_hook(reduce_scatter.all_reduced)
        for key, p in module.named_parameters():
            p.full_name, tp_shard, summed_over_tp = labels[key]
            if tp_shard is not None:
                p.shard = tp_shard
            if summed_over_tp:
                p.sequence_parallel = True

    for s, stage in stages.items():
        passes = _Pass()
        units = list(stage.pieces)
        nested = []  # (routed experts, the piece holding them)
        for name, module in zip(names[s], units):
            for experts in [m for m in module.modules() if isinstance(m, RoutedExperts)]:
                shard(experts, f"{name}.experts", s, experts_mesh, passes)
                experts.set_gradient_divide_factor(float(replicas))
                # NCCL divides inside the reduction (PREMUL_SUM); gloo has no such op: sum, then divide. (On one
                # rank FSDP2 reduces nothing and divides itself; forced sums would divide twice.)
                experts.set_force_sum_reduction_for_comms(experts_mesh.device_type != "cuda"
                                                          and experts_mesh.size(-1) > 1)
                nested.append((experts, module))
            shard(module, name, s, mesh, passes)
        # FSDP2's default backward prefetch follows the forward order recorded since the last backward; a
        # pipeline runs several microbatches' forwards first, so at the end of one microbatch's backward it
        # would gather the stage's last piece for the next one. Explicit lists keep every gather inside the
        # backward that uses it: each piece prefetches the one before it, the first piece itself, and routed
        # experts the piece holding them (already unsharded then: no-ops, which switch the default off).
        for k, module in enumerate(units):
            module.set_modules_to_backward_prefetch([units[max(k - 1, 0)]])
        for experts, module in nested:
            experts.set_modules_to_backward_prefetch([module])
        fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        stage.register_forward_pre_hook(lambda *_, passes=passes: setattr(passes, "forward", True))
        stage.register_forward_hook(lambda *_, passes=passes: setattr(passes, "forward", False))


def dense(tensor: Any) -> Any:
    """A DTensor's whole value (its TP shard, gathered over the FSDP mesh); any other tensor as it is.

    A collective over the mesh for a DTensor: every rank of the shard group calls it in the same order.
    """
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
