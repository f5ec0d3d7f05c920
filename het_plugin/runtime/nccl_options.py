"""One NCCL options object per group: the framework's settings copied, the plan's network written on the copy.

Why a copy: torch hands the caller's ``ProcessGroupNCCL.Options`` object itself to ``ProcessGroupNCCL``
(pytorch v2.13.0 torch/distributed/distributed_c10d.py ``_new_process_group_helper``: ``backend_options =
pg_options``), and the communicator is created lazily, so it reads ``config.net_name`` when first used. Megatron
passes one object to several groups (megatron-core 0.16.1-0.19.2 parallel_state.py ``create_hierarchical_groups``:
``[pg_options] * levels`` and one object per level for all sub-groups), so writing ``net_name`` in place would
carry one group's network into the others.

Composition: the user's settings (``--nccl-communicator-config-path``: CTAs, CGA cluster size, priority,
``net_name``) stay on the copy; only the plan's network choice is written over them, and where it replaces a
``net_name`` the user asked for, :class:`OptionNotes` says so once per group kind. SHARP (NCCL CollNet) on a
group the plan puts on sockets is refused: CollNet runs over one InfiniBand fabric's switches only.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ..core.errors import ConfigError
from ..core.ranks.transport import SOCKET_NET

# Options-level attributes worth carrying (torch's ProcessGroupNCCL.Options and its Backend.Options base).
_OPTION_FIELDS = ("_timeout", "global_ranks_in_group", "group_name", "split_from", "split_color")


def copied(options: Any) -> Any:
    """A new options object of the same type with ``options``' settings (None stays None). Works on torch's
    pybind ``ProcessGroupNCCL.Options`` (whose ``config`` fields are properties) and on stand-ins alike."""
    if options is None:
        return None
    cls = type(options)
    if not cls.__module__.startswith("torch"):         # a Python object (a wrapper, a test's stand-in)
        new = copy.copy(options)
        if getattr(options, "config", None) is not None:
            new.config = copy.copy(options.config)
        return new
    try:
        new = cls(is_high_priority_stream=bool(getattr(options, "is_high_priority_stream", False)))
    except TypeError:
        new = cls()
    for name in _OPTION_FIELDS:
        if hasattr(options, name):
            _set(new, name, getattr(options, name))
    config, target = getattr(options, "config", None), getattr(new, "config", None)
    if config is not None and target is not None:
        for name in config_fields(config):
            _set(target, name, getattr(config, name))
    return new


def config_fields(config: Any) -> list[str]:
    """The settable fields of an ncclConfig_t binding (or a stand-in's namespace)."""
    out = []
    for name in dir(config):
        if name.startswith("_"):
            continue
        try:
            value = getattr(config, name)
        except Exception:                   # a binding property that cannot be read: not a setting
            continue
        if not callable(value):
            out.append(name)
    return out


def _set(target: Any, name: str, value: Any) -> None:
    if value is None:
        return
    try:
        setattr(target, name, value)
    except (AttributeError, TypeError):     # read-only in this torch build
        pass


def user_net_name(options: Any) -> Optional[str]:
    """The ``net_name`` the framework's (the user's) options ask for, or None."""
    config = getattr(options, "config", None)
    value = getattr(config, "net_name", None) if config is not None else None
    return value if isinstance(value, str) and value else None


def sharp_requested(options: Any, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """How SHARP/CollNet is asked for at this creation (None: it is not): Megatron's ``--use-sharp`` sets
    ``NCCL_COLLNET_ENABLE=1`` while it creates the SHARP group (megatron-core 0.16.1-0.19.2 parallel_state.py
    ``initialize_model_parallel``), a config may set ``collnet_enable``."""
    env = os.environ if env is None else env
    if env.get("NCCL_COLLNET_ENABLE", "") not in ("", "0"):
        return "NCCL_COLLNET_ENABLE=1 (Megatron's --use-sharp / --sharp-enabled-group)"
    config = getattr(options, "config", None)
    if config is not None and getattr(config, "collnet_enable", 0) in (1, True):
        return "config.collnet_enable"
    return None


@dataclass
class OptionNotes:
    """What one rank says about the options of the groups it creates: once per group kind, rank 0 only."""
    rank: int
    said: set = field(default_factory=set)

    def check(self, kind: Optional[str], ranks, user_options: Any, planned_net: Optional[str],
              env: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """Refuse SHARP on a socket group; return the note to log (rank 0, first time for ``kind``) where the
        plan's network replaces the user's ``net_name``."""
        if planned_net == SOCKET_NET:
            how = sharp_requested(user_options, env)
            if how is not None:
                raise ConfigError(f"SHARP (NCCL CollNet) is asked for ({how}) on the {kind or 'unnamed'} group of "
                                  f"ranks {_short(ranks)}, which the plan puts across fabrics on sockets: SHARP "
                                  "runs in one InfiniBand fabric's switches", field="use_sharp",
                                  fix="drop --use-sharp (and --sharp-enabled-group), or plan the data-parallel "
                                      "groups inside one InfiniBand fabric (fix pipeline_model_parallel_size so "
                                      "each fabric holds whole data-parallel groups)")
        wanted = user_net_name(user_options)
        if wanted is None or planned_net is None or wanted.lower() == planned_net.lower():
            return None
        key = kind or "unnamed"
        if key in self.said:
            return None
        self.said.add(key)
        if self.rank != 0:
            return None
        return (f"the plan puts {key} groups (e.g. ranks {_short(ranks)}) on network {planned_net!r}; the "
                f"net_name {wanted!r} from the NCCL communicator config is replaced for them (the plan's "
                "transport decides which network reaches every member); the config's other settings stay")


def _short(ranks) -> str:
    ranks = list(ranks or [])
    return f"{ranks[:8]}{' ...' if len(ranks) > 8 else ''}"
