"""Test measure for megatron-core 0.17+ on Python 3.11 (the 0.19.2 test environment, see Makefile).

megatron-core 0.17+ declares Python >=3.12 but ships cp311 wheels; the only 3.12-only name its
``megatron.training`` imports is ``typing.override`` (PEP 698), which ``typing_extensions`` provides.
Python imports ``sitecustomize`` at start-up when this folder is on PYTHONPATH. Users on 3.12+ need none of this.
"""
import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
