"""``--explain``: the arithmetic behind a collective prediction, for a student."""

from __future__ import annotations

from ...hardware.topology import Topology
from ...report.results import busbw_factor
from ...units import format_size, format_time
from .algorithms import NCCL_P2P_OPS
from .deepep import NVLINK_FRACTION
from .nccl import nvlink_p2p_efficiency
from .simulate import CollectivePrediction

GIB = 2**30


def explain(p: CollectivePrediction, topo: Topology) -> str:
    n, size, t = p.nranks, p.size_bytes, p.time_s
    op = p.op.replace("_", "-")
    r = p.result()
    out = [f"{op} of {format_size(size)} ({size:,} bytes) on n = {n} GPUs of {topo.spec.name} "
           f"({topo.nodes} node(s), {topo.gpus_per_node} GPUs per node)", ""]
    out.append("1. The hardware")
    intra = topo.spec.intra
    out.append(f"   Inside a node each GPU has {intra.bw_Bps / 1e9:.0f} GB/s per direction into the "
               f"{intra.fabric} fabric, {intra.latency_s * 1e6:.2g} us per transfer step.")
    if topo.nodes > 1:
        so = topo.spec.scale_out
        out.append(f"   Between nodes: {topo.nics_per_node} NICs per node at {so.nic_bw_Bps * 8 / 1e9:.0f} Gb/s "
                   f"= {so.nic_bw_Bps / 1e9:.1f} GB/s each, {so.latency_s * 1e6:.2g} us NIC to NIC.")
    out.append("")
    if p.nccl is not None:
        out += _nccl_tuner(p)
    elif p.copies is not None:
        out += _deepep(p)
    else:
        out.append(f"2. The algorithm: {p.algorithm}")
        if p.candidates:
            for alg, time in sorted(p.candidates.items(), key=lambda kv: kv[1]):
                mark = "   <- fastest, chosen" if alg == p.algorithm else ""
                out.append(f"   {alg:<12} {format_time(time)}{mark}")
        efficiency = nvlink_p2p_efficiency(topo.spec)
        if p.op in NCCL_P2P_OPS and efficiency < 1.0:
            links, speed = topo.spec.nccl.nvlinks_per_gpu, efficiency * intra.bw_Bps / 1e9
            out.append(f"   NCCL runs {p.op.replace('_', '-')} as sends and receives: inside a node at its NVLink "
                       f"speed, {links} NVLinks x {speed / links:.3g} GB/s")
            out.append(f"   (its units, topo.h) = {speed:.1f} GB/s, {efficiency:.3g} of the {intra.bw_Bps / 1e9:.0f} "
                       f"GB/s peak, so each byte counts 1/{efficiency:.3g} on the link;")
            out.append("   across nodes at the NIC's line rate.")
    out.append("")
    out.append("3. Phase by phase (time = latency steps + bytes over the busiest link + reduction)")
    for i, ph in enumerate(p.phases, 1):
        out.append(f"   {i}) {ph.label}")
        carried = f" (payload / {ph.efficiency:.3g})" if ph.efficiency != 1.0 else ""
        out.append(f"      {ph.flows} concurrent flows; the busiest link, {ph.bottleneck}, carries "
                   f"{format_size(ph.bottleneck_bytes)}{carried} at {ph.bottleneck_bw_Bps / 1e9:.1f} GB/s")
        fill = p.nccl.fill_us * 1e-6 if p.nccl is not None and len(p.phases) == 1 else 0.0
        if fill and ph.latency_s > fill:
            out.append(f"      latency: NCCL's {format_time(ph.latency_s - fill)} + the pipeline's fill and drain "
                       f"{format_time(fill)} (section 2) = {format_time(ph.latency_s)}")
        out.append(f"      latency {format_time(ph.latency_s)} + transfer {format_time(ph.transfer_s)}"
                   f" + reduce {format_time(ph.reduce_s)} = {format_time(ph.time_s)}")
    out.append(f"   total: {format_time(t)}")
    out.append("")
    out += _identity(p)
    out.append("")
    factor = busbw_factor(p.op, n)
    out.append("4. Bandwidth, as nccl-tests reports it")
    out.append(f"   algbw = size / time = {size:,} B / {format_time(t)} = {r.algbw_Bps / 1e9:.1f} GB/s")
    out.append(f"   busbw = algbw x {_factor_text(p.op)} = {r.algbw_Bps / 1e9:.1f} x {factor:.4g} "
               f"= {r.busbw_Bps / 1e9:.1f} GB/s")
    out.append("   algbw is what the application sees; busbw rescales it by the data each rank must move,")
    out.append("   so it can be compared with a link's speed whatever n is.")
    out.append("")
    out += _course_formula(p)
    out.append("")
    out.append("6. How close to the hardware limit")
    out.append(f"   lower bound {format_time(p.lower_bound_s)}: {p.lower_bound_reason}")
    rest = "latency and reduction" if p.op in ("all_reduce", "reduce_scatter", "reduce") else \
        "latency and the links' sharing"
    out.append(f"   reached {p.lower_bound_s / t:.0%} of its speed (bound / time; {rest} are the rest).")
    return "\n".join(out)


