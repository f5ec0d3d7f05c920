"""Cross-vendor communicator shim: ``import het_plugin.comm`` registers the ``het_shim`` backend.

Groups whose plan transport is ``host-staged`` are created with
``torch.distributed.new_group(ranks, backend=SHIM_BACKEND, pg_options=ShimOptions.from_plan(plan))``
(the adapters do this); a group created by hand may instead rely on :func:`set_vendor_map`,
``HET_PLUGIN_VENDOR_MAP`` or ``HET_PLUGIN_VENDOR``. See docs/shim.md.
"""
import torch.distributed as dist

from .shim_layout import ShimLayout, chunk_bounds
from .shim import SHIM_BACKEND, ShimProcessGroup, ShimUnsupportedError, create_shim_group, register
from .vendors import (ENV_VENDOR, ENV_VENDOR_MAP, ShimOptions, VendorMapError, declared_vendor_map, detect_vendor,
                      parse_vendor_map, set_vendor_map)
from .work import ShimWork

register()


def registered_backend():
    """``SHIM_BACKEND`` when this torch accepted the registration above, else None (the adapters then
    create cross-vendor groups with the default backend and say so)."""
    return SHIM_BACKEND if SHIM_BACKEND in getattr(dist.Backend, "backend_list", []) else None

__all__ = ["SHIM_BACKEND", "ShimProcessGroup", "ShimUnsupportedError", "ShimWork", "ShimLayout", "ShimOptions",
           "VendorMapError", "set_vendor_map", "declared_vendor_map", "detect_vendor", "parse_vendor_map",
           "chunk_bounds", "create_shim_group", "register", "registered_backend", "ENV_VENDOR", "ENV_VENDOR_MAP"]
