"""The group-creation policy both adapters call: plan + members -> everything a patch site needs.

A patch site (Megatron-Core's ``create_group``, DeepSpeed's ``deepspeed.comm.new_group``) asks
:func:`spec_for` and creates the group with what it says:

* **backend**: what the framework asked for, except that a group spanning accelerator vendors
  ('host-staged') goes through het_plugin's ``het_shim`` backend (its gloo twins stay gloo);
* **pg_options**: for ``het_shim``, the group's :class:`~het_plugin.comm.ShimOptions` (vendors, the
  plan's transport rule and network choice, per group: no module state); for NCCL, the framework's own
  options (or new ones) with ``config.net_name`` from :func:`network_of`: 'Socket' for a group crossing
  fabrics, the cluster file's declared RDMA network for an RDMA group (none declared: NCCL's own choice,
  no options added) -- NCCL reads ``NCCL_IB_HCA`` once per process, so a per-communicator ``net_name`` is
  the only per-group switch. Every NCCL options object het_plugin builds comes from :func:`nccl_options`
  (the shim's vendor subgroups too);
* **gloo interface**: ``GLOO_SOCKET_IFNAME`` for the creation, from ``HET_PLUGIN_GLOO_IFNAMES``;
* **member order**: a member's group rank is what it would be without het_plugin. Torch sorts a group's
  members by rank, and a framework's lists are derived from its coordinates (logical ranks), so members are
  ordered by *logical* rank (:attr:`GroupSpec.torch_ranks`), with ``sort_ranks=False`` where that is not
  ascending in launch ranks (a pipeline group's member then has its stage as group rank, as the framework
  assumes). On an identity plan this is torch's own sorting whatever order a list comes in (Megatron
  concatenates some). DeepSpeed also lists launch ranks itself (``range(world)``): there an ascending list
  keeps torch's sorting (``ascending_is_launch_order``).

On a homogeneous cluster whose plan is the identity the framework's own choices stand (no net_name:
NCCL picks its network as it always does).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from ..core.errors import ConfigError
from ..core.ranks.transport import Transport
# The network choice and the NCCL options live in netselect (a leaf the shim imports too); named here as well.
from .netselect import (SHIM_BACKEND, gloo_ifnames, ifname_set,  # noqa: F401
                        nccl_options, network_of, with_net_name)


@dataclass(frozen=True)
class GroupSpec:
    """How to create one group."""
    ranks: tuple[int, ...]
    transport: str
    backend: Optional[str]          # None: the default backend
    net_name: Optional[str]         # NCCL per-communicator network, or None (no choice / not NCCL)
    gloo_ifname: Optional[str]      # GLOO_SOCKET_IFNAME while the group is created, or None
    sort_ranks: bool                # False: hand torch ``torch_ranks`` in that order
    pg_options: Any = None          # what to pass as new_group's pg_options (see the module docstring)
    torch_ranks: tuple[int, ...] = ()   # the members ordered by logical rank (what torch gets as ranks)
    timeout: Optional[timedelta] = None  # new_group's timeout (AppliedPlan.create: bounded for gloo, see runtime.guard)

    def new_group_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.distributed.new_group`` beyond ``ranks``."""
        kwargs: dict[str, Any] = {}
        if self.backend is not None:
            kwargs["backend"] = self.backend
        if self.pg_options is not None:
            kwargs["pg_options"] = self.pg_options
        if not self.sort_ranks:
            kwargs["sort_ranks"] = False
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        return kwargs

    @contextlib.contextmanager
    def creating(self) -> Iterator[None]:
        """The process environment one creation needs (gloo reads GLOO_SOCKET_IFNAME per group)."""
        with ifname_set(self.gloo_ifname):
            yield


@dataclass(frozen=True)
class ShimOptions:
    """What a het_shim group is told at creation (torch hands ``pg_options`` to the backend creator); the policy
    gives it to every cross-vendor group, the shim (:mod:`het_plugin.comm`, which names it too) reads it.

    ``vendors``: every global rank's vendor (at least the group's members). ``transport_of``: the
    transport of a set of global ranks (``Plan.transport_of``), so each vendor subgroup's gloo
    communicator uses its own fabric's interface (``HET_PLUGIN_GLOO_IFNAMES``); None: no choice.
    ``net_name_of``: the same for its NCCL/RCCL communicator (a one-vendor subgroup spanning an IB and a RoCE
    cluster must be a Socket communicator).
    """
    vendors: Mapping[int, str]
    transport_of: Optional[Callable[[Sequence[int]], str]] = None
    # The NCCL net_name of a vendor subgroup over these global ranks (netselect.network_of, the one network
    # choice); None: NCCL's own choice.
    net_name_of: Optional[Callable[[Sequence[int]], Optional[str]]] = None

    @classmethod
    def from_plan(cls, plan) -> "ShimOptions":
        return cls({r: plan.vendor_of(r) for r in range(plan.world_size)}, plan.transport_of,
                   functools.partial(network_of, plan))


@dataclass(frozen=True)
class GroupRecord:
    """One group created under a plan (for the start-up report, checks and tests)."""
    ranks: list[int]
    transport: str
    backend: Optional[str]
    net_name: Optional[str]
    gloo_ifname: Optional[str]
    desc: Optional[str] = None


