"""TEST-ONLY shims that let Megatron-Core 0.16-0.19 train a GPTModel on CPU with the gloo backend.

Never imported by het_plugin itself. Three CUDA assumptions are bent, nothing else:

1. the pipeline schedules allocate a token counter with a hard-coded ``device="cuda"``: mapped to CPU;
2. pipeline send/receive and DDP's buffers use ``torch.cuda.current_device()`` and
   ``torch.cuda.synchronize()``: they return ``"cpu"`` and do nothing (and ``Tensor.cuda()``, used once
   for the tied embedding, returns the tensor itself; from 0.19 DDP's gradient sync also takes
   ``torch.cuda.current_stream()``: torch's CPU stream, whose waits do nothing);
3. the CUDA RNG tracker (tensor-parallel dropout/initialisation streams) keeps CPU generator states.

What still does not run on CPU: the distributed optimizer and gradient clipping > 0 (both need
CUDA-only multi-tensor kernels). Usage, from a test or a plain script::

    from integration_tests.support.megatron_cpu import enable_cpu_shims
    enable_cpu_shims()          # before building any Megatron model

A MoE model (the local spec's SequentialMLP experts) also needs ``enable_moe_cpu_shims()``: 0.16's missing
Transformer Engine names in moe_utils, and the alltoall token dispatcher's side stream and host copies.
"""
from __future__ import annotations

import contextlib
import types

_enabled = False


def _cpu_device(device):
    if device == "cuda" or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, int):
        return "cpu"
    return device


class _TorchOnCpu(types.ModuleType):
    """A stand-in for ``torch`` inside one Megatron module: factory calls with device='cuda' go to CPU."""

    def __init__(self, torch_module):
        super().__init__("torch")
        self.__dict__["_torch"] = torch_module

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in ("zeros", "ones", "empty", "tensor", "full", "arange"):
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return attr(*args, **kwargs)
            return factory
        if name == "autocast":
            return lambda *a, **k: contextlib.nullcontext()
        return attr


def enable_cpu_shims() -> None:
    """Install the three shims (idempotent)."""
    global _enabled
    if _enabled:
        return
    import torch

    # (2) current device and synchronize: p2p_communication, DDP buffers, finalize_model_grads.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # ... and the tied-embedding setup moves the shared weight with ``.cuda()``: stay on the CPU.
    torch.Tensor.cuda = lambda self, *a, **k: self
    # 0.19+: DDP's bucket-group start_grad_sync takes ``torch.cuda.current_stream()`` to wait for CUDA-graph
    # gradient events (none here): torch's device-agnostic CPU stream, whose waits do nothing.
    torch.cuda.current_stream = lambda *a, **k: torch.cpu.current_stream()

    # (1) hard-coded device="cuda" in the schedules.
    from megatron.core.pipeline_parallel import schedules
    schedules.torch = _TorchOnCpu(torch)

    # (3) the RNG tracker on the CPU generator.
    from megatron.core.tensor_parallel import random as tp_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    tp_random._get_cuda_rng_state = get_state
    tp_random._set_cuda_rng_state = set_state

    def tracker_add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    tp_random.CudaRNGStatesTracker.add = tracker_add
    # model_parallel_cuda_manual_seed calls torch.cuda.manual_seed for the data-parallel stream.
    torch.cuda.manual_seed = lambda seed: None
    _enabled = True


def enable_moe_cpu_shims() -> None:
    """The MoE layer's CPU shims (idempotent; call with ``enable_cpu_shims``, before the first MoE forward).

    megatron-core 0.16's moe_utils imports Transformer Engine's fused MoE kernels in a ``try`` whose
    ``except ImportError`` leaves their names undefined, and ``RouterGatingLinearFunction`` (the router's
    gating GEMM) tests ``te_general_gemm is not None``: a NameError without TE. Define the missing names as
    None, as 0.19's moe_utils does itself, so the router takes its torch.mm path.
    """
    from megatron.core.transformer.moe import moe_utils
    for name in ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    # MoEAlltoAllTokenDispatcher copies its split sizes to the host on a side stream: torch.cuda.Stream() in
    # __init__, torch.cuda.stream(...), record_event().synchronize() in _maybe_dtoh_and_synchronize. On CPU
    # there is one stream and nothing to wait for.
    from megatron.core.transformer.moe import token_dispatcher
    if not isinstance(token_dispatcher.torch, _TorchWithNullStreams):
        token_dispatcher.torch = _TorchWithNullStreams(token_dispatcher.torch)
        # ... and its maybe_move_tensor_to_cpu(split sizes, as_numpy=True) converts only CUDA tensors: CPU split
        # sizes would reach all_to_all_single as tensors (a TypeError). Convert them as on a GPU.
        move = token_dispatcher.maybe_move_tensor_to_cpu

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and getattr(tensor, "device", None) is not None and tensor.device.type == "cpu":
                return tensor.numpy()
            return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


class _NullStream:
    """One CPU 'stream': waits and events do nothing (everything already ran in order)."""

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass


_NULL_STREAM = _NullStream()


class _CudaStreamsOnCpu(types.ModuleType):
    """``torch.cuda`` for one Megatron module, with its stream calls on the single CPU stream."""

    def __init__(self, cuda_module):
        super().__init__("torch.cuda")
        self.__dict__["_cuda"] = cuda_module
        self.__dict__["Stream"] = lambda *a, **k: _NULL_STREAM
        self.__dict__["current_stream"] = lambda *a, **k: _NULL_STREAM
        self.__dict__["stream"] = lambda *a, **k: contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(self._cuda, name)


class _TorchWithNullStreams(types.ModuleType):
    """A stand-in for ``torch`` inside one Megatron module whose ``torch.cuda`` streams are the CPU's."""

    def __init__(self, torch_module):
        super().__init__("torch")
        self.__dict__["_torch"] = torch_module
        self.__dict__["cuda"] = _CudaStreamsOnCpu(torch_module.cuda)

    def __getattr__(self, name):
        return getattr(self._torch, name)
