"""Layers per stage -> pipeline_model_parallel_layout, checked with Megatron-Core's own parser."""
from __future__ import annotations

from pathlib import Path

import pytest

from het_plugin.cluster import load_cluster
from het_plugin.errors import ConfigError
from het_plugin.megatron.pipeline_layout import apply_plan_to_config, layout_for_plan, layout_string
from het_plugin.model import ModelSpec
from het_plugin.planner import assemble_plan
from het_plugin.placement import place
from het_plugin.topology import ParallelDims

DATA = Path(__file__).resolve().parent.parent / "integration_tests" / "data"


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


def _plan(counts, tp=1):
    cluster = load_cluster(DATA / "megatron-ib-roce-4.yaml")
    model = ModelSpec(name="t", num_layers=sum(counts), hidden_size=32, num_attention_heads=4, vocab_size=128,
                      seq_length=16, global_batch_size=8, micro_batch_size=2)
    dims = ParallelDims(tp=tp, pp=len(counts), dp=4 // (tp * len(counts)))
    return assemble_plan(cluster, model, place(cluster, dims), counts, 2)


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
