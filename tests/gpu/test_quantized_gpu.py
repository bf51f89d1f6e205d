"""Quantized weights on a GPU (skipped without CUDA): weight-only layers through the Triton
kernel, inside CUDA graphs and eagerly, equal transformers on the dequantized weights; FP8 W8A8
through torch._scaled_mm (sm_89+) equals transformers with the same FP8 rounding of each
layer's input, in float32 where both are exact enough to agree token for token."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts, tiny_model
from tests.model.quantized_checkpoints import hf_w8a8_greedy, write_quantized

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
_ROOT = tempfile.mkdtemp(prefix="tandem-quantized-gpu-")


def _greedy(model: str, prompts: list[list[int]], **options) -> list[list[int]]:
    llm = LLM(model, device="cuda", dtype="float32", **options)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fmt", ["ct-int8", "ct-fp8-weight-only"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_weight_only_on_cuda_equals_transformers_on_dequantized_weights(fmt: str, enforce_eager: bool) -> None:
    model = tiny_model("llama")
    quantized, reference = write_quantized(model, fmt, os.path.join(_ROOT, "llama"))
    prompts = mixed_prompts()
    assert _greedy(quantized, prompts, enforce_eager=enforce_eager) == hf_greedy(reference, prompts, MAX_TOKENS)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores need sm_89+")
def test_w8a8_on_fp8_tensor_cores_equals_transformers_with_fp8_activations() -> None:
    # _scaled_mm needs both dims of every weight in multiples of 16: the block model's shape.
    model = tiny_model("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
    quantized, reference = write_quantized(model, "ct-fp8-channel", os.path.join(_ROOT, "llama-128"))
    prompts = mixed_prompts(lengths=(5, 40))
    assert _greedy(quantized, prompts) == hf_w8a8_greedy(reference, "ct-fp8-channel", prompts, MAX_TOKENS)
