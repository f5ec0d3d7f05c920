"""Layers per stage -> pipeline_model_parallel_layout, checked with Megatron-Core's own parser."""
from __future__ import annotations

from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.layer_split import virtual_split
from het_plugin.megatron.pipeline_layout import (apply_plan_to_config, layout_for_plan, layout_string,
                                                 virtual_layout_string)
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import assemble_plan
from het_plugin.core.ranks.placement import place
from het_plugin.core.ranks.dims import ParallelDims

DATA = Path(__file__).resolve().parents[2] / "integration_tests" / "data"


def megatron_layout(text: str, pp: int):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    return PipelineParallelLayerLayout(text, pp)


@pytest.mark.parametrize("counts", [[3, 2], [4, 1, 2, 5], [1, 1, 1], [7], [0, 3, 3]])
def test_layout_string_gives_megatron_the_per_stage_counts(counts):
    from megatron.core.transformer.enums import LayerType
    layout = megatron_layout(layout_string(counts), len(counts))
    layout.validate_layer_layout(sum(counts), None)
    assert [row[0].count(LayerType.decoder) for row in layout.layout] == counts
    assert LayerType.embedding in layout.layout[0][0] and LayerType.loss in layout.layout[-1][0]
    assert layout.virtual_pipeline_model_parallel_size == 1


def _plan(counts, tp=1, vpp=1, mtp_layers=0):
    cluster = load_cluster(DATA / "megatron-ib-roce-4.yaml")
    model = ModelSpec(name="t", num_layers=sum(counts), hidden_size=32, num_attention_heads=4, vocab_size=128,
                      seq_length=16, global_batch_size=8, micro_batch_size=2, mtp_layers=mtp_layers)
    dims = ParallelDims(tp=tp, pp=len(counts), dp=4 // (tp * len(counts)))
    return assemble_plan(cluster, model, place(cluster, dims), counts, 2, vpp=vpp, overlap_p2p_comm=vpp > 1)


def test_even_split_leaves_megatrons_default():
    assert layout_for_plan(_plan([2, 2])) is None
    assert layout_for_plan(_plan([3, 1])) == "Ettt|tL"


def test_apply_plan_to_config_dict_and_checks():
    plan = _plan([3, 1])
    cfg = apply_plan_to_config({"num_layers": 4, "pipeline_model_parallel_size": 2}, plan)
    assert cfg["pipeline_model_parallel_layout"] == "Ettt|tL"
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size"):
        apply_plan_to_config({"num_layers": 4, "pipeline_model_parallel_size": 4}, plan)
    with pytest.raises(ConfigError, match="num_layers"):
        apply_plan_to_config({"num_layers": 6, "pipeline_model_parallel_size": 2}, plan)
    with pytest.raises(ConfigError, match="num_layers_in_first_pipeline_stage"):
        apply_plan_to_config({"num_layers": 4, "pipeline_model_parallel_size": 2,
                              "num_layers_in_first_pipeline_stage": 3}, plan)


def test_apply_plan_to_a_real_transformer_config():
    import torch
    from megatron.core.transformer import TransformerConfig
    plan = _plan([3, 1])
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32, use_cpu_initialization=True)
    planned = apply_plan_to_config(config, plan)
    assert str(planned.pipeline_model_parallel_layout) == "Ettt|tL"
    from megatron.core.transformer.enums import LayerType
    assert [row[0].count(LayerType.decoder) for row in planned.pipeline_model_parallel_layout.layout] == [3, 1]


@pytest.mark.parametrize("virtual", [[[2, 1], [1, 2]], [[1, 3, 1], [2, 2, 2], [1, 1, 1]], [[1, 1], [1, 1]],
                                     [[1, 4], [2, 2], [3, 1], [1, 1]], [[0, 2], [1, 0]]])
