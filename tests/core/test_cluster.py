"""Cluster files: the flat view, and one clear error (file, field path, line, fix) for every bad input."""
from __future__ import annotations

import textwrap

import pytest

from het_plugin.core.inputs import catalog
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.ranks.placement import check_dims, check_world_size
from het_plugin.core.ranks.dims import ParallelDims

GOOD = """\
name: two
clusters:
  - name: ib
    fabric: {type: ib, gbps: 800, latency_us: 2}
    nodes:
      - count: 2
        accelerator: A100-80
        accelerators_per_node: 8
  - name: roce
    fabric: {type: roce, gbps: 400}
    nodes:
      - count: 1
        accelerator: MI300X
        accelerators_per_node: 4
links:
  - {between: [ib, roce], gbps: 25}
"""


def write(tmp_path, text: str, name: str = "cluster.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path, text: str) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    err = info.value
    assert err.source == str(path), "the message must name the file"
    assert err.fix, "every error says how to fix it"
    assert str(path) in str(err) and "fix:" in str(err)
    return err


# ---- the flat view --------------------------------------------------------------------------

def test_flat_view_of_a_good_file(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    assert [n.name for n in c.nodes] == ["ib-0", "ib-1", "roce-0"]
    assert c.world_size == 20
    assert c.node_first_rank == [0, 8, 16]
    assert c.rank_node == [0] * 8 + [1] * 8 + [2] * 4
    assert c.local_rank(17) == 1
    assert c.domains == [("ib", "A100-80"), ("roce", "MI300X")]
    assert c.nodes[2].vendor == "amd" and c.nodes[2].accelerator.memory_gib == 192
    assert c.link(c.nodes[0], c.nodes[1]).kind == "ib"
    assert c.link(c.nodes[0], c.nodes[0]).kind == "local"
    cross = c.link(c.nodes[0], c.nodes[2])
    assert (cross.kind, cross.gbps, cross.latency_us) == ("ethernet", 25, 50.0)   # defaults: Ethernet, 50 us
    assert c.nodes[2].fabric.latency_us == 5.0                                      # fabric default latency
    assert not c.is_homogeneous


def test_node_order_and_hostnames(tmp_path):
    text = GOOD.replace("      - count: 1\n", "      - count: 1\n        hostnames: [amd-box]\n")
    text += "launch: {node_order: [amd-box, ib-1, ib-0]}\n"
    c = load_cluster(write(tmp_path, text))
    assert [n.name for n in c.nodes] == ["amd-box", "ib-1", "ib-0"]
    assert [n.index for n in c.nodes] == [0, 1, 2]
    assert c.rank_node[:4] == [0, 0, 0, 0] and c.rank_node[4] == 1


def test_digest_ignores_formatting_but_not_content(tmp_path):
    a = load_cluster(write(tmp_path, GOOD, "a.yaml"))
    b = load_cluster(write(tmp_path, "# a comment\n" + GOOD.replace("latency_us: 2}", "latency_us: 2.0}"), "b.yaml"))
    c = load_cluster(write(tmp_path, GOOD.replace("gbps: 25", "gbps: 100"), "c.yaml"))
    assert a.digest == b.digest
    assert a.digest != c.digest


def test_default_link_is_the_slower_ethernet_nic(tmp_path):
    text = GOOD.split("links:")[0].replace(
        "accelerators_per_node: 8\n", "accelerators_per_node: 8\n        nics: [{type: ethernet, gbps: 100}]\n").replace(
        "accelerators_per_node: 4\n", "accelerators_per_node: 4\n        nics: [{type: ethernet, gbps: 10}]\n")
    c = load_cluster(write(tmp_path, text))
    link = c.cluster_link("ib", "roce")
    assert (link.kind, link.gbps) == ("ethernet", 10)


def test_custom_accelerator_and_overrides(tmp_path):
    text = GOOD.replace("accelerator: MI300X",
                        "accelerator: {name: X1, vendor: Acme, memory_gib: 32, peak_tflops: 100}\n"
                        "        efficiency: 0.3")
    c = load_cluster(write(tmp_path, text))
    acc = c.nodes[2].accelerator
    assert (acc.name, acc.vendor, acc.memory_gib, acc.peak_tflops, acc.efficiency) == ("X1", "acme", 32, 100, 0.3)


def test_examples_load(examples_dir):
    sizes = {}
    for path in sorted((examples_dir / "clusters").glob("*.yaml")):
        sizes[path.stem] = load_cluster(path).world_size
    assert sizes == {"h100-a100": 64, "h100-old-ethernet": 80, "hethub-mix": 768, "holmes-ib-roce": 64,
                     "homogeneous-ib": 64, "two-clusters-25gbe": 64}
    assert load_cluster(examples_dir / "clusters" / "homogeneous-ib.yaml").is_homogeneous
    assert not load_cluster(examples_dir / "clusters" / "holmes-ib-roce.yaml").is_homogeneous


def test_catalog_has_the_parts_the_issue_names():
    for name in ("A100-40", "A100-80", "H100", "H200", "MI250X", "MI300X", "other-vendor"):
        assert catalog.lookup(name.lower()).name == name
    with pytest.raises(KeyError, match="H100"):
        catalog.lookup("B200")


# ---- bad inputs: one clear message each --------------------------------------------------

def test_unknown_accelerator_lists_the_known_ones(tmp_path):
    err = error_of(tmp_path, GOOD.replace("MI300X", "MI301X"))
    assert err.field == "clusters[1].nodes[0].accelerator (line 13)"
    assert "'MI301X'" in err.problem
    for name in catalog.CATALOG:
        assert name in err.fix


def test_malformed_yaml_names_the_line(tmp_path):
    err = error_of(tmp_path, GOOD.replace("    fabric: {type: roce, gbps: 400}", "    fabric: {type: roce, gbps: 400"))
    assert "malformed YAML at line 11" in err.problem          # where the parser noticed
    assert "flow mapping that starts at line 10" in err.problem  # and where the unclosed '{' is


def test_tab_indentation_is_malformed_yaml(tmp_path):
    err = error_of(tmp_path, GOOD.replace("  - name: roce", "\t- name: roce"))
    assert "line 9" in err.problem and "'\\t'" in err.problem


def test_misspelled_field_suggests_the_right_one(tmp_path):
    err = error_of(tmp_path, GOOD.replace("accelerators_per_node: 4", "accelerator_per_node: 4"))
    assert err.field == "clusters[1].nodes[0].accelerator_per_node (line 14)"
    assert "unknown field 'accelerator_per_node'" in err.problem
    assert "did you mean 'accelerators_per_node'" in err.fix


def test_unknown_top_level_field(tmp_path):
    err = error_of(tmp_path, GOOD + "linkz: []\n")
    assert err.field.startswith("linkz (line 17)")
    assert "links" in err.fix and "clusters" in err.fix


def test_missing_field(tmp_path):
    err = error_of(tmp_path, GOOD.replace("        accelerators_per_node: 4\n", ""))
    assert err.field.startswith("clusters[1].nodes[0].accelerators_per_node")
    assert "missing" in err.problem and err.fix == "add this field"


@pytest.mark.parametrize("old,new,field,fix", [
    ("count: 2", "count: two", "clusters[0].nodes[0].count (line 6)", "whole number"),
    ("count: 2", "count: 0", "clusters[0].nodes[0].count (line 6)", "positive"),
    ("gbps: 25", "gbps: -25", "links[0].gbps (line 16)", "positive"),
    ("type: roce", "type: rocev2", "clusters[1].fabric.type (line 10)", "'ib', 'roce' or 'ethernet'"),
    ("fabric: {type: ib, gbps: 800, latency_us: 2}", "fabric: ib", "clusters[0].fabric (line 4)", "mapping"),
    ("links:\n  - {between", "links:\n  {between", "links (line 15)", "YAML list"),
])
def test_wrong_types_and_values(tmp_path, old, new, field, fix):
    assert old in GOOD
    err = error_of(tmp_path, GOOD.replace(old, new, 1))
    assert err.field == field
    assert fix in err.fix


def test_wrong_type_message_shows_the_value(tmp_path):
    err = error_of(tmp_path, GOOD.replace("count: 2", "count: two"))
    assert "'two'" in err.problem


def test_missing_link_between_clusters(tmp_path):
    err = error_of(tmp_path, GOOD.split("links:")[0])
    assert err.field == "links"
    assert "'ib' and 'roce'" in err.problem
    assert "between: [ib, roce]" in err.fix


def test_link_to_unknown_cluster(tmp_path):
    err = error_of(tmp_path, GOOD.replace("between: [ib, roce]", "between: [ib, rocee]"))
    assert err.field == "links[0].between (line 16)"
    assert "'rocee'" in err.problem and "'roce'" in err.fix


def test_link_listed_twice(tmp_path):
    err = error_of(tmp_path, GOOD + "  - {between: [roce, ib], gbps: 10}\n")
    assert err.field.startswith("links[1]")
    assert "twice" in err.problem


def test_duplicate_cluster_names(tmp_path):
    err = error_of(tmp_path, GOOD.replace("name: roce", "name: ib").replace("[ib, roce]", "[ib, ib]"))
    assert err.field == "clusters[1].name (line 9)"
    assert "'ib' is used twice" in err.problem and "unique" in err.fix


def test_duplicate_hostnames(tmp_path):
    err = error_of(tmp_path, GOOD.replace("      - count: 2\n", "      - count: 2\n        hostnames: [a, a]\n"))
    assert "['a']" in err.problem and "hostname" in err.field


def test_hostnames_count_mismatch(tmp_path):
    err = error_of(tmp_path, GOOD.replace("      - count: 2\n", "      - count: 2\n        hostnames: [a]\n"))
    assert err.field.startswith("clusters[0].nodes[0]")
    assert "1 names" in err.problem and "one hostname per node" in err.fix


@pytest.mark.parametrize("order,words", [
    ("[ib-0, ib-1]", ["missing ['roce-0']"]),
    ("[ib-0, ib-1, roce-0, gpu-9]", ["unknown ['gpu-9']"]),
    ("[ib-0, ib-0, roce-0]", ["missing ['ib-1']", "repeated ['ib-0']"]),
])
def test_bad_node_order(tmp_path, order, words):
    err = error_of(tmp_path, GOOD + f"launch: {{node_order: {order}}}\n")
    assert err.field == "launch.node_order (line 17)"
    for w in words:
        assert w in err.problem
    assert "ib-0, ib-1, roce-0" in err.fix


def test_empty_and_non_mapping_files(tmp_path):
    err = error_of(tmp_path, "")
    assert "empty" in err.problem
    err = error_of(tmp_path, "- just\n- a list\n")
    assert err.field == "(top level)" and "mapping" in err.fix


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_cluster(tmp_path / "nope.yaml")


# ---- degrees and launches that do not fit the file ---------------------------------------

def test_accelerators_per_node_not_divisible_by_tp(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    with pytest.raises(ConfigError) as info:
        check_dims(c, ParallelDims(tp=8, pp=1, dp=2))   # 20 ranks is not 16, but the node check comes first
    err = info.value
    assert err.field == "clusters[1].nodes[0].accelerators_per_node (line 14)"
    assert "roce-0" in err.problem and "tp = 8" in err.problem
    assert "[1, 2, 4]" in err.fix   # divisors of both 8 and 4


def test_cp_sits_inside_a_node_or_on_whole_nodes(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))           # nodes of 8 and of 4 accelerators
    with pytest.raises(ConfigError, match="tp\\*cp = 6 neither divides it nor is a multiple of it"):
        check_dims(c, ParallelDims(tp=2, cp=3, pp=1, dp=3))
    # tp*cp = 8: one 8-node, or two whole 4-nodes (a CP ring across nodes): the node check passes
    with pytest.raises(ConfigError, match="world size is 20"):
        check_dims(c, ParallelDims(tp=4, cp=2, pp=1, dp=5))


def test_degrees_that_do_not_multiply_to_the_world(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    with pytest.raises(ConfigError) as info:
        check_dims(c, ParallelDims(tp=2, pp=2, dp=4))
    assert "= 16, but the world size is 20" in info.value.problem and info.value.source == c.source
    assert "20" in info.value.fix


def test_more_stages_than_layers(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    with pytest.raises(ConfigError) as info:
        check_dims(c, ParallelDims(tp=1, pp=20, dp=1), num_layers=12)
    assert info.value.field.startswith("pp")
    assert "20 stages" in info.value.problem and "pp <= 12" in info.value.fix


def test_launched_world_size_must_match(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    check_world_size(c, 20)
    check_world_size(c, 20, rank=17, local_world_size=4)
    with pytest.raises(ConfigError) as info:
        check_world_size(c, 16)
    err = info.value
    assert "16 ranks were launched" in err.problem and "20 accelerators" in err.problem
    assert "ib: 16, roce: 4" in err.problem
    assert "launch 20 ranks" in err.fix


def test_launched_ranks_per_node_must_match(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    with pytest.raises(ConfigError) as info:
        check_world_size(c, 20, rank=17, local_world_size=8)
    err = info.value
    assert "roce-0" in err.problem and "LOCAL_WORLD_SIZE" in err.problem
    assert err.field == "clusters[1].nodes[0].accelerators_per_node (line 14)"


def test_cluster_from_dict_errors_name_the_source():
    with pytest.raises(ConfigError) as info:
        cluster_from_dict({"clusters": []}, source="discovered")
    assert info.value.source == "discovered" and info.value.field == "clusters"

