"""A calibrated CPU host's cluster data with round figures (imported by tests as ``cpu_host``)."""

from __future__ import annotations

from parsim.calibrate.host import host_cluster


def cpu_host(**compute) -> dict:
    """A host of 8 gloo ranks: links of 3 GB/s and 100 us, 70 GFLOP/s a core, 20 GB/s of memory; ``compute`` keys
    (``cpu_cores``, ``op_forward_us``, ...) added to its ``compute`` section."""
    data = host_cluster(8, 100e-6, 3e9, 9e9, peak_flops=70e9, mem_bw_Bps=20e9, matmul_half_dim=8.0,
                        algorithms={"all_reduce": "ring", "send_recv": "direct"})
    data["compute"].update(compute)
    return data
