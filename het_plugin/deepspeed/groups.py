"""DeepSpeed's groups, created by het_plugin's one group policy.

``PipelineParallelGrid`` and ``PipelineModule`` create every group through ``deepspeed.comm.new_group``
(the grid's model/data/pipe/slice groups, the module's world group and tied-weight groups). While
:func:`planned_groups` is active, that function asks the policy (:mod:`het_plugin.runtime.group_policy`,
through the :class:`~het_plugin.runtime.applied.AppliedPlan`) how to create each group -- backend
(``het_shim`` across vendors), NCCL ``net_name`` or the shim's options as ``pg_options``, the gloo
interface, ``sort_ranks=False`` for the plan's member order -- and creates it with
``torch.distributed.new_group``. Every group is recorded in ``applied.records``. Group building is
guarded (:mod:`het_plugin.runtime.guard`): a rank that fails or disappears stops every rank within the bound.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from ..runtime.applied import AppliedPlan
from ..runtime.group_policy import spans_vendors
from ..runtime.patches import PATCHES


def new_group(applied: AppliedPlan, ranks: Sequence[int]):
    """What ``deepspeed.comm.new_group(ranks)`` does under the plan."""
    import torch.distributed as tdist
    return applied.create(lambda spec: tdist.new_group(ranks=list(spec.torch_ranks), **spec.new_group_kwargs()), ranks,
                          ascending_is_launch_order=True)      # PipelineModule's world group: range(world)


@contextlib.contextmanager
def planned_groups(applied: AppliedPlan, what: str = "DeepSpeed's PipelineModule",
                   timeout_s: Optional[float] = None) -> Iterator[AppliedPlan]:
    """Route ``deepspeed.comm.new_group`` through the policy for the duration; the phase is guarded
    (runtime.guard): a rank that fails or disappears stops every rank within ``timeout_s`` (None: the
    section's, HET_PLUGIN_TIMEOUT or the default)."""
    import deepspeed.comm as ds_comm
    if spans_vendors(applied.plan):
        from .. import comm  # noqa: F401   registers het_shim, the backend of groups spanning vendors

    def planned(_deepspeeds_own):
        return lambda ranks: new_group(applied, ranks)

    with PATCHES.temporarily("deepspeed.groups", [(ds_comm, "new_group", planned)]):
        with applied.guarding(what, timeout_s=timeout_s):
            yield applied
