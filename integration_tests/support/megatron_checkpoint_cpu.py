"""TEST-ONLY: what megatron.training's checkpoint save and load (megatron-core 0.19.2) need on CPU and gloo.

Installed by :func:`integration_tests.support.megatron_training_cpu.enable_training_cpu_shims`; never imported
by het_plugin. Each shim names the call that needs it, and says whether it stands in for CUDA (the machine) or
works around a problem of Megatron's own (it would fail on a GPU too, with torch's Adam: the optimizer
megatron-core falls back to without Transformer Engine or apex).
"""
from __future__ import annotations

import functools


def enable_checkpoint_cpu_shims(torch_for) -> None:
    """``torch_for(torch, **cuda_overrides)``: the training shims' module-local ``torch`` stand-in."""
    import torch
    from megatron.training import checkpointing

    # CUDA: get_rng_state saves torch.cuda.get_rng_state() and load_checkpoint restores torch.cuda.set_rng_state();
    # and read_metadata all-reduces the iteration in a device='cuda' tensor. On CPU the "CUDA" generator is the CPU's
    # (saved and restored at the same moments as 'torch_rng_state', so it restores the same state).
    checkpointing.torch = torch_for(torch, get_rng_state=lambda *a, **k: torch.get_rng_state(),
                                    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
                                    empty_cache=lambda: None)

    # MEGATRON 0.19.2 (not CUDA): with torch's Adam (no TE/apex: HAVE_APEX_OR_TE False) DistributedOptimizer.state_dict
    # collects the step from every parameter's state and asserts there is one. load_checkpoint builds the sharded
    # state dict to load into from a fresh optimizer, whose state is still empty: `assert len(steps) == 1` fails on
    # every load of a distributed-optimizer checkpoint (TE's and apex's FusedAdam keep the step in param_groups and
    # take the other branch). Here a fresh parameter gets the state torch's Adam gives it at its first step
    # (step 0, zero moments), which the load then overwrites.
    from megatron.core.optimizer import distrib_optimizer
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        original_state_dict = distrib_optimizer.DistributedOptimizer.state_dict

        @functools.wraps(original_state_dict)
        def state_dict(self):
            inner = self.optimizer
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                for group in inner.param_groups:
                    for p in group["params"]:
                        if not inner.state[p]:
                            inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                              "exp_avg_sq": torch.zeros_like(p)}
            return original_state_dict(self)

        distrib_optimizer.DistributedOptimizer.state_dict = state_dict

        # MEGATRON 0.19.2 (not CUDA), the same optimizer: load_parameter_state_from_fully_reshardable leaves Adam's
        # "step" out of the tensors it hands to _set_main_param_and_optimizer_states ("handled separately": the
        # step comes back through param_groups), but the setter looks up every tensor of the parameter's state,
        # torch's tensor "step" included: KeyError: 'step'. A key the caller left out is skipped, as the setter
        # already skips non-tensor values.
        original_set = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

        class _SkipMissing(dict):
            def __missing__(self, key):
                return None

        @functools.wraps(original_set)
        def set_states(self, model_param, tensors):
            return original_set(self, model_param, _SkipMissing(tensors))

        distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_states

        # MEGATRON 0.19.2 (not CUDA), the same optimizer: DistributedOptimizer.load_state_dict gives every
        # parameter's state one shared tensor as its "step" (`s["step"] = step` in a loop; torch's
        # Optimizer.load_state_dict keeps a float32 tensor as it is), and torch's Adam adds 1 to each parameter's
        # step: the shared one grows by the number of parameters per iteration, and Adam's bias correction goes
        # wrong from the first step after a resume. Each parameter gets its own copy, as torch's Adam keeps them.
        original_load = distrib_optimizer.DistributedOptimizer.load_state_dict

        @functools.wraps(original_load)
        def load_state_dict(self, state_dict):
            out = original_load(self, state_dict)
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
            return out

        distrib_optimizer.DistributedOptimizer.load_state_dict = load_state_dict
