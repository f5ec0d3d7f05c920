"""``het-plugin plan``: compute a plan and show it (report, JSON, or a file)."""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..core.errors import ConfigError
from ..core.ranks.dims import DEFAULT_ORDER, parse_order

DEFAULT_CLUSTER = Path(__file__).resolve().parent.parent / "core" / "inputs" / "presets" / "clusters" / "holmes-ib-roce.yaml"
DEFAULT_MODEL = "gpt-7.5b"
PROGRESS_AFTER_S = 1.0      # a search shorter than this shows no progress line


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan placement, layer split and transports for a cluster and a model")
    p.add_argument("cluster", nargs="?", default=str(DEFAULT_CLUSTER),
                   help="cluster file (default: the bundled Holmes-shaped example), or a saved plan to show")
    p.add_argument("--model", help="model file or preset name (default: gpt-7.5b)")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--cp", type=int, help="context parallel size (default 1)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert model parallel size (Megatron's --expert-model-parallel-size); default: the planner "
                        "chooses among the divisors of the model's num_moe_experts (1 for a dense model)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor parallel size (--expert-tensor-parallel-size); default: tp with --ep, else "
                        "the planner tries 1 and tp")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--vpp", type=int,
                   help="virtual pipeline stages per rank: Megatron's interleaved schedule "
                        "(--num-virtual-stages-per-pipeline-rank); default 1 (not interleaved)")
    p.add_argument("--order", default=None,
                   help="Megatron's rank order: tp-cp-ep-dp-pp (default) or tp-cp-ep-pp-dp (Megatron-LM's "
                        "--use-tp-pp-dp-mapping)")
    p.add_argument("--no-overlap-p2p-comm", dest="overlap_p2p_comm", action="store_false", default=None,
                   help="with --vpp: plan for Megatron's interleaved schedule without p2p overlap "
                        "(Megatron-LM's --no-overlap-p2p-communication)")
    p.add_argument("--replica-split", metavar="auto|even|uneven|N,N,...", default=None,
                   help="micro-batches per data-parallel replica: auto (default: by each replica's speed where "
                        "replicas run on different devices and it pays, else the frameworks' even split), even, "
                        "uneven (only plans with uneven shares), or one count per replica (dp = their number)")
    p.add_argument("--profile", metavar="FILE",
                   help="measured profile (layer times, link bandwidths) overriding the analytic estimates; "
                        "format in docs/planner.md")
    p.add_argument("--use-all-nodes", action="store_true",
                   help="plan with every node of the cluster file (default: the planner may leave out node groups "
                        "that only slow the job down; the report says which and why)")
    p.add_argument("--objective", choices=["time", "cost"], default=None,
                   help="time (default): the shortest predicted iteration; cost: the cheapest iteration at the "
                        "cluster file's price_per_device_hour, devices included")
    p.add_argument("--min-throughput", type=float, metavar="TOKENS_PER_S",
                   help="with --objective cost: only plans predicted to reach this many tokens/s")
    p.add_argument("--hostfile-out", metavar="FILE",
                   help="write the plan's nodes as a DeepSpeed hostfile ('host slots=N', launch order)")
    p.add_argument("--nodes-out", metavar="FILE",
                   help="write the plan's nodes, one hostname a line in node_rank order (torchrun, Slurm)")
    p.add_argument("-o", "--output", help="write the plan to this file (.json or .yaml)")
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="text: a readable report; json: the plan itself on stdout")
    p.add_argument("--svg", metavar="FILE",
                   help="also draw the placement (clusters, nodes, ranks coloured by stage, slow links) "
                        "into FILE: .svg, or .png (needs matplotlib)")
    p.add_argument("--timeline", metavar="FILE",
                   help="also draw the predicted 1F1B schedule per stage (forward, backward, sends, gradient "
                        "reduction, bubbles; with a measured --profile the measured stage times beside it) into "
                        "FILE: .svg, or .png (needs matplotlib)")
    p.set_defaults(func=run)


