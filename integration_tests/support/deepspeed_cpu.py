"""Test-only settings that make DeepSpeed start quickly on a CPU-only machine (never used by het_plugin).

* ``DS_ACCELERATOR=cpu``: DeepSpeed's CPU accelerator; without oneCCL its communication backend is gloo.
* The CPU accelerator JIT-compiles a shared-memory all-reduce op (``deepspeed_shm_comm``) when the
  communication backend starts (~30 s, ~1.6 GB of compiler memory per rank). Training never uses it
  (only ``inference_all_reduce`` does), and ``build_shm_op`` returns None when the op is marked
  incompatible, so we mark it so before ``init_distributed``.
* No DeepSpeed optimizer from the config (its Adam is another JIT build): tests pass a torch optimizer.
"""
from __future__ import annotations

import os


def cpu_environment() -> dict[str, str]:
    """Environment for rank processes (set before ``import deepspeed``)."""
    return {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR"}


def skip_shm_build() -> None:
    """Mark DeepSpeed's shared-memory comm op incompatible so ``TorchBackend`` does not compile it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def init_gloo() -> None:
    """``deepspeed.init_distributed`` on gloo, without the shm build."""
    skip_shm_build()
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
