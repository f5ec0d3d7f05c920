"""``het-plugin wrap-config``: add het_plugin's ``"heterogeneous"`` section to a DeepSpeed config."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..core.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("wrap-config", help="record a heterogeneous plan in a DeepSpeed config (JSON)")
    p.add_argument("config", help="DeepSpeed config (JSON)")
    p.add_argument("--cluster", default="auto",
                   help="cluster file, plan file (het-plugin plan -o), or 'auto' (discover at start-up; default)")
    p.add_argument("--model", help="model file or preset for planning (default: derived from the layer list "
                                   "at start-up)")
    p.add_argument("--pp", type=int, help="pipeline stages of your PipelineModule (default: the planner's choice, "
                                          "or 1 for plain data parallelism)")
    p.add_argument("--tp", type=int, help="tensor (DeepSpeed 'model' axis) degree (default 1)")
    p.add_argument("--layer-pattern", help="regex on layer class names: the layers the plan counts "
                                           "(default: every entry of the layer list)")
    p.add_argument("--no-embed-plan", action="store_true",
                   help="store only the plan's hash; every rank recomputes the plan from the cluster file")
    p.add_argument("--profile-out", metavar="FILE",
                   help="time each pipeline stage while training; rank 0 writes the measured profile to FILE (.yaml "
                        "or .json) every --profile-every iterations and at exit, for `het-plugin plan --profile`")
    p.add_argument("--profile-every", type=int, metavar="N", help="iterations between writes (default 100)")
    p.add_argument("--replan-on-restart", action="store_true",
                   help="with --profile-out and a cluster: the next start re-plans from the profile this run writes, "
                        "for the nodes of that start, and logs the old and new plan and the predicted gain")
    p.add_argument("--resume-from", metavar="DIR",
                   help="with --replan-on-restart: the checkpoint folder the script loads (its load_dir); a re-plan "
                        "that checkpoint would not load under is not taken")
    p.add_argument("--use-all-nodes", action="store_true",
                   help="the run plans with every node it launches (default: a cluster planned at start-up may "
                        "leave node groups out, and a launch including them stops naming them)")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.set_defaults(func=run)


def check_args(args) -> None:
    """Before any planning: degrees in range, the config readable, -o writable and not one of the inputs."""

    from ..core.inputs.cluster import MAX_ACCELERATORS
    from ..core.files import check_writable, same_file
    from ..core.inputs.yamlio import parse_json, read_text
    from .plan import named_by

    for name in ("pp", "tp"):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= MAX_ACCELERATORS:
            raise ConfigError(f"{value} is not between 1 and {MAX_ACCELERATORS:,}", field=f"--{name}",
                              fix=f"pass a whole number from 1 to {MAX_ACCELERATORS:,}, or leave --{name} out")
    with named_by("CONFIG"):
        parse_json(read_text(args.config, "DeepSpeed config"), args.config)
    if args.output:
        for flag, given in (("CONFIG", args.config), ("--cluster", args.cluster), ("--model", args.model)):
            if given and Path(given).exists() and same_file(given, args.output):
                raise ConfigError(f"{args.output} is also the input ({flag}); writing it would destroy that file",
                                  source=args.output, field="-o/--output",
                                  fix="write the wrapped config to another file (e.g. wrapped.json)")
        check_writable(args.output, "-o/--output", "wrapped config")


def run(args) -> int:
    from ..deepspeed.config import SECTION, wrap
    from ..core.files import write_atomic

    check_args(args)
    wrapped = wrap(args.config, cluster=args.cluster, model=args.model, pp=args.pp, tp=args.tp,
                   layer_pattern=args.layer_pattern, embed_plan=not args.no_embed_plan,
                   profile_out=args.profile_out, profile_every=args.profile_every,
                   replan_on_restart=args.replan_on_restart, resume_from=args.resume_from,
                   use_all_nodes=args.use_all_nodes)
    section = wrapped[SECTION]
    if args.output:
        write_atomic(args.output, json.dumps(wrapped, indent=2) + "\n", "wrapped config")
        what = f"plan {section['plan_hash']}" if section["plan_hash"] else "planning at start-up"
        print(f"wrote {args.output} ({what}; degrees tp={section['tp']} pp={section['pp']} dp={section['dp']})",
              file=sys.stderr)
    else:
        json.dump(wrapped, sys.stdout, indent=2)
        sys.stdout.write("\n")
    if not args.use_all_nodes:      # which nodes the config runs on (a cluster file's plan: every node)
        from ..deepspeed.config_nodes import every_node_lines
        for line in every_node_lines(args.config, args.cluster, args.model, section["plan_hash"], pp=args.pp,
                                     tp=args.tp):
            print(f"  {line}", file=sys.stderr)
    return 0
