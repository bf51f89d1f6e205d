"""Pipeline stages' layers: the LM head counted on the last stage, so a model whose head weighs
several layers gives its last stage fewer; the large models pipeline parallelism is for split
evenly; a partition given by hand must be the model's."""

from __future__ import annotations

import pytest

from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.model.stages import head_layers, layer_counts, stage_layers


def _cfg(**overrides) -> HFModelConfig:
    spec = dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=512, intermediate_size=2048,
                num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    spec.update(overrides)
    return HFModelConfig.from_dict(spec)


def test_the_head_in_layers_is_its_weight_over_a_layers() -> None:
    # 32000 x 512 against 4 x 512^2 + 3 x 512 x 2048 = 4,194,304
    assert head_layers(_cfg()) == 32000 * 512 / 4_194_304
    # Llama-3.1-405B: 126 layers of 16384, a 128256-token vocabulary: the head is under a layer
    big = _cfg(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
               num_attention_heads=128, num_key_value_heads=8)
    assert round(head_layers(big), 3) == 0.659


@pytest.mark.parametrize(("layers", "stages", "head", "counts"), [
    (8, 2, 3.90625, [6, 2]),    # the CPU bench model: its head weighs ~4 layers
    (126, 2, 0.659, [63, 63]),  # 405B: even
    (80, 2, 1.42, [41, 39]),    # Qwen2-72B: one layer fewer on the last stage
    (32, 4, 0.5, [8, 8, 8, 8]),
    (3, 2, 0.89, [2, 1]),       # earlier stages take the extra
    (4, 3, 0.9, [2, 1, 1]),
    (2, 2, 5.0, [1, 1]),        # every stage keeps a layer
    (1, 2, 0.5, [1, 0]),        # fewer layers than stages: one each, from the first
    (7, 1, 9.0, [7]),
])
def test_layer_counts(layers: int, stages: int, head: float, counts: list[int]) -> None:
    assert layer_counts(layers, stages, head) == counts


def test_stage_layers_follow_the_counts_or_a_given_partition() -> None:
    cfg = _cfg()
    assert [stage_layers(cfg, r, 2) for r in range(2)] == [(0, 6), (6, 8)]
    assert [stage_layers(cfg, r, 2, (5, 3)) for r in range(2)] == [(0, 5), (5, 8)]
    with pytest.raises(ValueError, match="pipeline_layer_partition: 4,3 must give each of the 2 stages its layers, "
                                         "8 in all"):
        stage_layers(cfg, 0, 2, (4, 3))
