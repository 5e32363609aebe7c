"""The links a multi-GPU strategy's traffic crosses, and the seconds a step's bytes take over them.

Bandwidths are nominal, one direction (what each rank can send while it receives as much), from the sources named:
a collective's achieved rate is lower (protocol overhead, latency for small messages), so the seconds here are a
lower bound, and a strategy's traffic is taken as not overlapped with compute (an upper bound on its share of the
step: DDP and FSDP overlap much of it with backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vram.prediction.timing.peaks import GB


@dataclass(frozen=True)
class Link:
    """A link between ranks: ``bandwidth`` in bytes/s one way, ``source`` where the figure comes from."""

    name: str
    bandwidth: float
    source: str


LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link(
            "NVLink 4",
            450 * GB,
            "NVIDIA H100 and H200 Tensor Core GPU datasheets, SXM: NVLink 900 GB/s a GPU, both directions together",
        ),
        Link(
            "NVLink 3",
            300 * GB,
            "NVIDIA A100 Tensor Core GPU datasheet, SXM: NVLink 600 GB/s a GPU, both directions together",
        ),
        Link("PCIe 4.0 x16", 31.5 * GB, "PCI-SIG PCIe 4.0: 16 GT/s a lane, 128b/130b encoding, 16 lanes, one way"),
        Link("PCIe 5.0 x16", 63 * GB, "PCI-SIG PCIe 5.0: 32 GT/s a lane, 128b/130b encoding, 16 lanes, one way"),
        Link("100 Gb/s network", 12.5 * GB, "100 Gb/s a port (EDR InfiniBand, 100 GbE): line rate, one way"),
        Link("200 Gb/s network", 25 * GB, "200 Gb/s a port (HDR InfiniBand, NVIDIA ConnectX-6): line rate, one way"),
        Link("400 Gb/s network", 50 * GB, "400 Gb/s a port (NDR InfiniBand, NVIDIA ConnectX-7): line rate, one way"),
    )
}
"""Links between GPUs (NVLink, PCIe) and between nodes (networks), by name."""


def communication_seconds(bytes_per_rank: int, link: Link) -> float:
    """Seconds for each rank to send ``bytes_per_rank`` bytes over ``link`` at its nominal bandwidth.

    ``bytes_per_rank`` is what one rank sends in one step (a ring all-reduce of ``n`` bytes over ``w`` ranks sends
    ``2 n (w - 1) / w``: the strategy's model counts it).

    >>> communication_seconds(450_000_000, LINKS["NVLink 4"])
    0.001
    """
    if isinstance(bytes_per_rank, bool) or not isinstance(bytes_per_rank, int) or bytes_per_rank < 0:
        raise ValueError(f"bytes_per_rank must be an int >= 0, got {bytes_per_rank!r}")
    return bytes_per_rank / link.bandwidth
