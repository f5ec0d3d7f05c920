"""TEST-ONLY: run an unmodified Megatron-LM training script (megatron.training, megatron-core 0.19) on CPU/gloo.

    python integration_tests/support/megatron_training_cpu.py SCRIPT [megatron arguments ...]

installs the shims below, then runs SCRIPT as ``__main__`` (runpy) with ``sys.argv = [SCRIPT, args...]``,
and prints one ``RESULT <json>`` line per rank at the end (see :func:`rank_report`). Never imported by
het_plugin. Megatron-Core's own CPU shims come from :mod:`integration_tests.support.megatron_cpu`; the
ones here are for exactly the CUDA assumptions of ``megatron.training`` (each names the call that needs it).
"""
from __future__ import annotations

import functools
import runpy
import sys
import types
from pathlib import Path

if __package__ in (None, ""):      # run as a file: the repository root is on PYTHONPATH (launcher)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

_enabled = False
_seen: dict = {"losses": {}, "model": None, "train_samples": [], "train_sampler": None}


class _CudaFor(types.ModuleType):
    """``torch.cuda`` as one Megatron module sees it: the named attributes replaced, the rest torch's own."""

    def __init__(self, cuda, overrides):
        super().__init__("torch.cuda")
        self.__dict__.update(_cuda=cuda, **overrides)

    def __getattr__(self, name):
        return getattr(self._cuda, name)


_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "rand", "randn")


def _on_cpu(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, __import__("torch").device) and device.type == "cuda":
        return "cpu"
    return device


class _TorchFor(types.ModuleType):
    """``torch`` as one Megatron module sees it: ``torch.cuda`` replaced by :class:`_CudaFor`, and tensor
    factories called with ``device='cuda'`` (or a CUDA index) allocate on the CPU."""

    def __init__(self, torch_module, **cuda_overrides):
        super().__init__("torch")
        self.__dict__.update(_torch=torch_module, cuda=_CudaFor(torch_module.cuda, cuda_overrides))

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in _FACTORIES:
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _on_cpu(kwargs["device"])
                return attr(*args, **kwargs)
            return factory
        return attr


def _cuda_type_name(tensor, *args, **kwargs):
    """``Tensor.type()``; with no argument, a CPU tensor answers its CUDA name ('torch.cuda.FloatTensor')."""
    import torch
    name = torch.Tensor.type(tensor, *args, **kwargs)
    if args or kwargs or tensor.is_cuda:
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def enable_training_cpu_shims() -> None:
    """Megatron-Core's CPU shims, then megatron.training's (idempotent)."""
    global _enabled
    if _enabled:
        return
    from integration_tests.support.megatron_cpu import enable_cpu_shims
    enable_cpu_shims()
    import torch
    from megatron.training import initialize, training

    # validate_args reads get_device_arch_version() (torch.cuda.get_device_properties) with TP or CP > 1: Hopper.
    from megatron.training import arguments
    arguments.get_device_arch_version = lambda: 9
    # pretrain -> initialize_megatron asserts torch.cuda.is_available() unless allow_no_cuda=True.
    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    # _initialize_distributed (mpu.initialize_model_parallel), _set_random_seed need torch.cuda.device_count() > 0.
    initialize.torch = _TorchFor(torch, device_count=lambda: 1, set_device=lambda *a, **k: None)
    # _compile_dependencies runs `make` in megatron/core/datasets: the wheel has helpers_cpp built, no Makefile.
    from megatron.core.datasets import utils as dataset_utils
    dataset_utils.compile_helpers = lambda: None
    # set_jit_fusion_options -> _warmup_jit_function runs fused kernels on device='cuda' tensors (tests: unfused).
    initialize._warmup_jit_function = lambda *a, **k: None
    # pretrain all-reduces its start timestamps in torch.tensor(..., device='cuda').
    training.torch = _TorchFor(torch)
    # models.dist_utils._ddp_wrap builds DDP on a side torch.cuda.Stream(): torch's CPU streams (no-op waits).
    from megatron.training.models import dist_utils
    dist_utils.torch = _TorchFor(torch, Stream=torch.cpu.Stream, current_stream=torch.cpu.current_stream,
                                 stream=torch.cpu.stream)
    # get_megatron_optimizer -> FP32Optimizer.__init__ keeps its loss scale in torch.tensor(..., device='cuda').
    from megatron.core.optimizer import optimizer as core_optimizer
    core_optimizer.torch = _TorchFor(torch)
    # optimizer.step -> get_grad_norm_fp32 sums in device='cuda' tensors (also with --clip-grad 0) ...
    from megatron.core.optimizer import clip_grads
    clip_grads.torch = _TorchFor(torch)
    # ... and its l2 norm without TE/apex, megatron.core.utils.local_multi_tensor_l2_norm, returns a 'cuda' tensor.
    if clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm":
        def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
            norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
            return torch.norm(torch.tensor(norms)).view(1).float(), None
        clip_grads.l2_norm_impl = l2_norm
    # train_step -> RerunStateMachine saves torch.cuda.get_rng_state() and all-reduces flags in 'cuda' tensors.
    from megatron.core import rerun_state_machine
    rerun_state_machine.torch = _TorchFor(torch, get_rng_state=lambda *a, **k: torch.get_rng_state(),
                                          set_rng_state=lambda state, *a, **k: torch.set_rng_state(state))
    # DistributedOptimizer.__init__ (plans may use it) takes only params whose type() is 'torch.cuda.*Tensor'.
    from megatron.core.optimizer import distrib_optimizer
    original_init = distrib_optimizer.DistributedOptimizer.__init__

    @functools.wraps(original_init)
    def init_with_cuda_type_names(self, *args, **kwargs):
        own = vars(torch.nn.Parameter).get("type")       # None: Parameter inherits Tensor.type
        torch.nn.Parameter.type = _cuda_type_name
        try:
            original_init(self, *args, **kwargs)
        finally:
            if own is None:
                del torch.nn.Parameter.type
            else:
                torch.nn.Parameter.type = own

    distrib_optimizer.DistributedOptimizer.__init__ = init_with_cuda_type_names
    _enabled = True


