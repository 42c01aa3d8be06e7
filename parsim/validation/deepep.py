"""DeepEP's published bandwidths next to parsim's model of its kernels (:mod:`parsim.sim.collectives.deepep`).

DeepEP's README ("Normal kernels with NVLink and RDMA forwarding", now
``docs/legacy.md`` in deepseek-ai/DeepEP) times its dispatch and combine on
H800s, one 400 Gb/s CX7 NIC per GPU, in DeepSeek-V3's pre-training setting:
4,096 tokens per rank, hidden 7,168, 256 experts, top-8 on the top-4 groups
(``tests/test_internode.py``: a group per node, ``min(nodes, 4)`` of them per
token), dispatch in fp8 (1 byte per element and an fp32 scale per 128), combine
in bf16. Its "bottleneck bandwidth" is a logical one, the tokens' bytes over
the kernel's time: inside a node the rows a rank receives (``recv_x``, its
own included); across nodes the rows sent to each node reached, the sender's
own included (``num_rdma_token_sent``). parsim times the same call alone on
``hgx-h800`` and divides the same bytes by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware.cluster import load_cluster
from ..sim.collectives.deepep import TokenRouting
from ..sim.collectives.simulate import predict
from ..workload.model import FP8_DISPATCH_BYTES

TOKENS, HIDDEN, EXPERTS, TOP_K = 4096, 7168, 256, 8
BF16_BYTES = 2.0
SOURCE = ("DeepEP README, 'Normal kernels with NVLink and RDMA forwarding' (docs/legacy.md, "
          "github.com/deepseek-ai/DeepEP)")
# (ep ranks, dispatch GB/s, combine GB/s, the link the figure is of), as published
PUBLISHED = ((8, 153.0, 158.0, "NVLink"), (16, 43.0, 43.0, "RDMA"), (32, 58.0, 57.0, "RDMA"),
             (64, 51.0, 50.0, "RDMA"))


@dataclass(frozen=True)
class Row:
    ranks: int
    call: str  # "dispatch" | "combine"
    link: str
    published_GBps: float
    predicted_GBps: float
    seconds: float  # parsim's time for the call

    @property
    def error(self) -> float:
        """predicted / published - 1 (positive: parsim predicts a faster call)."""
        return self.predicted_GBps / self.published_GBps - 1


def compare(cluster: str = "hgx-h800") -> list[Row]:
    """Every published row with parsim's logical bandwidth for the same call."""
    spec = load_cluster(cluster)
    rows = []
    for ranks, dispatch, combine, link in PUBLISHED:
        nodes = ranks // spec.gpus_per_node
        topo = spec.build(nodes)
        routing = TokenRouting(TOP_K, EXPERTS, max_nodes=min(nodes, 4))
        calls = (("dispatch", dispatch, FP8_DISPATCH_BYTES), ("combine", combine, BF16_BYTES))
        for call, published, element_bytes in calls:
            p = predict(topo, "all_to_all", TOKENS * TOP_K * HIDDEN * element_bytes, routing=routing)
            logical_rows = p.copies.gpus if nodes == 1 else p.copies.nodes  # per token: rows received, or sent
            predicted = TOKENS * logical_rows * HIDDEN * element_bytes / p.time_s / 1e9
            rows.append(Row(ranks, call, link, published, predicted, p.time_s))
    return rows
