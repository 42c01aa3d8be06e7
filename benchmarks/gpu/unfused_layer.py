"""Time one GPT layer as Megatron-LM ran it in 2021 (SC21): fp16, unfused attention, dropout 0.1.

The layer is the 1.7B row of `parsim validate` (hidden 2304, 24 heads, seq 2048, microbatch 16), in
Megatron-LM's [seq, batch, hidden] layout: LayerNorm, one QKV linear (its bias added after the matmul, as
torch 1.8 ran it), scores by baddbmm, softmax, dropout, context by bmm, output linear, dropout and
residual. It prints the forward's and the backward's time (CUDA events, the mean over at least
0.3 s after warm-up: executor.gpu_bench.timed) and, from a torch.profiler trace of one of each, the
GPU time by kind of kernel, to set beside `parsim explain compute benchmarks/gpu/sc21-1.7b.yaml
--cluster CLUSTER` (benchmarks/gpu/check.sh does).

    python benchmarks/gpu/unfused_layer.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from executor.gpu_bench import open_json_out, timed

HIDDEN, HEADS, SEQ, MICROBATCH, DROPOUT = 2304, 24, 2048, 16, 0.1


class Layer(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.dense = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        s, b, h = x.shape
        a, d = self.heads, self.head_dim
        qkv = F.linear(self.ln1(x), self.qkv.weight)
        qkv += self.qkv.bias  # torch 1.8's F.linear on 3-D input: the bias in a kernel of its own
        q, k, v = qkv.view(s, b, a, 3 * d).split(d, dim=-1)
        q, k, v = (t.reshape(s, b * a, d).transpose(0, 1) for t in (q, k, v))  # [b*a, s, d]
        scores = torch.baddbmm(torch.empty(b * a, s, s, dtype=x.dtype, device=x.device), q, k.transpose(1, 2),
                               beta=0.0, alpha=1.0 / math.sqrt(d))
        probs = F.dropout(torch.softmax(scores, dim=-1), DROPOUT)
        context = torch.bmm(probs, v).view(b, a, s, d).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + F.dropout(self.dense(context), DROPOUT)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), DROPOUT)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    for key, kind in (("gemm", "matmul"), ("cutlass", "matmul"), ("xmma", "matmul"), ("nvjet", "matmul"),
                      ("softmax", "softmax"), ("dropout", "dropout"), ("layer_norm", "layernorm"), ("gelu", "gelu")):
        if key in name:
            return kind
    return "other elementwise"


def by_kind(fn, names: dict[str, float] | None = None) -> dict[str, float]:
    """GPU seconds per kind of kernel in one call of ``fn`` (and per kernel name into ``names``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[kind_of(event.name)] += event.device_time / 1e6
            if names is not None:
                names[event.name[:90]] = names.get(event.name[:90], 0.0) + event.device_time / 1e6
    return dict(sorted(totals.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    out_file = open_json_out("unfused_layer.py", parser.parse_args().json)
    torch.manual_seed(0)
    layer = Layer(HIDDEN, HEADS).cuda().half()
    x = torch.randn(SEQ, MICROBATCH, HIDDEN, device="cuda", dtype=torch.half, requires_grad=True)
    grad, cuda = torch.randn_like(x), torch.device("cuda")
    forward_s = timed(lambda: layer(x), cuda, min_s=0.3)
    both_s = timed(lambda: layer(x).backward(grad), cuda, min_s=0.3)
    out = layer(x)
    forward_kernels: dict[str, float] = {}
    backward_kernels: dict[str, float] = {}
    figures = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "forward_s": forward_s, "backward_s": both_s - forward_s,
               "forward_by_kind_s": by_kind(lambda: layer(x), forward_kernels),
               "backward_by_kind_s": by_kind(lambda: out.backward(grad), backward_kernels),
               "forward_kernels_s": forward_kernels, "backward_kernels_s": backward_kernels}
    print(f"{figures['gpu']} (torch {figures['torch']}): forward {forward_s * 1e3:.2f} ms, "
          f"backward {figures['backward_s'] * 1e3:.2f} ms")
    for kind in sorted(set(figures["forward_by_kind_s"]) | set(figures["backward_by_kind_s"])):
        print(f"  {kind:<18} forward {figures['forward_by_kind_s'].get(kind, 0) * 1e3:6.2f} ms, "
              f"backward {figures['backward_by_kind_s'].get(kind, 0) * 1e3:6.2f} ms")
    if out_file:
        with out_file:
            json.dump(figures, out_file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
