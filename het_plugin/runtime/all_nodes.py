"""Whether a launch plans with every node it started (issue 32): the user's ask (a flag, a keyword, a config
option) or, for launches whose scripts cannot change, ``HET_PLUGIN_USE_ALL_NODES=1``.

Without either, a cluster file or discovery is planned over subsets of its node groups
(:mod:`het_plugin.core.subsets`), and a best plan that leaves nodes out stops every rank before any group,
naming the nodes and both fixes (:func:`het_plugin.core.launch.refuse_left_out`).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from ..core.errors import ConfigError

ENV = "HET_PLUGIN_USE_ALL_NODES"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def use_all_nodes(asked: Optional[bool], environ: Optional[Mapping[str, str]] = None) -> bool:
    """``asked`` (True/False: the user's flag, keyword or option) wins; None: ``HET_PLUGIN_USE_ALL_NODES``
    (unset or empty: False, search subsets)."""
    if asked is not None:
        return bool(asked)
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in ("",) + _FALSE:
        return False
    raise ConfigError(f"{ENV}={environ.get(ENV)!r} is not a yes/no value", source="environment", field=ENV,
                      fix=f"set {ENV}=1 (plan with every node launched) or unset it")
