import pytest


@pytest.fixture(autouse=True)
def _no_run_long_group_patches():
    """build_groups leaves Megatron's later group creation on its plan for the run; a test's run ends here."""
    yield
    from het_plugin.megatron.late_groups import uninstall
    uninstall()
