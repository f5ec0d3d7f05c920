"""The pre-flight's result (:class:`het_plugin.core.nccl_env.Preflight`) as shell ``export`` lines and as text:
what ``het-plugin check`` prints."""
from __future__ import annotations

import shlex
from typing import Mapping, Optional

from ..core.nccl_env import Preflight, _names


def render_env(result: Preflight, *, per: str = "node", node: Optional[str] = None) -> str:
    """``export`` lines: per node (``# node NAME``), per cluster (shared lines, then each node's own), or one node."""
    def exports(settings: Mapping[str, str]) -> list[str]:
        return [f"export {k}={_quote(v)}" for k, v in settings.items()]
    lines: list[str] = []
    if node is not None:
        return "\n".join(exports(result.nodes[node].settings)) + "\n"
    if per == "cluster":
        for c, info in result.cluster_settings().items():
            lines.append(f"# cluster {c}: {_names(info['nodes'])}")
            lines += exports(info["common"])
            for n, own in info["per_node"].items():
                lines.append(f"#   node {n} only:")
                lines += ["#   " + x for x in exports(own)]
    else:
        for n, r in result.nodes.items():
            lines.append(f"# node {n}" + (f" (cluster {r.cluster})" if r.cluster else ""))
            lines += exports(r.settings)
    return "\n".join(lines) + "\n"


def _quote(value: str) -> str:
    return shlex.quote(value)


def render_text(result: Preflight) -> str:
    lines = []
    for n, r in result.nodes.items():
        head = f"node {n}" + (f" (cluster {r.cluster}, NICs from {r.source})" if r.cluster else f" ({r.source})")
        lines.append(head)
        for t, used in r.uses.items():
            lines.append(f"  {t:<11} uses {', '.join(used) or 'nothing'}")
        for k, v in r.settings.items():
            lines.append(f"  export {k}={_quote(v)}")
    for w in result.warnings:
        lines.append(f"warning: {w}")
    if result.ok:
        lines.append("pre-flight: ok")
    else:
        lines.append(f"pre-flight: {len(result.refusals)} problem(s) would make NCCL hang or fail; refused")
    return "\n".join(lines) + "\n"