# Options that shape a plan; with a saved plan they must agree with it (or be left out).
PLAN_OPTIONS = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "micro_batch_size")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_numbers(args) -> None:
    """Degrees and the micro-batch size are whole numbers from 1 up to a limit (0 was taken and ignored)."""
    from ..core.inputs.cluster import MAX_ACCELERATORS
    from ..core.inputs.model import LIMITS
    for name in PLAN_OPTIONS:
        value = getattr(args, name, None)
        if value is None:
            continue
        limit = {"micro_batch_size": LIMITS["micro_batch_size"], "vpp": LIMITS["num_layers"]}.get(name, MAX_ACCELERATORS)
        if not 1 <= value <= limit:
            raise ConfigError(f"{value} is not between 1 and {limit:,}", field=_flag(name),
                              fix=f"pass a whole number from 1 to {limit:,}, or leave {_flag(name)} out and the "
                                  "planner chooses it")


def check_order(args) -> None:
    """--order names Megatron's five parallel dimensions, each at most once (checked before planning)."""
    if args.order is None:
        return
    try:
        parse_order(args.order, args.ep or 1)
    except ValueError as exc:
        raise ConfigError(str(exc), field="--order",
                          fix="pass tp-cp-ep-dp-pp (Megatron's default) or tp-cp-ep-pp-dp (--use-tp-pp-dp-mapping)") \
            from None


@contextmanager
def named_by(option: str):
    """A file-level error (missing, a directory, not UTF-8, ...) names the option that passed the file."""
    try:
        yield
    except ConfigError as exc:
        if exc.field:
            raise
        raise ConfigError(exc.problem, source=exc.source, field=option, fix=exc.fix) from None


def check_files(args) -> None:
    """No output may overwrite an input, and every output must be writable: both checked before planning."""
    from ..core.files import check_writable, same_file
    inputs = [("CLUSTER", args.cluster), ("--model", args.model), ("--profile", args.profile)]
    for out_flag, out in (("-o/--output", args.output), ("--svg", args.svg),
                          ("--timeline", getattr(args, "timeline", None)),
                          ("--hostfile-out", getattr(args, "hostfile_out", None)),
                          ("--nodes-out", getattr(args, "nodes_out", None))):
        if not out:
            continue
        for in_flag, given in inputs:
            if given and Path(given).exists() and same_file(given, out):
                raise ConfigError(f"{out} is also the input ({in_flag}); writing it would destroy that file",
                                  source=out, field=out_flag, fix=f"write {out_flag.split('/')[0]} to another file")
        check_writable(out, out_flag, "plan" if out_flag.startswith("-o") else
                       "node list" if out_flag.endswith("-out") else "picture")
    if getattr(args, "timeline", None) and args.svg and same_file(args.timeline, args.svg):
        raise ConfigError(f"--timeline and --svg both name {args.svg}", source=args.svg, field="--timeline",
                          fix="give the two pictures different files")


def replica_split_arg(text: str | None):
    """``--replica-split``: a mode, or comma-separated counts (checked by the planner, which names the numbers)."""
    if text is None:
        return "auto"
    text = text.strip()
    if text in ("auto", "even", "uneven"):
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--replica-split {text!r} is neither auto, even, uneven nor comma-separated whole "
                          "numbers", field="--replica-split",
                          fix="e.g. --replica-split even, or --replica-split 6,6,2,2 (one count per replica)") from None


def check_node_options(args) -> None:
    """--min-throughput goes with --objective cost; the objectives choose among subsets, --use-all-nodes has none."""
    if getattr(args, "min_throughput", None) is not None and getattr(args, "objective", None) != "cost":
        raise ConfigError("--min-throughput was passed without --objective cost (the time objective takes the "
                          "fastest plan anyway)", field="--min-throughput", fix="add --objective cost, or drop it")
    if getattr(args, "min_throughput", None) is not None and not 0 < args.min_throughput < float("inf"):
        raise ConfigError(f"--min-throughput {args.min_throughput:g} is not a positive number of tokens/s",
                          field="--min-throughput", fix="give tokens per second, e.g. 100000")


