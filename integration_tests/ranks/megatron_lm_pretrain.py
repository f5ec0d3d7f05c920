"""Rank script playing Megatron-LM's pretrain_gpt.py on the stub tree (TEST ONLY), with the pip hook.

The hook (het_plugin_megatron.pth, installed with het_plugin) is what handles --heterogeneous-nic
here: this script imports nothing from het_plugin before Megatron parses its arguments.
"""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import megatron  # noqa: E402  (the pip megatron-core package)

megatron.__path__.append(str(HERE / "megatron_lm_stub" / "megatron"))

from integration_tests.support.launch import arm_watchdog, report  # noqa: E402


def extra_args_provider(parser):
    """A training script's own flag, as pretrain_gpt.py scripts add them."""
    group = parser.add_argument_group(title="script")
    group.add_argument("--my-script-flag", type=int, default=0)
    return parser


def main() -> int:
    arm_watchdog()
    hooked = any(type(f).__name__ == "MegatronArgsFinder" for f in sys.meta_path)
    if os.environ.get("HET_TEST_PARSE_ONLY"):      # only Megatron's argument parsing, nothing distributed
        from megatron.training.arguments import parse_args
        args = parse_args(extra_args_provider)
        report({"hook_installed": hooked, "args": vars(args),
                "het_plugin_imported": sorted(m for m in sys.modules if m.startswith("het_plugin"))})
        return 0
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron
    initialize_megatron(extra_args_provider=extra_args_provider)
    args = get_args()
    out = {"hook_installed": hooked, "rank": args.rank,
           "args": {k: getattr(args, k, None) for k in (
               "tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_model_parallel_layout",
               "virtual_pipeline_model_parallel_size", "overlap_grad_reduce", "global_batch_size",
               "micro_batch_size", "my_script_flag", "heterogeneous_nic", "data_parallel_size")}}
    if "het_plugin.megatron.core" in sys.modules:
        from het_plugin.megatron.core import current_plan
        from integration_tests.support.megatron_tiny import my_groups
        applied = current_plan()
        if applied is not None:
            out["plan"] = applied.plan.to_dict()
            out["groups"] = my_groups()
    report(out)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
