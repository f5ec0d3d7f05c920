"""``het-plugin wrap-config``: add het_plugin's ``"heterogeneous"`` section to a DeepSpeed config."""
from __future__ import annotations

import sys


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
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..deepspeed.config import SECTION, wrap, write_config
    import json

    wrapped = wrap(args.config, cluster=args.cluster, model=args.model, pp=args.pp, tp=args.tp,
                   layer_pattern=args.layer_pattern, embed_plan=not args.no_embed_plan)
    section = wrapped[SECTION]
    if args.output:
        write_config(wrapped, args.output)
        what = f"plan {section['plan_hash']}" if section["plan_hash"] else "planning at start-up"
        print(f"wrote {args.output} ({what}; degrees tp={section['tp']} pp={section['pp']} dp={section['dp']})",
              file=sys.stderr)
    else:
        json.dump(wrapped, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0
