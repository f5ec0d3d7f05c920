"""The launch request (het_plugin.core.request): one value from the adapter to the planner. The planner's request
form and its keyword form plan the same; the request checks its degrees under the user's names."""
from __future__ import annotations

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.launch import Launch, resolve_launch
from het_plugin.core.planner import make_plan
from het_plugin.core.request import LaunchRequest, Schedule, Timeout
from tests.core.test_measured import IB_ROCE_4, tiny_model

NAMES = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size"}


def test_the_request_and_the_keyword_form_make_the_same_plan():
    cluster, model = load_cluster(IB_ROCE_4), tiny_model()
    request = LaunchRequest.of(4, tp=1, pp=2, micro_batch_size=2, names=NAMES, source="command line")
    by_request = make_plan(cluster, model, request)
    assert by_request.hash == make_plan(cluster, model, tp=1, pp=2, micro_batch_size=2).hash
    assert (by_request.tp, by_request.pp, by_request.vpp) == (1, 2, 1)        # vpp not set: not interleaved
    # resolve_launch passes it unchanged; its keyword form builds the same request
    assert resolve_launch(str(IB_ROCE_4), request, model=model).plan.hash == by_request.hash
    assert resolve_launch(str(IB_ROCE_4), launch=Launch(4), degrees=request.degrees, micro_batch_size=2,
                          model=model).plan.hash == by_request.hash


def test_the_request_checks_its_degrees_under_the_users_names():
    with pytest.raises(ConfigError) as e:
        LaunchRequest.of(4, tp=3, pp=1, names=NAMES, source="command line")
    assert e.value.source == "command line" and "--tensor-model-parallel-size" in e.value.field
    request = LaunchRequest.of(8, vpp=2, overlap_p2p_comm=False, timeout=Timeout(30, "--heterogeneous-timeout"))
    assert request.schedule == Schedule(2, False) and request.settings() == {"vpp": 2, "overlap_p2p_comm": False}
    assert (request.degrees.cp, request.degrees.ep, request.launch.world_size) == (1, 1, 8)


def test_make_plan_takes_the_request_or_its_keywords_not_both():
    cluster, model = load_cluster(IB_ROCE_4), tiny_model()
    with pytest.raises(TypeError, match="not both"):
        make_plan(cluster, model, LaunchRequest.of(4), tp=1)
    with pytest.raises(TypeError, match="'tensor_parallel'"):
        make_plan(cluster, model, tensor_parallel=1)
