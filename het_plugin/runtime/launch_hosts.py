"""The launch's hostnames, checked against a plan that leaves nodes out (issue 32), at no extra store round.

A plan made for the kept nodes of a cluster (``Plan.left_out``) must run on exactly those nodes, in its launch
order. The world size alone cannot tell a launch of the kept nodes from one of the right size on the wrong nodes
(a left-out node in, a kept node out), and no rank knows the others' hosts. So every rank sends its hostname with
its plan hash at the plan agreement (:func:`het_plugin.runtime.agreement.agree_on_plan`, ``fact=``), and rank 0,
which gathers every hash anyway, checks the hosts by rank (:func:`het_plugin.core.subsets.check_launch_hosts`)
and publishes the verdict every rank reads: a few bytes more per rank, no request more, and only for a plan that
leaves nodes out (any other plan publishes its hash alone, as before). A refusal stops every rank before any
process group with the nodes and the launch to use.

A rank's host is ``Launch.host`` when the adapter or a test sets it, else ``HET_PLUGIN_NODE_NAME``, else the
hostname (what discovery names the node: :func:`het_plugin.discovery.node.node_name`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..core.launch import Resolved
from ..core.request import Launch
from ..core.subsets import check_launch_hosts
from ..discovery.node import node_name


def this_host(launch: Launch) -> str:
    """The node this rank runs on, by the name a cluster file would give it."""
    return launch.host or node_name()


@dataclass(frozen=True)
class HostCheck:
    """The agreement's per-rank fact for one start: this rank's host, sent only when the plan leaves nodes out."""
    host: str

    def of(self, resolved: Resolved) -> Optional[str]:
        """What this rank sends with its hash (None: nothing, the plan uses every node it was made for)."""
        return self.host if resolved.plan.left_out else None

    @staticmethod
    def judge(resolved: Resolved, hosts: Sequence[Any]) -> None:
        """Rank 0, once every hash agrees: ``hosts[r]`` is rank r's host; raises the ConfigError every rank stops
        with."""
        check_launch_hosts(resolved.plan, [h if isinstance(h, str) else None for h in hosts])
