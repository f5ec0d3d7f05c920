"""``het-plugin profile``: under a launcher (torchrun, deepspeed, ``het-plugin emulate``), measure this cluster
and write a measured profile for ``het-plugin plan --profile`` (het_plugin.tools.profiler does the measuring)."""
from __future__ import annotations

import re
import sys

from ..core.errors import ConfigError

SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure this cluster's layer times and links (run on every rank, e.g. "
                                       "torchrun --no-python het-plugin profile ...) and write a profile file")
    p.add_argument("cluster", help="cluster file of this launch, or 'discover' (every rank's node, gathered)")
    p.add_argument("--model", required=True, help="model file or preset name whose layers are timed")
    p.add_argument("-o", "--output", default="profile.yaml",
                   help="profile file rank 0 writes (.yaml or .json; default profile.yaml)")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and short windows: a minute-scale run (micro-batches 1,2; messages 64K,16M; "
                        "0.1 s per point)")
    p.add_argument("--micro-batch-sizes", metavar="N,N,...",
                   help="micro-batch sizes timed (default 1,2,4,8 and the model file's micro_batch_size)")
    p.add_argument("--tp", metavar="N,N,...", help="TP degrees timed (default: every one that fits a node)")
    p.add_argument("--message-sizes", metavar="SIZE,...",
                   help="link message sizes, bytes or with K/M/G (powers of 1024): default 64K,1M,16M,64M")
    p.add_argument("--window", type=float, help="seconds each point is timed for (default 0.5; --quick 0.1)")
    p.add_argument("--layers", choices=["auto", "megatron", "torch"], default="auto",
                   help="whose layers are timed: megatron (Megatron-Core's own), torch (plain blocks of the model's "
                        "shape), auto (default: Megatron-Core on CUDA when installed, else torch)")
    p.add_argument("--no-links", dest="links", action="store_false", help="time the compute only")
    p.add_argument("--no-compute", dest="compute", action="store_false", help="time the links only")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any rank waits for the others (default: HET_PLUGIN_TIMEOUT, else 300)")
    p.set_defaults(func=run)


def int_list(text: str | None, field: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{text!r} is not comma-separated whole numbers", field=field,
                          fix=f"e.g. {field} 1,2,4") from None


def size_list(text: str | None) -> list[int] | None:
    """``64K,1M,16777216`` -> bytes (K, M, G are powers of 1024)."""
    if text is None:
        return None
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = SIZE.match(part)
        if not m:
            raise ConfigError(f"{part!r} is not a size", field="--message-sizes",
                              fix="give bytes, or a number with K, M or G (powers of 1024), e.g. 64K,1M,16M")
        out.append(int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])
    return out


def run(args) -> int:
    from ..tools.profiler import make_settings
    from ..core.launch import model_from_arg
    from .discover import check_timeout_arg
    from .plan import named_by

    check_timeout_arg(args)
    with named_by("--model"):
        model = model_from_arg(args.model)
    settings = make_settings(quick=args.quick, micro_batch_sizes=int_list(args.micro_batch_sizes,
                                                                          "--micro-batch-sizes"),
                             message_sizes=size_list(args.message_sizes), tp=int_list(args.tp, "--tp"),
                             window_s=args.window, compute=args.compute, links=args.links,
                             layers=args.layers, model_micro_batch=model.micro_batch_size)
    from ..tools.profiler.run import profile_launch
    outcome = profile_launch(args.cluster, model, settings, args.output, timeout_s=args.timeout)
    if outcome.profile is not None:
        prof = outcome.profile
        print(f"profile written to {args.output} in {outcome.seconds:.0f} s: {len(prof.compute)} compute points, "
              f"{len(prof.links)} links, {len(prof.optimizer)} optimizer and {len(prof.overhead)} overhead entries "
              f"(use: het-plugin plan CLUSTER --model {args.model} --profile {args.output})", file=sys.stderr)
    return 0
