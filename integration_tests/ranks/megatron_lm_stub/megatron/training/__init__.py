"""TEST ONLY: a cut-down stand-in for Megatron-LM's ``megatron.training`` (core_v0.16 shape).

Megatron-LM's real ``initialize_megatron`` needs CUDA; this stub keeps the parts het_plugin's hook
touches -- ``arguments.parse_args`` (strict argparse, ``extra_args_provider``), ``validate_args``'s
layout handling, and ``initialize._initialize_distributed`` calling ``mpu.initialize_model_parallel``
-- so the no-patch path runs end to end on CPU. Rank scripts append this folder to ``megatron.__path__``.
"""
_GLOBAL_ARGS = None


def get_args():
    return _GLOBAL_ARGS
