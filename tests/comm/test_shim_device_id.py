"""A het_shim world created with ``device_id`` (DeepSpeed binds one on CUDA and ROCm): torch asks the world for
its backend on that device (distributed_c10d._new_process_group_helper: ``pg._get_backend(device_id)
.supports_splitting``); a Python ProcessGroup has none registered, so without an answer it raises "No backend type
associated with device type". The shim answers with itself, never split from."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from het_plugin.comm import ShimLayout, ShimProcessGroup


def test_a_device_bound_shim_world_is_neither_eagerly_connected_nor_split():
    plain = dist.ProcessGroup(0, 1)
    device = torch.device("cuda", 0)
    try:
        plain._get_backend(device)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    assert raised is not None and "No backend type associated with device type cuda" in raised, \
        "the failure the shim answers for (torch's own ProcessGroup)"
    pg = ShimProcessGroup(dist.HashStore(), 0, 1, [0], timedelta(seconds=10), ShimLayout(("nvidia",)))
    try:
        backend = pg._get_backend(device)       # what init_process_group(device_id=...) and new_group look up
        assert backend is pg and backend.supports_splitting is False
    finally:
        pg.shutdown()
