"""Rank arithmetic: coordinates <-> logical ranks, the placement (logical -> launch rank), the transport rule
and its network names, the replicas' batches.
"""