def install_report() -> None:
    """Remember each iteration's reported losses and the model, for :func:`rank_report`."""
    from megatron.training import training

    original_log = training.training_log

    @functools.wraps(original_log)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        _seen["losses"][iteration] = {k: float(v) for k, v in loss_dict.items()}
        return original_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)

    training.training_log = training_log
    original_setup = training.setup_model_and_optimizer

    @functools.wraps(original_setup)
    def setup_model_and_optimizer(*args, **kwargs):
        out = original_setup(*args, **kwargs)
        _seen["model"] = out[0]
        return out

    training.setup_model_and_optimizer = setup_model_and_optimizer
    original_loader = training.build_pretraining_data_loader

    @functools.wraps(original_loader)
    def build_pretraining_data_loader(dataset, consumed_samples):
        loader = original_loader(dataset, consumed_samples)
        if loader is None or _seen["train_sampler"] is not None:
            return loader
        _seen["train_sampler"] = type(loader.batch_sampler).__name__
        return _Recording(loader)       # the first loader built is the training one

    training.build_pretraining_data_loader = build_pretraining_data_loader


class _Recording:
    """The training data loader, recording the sample indices of each micro-batch the loop takes from it (a
    DataLoader without workers takes its batch sampler's batches in order)."""

    def __init__(self, loader):
        self._loader = loader

    def __iter__(self):
        indices = iter(self._loader.batch_sampler)
        for batch in self._loader:
            _seen["train_samples"].append(list(next(indices)))
            yield batch

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def rank_report(namespace: dict) -> dict:
    """What this rank ran: its Megatron groups, its transformer layers, the losses, het_plugin's plan."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training import get_args

    from integration_tests.support.megatron_tiny import my_groups

    args = get_args()
    layers = sorted(m.layer_number for chunk in (_seen["model"] or []) for m in chunk.modules()
                    if isinstance(m, TransformerLayer))
    pp_ranks = list(ps._PIPELINE_GLOBAL_RANKS)
    out = {"rank": dist.get_rank(), "groups": my_groups(), "layer_numbers": layers,
           "callback_embedding": namespace["get_embedding_ranks"](pp_ranks),
           "losses": {str(k): v for k, v in sorted(_seen["losses"].items())},
           "hook_installed": any(type(f).__name__ == "MegatronArgsFinder" for f in sys.meta_path),
           "args": {k: getattr(args, k, None) for k in (
               "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
               "pipeline_model_parallel_layout", "overlap_grad_reduce", "global_batch_size",
               "micro_batch_size", "heterogeneous_nic", "use_distributed_optimizer", "calculate_per_token_loss")}}
    out["args"]["pipeline_model_parallel_layout"] = (
        None if args.pipeline_model_parallel_layout is None else str(args.pipeline_model_parallel_layout))
    out["flag_in_args"] = hasattr(args, "heterogeneous_nic")
    from megatron.training import arguments
    patches = sys.modules.get("het_plugin.runtime.patches")       # loaded only where the hook wrapped parse_args
    out["parse_args_wrapped"] = patches is not None and "megatron.hook" in patches.PATCHES.labels(arguments, "parse_args")
    out["het_plugin_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "het_plugin")
    core = sys.modules.get("het_plugin.megatron.mcore")
    applied = core.current_plan() if core is not None else None
    out["plan_hash"] = applied.plan.hash if applied is not None else None
    out["replica"] = applied.replica_share.replica if applied is not None else None
    out["train_sampler"] = _seen["train_sampler"]
    out["train_samples"] = _seen["train_samples"]
    return out


def main(argv: list[str]) -> int:
    arm_watchdog()
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    script = argv[0]
    sys.argv = list(argv)
    enable_training_cpu_shims()
    install_report()
    namespace = runpy.run_path(script, run_name="__main__")
    report(rank_report(namespace))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
