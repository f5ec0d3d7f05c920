"""Shared by tests/ and integration_tests/: the ``megatron`` marker, set by file name so that the second
test pass (``make test``: every Megatron test on the newest megatron-core) cannot miss a new test file."""
import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "megatron" in item.path.name:
            item.add_marker(pytest.mark.megatron)
