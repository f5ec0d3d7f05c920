"""``het-plugin discover``: this node's NICs and accelerator; with ``--gather`` (under torchrun) the
cluster file every rank of the job would build."""
from __future__ import annotations

import json
import math
import os
import sys

import yaml

from ..core.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("discover", help="show this node's NICs and accelerator; --gather: the whole job's cluster")
    p.add_argument("--gather", action="store_true",
                   help="under torchrun: gather every rank's node over the store and print the cluster file "
                        "(rank 0 prints)")
    p.add_argument("--sysfs-root", help="read sysfs here instead of /sys (env HET_PLUGIN_SYSFS_ROOT)")
    p.add_argument("--node-name", help="this node's name (env HET_PLUGIN_NODE_NAME; default: the hostname)")
    p.add_argument("--links", help="YAML file of links between the discovered clusters (env HET_PLUGIN_LINKS)")
    p.add_argument("--ethernet-gbps", type=float,
                   help="speed assumed for Ethernet NICs that report none (env HET_PLUGIN_ETHERNET_GBPS; default 10)")
    p.add_argument("--format", choices=["text", "yaml", "json"], default=None,
                   help="node view: text (default), yaml or json; --gather always writes a YAML cluster file")
    p.add_argument("-o", "--output", help="--gather: write the cluster file here (rank 0) instead of stdout")
    p.add_argument("--timeout", type=float, default=None,
                   help="--gather: seconds to wait for the other ranks (default: HET_PLUGIN_TIMEOUT, else 300)")
    p.set_defaults(func=run)


def check_timeout_arg(args) -> None:
    """--timeout, when given, is a positive number of seconds (it was passed through to the store as is)."""
    from ..runtime.exchange import check_timeout
    if args.timeout is not None:
        check_timeout(args.timeout, "--timeout")


def check_args(args) -> None:

    check_timeout_arg(args)
    if args.ethernet_gbps is not None:
        from ..core.inputs.cluster import GBPS_RANGE
        lo, hi = GBPS_RANGE
        if not (math.isfinite(args.ethernet_gbps) and lo <= args.ethernet_gbps <= hi):
            raise ConfigError(f"{args.ethernet_gbps} is outside {lo:g} .. {hi:g} Gbit/s", field="--ethernet-gbps",
                              fix="give the speed in Gbit/s, e.g. 25")
    if args.output:
        if not args.gather:
            raise ConfigError("-o writes the cluster file of --gather; without --gather it is not used",
                              field="-o/--output", fix="add --gather (under torchrun), or drop -o")
        from ..core.files import check_writable
        check_writable(args.output, "-o/--output", "cluster file")


def run(args) -> int:
    check_args(args)
    if args.gather:
        return _gather(args)
    from ..discovery import discover_node
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    view = discover_node(args.sysfs_root, name=args.node_name, device_index=local_rank)
    fmt = args.format or "text"
    if fmt == "text":
        print(view.render())
    elif fmt == "json":
        print(json.dumps(view.to_dict(), indent=1))
    else:
        print(yaml.safe_dump(view.to_dict(), sort_keys=False), end="")
    return 0


def _gather(args) -> int:
    from ..discovery import format_yaml, gather_launch

    rank, found = gather_launch(sysfs_root=args.sysfs_root, node_name=args.node_name, links=args.links,
                                unknown_ethernet_gbps=args.ethernet_gbps, timeout_s=args.timeout)
    if rank == 0:
        text = format_yaml(found.data, found.notes)
        if args.output:
            from ..core.files import write_atomic
            write_atomic(args.output, text, "cluster file")
            print(f"cluster file written to {args.output} ({len(found.cluster.nodes)} nodes, "
                  f"{found.cluster.world_size} ranks)", file=sys.stderr)
        else:
            sys.stdout.write(text)
    return 0
