"""Create DeepSpeed's groups with the plan's network per group.

``PipelineParallelGrid`` and ``PipelineModule`` create every group through ``deepspeed.comm.new_group``
(the grid's model/data/pipe/slice groups, the module's world group and tied-weight groups). While a
:class:`PlannedGroups` is installed, that function is replaced by one that looks up the group's transport
in the plan and creates it:

* gloo: inside ``netselect.gloo_network(transport)`` (GLOO_SOCKET_IFNAME per group);
* NCCL: with ``ProcessGroupNCCL.Options`` whose ``config.net_name`` is ``IB`` or ``Socket``;
* transport ``host-staged`` (members of different vendors): backend ``het_shim`` (registered by
  ``import het_plugin.comm``; the plan's vendor per rank is handed to it first), or the default backend
  with a warning where het_plugin.comm cannot be imported;
* ranks kept in the order DeepSpeed gave (``sort_ranks=False``), so a group's rank order is the plan's.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..netselect import SHIM_BACKEND, gloo_network, nccl_net_name
from ..plan import Plan

log = logging.getLogger(__name__)


@dataclass
class GroupRecord:
    """One group created under the plan (kept for checks and for the start-up report)."""
    ranks: list[int]
    transport: str
    backend: Optional[str]
    ifname: Optional[str]
    net_name: Optional[str]


class PlannedGroups:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.records: list[GroupRecord] = []
        self._warned_shim = False
        self._vendors_declared = False

    def transport_of(self, ranks: Sequence[int]) -> str:
        return self.plan.transport_of(ranks)

    def new_group(self, ranks):
        import torch.distributed as tdist
        ranks = list(ranks)
        transport = self.transport_of(ranks)
        kwargs = {}
        if ranks != sorted(ranks) and "sort_ranks" in inspect.signature(tdist.new_group).parameters:
            kwargs["sort_ranks"] = False
        backend = self._backend_for(transport)
        if backend is not None:
            kwargs["backend"] = backend
        default_backend = str(tdist.get_backend()).lower()
        net_name = None
        if backend is None and default_backend == "nccl":
            net_name = nccl_net_name(transport)
            options = nccl_options(net_name)
            if options is not None:
                kwargs["pg_options"] = options
        uses_gloo = "gloo" in default_backend or backend is not None     # e.g. "gloo", "cpu:gloo,cuda:nccl"
        with gloo_network(transport) if uses_gloo else contextlib.nullcontext() as ifname:
            group = tdist.new_group(ranks=ranks, **kwargs)
        self.records.append(GroupRecord(ranks, transport, backend, ifname, net_name))
        return group

    def _backend_for(self, transport: str) -> Optional[str]:
        if transport != "host-staged":
            return None
        from ..comm import registered_backend, set_vendor_map_from_plan   # only for cross-vendor groups
        if registered_backend() is not None:
            if not self._vendors_declared:
                set_vendor_map_from_plan(self.plan)
                self._vendors_declared = True
            return SHIM_BACKEND
        if not self._warned_shim:
            log.warning("a group spans vendors (transport host-staged) but het_plugin.comm (backend %r) is not "
                        "available; using the default backend for it", SHIM_BACKEND)
            self._warned_shim = True
        return None

    @contextlib.contextmanager
    def installed(self) -> Iterator["PlannedGroups"]:
        """Route ``deepspeed.comm.new_group`` through :meth:`new_group` for the duration."""
        import deepspeed.comm as ds_comm
        original = ds_comm.new_group
        ds_comm.new_group = self.new_group
        try:
            yield self
        finally:
            ds_comm.new_group = original


def nccl_options(net_name: Optional[str]):
    """``ProcessGroupNCCL.Options`` selecting NCCL's network for one communicator (what Megatron-Core's
    ``nccl_communicator_config_path`` sets); None when there is nothing to select or no NCCL."""
    if net_name is None:
        return None
    import torch.distributed as tdist
    pg_nccl = getattr(tdist, "ProcessGroupNCCL", None)
    if pg_nccl is None:
        return None
    options = pg_nccl.Options()
    options.config.net_name = net_name
    return options
