"""Emulated heterogeneous network on one Linux machine (root): namespaces as nodes, two networks per node
(shared Ethernet; a per-cluster fabric for RDMA clusters), htb bandwidth shaping per destination, and
optionally each node's compute speed as a cpu cgroup quota.

See docs/emulator.md. Latency is not emulated (no netem in the kernels we target); bandwidth is.
"""
from .netspec import ETH_IF, FAB_IF, EmuNode, ExtraNetwork, Interface, Layout, ShapedClass, make_layout
from .network import Emulation, RankOutput, collect, stream_prefixed, terminate_on_signals
from .speed import CATALOG, CpuShare, cpu_shares, node_speeds
from .system import EmulatorUnavailable, check_cpu_controller, check_preconditions, clean_leftovers, leftovers

__all__ = ["Emulation", "EmulatorUnavailable", "ExtraNetwork", "RankOutput", "collect", "Layout", "EmuNode", "Interface", "ShapedClass", "make_layout",
           "check_preconditions", "clean_leftovers", "leftovers", "stream_prefixed", "terminate_on_signals",
           "ETH_IF", "FAB_IF", "CATALOG", "CpuShare", "cpu_shares", "node_speeds", "check_cpu_controller"]