def _deepep(p: CollectivePrediction) -> list[str]:
    """Section 2 for DeepEP's dispatch: how many copies of a token cross the network and NVLink, and why."""
    r, c = p.routing, p.copies
    nodes, per_node = c.group_nodes, c.per_node
    k, experts = r.experts_per_token, r.num_experts
    m, e, rank_experts = c.node_limit, experts // nodes, experts // p.nranks
    limit = (f"on at most {m} of the {nodes} nodes (node-limited routing)" if m < nodes
             else f"on any of the {nodes} node(s)")
    reached = (f"D = m = {m} (the router picks a token's nodes by their best experts, so each gets one)"
               if m < nodes else f"D = N (1 - C(E - e, k) / C(E, k)) = {c.nodes:.3f}")
    return ["2. The algorithm: DeepEP's dispatch (its normal kernels)",
            f"   Each token goes to k = {k} of E = {experts} experts, {limit};",
            f"   r = {rank_experts} experts per GPU, e = {e} per node, g = {per_node} GPUs per node. Spread evenly "
            f"over the m x e = {m * e} candidates:",
            f"   GPUs reached  R = m g (1 - C(m e - r, k) / C(m e, k)) = {c.gpus:.3f}",
            f"   nodes reached {reached}",
            f"   across the network: D (N - 1) / N = {c.network:.3f} copies, each to the GPU of the sender's index",
            f"   over NVLink: R (g - 1) / g = {c.nvlink:.3f} copies (the receiving GPU forwards to its node's experts)",
            f"   (the plain all-to-all sends k (n - g) / n = {k * (p.nranks - per_node) / p.nranks:.3f} copies across "
            f"the network)",
            f"   One row is size / k = {format_size(p.size_bytes / k)}; NVLink flows carry 1 / {NVLINK_FRACTION:g} of "
            f"their bytes,",
            "   as DeepEP's kernels reach ~160 of the H800's 200 GB/s (DeepEP README)."]


def _nccl_tuner(p: CollectivePrediction) -> list[str]:
    """Section 2 on clusters timed with NCCL's model: its channels, its tuning table, its pick."""
    c = p.nccl
    chosen = c.chosen
    out = [f"2. The algorithm and protocol, as NCCL's tuner picks them: {chosen.algo} / {chosen.proto} "
           f"(parsim's {p.algorithm})",
           "   NCCL's topology search found these channels (channels x GB/s per channel, NCCL's link units):"]
    for name, graph in c.graphs.items():
        out.append(f"     {name:<13} {graph.describe()}")
    out += ["   Each cell of NCCL's tuning table is  time = latency + bytes / bandwidth  (tuning.cc):",
            f"   {'algorithm/protocol':<20} {'latency':>10} {'bandwidth':>12} {'time':>10}"]
    for cand in c.candidates:
        mark = "   <- least time, chosen" if cand.name == chosen.name else ""
        out.append(f"   {cand.name:<20} {cand.latency_us:>7.1f} us {cand.bw_GBps:>7.1f} GB/s "
                   f"{cand.time_us:>7.1f} us{mark}")
    for algo, why in c.disabled.items():
        out.append(f"   {algo:<20} not used: {why}")
    out.append("   Each cell from tuning.cc's constants (latency: a base per algorithm and protocol plus a latency")
    out.append("   per hop of each kind; bandwidth: the search's channels x GB/s each, the protocol's and")
    out.append("   algorithm's factors and caps, then busbw converted to the message's own rate):")
    for cand in c.candidates:
        out.append(f"     {cand.name:<14} latency  {cand.latency_text} = {cand.latency_us:.1f} us")
        out.append(f"     {'':<14} bandwidth {cand.bw_text}")
    share = f"{c.channels} of {c.max_channels} channels"
    if c.channels < c.max_channels:
        out.append(f"   The message is small, so the kernel runs on {share} (enqueue.cc: fewer channels when")
        out.append("   bytes < channels x threads x threshold): a speed per channel scales down with them, a cap")
        out.append(f"   on the whole (LL's llMaxBw) does not: {c.bw_GBps:.1f} GB/s on every channel, "
                   f"{c.effective_bw_GBps:.1f} on these.")
    else:
        out.append(f"   The kernel runs on {share}.")
    out.append(f"   NCCL's estimate: {c.latency_us:.1f} us + {c.nbytes:,} B / {c.effective_bw_GBps:.1f} GB/s "
               f"= {c.time_us:.1f} us.")
    out += _pipeline(c)
    efficiency = p.phases[0].efficiency if p.phases else 1.0
    out.append("   On the links each phase carries its bytes / efficiency (here "
               f"{efficiency:.3g}: payload per byte on the wire at")
    out.append("   the links' peak), so that alone on this cluster it takes NCCL's time, and collectives that")
    out.append("   overlap in a training step share links with NCCL's real wire traffic.")
    return out


