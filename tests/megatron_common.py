"""What the Megatron adapter's unit tests share: their test cluster files and the tiny model they plan for."""
from pathlib import Path

from het_plugin.core.inputs.model import ModelSpec

DATA = Path(__file__).resolve().parent.parent / "integration_tests" / "data"
MODEL = ModelSpec(name="t", num_layers=5, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
                  global_batch_size=8, micro_batch_size=2)
