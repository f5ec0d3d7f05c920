"""``het-plugin plan``: compute a plan and show it (report, JSON, or a file)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..errors import ConfigError

DEFAULT_CLUSTER = Path(__file__).resolve().parent.parent / "data" / "clusters" / "holmes-ib-roce.yaml"
DEFAULT_MODEL = "gpt-7.5b"
PROGRESS_AFTER_S = 1.0      # a search shorter than this shows no progress line


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan placement, layer split and transports for a cluster and a model")
    p.add_argument("cluster", nargs="?", default=str(DEFAULT_CLUSTER),
                   help="cluster file (default: the bundled Holmes-shaped example), or a saved plan to show")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model file or preset name (default: gpt-7.5b)")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=None,
                   help="expert model parallel size (Megatron's --expert-model-parallel-size); default: the planner "
                        "chooses among the divisors of the model's num_moe_experts (1 for a dense model)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor parallel size (--expert-tensor-parallel-size); default: tp with --ep, else "
                        "the planner tries 1 and tp")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--vpp", type=int, default=1,
                   help="virtual pipeline stages per rank: Megatron's interleaved schedule "
                        "(--num-virtual-stages-per-pipeline-rank); default 1 (not interleaved)")
    p.add_argument("--profile", metavar="FILE",
                   help="measured profile (layer times, link bandwidths) overriding the analytic estimates; "
                        "format in docs/planner.md")
    p.add_argument("-o", "--output", help="write the plan to this file (.json or .yaml)")
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="text: a readable report; json: the plan itself on stdout")
    p.add_argument("--svg", metavar="FILE",
                   help="also draw the placement (clusters, nodes, ranks coloured by stage, slow links) "
                        "into FILE: .svg, or .png (needs matplotlib)")
    p.set_defaults(func=run)


def check_output_names(args) -> None:
    """Refuse output names we cannot write before spending time on planning."""
    if args.output and Path(args.output).suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"cannot tell the format of {args.output!r}", field="-o/--output",
                          fix="use a name ending in .json or .yaml")
    if args.svg and Path(args.svg).suffix.lower() not in (".svg", ".png"):
        raise ConfigError(f"cannot draw into {Path(args.svg).name!r}", field="--svg",
                          fix="give a file name ending in .svg or .png")


class ProgressLine:
    """The planner's progress as one line on a stream (stderr), shown once the search has run for a second;
    pass it as ``make_plan(..., progress=...)`` and call :meth:`close` when planning ends."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.start, self.shown, self.last = time.monotonic(), False, 0.0

    def __call__(self, done: int, total: int, best_iteration_s: float | None) -> None:
        now = time.monotonic()
        if now - self.start < PROGRESS_AFTER_S or now - self.last < 0.2:
            return
        self.last, self.shown = now, True
        tail = f", best so far {best_iteration_s:.3f} s/iteration" if best_iteration_s is not None else ""
        self.stream.write(f"\rplanning: {done}/{total} degree combinations{tail}   ")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write(f"\rplanning: done in {time.monotonic() - self.start:.1f} s" + " " * 40 + "\n")
            self.stream.flush()


def run(args) -> int:
    from ..plan import Plan
    from ..resolve import load_source, model_from_arg
    from ..planner import make_plan
    from ..report import render_text

    check_output_names(args)
    loaded = load_source(args.cluster)
    if loaded is None:
        raise ConfigError(f"{args.cluster!r} means discovery, which runs inside a launch", field="cluster",
                          fix="pass a cluster file; `het-plugin discover --gather` under torchrun writes one")
    cluster = None
    if isinstance(loaded, Plan):
        # A saved plan: show (or convert, or draw) it without planning again.
        plan = loaded
    else:
        cluster = loaded
        model = model_from_arg(args.model)
        profile = None
        if args.profile:
            from ..profile import load_profile
            profile = load_profile(args.profile)
        show = ProgressLine() if sys.stderr.isatty() else None
        try:
            plan = make_plan(cluster, model, tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep,
                             etp=args.etp, micro_batch_size=args.micro_batch_size, progress=show, profile=profile,
                             vpp=args.vpp)
        finally:
            if show is not None:
                show.close()
    if args.output:
        plan.save(args.output)
    if args.svg:
        from ..svg import draw_plan
        draw_plan(plan, args.svg, cluster)
    if args.format == "json":
        json.dump(plan.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render_text(plan, cluster))
        if args.output:
            print(f"\nplan written to {args.output} (hash {plan.hash})")
        if args.svg:
            print(f"placement picture written to {args.svg}")
    return 0
