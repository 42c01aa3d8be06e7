"""Time a GPU's kernels the way the kernel model prices them (:mod:`parsim.sim.compute`).

Each measurement is a row: what ran, its mean seconds (CUDA events after
warm-up; wall clock on a CPU, only so the code can be checked there) and the
work the model prices for it (``work``: a matmul's ``mnk``, attention FLOPs as
the model counts them with their pass and sequence length, memory-bound
bytes, or kernels launched). ``benchmarks/gpu_kernels.py`` sets them beside a
cluster file's predictions; ``parsim calibrate --ranks 1`` fits a GPU's
figures on them (:func:`parsim.calibrate.gpu.fit_gpu`).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time

from parsim.lowering.lower import FP32, FUSED_ADAMW_ACCESSES
from parsim.workload.model import AttentionCore, flash_softmax_factor

from ._torch import require_torch
from .compute_bench import DEPTH, measure_dispatch, measure_optimizer, synchronizer

torch = require_torch()
F = torch.nn.functional

MEMORY_ELEMENTS = 1 << 29  # 1 GiB of bf16 per operand


def timed(fn, device: torch.device, min_s: float = 0.05, max_iters: int = 200) -> float:
    """Mean seconds per call of ``fn`` after three warm-up calls, over at least ``min_s`` of calls."""
    for _ in range(3):
        fn()
    sync = synchronizer(device)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    iters = int(min(max_iters, max(3, min_s / max(time.perf_counter() - start, 1e-9))))
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / iters
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def dump_rows(out, rows: list[dict]) -> None:
    """A GPU benchmark's ``--json`` (``out``, from :func:`open_json_out`; None: none asked for): the GPU, torch's
    version and the rows, written and closed."""
    if out is not None:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, out, indent=1)
        out.close()


def params_with_grads(shapes, device, dtype=None) -> list:
    """Parameters of these shapes (fp32 unless ``dtype``), random, each with a random gradient: what an optimizer
    step reads."""
    params = [torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def open_json_out(script: str, path: str | None):
    """A GPU benchmark script's ``--json`` file, opened (None without one) before any timing: without a CUDA GPU,
    or where the file cannot be written, one line on stderr and exit 2, not a traceback after minutes of work."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    try:
        return open(path, "w") if path else None
    except OSError as error:
        print(f"{script}: --json: {error}", file=sys.stderr)
        raise SystemExit(2) from None


class ClockSampler:
    """`nvidia-smi` reading the SM clock every 20 ms in the background, each reading stamped as it arrives."""

    def __init__(self) -> None:
        self.readings: list[tuple[float, float]] = []
        try:
            self.process = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                                             "-lms", "20"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.process = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.readings.append((time.perf_counter(), float(line)))

    def median_since(self, since: float) -> float | None:
        """The median SM clock in MHz read after ``since`` (a ``time.perf_counter()``); None without readings."""
        recent = [mhz for t, mhz in self.readings if t >= since]
        return statistics.median(recent) if recent else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()


def row(kind: str, what: str, measured: float, work: dict, **extra) -> dict:
    """One measured kernel and the work the kernel model prices for it."""
    return {"kind": kind, "what": what, "measured_s": measured, "work": work, **extra}


def operands(m: int, n: int, k: int, role: str, dtype, device) -> tuple:
    """``a[m, k]`` and ``b[k, n]`` laid out as ``nn.Linear`` hands them to cuBLAS: the forward multiplies
    by the transposed weight ``W[n, k]ᵀ``, the input gradient by ``W`` as stored, and the weight gradient
    is ``dYᵀ X``, its first operand a transposed activation."""
    a = torch.randn(k, m, device=device, dtype=dtype).t() if role == "wgrad" else \
        torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t() if role == "fwd" else \
        torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def matmul_row(m: int, n: int, k: int, role: str, label: str, dtype, device) -> dict:
    """One ``(m, n, k)`` matmul laid out for its ``role`` (:func:`operands`); in fp8 (``torch.float8_e4m3fn``), as
    Transformer Engine runs every fp8 GEMM whatever its role: ``torch._scaled_mm`` of a row-major ``a[m, k]`` by
    a column-major ``b[k, n]`` (its cast-transpose leaves both operands so), per-tensor scales, bf16 out."""
    if dtype == torch.float8_e4m3fn:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(n, k, device=device).to(dtype).t()
        scale = torch.ones((), device=device)
        seconds = timed(lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16),
                        device)
    else:
        a, b = operands(m, n, k, role, dtype, device)
        seconds = timed(lambda: torch.matmul(a, b), device)
    return row("matmul", label, seconds, {"mnk": [m, n, k]}, shape=f"{m}x{n}x{k}",
               tflops=2 * m * n * k / seconds / 1e12)


def attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention as the model counts them (:func:`parsim.lowering.kernels.block_work`):
    ``4·s·d`` per token and head over the tiles executed; the backward is twice that."""
    core = AttentionCore(heads, head_dim, seq)
    return 4.0 * batch * seq * seq * heads * head_dim * core.executed_fraction() * flash_softmax_factor(head_dim)


def attention_at(name: str, backend, batch: int, seq: int, heads: int, head_dim: int, dtype, device) -> list[dict]:
    """Causal SDPA on ``backend`` (a ``torch.nn.attention.SDPBackend``; None: torch's choice): forward, and
    forward + backward less it."""
    from torch.nn.attention import sdpa_kernel
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (q, k, v), grad)

    try:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            t_fwd, t_both = timed(fwd, device), timed(fwd_bwd, device)
    except RuntimeError as error:  # this backend does not take these inputs on this GPU
        print(f"attention, {name}: not run ({str(error).splitlines()[0][:120]})")
        return []
    forward = attention_flops(batch, seq, heads, head_dim)
    what = f"{name}, b{batch} h{heads} s{seq} d{head_dim} causal"
    return [row("attention", f"{what}, forward", t_fwd, {"flops": forward, "pass": "forward", "seq": seq},
                tflops=forward / t_fwd / 1e12),
            row("attention", f"{what}, backward", t_both - t_fwd,
                {"flops": 2 * forward, "pass": "backward", "seq": seq}, tflops=2 * forward / (t_both - t_fwd) / 1e12)]


def memory_rows(dtype, device, elements: int = MEMORY_ELEMENTS) -> list[dict]:
    """Memory-bound kernels at the bytes they read and write, against HBM x memory_efficiency."""
    x, y = torch.randn(elements, device=device, dtype=dtype), torch.randn(elements, device=device, dtype=dtype)
    out = torch.empty_like(x)
    size = x.element_size() * elements
    kernels = {
        "copy (read 1, write 1)": (lambda: out.copy_(x), 2),
        "add (read 2, write 1)": (lambda: torch.add(x, y, out=out), 3),
        "silu (read 1, write 1)": (lambda: F.silu(x), 2),
        "multiply (read 2, write 1)": (lambda: torch.mul(x, y, out=out), 3),
    }
    rows = []
    for what, (fn, passes) in kernels.items():
        seconds = timed(fn, device)
        rows.append(row("memory", what, seconds, {"bytes": passes * size}, GBps=passes * size / seconds / 1e9))
    return rows


SM_ELEMENTS = 1 << 28  # scores for the softmax and dropout rows: 512 MiB at 2 bytes
SM_ROW_LENGTHS = (512, 1024, 2048, 4096, 8192)
SM_TOKENS, SM_HIDDEN = 16384, 4096  # the norm's and GeLU's rows (GeLU over 4 x SM_HIDDEN)


def sm_row(kind: str, what: str, seconds: float, elements: float, nbytes: float, pass_: str = "forward",
           length: int = 0) -> dict:
    """A memory-bound kernel whose arithmetic may outlast its bytes, with the elements the model counts for
    it (:class:`parsim.sim.compute.SmWork`): read and written, or for dropout drawn."""
    return row("sm", what, seconds, {"sm": kind, "pass": pass_, "elements": elements, "bytes": nbytes,
                                     "row": length})


def sm_rows(device, dtype, elements: int = SM_ELEMENTS, tokens: int = SM_TOKENS) -> list[dict]:
    """Softmax forward by row length, dropout's forward, GeLU and LayerNorm forward and backward (each
    backward timed alone, on a graph kept for it: a backward as the difference of two timings came out negative
    now and then on a noisy CPU host), and a bias added in place over rows of 3 x SM_HIDDEN (a broadcast add,
    which torch runs unvectorized), each with its elements and bytes: ``elements`` scores, ``tokens`` rows of
    SM_HIDDEN."""
    x = torch.randn(elements, device=device, dtype=dtype)
    size = x.element_size()
    rows = []
    for length in SM_ROW_LENGTHS:
        scores = x.view(-1, length)
        rows.append(sm_row("softmax", f"softmax forward, rows of {length}", timed(lambda: torch.softmax(scores, -1),
                           device), 2 * elements, 2 * size * elements, length=length))
    rows.append(sm_row("dropout", "dropout forward, p 0.1", timed(lambda: torch.native_dropout(x, 0.1, True), device),
                       elements, (2 * size + 1) * elements))
    a = torch.randn(tokens, SM_HIDDEN, device=device, dtype=dtype, requires_grad=True)
    norm = torch.nn.LayerNorm(SM_HIDDEN).to(device, dtype)
    b = torch.randn(tokens, 4 * SM_HIDDEN, device=device, dtype=dtype, requires_grad=True)
    da, db = torch.randn_like(a), torch.randn_like(b)
    width = tokens * SM_HIDDEN
    normed, gelued = norm(a), F.gelu(b)  # graphs kept, so each backward is timed alone
    kernels = (("norm", lambda: norm(a), lambda: torch.autograd.grad(normed, (a, norm.weight, norm.bias), da,
                                                                     retain_graph=True), width),
               ("gelu", lambda: F.gelu(b), lambda: torch.autograd.grad(gelued, b, db, retain_graph=True), 4 * width))
    for kind, forward, backward, n in kernels:
        rows += [sm_row(kind, f"{kind} forward", timed(forward, device), 2 * n, 2 * size * n),
                 sm_row(kind, f"{kind} backward", timed(backward, device), 3 * n, 3 * size * n, "backward")]
    out = torch.randn(tokens, 3 * SM_HIDDEN, device=device, dtype=dtype)
    bias = torch.randn(3 * SM_HIDDEN, device=device, dtype=dtype)
    n = out.numel()
    rows.append(sm_row("bias_add", "bias add, in place", timed(lambda: out.add_(bias), device), 2 * n, 2 * size * n))
    return rows


def launch_rows(device, kernels: int = 2000) -> list[dict]:
    """Tiny kernels back to back: GPU time per kernel, and the host's time to issue one."""
    x, sync = torch.zeros(1, device=device), synchronizer(device)
    gpu = timed(lambda: [x.add_(1) for _ in range(kernels)], device) / kernels
    sync()
    start = time.perf_counter()
    for _ in range(kernels):
        x.add_(1)
    host = (time.perf_counter() - start) / kernels
    sync()
    return [row("launch", "tiny kernel, GPU time each (back to back)", gpu, {"kernels": 1}),
            row("launch", "tiny kernel, host time to issue one (eager)", host, {"kernels": 1})]