@dataclass
class Policy:
    """The per-run inputs of :func:`spec_for` that are not in the plan."""
    default_backend: str                       # the world group's backend ('gloo', 'nccl', 'cpu:gloo,cuda:nccl')
    native_network: bool = False               # homogeneous identity plan: the framework's own network choice
    shim_backend: Optional[str] = None         # 'het_shim' where registered (looked up on first need)
    shim_checked: bool = False
    warnings: list[str] = field(default_factory=list)


def spec_for(plan, ranks: Optional[Sequence[int]], policy: Policy, *, backend: Optional[str] = None,
             pg_options: Any = None, ascending_is_launch_order: bool = False) -> GroupSpec:
    """How a group over ``ranks`` (None: every rank) is created under ``plan``; ``backend`` and
    ``pg_options`` are what the framework asked for. ``ascending_is_launch_order``: the framework may list
    launch ranks itself (DeepSpeed's ``range(world)`` group), so an ascending list keeps torch's sorting;
    otherwise (Megatron: every list comes from its rank generator) members are ordered by logical rank."""
    members = tuple(range(plan.world_size)) if ranks is None else tuple(int(r) for r in ranks)
    transport = plan.transport_of(members)
    chosen, options = backend, pg_options
    if transport == Transport.HOST_STAGED and backend in (None, "nccl"):
        shim = _shim_backend(policy)
        if shim is not None:
            chosen, options = shim, ShimOptions.from_plan(plan)
    effective = str(chosen or policy.default_backend).lower()
    if transport == Transport.HOST_STAGED and "nccl" in effective and chosen != SHIM_BACKEND:
        raise ConfigError(f"the group of ranks {list(members)[:8]}{' ...' if len(members) > 8 else ''} spans "
                          f"accelerator vendors, and its backend would be {effective!r}: NCCL and RCCL cannot form "
                          "one communicator, so it could only fail or hang", field="backend",
                          fix="use a torch that accepts third-party backends (torch.distributed.Backend."
                              "register_backend, so that het_plugin's het_shim backend registers), or plan the model "
                              "inside one vendor's nodes")
    net_name = None
    if "nccl" in effective and chosen != SHIM_BACKEND and not policy.native_network:
        net_name = network_of(plan, members, transport)
        if net_name is not None:
            options = nccl_options(net_name, options)
    ifname = None
    if "gloo" in effective or chosen == SHIM_BACKEND:     # e.g. 'gloo', 'cpu:gloo,cuda:nccl', the shim's host hops
        names = gloo_ifnames()
        # gloo has no multi-network mode: a group NCCL would run across fabrics crosses on the socket interface
        ifname = names.get(transport) or (names.get(Transport.SOCKET) if transport == Transport.MULTINET else None)
    logical = plan.logical_of_physical
    keep = ranks is None or (ascending_is_launch_order and list(members) == sorted(members))
    by_logical = members if keep else tuple(sorted(members, key=lambda r: logical[r]))
    sort = list(by_logical) == sorted(members)
    if not sort:
        check_torch_keeps_order()
    return GroupSpec(members, transport, chosen, net_name if options is not None else None, ifname, sort, options,
                     by_logical)


def check_torch_keeps_order() -> None:
    """A permuted plan needs ``new_group(sort_ranks=False)`` (added to torch in March 2026, pytorch#176580);
    an older torch would give members group ranks in ascending order and the framework would deadlock."""
    from torch.distributed import distributed_c10d      # torch's own function, whatever wraps the attribute
    if "sort_ranks" not in inspect.signature(distributed_c10d.new_group).parameters:
        import torch
        raise ConfigError(f"torch {torch.__version__} sorts every group's members (its new_group has no "
                          "sort_ranks), but this plan places ranks out of order", field="torch",
                          fix="use a torch whose new_group takes sort_ranks (2026 releases; 2.13 is tested), or "
                              "launch the nodes in the plan's order (launch.node_order) so the plan is the identity")


def spans_vendors(plan) -> bool:
    """Whether some group of ``plan`` may span accelerator vendors, so that the caller imports
    :mod:`het_plugin.comm` (registering ``het_shim``) before creating groups. Runtime never imports comm."""
    return len({plan.vendor_of(r) for r in range(plan.world_size)}) > 1


def _shim_backend(policy: Policy) -> Optional[str]:
    if not policy.shim_checked:
        policy.shim_checked = True
        import torch.distributed as tdist       # `import het_plugin.comm` registered it (the adapters: spans_vendors)
        policy.shim_backend = SHIM_BACKEND if SHIM_BACKEND in getattr(tdist.Backend, "backend_list", []) else None
        if policy.shim_backend is None and "het_plugin.comm" not in sys.modules:
            # not a torch that refused the backend: nobody imported the shim (runtime never imports comm)
            raise ConfigError("a group spans accelerator vendors, but het_plugin's het_shim backend is not registered "
                              "in this process", field="het_shim",
                              fix="import het_plugin.comm before creating the groups of a plan that spans vendors "
                                  "(the Megatron and DeepSpeed adapters do: runtime.group_policy.spans_vendors)")
        if policy.shim_backend is None:
            policy.warnings.append("a group spans accelerator vendors but this torch did not accept the het_shim "
                                   "backend; such groups use the default backend")
    return policy.shim_backend