def check_saved_plan(args, plan) -> None:
    """A saved plan is shown as it is: options that would change it are refused, not ignored."""
    for flag, given in (("--use-all-nodes", getattr(args, "use_all_nodes", False)),
                        ("--objective", getattr(args, "objective", None)),
                        ("--min-throughput", getattr(args, "min_throughput", None))):
        if given not in (None, False):
            raise ConfigError(f"{flag} was passed, but a saved plan is shown as it is (it uses "
                              f"{len(plan.nodes)} nodes)", source=args.cluster, field=flag,
                              fix=f"drop {flag}, or re-plan from the cluster file: het-plugin plan CLUSTER {flag} "
                                  "... -o PLAN")
    if getattr(args, "replica_split", None) is not None:
        raise ConfigError("--replica-split was passed, but a saved plan is shown as it is (its replica split is "
                          f"{plan.replica_counts if plan.uneven_replicas else 'even'})", source=args.cluster,
                          field="--replica-split",
                          fix="drop --replica-split, or re-plan from the cluster file: het-plugin plan CLUSTER "
                              "--replica-split ... -o PLAN")
    for name in PLAN_OPTIONS:
        given = getattr(args, name, None)
        planned = getattr(plan, name, None)
        if name == "etp" and planned == 0:       # a hand-written plan's 0 means "= tp"
            planned = plan.tp
        if given is not None and given != planned:
            raise ConfigError(f"{_flag(name)} {given} was passed, but the saved plan has {name}={planned}; a saved "
                              "plan is shown as it is", source=args.cluster, field=_flag(name),
                              fix=f"drop {_flag(name)}, or re-plan from the cluster file: het-plugin plan CLUSTER "
                                  f"{_flag(name)} {given} -o PLAN")
    if args.order is not None and "-".join(parse_order(args.order, plan.ep)) != plan.order:
        raise ConfigError(f"--order {args.order} was passed, but the saved plan has order={plan.order}; a saved plan "
                          "is shown as it is", source=args.cluster, field="--order",
                          fix=f"drop --order, or re-plan from the cluster file: het-plugin plan CLUSTER --order "
                              f"{args.order} -o PLAN")
    if args.overlap_p2p_comm is False and plan.overlap_p2p_comm:
        raise ConfigError("--no-overlap-p2p-comm was passed, but the saved plan assumed p2p overlap; a saved plan is "
                          "shown as it is", source=args.cluster, field="--no-overlap-p2p-comm",
                          fix="drop it, or re-plan from the cluster file with --no-overlap-p2p-comm -o PLAN")
    if getattr(args, "timeline", None):
        raise ConfigError("--timeline needs the cluster file (the predictor works out the schedule on it), but "
                          "a saved plan was given", source=args.cluster, field="--timeline",
                          fix="re-plan from the cluster file: het-plugin plan CLUSTER --timeline FILE (with the "
                              "saved plan's options)")
    if args.profile:
        raise ConfigError("--profile was passed, but a saved plan is shown as it is (nothing is planned)",
                          source=args.cluster, field="--profile",
                          fix="drop --profile, or re-plan from the cluster file: het-plugin plan CLUSTER --profile FILE")
    if args.model is not None:
        from ..core.launch import model_from_arg
        with named_by("--model"):
            spec = model_from_arg(args.model).model_dump()
        saved = plan.model or {}
        differ = [k for k in sorted(set(spec) | set(saved)) if spec.get(k) != saved.get(k)]
        if differ:
            k = differ[0]
            raise ConfigError(f"--model {args.model} has {k}={spec.get(k)!r}, the saved plan was made for "
                              f"{k}={saved.get(k)!r}", source=args.cluster, field="--model",
                              fix="drop --model to show the plan as saved, or re-plan for this model: het-plugin plan "
                                  "CLUSTER --model MODEL -o PLAN")


