"""``het-plugin check``: the mixed-NIC pre-flight. Which HCAs / interfaces every group's transport uses on
each node, the NCCL/gloo settings that make the nodes agree (``--format env``: export lines), and a refusal
(exit status 2) when the environment contradicts the plan (het_plugin.core.nccl_env)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..core.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("check", help="pre-flight for mixed NICs: per-node NCCL settings; refuses an environment "
                                     "that would make NCCL hang")
    p.add_argument("source", nargs="?",
                   help="plan file (checks its groups) or cluster file (checks every group the planner can make); "
                        "optional with --gather")
    p.add_argument("--gather", action="store_true",
                   help="under torchrun: discover every node over the store (as `het-plugin discover --gather`); "
                        "rank 0 prints")
    p.add_argument("--no-discover", action="store_true",
                   help="do not read this node's NICs; use the cluster file's nics only")
    p.add_argument("--sysfs-root", help="read sysfs here instead of /sys (env HET_PLUGIN_SYSFS_ROOT)")
    p.add_argument("--node-name", help="this node's name (env HET_PLUGIN_NODE_NAME; default: the hostname)")
    p.add_argument("--format", choices=["text", "env", "json"], default="text",
                   help="text (default): what each node uses and its settings; env: export lines; json: everything")
    p.add_argument("--per", choices=["node", "cluster"], default="node",
                   help="--format env: one block per node (default), or per cluster (shared lines, then each "
                        "node's own as comments)")
    p.add_argument("--node", help="--format env: only this node's export lines (e.g. eval in a launcher)")
    p.add_argument("--nccl-version", default=None,
                   help="the NCCL/RCCL version the job loads, e.g. 2.21.5 (default: the one this torch loads, "
                        "torch.cuda.nccl.version(); unknown on a CPU build); version-dependent rules follow it")
    p.add_argument("--timeout", type=float, default=None,
                   help="--gather: seconds to wait for the other ranks (default: HET_PLUGIN_TIMEOUT, else 300)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..core.nccl_env import check_launch
    from ..views.nccl_env import render_env, render_text

    from .discover import check_timeout_arg
    check_timeout_arg(args)
    if not args.source and not args.gather:
        raise ConfigError("nothing to check", field="source",
                          fix="pass a plan or cluster file, or run under torchrun with --gather")
    rank, source, views, gids, cluster = 0, None, [], {}, None
    if args.source:
        source, cluster = _load(args.source)
    if args.gather:
        rank, gathered, view = _gather(args)
        if source is None:
            source = gathered
        cluster = gathered
        views = [view]
    elif not args.no_discover:
        from ..discovery import discover_node
        view = discover_node(args.sysfs_root, name=args.node_name,
                             device_index=int(os.environ.get("LOCAL_RANK", "0") or 0))
        known = {n.name for n in (source.nodes if source is not None else [])}
        if view.name in known:
            views = [view]
        else:
            print(f"note: this node ({view.name}) is not in {args.source}; its NICs were not used "
                  "(pass --node-name, or run on a node of the job)", file=sys.stderr)
    for v in views:
        gids[v.name] = _gid_indices(v)
    result = check_launch(source, os.environ, views=views, cluster=cluster, gid_index=gids,
                          nccl_version=_nccl_version(args))
    if args.node is not None and args.node not in result.nodes:
        raise ConfigError(f"no node {args.node!r} with known NICs", field="--node",
                          fix=f"use one of {', '.join(list(result.nodes)[:8]) or '(none)'}")
    if rank == 0:
        if args.format == "json":
            json.dump(result.to_dict(), sys.stdout, indent=1)
            sys.stdout.write("\n")
        elif args.format == "env":
            if result.ok:
                sys.stdout.write(render_env(result, per=args.per, node=args.node))
        else:
            sys.stdout.write(render_text(result))
    who = f" (rank {rank})" if args.gather else ""
    if rank == 0 and args.format != "text":        # text: render_text lists them
        for w in result.warnings:
            print(f"het-plugin check{who}: warning: {w}", file=sys.stderr)
    for r in result.refusals:
        print(f"het-plugin check{who}: refused: {r.text()}", file=sys.stderr)
    return 0 if result.ok else 2


def _nccl_version(args):
    from ..core.nccl_version import parse_version
    from ..runtime.nccl_version import loaded_nccl_version
    if args.nccl_version is None:
        return loaded_nccl_version()
    try:
        return parse_version(args.nccl_version)
    except ValueError as exc:
        raise ConfigError(str(exc), field="--nccl-version", fix="give it as MAJOR.MINOR.PATCH, e.g. 2.21.5") from None


def _load(path: str):
    """(Plan or Cluster, the Cluster whose nics describe the nodes, or None for a plan)."""
    from ..core.plan import Plan
    from ..core.launch import load_source
    loaded = load_source(path)
    if loaded is None:
        raise ConfigError(f"{path!r} means discovery", field="source",
                          fix="run under torchrun with --gather (no source), or pass a cluster file")
    return loaded, (None if isinstance(loaded, Plan) else loaded)


def _gather(args):
    from ..discovery import gather_launch
    rank, found = gather_launch(sysfs_root=args.sysfs_root, node_name=args.node_name, timeout_s=args.timeout)
    return rank, found.cluster, found.view.node


def _gid_indices(view) -> dict:
    from ..discovery.sysfs import roce_v2_gid_index
    out = {}
    for p in view.rdma:
        if p.type == "roce":
            index = roce_v2_gid_index(Path(view.sysfs_root), p.device, p.port)
            if index is not None:
                out[(p.device, p.port)] = index
    return out
