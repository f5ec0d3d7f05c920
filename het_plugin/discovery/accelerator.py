"""Which accelerator a node has: from torch (CUDA or ROCm build), or from the environment.

torch reports a marketing name ("NVIDIA H100 80GB HBM3", "AMD Instinct MI250X/MI250"); we map it to a
catalog part. Vendors torch cannot see (HETHUB's "other" accelerators) are named through
``HET_PLUGIN_ACCELERATOR``: a catalog name, or a full spec as a YAML mapping
``{name: X, vendor: y, memory_gib: 64, peak_tflops: 300}``. ``HET_PLUGIN_ACCELERATOR_COUNT`` sets
the count when torch cannot count the devices.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import yaml

from ..core.inputs import catalog
from ..core.errors import ConfigError
from ..core.inputs.cluster import AcceleratorSpec
from ..core.inputs.yamlio import validate

ENV_ACCELERATOR = "HET_PLUGIN_ACCELERATOR"
ENV_ACCELERATOR_COUNT = "HET_PLUGIN_ACCELERATOR_COUNT"

OVERRIDE_FIX = (f"set {ENV_ACCELERATOR} to a catalog name ({catalog.known_names()}) or to a spec like "
                "'{name: X, vendor: y, memory_gib: 64, peak_tflops: 300}'")


@dataclass(frozen=True)
class AcceleratorInfo:
    """A node's device type. ``in_catalog``: ``name`` is a catalog part; otherwise the numbers are ours."""
    name: str
    vendor: str
    in_catalog: bool
    memory_gib: Optional[float] = None
    peak_tflops: Optional[float] = None   # None: torch named a part we do not know
    intra_node_gbps: Optional[float] = None
    efficiency: Optional[float] = None
    device_name: Optional[str] = None     # what torch reported, if it did
    source: str = "torch"                 # 'torch' or 'env'

    def cluster_spec(self, peak_tflops: Optional[float] = None) -> Any:
        """What a cluster file's ``accelerator:`` holds for this part."""
        if self.in_catalog:
            return self.name
        spec: dict[str, Any] = {"name": self.name, "vendor": self.vendor,
                                "memory_gib": self.memory_gib,
                                "peak_tflops": self.peak_tflops if self.peak_tflops is not None else peak_tflops}
        if self.intra_node_gbps is not None:
            spec["intra_node_gbps"] = self.intra_node_gbps
        if self.efficiency is not None:
            spec["efficiency"] = self.efficiency
        return spec


# Marketing names -> catalog parts; first match wins. MI250 (not X) has nearly the same GCD.
_NAME_RULES: list[tuple[str, str]] = [
    (r"\bH200\b", "H200"),
    (r"\bH100\b", "H100"),
    (r"\bMI300X\b", "MI300X"),
    (r"\bMI250X?\b", "MI250X"),
]
# ROCm builds sometimes report an empty or generic name; the gfx architecture still tells the part.
_ARCH_RULES = {"gfx90a": "MI250X", "gfx942": "MI300X"}


def from_device_name(device_name: str, vendor: str, memory_gib: Optional[float] = None,
                     arch: Optional[str] = None) -> AcceleratorInfo:
    """Map what torch reports to a catalog part; an unknown part keeps its name and memory."""
    name = device_name or ""
    part = None
    if re.search(r"\bA100\b", name):
        big = "80GB" in name.replace(" ", "") or (memory_gib is not None and memory_gib > 48)
        part = "A100-80" if big else "A100-40"
    for pattern, candidate in _NAME_RULES:
        if part is None and re.search(pattern, name):
            part = candidate
    if part is None and arch:
        part = _ARCH_RULES.get(arch.split(":", 1)[0])
    if part is not None:
        acc = catalog.lookup(part)
        return AcceleratorInfo(acc.name, acc.vendor, True, device_name=device_name or None)
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or f"{vendor}-unknown"
    return AcceleratorInfo(label, vendor, False, memory_gib=memory_gib, device_name=device_name or None)


def parse_override(text: str) -> AcceleratorInfo:
    """``HET_PLUGIN_ACCELERATOR``: a catalog name or a YAML mapping checked like a cluster file's spec."""

    text = text.strip()
    if text.startswith("{"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"not a YAML mapping: {exc}", source=ENV_ACCELERATOR, fix=OVERRIDE_FIX) from None
        spec = validate(AcceleratorSpec, data, ENV_ACCELERATOR)
        return AcceleratorInfo(spec.name, spec.vendor.lower(), False, spec.memory_gib, spec.peak_tflops,
                               spec.intra_node_gbps, spec.efficiency, source="env")
    try:
        acc = catalog.lookup(text)
    except KeyError:
        raise ConfigError(f"unknown accelerator {text!r}", source=ENV_ACCELERATOR, fix=OVERRIDE_FIX) from None
    return AcceleratorInfo(acc.name, acc.vendor, True, source="env")


def parse_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"{text!r} is not a positive whole number", source=ENV_ACCELERATOR_COUNT,
                          fix="set it to the number of accelerators on this node, e.g. 8")
    return count


def from_torch(torch_module=None, device_index: int = 0) -> tuple[Optional[AcceleratorInfo], int, list[str]]:
    """(part, device count, notes) as torch sees them; (None, 0, why) on a machine without devices."""
    try:
        torch = torch_module or __import__("torch")
    except ImportError:
        return None, 0, ["torch is not importable: no accelerator detected"]
    version = getattr(torch, "__version__", "?")
    hip = getattr(getattr(torch, "version", None), "hip", None)
    try:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    except Exception as exc:  # a broken driver must not crash discovery
        return None, 0, [f"torch {version}: querying devices failed ({exc})"]
    if count == 0:
        build = "ROCm" if hip else ("CUDA" if getattr(torch.version, "cuda", None) else "CPU-only")
        return None, 0, [f"torch {version} ({build} build) sees no CUDA/ROCm device"]
    index = min(max(device_index, 0), count - 1)
    name = torch.cuda.get_device_name(index)
    props = torch.cuda.get_device_properties(index)
    memory_gib = round(props.total_memory / 2**30, 1)
    arch = getattr(props, "gcnArchName", None) if hip else None
    vendor = "amd" if hip else "nvidia"
    info = from_device_name(name, vendor, memory_gib, arch)
    notes = [] if info.in_catalog else [f"torch names the device {name!r}, which is not in the catalog"]
    return info, count, notes


def detect(env: Mapping[str, str] | None = None, torch_module=None,
           device_index: int = 0) -> tuple[Optional[AcceleratorInfo], Optional[int], list[str]]:
    """The node's part and count: environment overrides first, then torch. Count None: unknown."""
    env = os.environ if env is None else env
    override = env.get(ENV_ACCELERATOR, "").strip()
    count_text = env.get(ENV_ACCELERATOR_COUNT, "").strip()
    info, seen, notes = from_torch(torch_module, device_index)
    if override:
        if info is not None:
            notes.append(f"{ENV_ACCELERATOR} overrides what torch sees ({info.device_name or info.name})")
        info = parse_override(override)
    count: Optional[int] = parse_count(count_text) if count_text else (seen or None)
    return info, count, notes
