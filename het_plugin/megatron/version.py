"""Which Megatron-Core the adapter runs against, checked once before it touches Megatron's internals.

The adapter patches ``RankGenerator.get_ranks`` and ``parallel_state.create_group`` and reads Megatron-LM's
arguments, all internals that move between releases. On a release it was not tested with it stops with
a message naming the version and the tested range, instead of an ``AttributeError`` from deep inside.
"""
from __future__ import annotations

import os
import re
from typing import Optional

from ..core.errors import ConfigError

# Tested releases: megatron-core 0.16.x to 0.19.x (CI runs 0.16.1 and 0.19.2). Megatron-LM main reports the
# next version (0.20.0) before its release; it was checked on 2026-12-01 and is accepted as well.
TESTED = ((0, 16), (0, 19))
MAIN = (0, 20)
ENV_ANY = "HET_PLUGIN_ANY_MEGATRON"


def installed_version() -> Optional[str]:
    """The version Megatron-Core reports (a checkout's ``package_info``, or the wheel's), None if absent."""
    try:
        from megatron.core import package_info
    except ImportError:
        return None
    return str(getattr(package_info, "__version__", None) or "") or None


def parse(version: str) -> Optional[tuple[int, int]]:
    """``'0.19.2+630898f'`` -> ``(0, 19)``; None when it does not start with two numbers."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    return (f"megatron-core >={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1} "
            f"(and Megatron-LM main reporting {MAIN[0]}.{MAIN[1]}.x)")


def check_megatron_version(version: Optional[str] = None) -> str:
    """Raise ConfigError unless ``version`` (default: the installed one) is in the tested range; returns it."""
    version = installed_version() if version is None else version
    if version is None:
        raise ConfigError("megatron.core is not importable (or reports no version)", field="megatron-core",
                          fix='pip install "het_plugin[megatron]" (or put your Megatron-LM checkout on PYTHONPATH)')
    if os.environ.get(ENV_ANY, "") not in ("", "0"):
        return version
    minor = parse(version)
    if minor is not None and (TESTED[0] <= minor <= TESTED[1] or minor == MAIN):
        return version
    raise ConfigError(f"megatron-core {version} is outside the range het_plugin is tested with: {supported_range()}",
                      field="megatron-core",
                      fix=f"install a release in that range (pip install 'megatron-core>={TESTED[0][0]}.{TESTED[0][1]},"
                          f"<{TESTED[1][0]}.{TESTED[1][1] + 1}'), or set {ENV_ANY}=1 to try this version anyway")
