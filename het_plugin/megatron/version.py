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

# The one statement of the supported versions (README, docs/megatron.md and pyproject's ``megatron`` extra say
# the same; tests/megatron/test_megatron_version.py checks each): megatron-core releases 0.16.x to 0.19.x
# (``make test`` runs 0.16.1, 0.17.0, 0.18.0 and 0.19.2), and Megatron-LM main, which reports the next version,
# 0.20.0, before its release (checked on 2026-12-01). A release 0.20.1 or later is not main: refused.
TESTED = ((0, 16), (0, 19))
MAIN = (0, 20, 0)
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


def is_main(version: str) -> bool:
    """Megatron-LM main: it reports exactly MAIN (with any local or pre-release suffix, e.g. '0.20.0+d98e8a6')."""
    m = re.match(r"\s*(\d+)\.(\d+)\.(\d+)(?!\d)", version)
    return bool(m) and tuple(int(g) for g in m.groups()) == MAIN


def extra_requirement() -> str:
    """What pyproject's ``megatron`` extra requires of megatron-core: the tested releases."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    return f"megatron-core>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


def supported_range() -> str:
    """The statement README and docs/megatron.md carry word for word."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    return (f"megatron-core >={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1} (releases {lo_major}.{lo_minor}.x to "
            f"{hi_major}.{hi_minor}.x) and Megatron-LM main reporting {'.'.join(map(str, MAIN))}")


def check_megatron_version(version: Optional[str] = None) -> str:
    """Raise ConfigError unless ``version`` (default: the installed one) is in the tested range; returns it."""
    version = installed_version() if version is None else version
    if version is None:
        raise ConfigError("megatron.core is not importable (or reports no version)", field="megatron-core",
                          fix='pip install "het_plugin[megatron]" (or put your Megatron-LM checkout on PYTHONPATH)')
    if os.environ.get(ENV_ANY, "") not in ("", "0"):
        return version
    minor = parse(version)
    if minor is not None and (TESTED[0] <= minor <= TESTED[1] or is_main(version)):
        return version
    raise ConfigError(f"megatron-core {version} is outside the range het_plugin is tested with: {supported_range()}",
                      field="megatron-core",
                      fix=f"install a release in that range (pip install 'megatron-core>={TESTED[0][0]}.{TESTED[0][1]},"
                          f"<{TESTED[1][0]}.{TESTED[1][1] + 1}'), or set {ENV_ANY}=1 to try this version anyway")
