"""The pure planning core: inputs -> rank arithmetic -> cost model -> planner -> Plan.

No torch, no store, no environment writes (tests/core/test_purity.py checks it).
"""