def _pipeline(c) -> list[str]:
    """How the kernel streams the message in chunks and loops, and the fill and drain NCCL's estimate omits."""
    pipe = c.pipeline
    if pipe is None:
        return []
    nvls = c.chosen.algo in ("NVLS", "NVLSTree")
    source = "NCCL_NVLS_NCHANNELS" if nvls else "enqueue.cc"
    out = ["   How the kernel streams it (enqueue.cc calcCollChunking, device/*.h), which that estimate leaves out:",
           f"     a) {pipe.channels} channels ({source}): {c.nbytes:,} B / {pipe.channels} = "
           f"{pipe.channel_bytes:,.0f} B per channel",
           f"     b) chunk: {pipe.chunk_steps[0]}"]
    out += [f"        {note}" for note in pipe.chunk_steps[1:]]
    unit = ("one" if pipe.chunks_per_loop == 1 else
            "one per NVLS head" if nvls else "one per rank")
    out.append(f"     c) a loop moves {pipe.chunks_per_loop} chunk(s) ({unit}) = {pipe.loop_bytes:,} B per channel: "
               f"{pipe.loops} loop(s)")
    per_channel = c.effective_bw_GBps / pipe.channels
    out.append(f"     d) the largest loop at NCCL's bandwidth: {pipe.first_loop_bytes:,.0f} B / "
               f"({c.effective_bw_GBps:.1f} GB/s / {pipe.channels}) = {pipe.loop_us:.1f} us "
               f"({per_channel:.2f} GB/s per channel)")
    out.append(f"     e) a chunk's path: {pipe.path}")
    if pipe.handoffs == 0:
        out.append(f"     f) no fill to pay: {pipe.why}.")
        return out
    share = " / 2" if pipe.flows == 2 else ""
    out.append(f"     f) {pipe.handoffs} hand-offs, each passing a chunk on only once it holds all of it (a FIFO of "
               "NCCL_STEPS = 8 chunk slots)")
    if pipe.flows == 2:
        out.append("        the reducing and broadcasting halves share every link, so while the pipe fills (only the")
        out.append("        first runs) and drains (only the second) a hand-off takes half a loop")
    out.append(f"        fill + drain = {pipe.handoffs} x {pipe.loop_us:.1f} us{share} = {pipe.fill_us:.1f} us")
    out.append(f"   parsim's time alone: {c.time_us:.1f} us + {pipe.fill_us:.1f} us = {c.predicted_us:.1f} us "
               "(the fill is paid as latency below).")
    return out


def _factor_text(op: str) -> str:
    return {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n",
            "all_to_all": "(n-1)/n", "gather": "(n-1)/n", "scatter": "(n-1)/n"}.get(op, "1")


def _identity(p: CollectivePrediction) -> list[str]:
    if p.op != "all_reduce":
        return []
    n = p.nranks
    return [
        "   Why all-reduce = reduce-scatter + all-gather: after a reduce-scatter every rank holds",
        f"   the sum of one 1/{n} of the buffer; an all-gather then hands every rank all {n} summed",
        f"   pieces. Each half moves (n-1)/n = {(n - 1) / n:.3g} of the buffer per rank, hence the ring's",
        "   closed form  T = 2(n-1)*alpha + 2(n-1)/n * S/B  (+ (n-1)/n * S/reduce speed).",
    ]


def _course_formula(p: CollectivePrediction) -> list[str]:
    n, size, t = p.nranks, p.size_bytes, p.time_s
    lines = ["5. The course's benchmark formula"]
    if p.op == "all_reduce":
        course = size * 2 * (n - 1) / (n * t)
        lines += [
            "   bandwidth = bytes x 2(n-1) / (n x time), printed in GiB/s:",
            f"   {size:,} x {2 * (n - 1)} / ({n} x {format_time(t)}) = {course / GIB:.1f} GiB/s"
            f" = {course / 1e9:.1f} GB/s, which is exactly busbw.",
            "   For reduce-scatter the course counts only the OUTPUT (one rank's 1/n share):",
            "   bytes_out x (n-1) / (n x time). The input is n times the output, so that formula is",
            "   busbw / n: on 4 GPUs reduce-scatter looks ~4x slower than all-reduce even when the",
            "   links run equally fast (the notes' 277 vs 75 GB/s).",
        ]
    elif p.op == "reduce_scatter":
        out_bytes = size / n
        course = out_bytes * (n - 1) / (n * t)
        lines += [
            "   bandwidth = output bytes x (n-1) / (n x time), the output being one rank's 1/n",
            "   (where your copy of the lecture's code counts the output tensor's bytes):",
            f"   {out_bytes:,.0f} x {n - 1} / ({n} x {format_time(t)}) = {course / GIB:.2f} GiB/s "
            f"= {course / 1e9:.1f} GB/s",
            f"   = busbw / n = {p.result().busbw_Bps / 1e9:.1f} / {n} GB/s: it counts 1/n of the bytes",
            "   moved, so reduce-scatter looks n times slower than all-reduce on the same links.",
            "   (A copy that counts the input instead prints busbw itself.)",
        ]
    else:
        lines.append("   (the course writes formulas for all-reduce and reduce-scatter; busbw is the one to compare)")
    return lines
