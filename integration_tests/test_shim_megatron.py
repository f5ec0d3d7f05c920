"""Pipeline training of a tiny Megatron-Core GPT whose stages sit on two emulated vendors.

The plugin places the 4 pipeline stages on 2 'nvidia' + 2 'amd' nodes; the pipeline group (2 + 2)
and the tied-embedding group (1 + 1) span vendors, so het_plugin.megatron creates them with backend
het_shim: activations and gradients cross vendors through host memory, same-vendor neighbours use the
native backend. The reference is plain Megatron-Core (gloo everywhere) with the same layer split.
A second run forces data parallelism across the vendors (dp=4).
"""
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from integration_tests.support.launch import run_ranks  # noqa: E402

SCRIPT = Path(__file__).parent / "ranks" / "shim_megatron.py"
CLUSTER = """
name: shim-two-vendors
clusters:
  - name: nv
    fabric: {type: ib, gbps: 400, latency_us: 2}
    nodes:
      - {count: 2, accelerator: H100, accelerators_per_node: 1, hostnames: [nv-0, nv-1]}
  - name: amd
    fabric: {type: roce, gbps: 200, latency_us: 5}
    nodes:
      - {count: 2, accelerator: MI250X, accelerators_per_node: 1, hostnames: [amd-0, amd-1]}
links:
  - {between: [nv, amd], type: ethernet, gbps: 25, latency_us: 50}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("shim-megatron") / "two-vendors.yaml"
    path.write_text(CLUSTER)
    return path


@pytest.fixture(scope="module")
def pipeline_run(cluster):
    return [o.result for o in run_ranks(SCRIPT, 4, ["--cluster", str(cluster), "--pp", "4"], timeout=120,
                                        ranks_per_node=1)]


@pytest.fixture(scope="module")
def reference(pipeline_run):
    """Plain Megatron-Core (gloo only, no het_plugin), the same 4-stage layer split."""
    split = [0] * 4
    for res in pipeline_run:
        split[res["stage"]] = len(res["layer_numbers"])
    outs = run_ranks(SCRIPT, 4, ["--baseline", "--pp", "4", "--split", ",".join(map(str, split))], timeout=120)
    return outs[0].result["losses"]


@pytest.mark.timeout(300)
def test_pipeline_across_two_vendors_matches_single_vendor_losses(pipeline_run, reference):
    # every pipeline group and the embedding group really are cross-vendor het_shim groups
    for res in pipeline_run:
        assert res["shim_groups"]["pp"] == [[0, 1], [2, 3]], res["shim_groups"]
    ends = [res for res in pipeline_run if res["stage"] in (0, 3)]
    assert len(ends) == 2 and all(res["shim_groups"]["embedding"] == [[0], [1]] for res in ends)
    losses = pipeline_run[0]["losses"]
    assert all(res["losses"] == losses for res in pipeline_run)
    assert len(losses) == 3 and losses[-1] < losses[0]     # it trains
    assert losses == pytest.approx(reference, rel=1e-6, abs=1e-6)


@pytest.mark.timeout(300)
def test_data_parallel_across_two_vendors_with_overlapped_grad_reduce(cluster, reference):
    """dp=4 over 2 + 2 vendors: Megatron's async (overlapped) gradient all-reduce goes through het_shim.

    The tiny trainer computes the same function whatever the layout (weights seeded by global identity,
    the same global batch), so the pipeline reference applies; only the gradient summation order differs.
    """
    outs = [o.result for o in run_ranks(SCRIPT, 4, ["--cluster", str(cluster), "--pp", "1"], timeout=120,
                                        ranks_per_node=1)]
    for res in outs:
        assert res["shim_groups"]["dp"] == [[0, 1], [2, 3]], res["shim_groups"]
        assert res["overlap_grad_reduce"] is True
        assert res["losses"] == pytest.approx(reference, rel=1e-6, abs=1e-6)
