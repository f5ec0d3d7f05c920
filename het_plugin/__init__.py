"""het_plugin: heterogeneous-cluster placement, layer split and transports for Megatron-Core and DeepSpeed.

Data flow: cluster description -> planner (cost model + search) -> Plan -> adapters.
The planning core (cluster, model, topology, placement, cost, layer_split, planner, plan) never touches
torch.distributed.
"""
__version__ = "0.1.0"