def check_output_names(args) -> None:
    """Refuse output names we cannot write before spending time on planning."""
    if args.output and Path(args.output).suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"cannot tell the format of {args.output!r}", field="-o/--output",
                          fix="use a name ending in .json or .yaml")
    for flag, out in (("--svg", args.svg), ("--timeline", getattr(args, "timeline", None))):
        if out and Path(out).suffix.lower() not in (".svg", ".png"):
            raise ConfigError(f"cannot draw into {Path(out).name!r}", field=flag,
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
    from ..core.plan import Plan
    from ..core.launch import load_source, model_from_arg
    from ..core.planner import make_plan
    from ..core import subsets
    from ..views.report import render_text

    check_output_names(args)
    check_numbers(args)
    check_node_options(args)
    check_order(args)
    replica_split = replica_split_arg(getattr(args, "replica_split", None))
    check_files(args)
    with named_by("CLUSTER"):
        loaded = load_source(args.cluster)
    if loaded is None:
        raise ConfigError(f"{args.cluster!r} means discovery, which runs inside a launch", field="cluster",
                          fix="pass a cluster file; `het-plugin discover --gather` under torchrun writes one")
    cluster = None
    profile = None
    if isinstance(loaded, Plan):
        # A saved plan: show (or convert, or draw) it without planning again.
        plan = loaded
        check_saved_plan(args, plan)
    else:
        cluster = loaded
        args.cp = 1 if args.cp is None else args.cp
        args.vpp = 1 if args.vpp is None else args.vpp
        with named_by("--model"):
            model = model_from_arg(DEFAULT_MODEL if args.model is None else args.model)
        if args.profile:
            from ..core.inputs.profile import load_profile
            with named_by("--profile"):
                profile = load_profile(args.profile)
        show = ProgressLine() if sys.stderr.isatty() else None
        try:
            plan = subsets.plan_nodes(
                cluster, model, use_all_nodes=getattr(args, "use_all_nodes", False),
                objective=getattr(args, "objective", None) or "time",
                min_tokens_per_s=getattr(args, "min_throughput", None), plan_fn=make_plan,
                tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep, etp=args.etp,
                micro_batch_size=args.micro_batch_size, progress=show, profile=profile, vpp=args.vpp,
                replica_split=replica_split, order=args.order or DEFAULT_ORDER, overlap_p2p_comm=args.overlap_p2p_comm)
        except ConfigError as exc:
            if exc.field not in ("replica_split", "min_throughput", "objective"):
                raise
            field = {"replica_split": "--replica-split", "min_throughput": "--min-throughput"}.get(exc.field,
                                                                                                  "--objective")
            raise ConfigError(exc.problem, source=exc.source, field=field, fix=exc.fix) from None
        finally:
            if show is not None:
                show.close()
        cluster = subsets.kept_cluster(cluster, plan)     # what the pictures and the measured lines re-predict on
    if args.output:
        plan.save(args.output)
    written = []
    for flag, out, text in (("--hostfile-out", getattr(args, "hostfile_out", None), subsets.deepspeed_hostfile),
                            ("--nodes-out", getattr(args, "nodes_out", None), subsets.node_list)):
        if out:
            try:
                Path(out).write_text(text(plan))
            except OSError as exc:
                raise ConfigError(f"cannot write the node list: {exc.strerror or exc}", source=out, field=flag,
                                  fix="choose a folder you can write to") from None
            written.append(f"{'DeepSpeed hostfile' if flag == '--hostfile-out' else 'node list'} written to {out} "
                           f"({len(plan.nodes)} nodes)")
    if args.svg:
        from ..views.svg import draw_plan
        try:
            draw_plan(plan, args.svg, cluster)
        except OSError as exc:
            raise ConfigError(f"cannot write the picture: {exc.strerror or exc}", source=args.svg, field="--svg",
                              fix="choose a folder you can write to (and that has space)") from None
    timeline = getattr(args, "timeline", None)
    if timeline:
        from ..views.timeline import draw_timeline
        try:
            draw_timeline(plan, timeline, cluster, profile)
        except OSError as exc:
            raise ConfigError(f"cannot write the picture: {exc.strerror or exc}", source=timeline, field="--timeline",
                              fix="choose a folder you can write to (and that has space)") from None
    if args.format == "json":
        json.dump(plan.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render_text(plan, cluster))
        if profile is not None and profile.measured is not None:
            print()
            print("\n".join(measured_comparison(plan, cluster, profile)))
        if args.output:
            print(f"\nplan written to {args.output} (hash {plan.hash})")
        if args.svg:
            print(f"placement picture written to {args.svg}")
        if timeline:
            print(f"schedule picture written to {timeline}")
        for line in written:
            print(line)
    return 0


def measured_comparison(plan, cluster, profile) -> list[str]:
    """The report's measured-run section (a profile written by a training run): predicted against measured per
    stage and, where the new plan has the run's degrees and stage devices, the run's split predicted with the
    profile on the new plan's placement."""
    from ..core.cost.measured import comparison_lines, stage_devices
    run = profile.measured
    repredicted = None
    if ((plan.pp, plan.tp, plan.micro_batch_size, plan.vpp) == (len(run.layers_per_stage), run.tp,
                                                                run.micro_batch_size, 1)
            and all(st.device in d.split("+") for st, d in zip(run.stages, stage_devices(plan)))):
        from ..core.cost.plan_costs import split_costs
        try:
            repredicted = split_costs(plan, cluster, profile).predict(run.layers_per_stage).stage_compute_s
        except (ValueError, ConfigError):
            repredicted = None
    return comparison_lines(run, plan, repredicted, profile)