def test_virtual_layout_gives_megatron_each_ranks_virtual_stages(virtual, monkeypatch):
    """Megatron's parser reads segment k as virtual stage k // pp of rank k % pp; E opens and L closes the
    layout; empty segments are accepted by its validator (het_plugin's plans never have them)."""
    from megatron.core.transformer.enums import LayerType
    pp, vpp = len(virtual), len(virtual[0])
    text = virtual_layout_string(virtual)
    layout = megatron_layout(text, pp)
    layout.validate_layer_layout(sum(map(sum, virtual)), None)
    assert layout.virtual_pipeline_model_parallel_size == vpp
    assert [[chunk.count(LayerType.decoder) for chunk in row] for row in layout.layout] == virtual
    assert layout.layout[0][0][0] == LayerType.embedding and layout.layout[-1][-1][-1] == LayerType.loss
    # the layer numbers run rank by rank within each virtual stage (Megatron's own get_layer_offset, which asks
    # parallel_state whether the pipeline is interleaved)
    from megatron.core import parallel_state
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
    offsets = [[layout.get_layer_offset(vp_stage=c, pp_rank=r) for c in range(vpp)] for r in range(pp)]
    flat = sorted((c, r) for r in range(pp) for c in range(vpp))
    start = 0
    for c, r in flat:
        assert offsets[r][c] == start
        start += virtual[r][c]


def test_virtual_layout_with_mtp_passes_megatrons_mtp_rules():
    """MTP goes in the last virtual stage of the last rank (Megatron: the last virtual stage of a rank, not the
    first rank, all MTP layers together, after every decoder layer)."""
    text = virtual_layout_string([[2, 1], [1, 2]], mtp_layers=2)
    assert text == "Ett|t|t|ttmmL"
    layout = megatron_layout(text, 2)
    assert layout.validate_layer_layout(6, 2) is False        # not "standalone": MTP with the loss


def test_virtual_split_keeps_even_stages_even_and_spares_the_embedding_and_output_chunks():
    assert virtual_split([4, 4], 2) == [[2, 2], [2, 2]]
    assert virtual_split([5, 3], 2) == [[2, 3], [2, 1]]
    assert virtual_split([7, 5, 7], 3) == [[2, 3, 2], [2, 2, 1], [3, 2, 2]]
    with pytest.raises(ValueError, match="fewer than"):
        virtual_split([3, 1], 2)


def test_an_interleaved_plan_becomes_a_layout_and_the_configs_virtual_size():
    plan = _plan([3, 1], vpp=1)
    assert layout_for_plan(plan) == "Ettt|tL"
    even = _plan([4, 4], vpp=2)
    assert even.layers_per_virtual_stage == [[2, 2], [2, 2]] and layout_for_plan(even) is None
    uneven = _plan([5, 3], vpp=2)
    assert layout_for_plan(uneven) == "Ett|tt|ttt|tL"
    cfg = apply_plan_to_config({"num_layers": 8, "pipeline_model_parallel_size": 2}, uneven)
    assert cfg["pipeline_model_parallel_layout"] == "Ett|tt|ttt|tL"
    assert cfg["virtual_pipeline_model_parallel_size"] == 2
    assert cfg["overlap_p2p_comm"] is True and cfg["batch_p2p_comm"] is False
    # an even interleaved split: Megatron's own, the config still gets the virtual size and the overlap
    cfg = apply_plan_to_config({"num_layers": 8, "pipeline_model_parallel_size": 2}, even)
    assert "pipeline_model_parallel_layout" not in cfg and cfg["virtual_pipeline_model_parallel_size"] == 2
    with pytest.raises(ConfigError) as e:
        apply_plan_to_config({"num_layers": 8, "pipeline_model_parallel_size": 2,
                              "virtual_pipeline_model_parallel_size": 4}, uneven)
    assert e.value.field == "virtual_pipeline_model_parallel_size" and "--vpp 4" in e.value.fix
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size"):
        apply_plan_to_config({"num_layers": 4, "pipeline_model_parallel_size": 2,
                              "virtual_pipeline_model_parallel_size": 2}, plan)


def test_an_interleaved_plan_builds_a_real_transformer_config():
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import LayerType
    plan = _plan([5, 3], vpp=2)
    kwargs = apply_plan_to_config(dict(num_layers=8, hidden_size=32, num_attention_heads=4,
                                       pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                       use_cpu_initialization=True), plan)
    config = TransformerConfig(**kwargs)
    assert config.virtual_pipeline_model_parallel_size == 2 and config.overlap_p2p_comm and not config.batch_p2p_comm
    rows = config.pipeline_model_parallel_layout.layout
    assert [[chunk.count(LayerType.decoder) for chunk in row] for row in rows] == plan.virtual_layers == [[2, 3], [2, 1]]
