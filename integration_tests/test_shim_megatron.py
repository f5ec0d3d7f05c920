"""Pipeline training of a tiny Megatron-Core GPT whose stages sit on two emulated vendors.

The plugin places the 4 pipeline stages on 2 'nvidia' + 2 'amd' nodes; the pipeline group (2 + 2)
and the tied-embedding group (1 + 1) span vendors, so het_plugin.megatron creates them with backend
het_shim: activations and gradients cross vendors through host memory, same-vendor neighbours use the
native backend. The reference is plain Megatron-Core (gloo everywhere) with the same layer split.
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


@pytest.mark.timeout(200)
def test_pipeline_across_two_vendors_matches_single_vendor_losses(tmp_path):
    cluster = tmp_path / "two-vendors.yaml"
    cluster.write_text(CLUSTER)
    het = [o.result for o in run_ranks(SCRIPT, 4, ["--cluster", str(cluster), "--pp", "4"], timeout=90,
                                        ranks_per_node=1)]
    # every pipeline group and the embedding group really are cross-vendor het_shim groups
    for res in het:
        assert res["shim_groups"]["pp"] == [[0, 1], [2, 3]], res["shim_groups"]
    ends = [res for res in het if res["stage"] in (0, 3)]
    assert len(ends) == 2 and all(res["shim_groups"]["embedding"] == [[0], [1]] for res in ends)
    split = [0] * 4
    for res in het:
        split[res["stage"]] = len(res["layer_numbers"])
    ref = [o.result for o in run_ranks(SCRIPT, 4, ["--baseline", "--pp", "4", "--split", ",".join(map(str, split))],
                                       timeout=90)]
    het_losses, ref_losses = het[0]["losses"], ref[0]["losses"]
    assert all(res["losses"] == het_losses for res in het)
    assert len(het_losses) == 3 and het_losses[-1] < het_losses[0]     # it trains
    assert het_losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
