"""Shared by tests/ and integration_tests/: markers set by where a test lives, so no new file can miss one.

* ``megatron`` by file name: the second test pass (``make test``: every Megatron test on the newest megatron-core).
* ``core`` for tests/core and tests/views: the pure core's milliseconds tier (``make test-core``).
"""
import pytest

_CORE_DIRS = ("core", "views")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "megatron" in item.path.name:
            item.add_marker(pytest.mark.megatron)
        parts = item.path.parts
        if len(parts) >= 3 and parts[-3] == "tests" and parts[-2] in _CORE_DIRS:
            item.add_marker(pytest.mark.core)