ADAMW_TENSORS, ADAMW_NUMEL = 16, 1 << 24  # a fused AdamW's parameters: 268M fp32, 7.5 GB with states and grads


def adamw_row(device, tensors: int = ADAMW_TENSORS, numel: int = ADAMW_NUMEL) -> dict:
    """torch's fused AdamW step over ``tensors`` fp32 parameters of ``numel``: its seconds, and the parameters and
    bytes (7 fp32 accesses each) the model prices it by (``sm_cycles.adamw`` beside the bytes)."""
    optimizer = torch.optim.AdamW(params_with_grads([(numel,)] * tensors, device), lr=1e-4, fused=True)
    count = tensors * numel
    return row("optimizer", f"fused AdamW, {tensors} tensors of {numel:,} fp32", timed(optimizer.step, device),
               {"params": count, "bytes": count * FUSED_ADAMW_ACCESSES * FP32})


OPTIMIZER_TENSORS = (1, 64)  # small parameter tensors per timed AdamW step: the step's own cost, a few layers'


def host_rows(device) -> list[dict]:
    """Eager PyTorch's host time per op on blocks too small to keep a GPU busy (its kernels wait on the
    host): eager blocks' forward and backward, with the ATen ops each dispatches
    (:func:`executor.compute_bench.measure_dispatch`), and torch's default AdamW step on one and on many small
    tensors."""
    rows = []
    for r in measure_dispatch(device, depths=(DEPTH,)):  # a GPU's host time per op: the deep stacks' pooled
        for p in ("forward", "backward"):
            rows.append(row("host", f"{r['name']}, {p}", r[f"{p}_s"], {"pass": p, "ops": r[f"{p}_ops"]}))
    for tensors, numel, seconds in measure_optimizer([(n, 256) for n in OPTIMIZER_TENSORS], device):
        rows.append(row("host", f"AdamW step, {tensors} tensors of {numel}", seconds, {"optimizer_tensors": tensors}))
    return rows


# What `parsim calibrate --ranks 1` times (parsim.calibrate.gpu): square-ish matmuls, where cuBLAS reaches its
# best rate (the MAMF rule takes the best shape); causal attention at the lengths FlashAttention-3's figures
# give, 16k tokens each, at the models' head dim 128; memory-bound kernels on 1 GiB, and those whose arithmetic
# may outlast their bytes; a fused AdamW step; the host's time per eager op.
CALIBRATION_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192))
CALIBRATION_LENGTHS = (1024, 2048, 4096, 8192, 16384)
CALIBRATION_TOKENS, CALIBRATION_HEADS, CALIBRATION_HEAD_DIM = 16384, 32, 128


def calibration_rows(device, dtype) -> list[dict]:
    """The kernels one GPU's compute figures are fitted on."""
    rows = [matmul_row(m, n, k, "dgrad", f"{m} x {n} x {k}", dtype, device) for m, n, k in CALIBRATION_SHAPES]
    for length in CALIBRATION_LENGTHS:
        rows += attention_at("default", None, CALIBRATION_TOKENS // length, length, CALIBRATION_HEADS,
                             CALIBRATION_HEAD_DIM, dtype, device)
    return rows + memory_rows(dtype, device) + sm_rows(device, dtype) + [adamw_row(device)] + host_rows(device)
