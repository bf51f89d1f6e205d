"""Quantized weights across ranks and stages (CPU, gloo): scales shard with their weights
(column-parallel rows, row-parallel whole rows, replicated KV heads' rows), each stage loads only
its layers' scales, and online quantization's row-parallel scales span every rank, so greedy
output equals transformers on the dequantized weights at TP=2 and TP=2 x PP=2."""

from __future__ import annotations

import os
import tempfile

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts, tiny_model
from tests.model.quantized_checkpoints import hf_w8a8_greedy, write_quantized

pytestmark = pytest.mark.slow  # Ray workers: not in the fast loop

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
_ROOT = tempfile.mkdtemp(prefix="tandem-quantized-tp-")

CASES = {
    # name: (model options, checkpoint format or None (online), engine options)
    "llama-packed-int8-tp2": (dict(arch="llama"), "ct-int8-packed", dict(tensor_parallel_size=2)),
    # one KV head, two ranks: both ranks read the same k and v rows and their scales
    "llama-kv1-fp8-tensor-tp2": (dict(arch="llama", num_key_value_heads=1), "ct-fp8-tensor-wo",
                                 dict(tensor_parallel_size=2)),
    "qwen2-fp8-static-tp2pp2": (dict(arch="qwen2"), "ct-fp8-tensor-static",
                                dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    "mistral-online-int8-tp2": (dict(arch="mistral"), None, dict(tensor_parallel_size=2, quantization="int8")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_greedy_equals_transformers(ray_local, case: str) -> None:
    spec, fmt, options = CASES[case]
    spec = dict(spec)
    model = tiny_model(spec.pop("arch"), **spec)
    root = os.path.join(_ROOT, os.path.basename(model))
    quantized, reference = write_quantized(model, fmt or "ct-int8", root)
    prompts = mixed_prompts(lengths=(5, 40))
    expected = hf_w8a8_greedy(reference, fmt, prompts, MAX_TOKENS) if fmt == "ct-fp8-tensor-static" else \
        hf_greedy(reference, prompts, MAX_TOKENS)
    llm = LLM(quantized if fmt else model, **options)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    finally:
        llm.shutdown()
