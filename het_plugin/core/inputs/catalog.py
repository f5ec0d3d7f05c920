"""Built-in catalog of accelerator parts, so a cluster file can say ``accelerator: H100``.

Numbers are vendor peak dense BF16 TFLOPS, memory as the framework sees one device (an MI250X
shows up as two GCDs, so one catalog entry is one GCD), and intra-node bandwidth per device in
Gbit/s (NVLink / xGMI / PCIe, one direction). ``efficiency`` is the share of peak a transformer
layer sustains; a measured profile (see ``het_plugin.core.inputs.profile``) overrides the analytic estimate.
The catalog has no prices (they differ by buyer and change by the month): a cluster file gives
``price_per_device_hour`` per node group where the user wants costs (het_plugin.core.subsets).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    vendor: str
    memory_gib: float
    peak_tflops: float
    intra_node_gbps: float
    efficiency: float = 0.5

    @property
    def sustained_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency


CATALOG: dict[str, Accelerator] = {
    a.name: a
    for a in [
        Accelerator("A100-40", "nvidia", 40, 312, 2400),
        Accelerator("A100-80", "nvidia", 80, 312, 2400),
        Accelerator("H100", "nvidia", 80, 989, 3600),
        Accelerator("H200", "nvidia", 141, 989, 3600),
        Accelerator("MI250X", "amd", 64, 191.5, 800),
        Accelerator("MI300X", "amd", 192, 1307, 3584),
        # A generic part of a vendor torch cannot identify (HETHUB's "other" accelerators).
        Accelerator("other-vendor", "other", 64, 256, 256),
    ]
}


def known_names() -> str:
    return ", ".join(sorted(CATALOG))


def lookup(name: str) -> Accelerator:
    """Case-insensitive catalog lookup; raises KeyError naming the known parts."""
    for key, acc in CATALOG.items():
        if key.lower() == name.lower():
            return acc
    raise KeyError(f"unknown accelerator {name!r}; known: {known_names()}")
