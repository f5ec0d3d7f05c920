"""het_plugin: heterogeneous-cluster placement, layer split and transports for Megatron-Core and DeepSpeed.

Data flow: cluster description -> planner (cost model + search) -> Plan -> adapters.
The tree (docs/architecture.md): ``core/`` is the pure planning core (no torch, no store, no environment
writes); ``views/`` draws plans; ``runtime/``, ``comm/`` and ``discovery/`` run on ranks; ``megatron/`` and
``deepspeed/`` are the frameworks' patch sites; ``cli/`` and ``tools/`` are the commands around them.
"""
__version__ = "0.1.0"

from . import _moved

_moved.install()
