"""A wrongly declared vendor map, or an unsupported call, stops every rank with a clear message."""
from pathlib import Path

import pytest

from integration_tests.support.launch import run_ranks

RANKS = Path(__file__).parent / "ranks"


@pytest.fixture(scope="module")
def outcomes():
    outs = run_ranks(RANKS / "shim_errors.py", 4, env={"HET_PLUGIN_TIMEOUT": "4"}, timeout=90)
    return [o.result for o in outs]


def _same_error_everywhere(outcomes, scenario, *fragments):
    messages = set()
    for rank, res in enumerate(outcomes):
        got = res[scenario]
        assert got["error"] == "VendorMapError", f"rank {rank}: {got}"
        assert got["is_config_error"]
        for fragment in fragments:
            assert fragment in got["message"], f"rank {rank}: {got['message']}"
        messages.add(got["message"])
    assert len(messages) == 1, messages        # every rank stops with the same explanation


@pytest.mark.timeout(120)
def test_ranks_that_disagree_are_named(outcomes):
    _same_error_everywhere(outcomes, "disagree", "declare different vendor maps", "rank(s) [0] say",
                           "rank(s) [1, 2, 3] say", "fix:")


@pytest.mark.timeout(120)
def test_map_naming_a_rank_outside_the_job(outcomes):
    _same_error_everywhere(outcomes, "outside", "rank(s) [7]", "outside the job's 4 ranks")


@pytest.mark.timeout(120)
def test_map_declared_by_some_ranks_only(outcomes):
    _same_error_everywhere(outcomes, "partial", "rank(s) [1] declared a vendor map", "rank(s) [0, 2, 3] did not")


@pytest.mark.timeout(120)
def test_env_vendor_contradicting_the_map(outcomes):
    _same_error_everywhere(outcomes, "contradicts", "rank 2 is 'amd' (HET_PLUGIN_VENDOR)", "map says 'nvidia'")


@pytest.mark.timeout(120)
def test_member_that_never_arrives_is_named_not_waited_for(outcomes):
    for res in outcomes[:3]:
        assert res["absent"]["error"] == "VendorMapError"
        assert "rank(s) 3 never reached" in res["absent"]["message"]
    assert "absent" not in outcomes[3]


@pytest.mark.timeout(120)
def test_unsupported_calls_name_operation_and_workaround(outcomes):
    for res in outcomes:
        assert res["all_to_all"]["error"] == "ShimUnsupportedError"
        assert "all_to_all_single" in res["all_to_all"]["message"]
        assert "inside one vendor" in res["all_to_all"]["message"]
        assert "BAND" in res["band"]["message"] and "MIN/MAX" in res["band"]["message"]
        assert res["gather"]["error"] == "ShimUnsupportedError" and "all_gather_into_tensor" in res["gather"]["message"]
        assert res["after"] == [10.0, 10.0, 10.0]   # 1+2+3+4: the group still works afterwards
