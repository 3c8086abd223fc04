"""Links that carry a request's KV pages from a prefill engine to a decode engine in the disaggregated simulator
(cbjax/sim/disaggregated.py), and the queue that makes each link a resource.

A transfer of `nbytes` takes

    nbytes / bandwidth + latency

seconds. Bandwidth is per direction, from the vendors' data sheets (like the accelerators of roofline.py); the
latency is an assumption (data sheets give none for a whole transfer): a few microseconds for a hop over the
fabric, more over a network. Connector software (vLLM's NIXL or LMCache, gathering pages into a buffer, a
handshake per request) is not modelled: a lower bound on the cost, as the roofline is for steps.

- `nvlink`: NVLink 4 on H100 / H200 SXM, 900 GB/s per GPU both directions together ("NVIDIA H200 Tensor Core GPU
  Datasheet": "NVLink: 900GB/s"), so 450 GB/s one way; 5 us latency (assumed).
- `ici-v5e`: TPU v5e inter-chip interconnect, 1,600 Gbps per chip (Google Cloud TPU documentation, "TPU v5e":
  "Interchip Interconnect BW: 1,600 Gbps"), i.e. 200 GB/s over the chip's 4 ports of its 2D torus; a transfer
  between two chips is taken to use one port one way: 50 GB/s (an assumption: neighbours in the torus, one
  port, no multi-path routing); 5 us latency (assumed).
- `rdma-100g`, `rdma-200g`, `rdma-400g`: a data-centre RDMA network (InfiniBand or RoCE) at 100, 200 and 400 Gb/s
  per NIC ("NVIDIA ConnectX-7 Adapter Card" data sheet: up to 400 Gb/s NDR InfiniBand / Ethernet): 12.5, 25 and
  50 GB/s; 10 us latency (assumed: NIC to NIC through one switch, plus the verbs' posting).
- `free`: no cost at all (tests: a disaggregated run whose transfers take no time).

What is modelled of contention (LinkQueue): each prefill engine has one outbound link; its transfers go one after
another in the order their prompts finish (FIFO), each occupying the link for nbytes / bandwidth, the latency
adding to its arrival without occupying the link (a pipelined wire). Different prefill engines send at the same
time without sharing bandwidth (a non-blocking fabric); a decode engine's inbound side is not a bottleneck. Transfers
overlap the engines' steps: the prefill engine goes on with its next step while the link sends.
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, one direction
    latency_s: float
    source: str

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency_s >= 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 and latency_s >= 0")

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to move `nbytes` over an idle link: nbytes / bandwidth + latency."""
        if nbytes < 0:
            raise ValueError(f"a transfer of {nbytes} bytes")
        return nbytes / self.bandwidth + self.latency_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


LINKS = {
    link.name: link
    for link in (
        Link("nvlink", 450e9, 5e-6, "NVIDIA H200 Tensor Core GPU Datasheet: NVLink 900 GB/s (both directions)"),
        Link("ici-v5e", 50e9, 5e-6, "Google Cloud TPU documentation, TPU v5e: ICI 1,600 Gbps per chip, 4 ports"),
        Link("rdma-100g", 12.5e9, 10e-6, "100 Gb/s RDMA NIC (NVIDIA ConnectX-7 data sheet: up to 400 Gb/s)"),
        Link("rdma-200g", 25e9, 10e-6, "200 Gb/s RDMA NIC (NVIDIA ConnectX-7 data sheet: up to 400 Gb/s)"),
        Link("rdma-400g", 50e9, 10e-6, "400 Gb/s RDMA NIC (NVIDIA ConnectX-7 data sheet: NDR 400 Gb/s)"),
        Link("free", math.inf, 0.0, "none: a transfer that costs nothing (tests)"),
    )
}


def get_link(link: "str | Link") -> Link:
    """A Link, or the one named in LINKS."""
    if isinstance(link, Link):
        return link
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; known: {sorted(LINKS)}")
    return LINKS[link]


class LinkQueue:
    """One link as a resource: transfers go one at a time in the order they are sent (FIFO)."""

    def __init__(self, link: Link):
        self.link = link
        self.free_at = 0.0  # when the transfer on the wire now has left it
        self.busy_s = 0.0  # seconds the link spent sending
        self.num_bytes = 0

    def send(self, ready: float, nbytes: int) -> tuple[float, float]:
        """A transfer of `nbytes` that can start at `ready`: returns (start, arrival). The link is busy for
        nbytes / bandwidth from the start; the latency only delays the arrival."""
        start = max(ready, self.free_at)
        wire = nbytes / self.link.bandwidth
        self.free_at = start + wire
        self.busy_s += wire
        self.num_bytes += nbytes
        return start, start + wire + self.link.latency_s
