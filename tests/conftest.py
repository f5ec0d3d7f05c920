import os
from pathlib import Path

import pytest

# Tests not about issue 32's launch refusal plan with every node they launch, as before (tiny models on small example
# clusters would otherwise be planned over node subsets); the tests of the refusal unset it (tests/runtime/test_all_nodes.py).
os.environ.setdefault("HET_PLUGIN_USE_ALL_NODES", "1")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES


@pytest.fixture(scope="module")
def plan8():
    """2 IB + 2 RoCE nodes of 2 ranks, tp=2 pp=2: tp inside a node, dp inside a cluster, pp across 25 GbE."""
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.planner import make_plan
    from megatron_common import DATA, MODEL
    return make_plan(load_cluster(DATA / "megatron-ib-roce-8.yaml"), MODEL, tp=2, pp=2)
