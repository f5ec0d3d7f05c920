"""``het-plugin profile``: measure this cluster (layer times per device type, the optimizer step, the fixed
per-iteration work, every link tier) and write a format-2 profile (docs/planner.md, "Measured profiles").

* :mod:`.settings` -- what is measured, decided from the cluster, model and options before any process
  group; memory and TP refusals (pure).
* :mod:`.records` -- what ranks report and how rank 0 turns it into a :class:`~het_plugin.core.inputs.profile.Profile`
  (pure: the measuring math).
* :mod:`.layers`, :mod:`.compute`, :mod:`.links` -- the torch side (imported only when measuring).
* :mod:`.run` -- one launch, every rank: :func:`~.run.profile_launch`.

A runtime package, like ``runtime/``: the torch.distributed calls are here, not in the planning core.
"""
from .records import build_profile, bus_gbps, link_gbps
from .settings import Settings, make_settings

__all__ = ["Settings", "build_profile", "bus_gbps", "link_gbps", "make_settings"]
