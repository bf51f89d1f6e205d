"""Quantized weights: pre-quantized checkpoints in each supported format load and generate, online
quantization works, and weight-only output equals transformers running the dequantized weights
(same scales) token for token, for every model family. W8A8 (activations rounded to FP8) is held
to its agreement with the unquantized model instead (bench quality measures it on larger sets)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import ARCHITECTURES, hf_greedy, mixed_prompts, tiny_model
from tests.model.quantized_checkpoints import WEIGHT_ONLY, write_quantized

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = mixed_prompts(lengths=(5, 40))
_ROOT = tempfile.mkdtemp(prefix="tandem-quantized-")


def _checkpoint(fmt: str, arch: str = "llama", **overrides) -> tuple[str, str]:
    model = tiny_model(arch, **overrides)
    root = os.path.join(_ROOT, os.path.basename(model))
    return write_quantized(model, fmt, root)


def _greedy(model: str, **options) -> list[list[int]]:
    llm = LLM(model, **options)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


# Every format once and every family under two of them (the formats differ in the loader, the
# families in the layers the scales load into).
WEIGHT_ONLY_CASES = [(fmt, "llama") for fmt in WEIGHT_ONLY] + [
    (fmt, arch) for fmt in ("ct-int8-packed", "ct-fp8-tensor-wo") for arch in ARCHITECTURES if arch != "llama"]


@pytest.mark.parametrize(("fmt", "arch"), WEIGHT_ONLY_CASES)
def test_weight_only_checkpoint_equals_transformers_on_dequantized_weights(arch: str, fmt: str) -> None:
    quantized, reference = _checkpoint(fmt, arch)
    assert _greedy(quantized) == hf_greedy(reference, PROMPTS, MAX_TOKENS)


W8A8 = ("ct-fp8-channel", "ct-fp8-tensor-static", "fbgemm-fp8")
# Block-wise FP8 needs every shard in whole 128 x 128 blocks.
BLOCK_MODEL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)


@pytest.mark.parametrize("fmt", [*W8A8, "fp8-block"])
def test_w8a8_checkpoint_equals_transformers_with_fp8_activations(fmt: str) -> None:
    """W8A8 rounds each layer's input to FP8 (per token, per 128-column group, or by the static
    scale): transformers doing the same on the dequantized weights gives the same tokens."""
    from tests.model.quantized_checkpoints import hf_w8a8_greedy

    overrides = BLOCK_MODEL if fmt == "fp8-block" else {}
    quantized, reference = _checkpoint(fmt, "llama", **overrides)
    assert _greedy(quantized) == hf_w8a8_greedy(reference, fmt, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(("method", "fmt"), [("int8", "ct-int8"), ("fp8_weight_only", "ct-fp8-weight-only"),
                                             ("fp8", "ct-fp8-channel")])
def test_online_quantization_equals_the_checkpoint_format(method: str, fmt: str) -> None:
    """quantization=METHOD on a full-precision checkpoint: per-channel scales made at load, the
    same weights a per-channel checkpoint of the format holds, so the same tokens."""
    from tests.model.quantized_checkpoints import hf_w8a8_greedy

    model = tiny_model("qwen2")
    _, reference = _checkpoint(fmt, "qwen2")
    expected = hf_greedy(reference, PROMPTS, MAX_TOKENS) if method != "fp8" else \
        hf_w8a8_greedy(reference, fmt, PROMPTS, MAX_TOKENS)
    assert _greedy(model, quantization=method) == expected


def test_weights_are_stored_at_their_quantized_size() -> None:
    model = tiny_model("llama")
    full = LLM(model)
    int8 = LLM(model, quantization="int8")
    try:
        layer_full = full.engine.executor.runner.model.layers[0]
        layer_int8 = int8.engine.executor.runner.model.layers[0]
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            a, b = layer_full.get_submodule(path), layer_int8.get_submodule(path)
            assert b.weight.dtype == torch.int8 and b.weight.shape == a.weight.shape
            assert b.weight_scale.dtype == torch.float32 and b.weight_scale.shape == (a.weight.shape[0],)
        # int8 linears: a quarter of float32's bytes, plus a float32 scale per output row
        # (q|k|v 128 x 64, o 64 x 64, gate|up 256 x 64, down 64 x 128).
        from tandem.workers.quant.memory import weight_bytes

        def linear_bytes(layer) -> int:
            return sum(weight_bytes(layer.get_submodule(p)) for p in ("self_attn", "mlp"))
        assert linear_bytes(layer_full) == 4 * 36_864 == 147_456
        assert linear_bytes(layer_int8) == 36_864 + 4 * (128 + 64 + 256 + 64) == 38_912
    finally:
        full.shutdown()
        int8.shutdown()


def test_static_input_scales_of_fused_parts_take_the_largest() -> None:
    quantized, _ = _checkpoint("ct-fp8-tensor-static")
    llm = LLM(quantized)
    try:
        layer = llm.engine.executor.runner.model.layers[1]
        assert layer.self_attn.qkv_proj.input_scale.item() == pytest.approx(0.012)
        assert layer.self_attn.o_proj.input_scale.item() == pytest.approx(0.01)
        assert layer.mlp.gate_up_proj.input_scale.item() == pytest.approx(0.015)
        # per-tensor weight scales: each of q, k and v keeps its own over its rows
        scale = layer.self_attn.qkv_proj.weight_scale
        q, k, v = scale.split(layer.self_attn.qkv_proj.out_sizes)
        for part in (q, k, v):
            assert torch.all(part == part[0])
        assert len({q[0].item(), k[0].item(), v[0].item()}) == 3
    finally:
        llm.shutdown()


def _with_config(fmt: str, **changes) -> str:
    quantized, _ = _checkpoint(fmt)
    path = quantized + "-" + "-".join(f"{k}" for k in changes)
    import shutil

    shutil.copytree(quantized, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**config["quantization_config"], **changes}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize(("changes", "message"), [
    ({"quant_method": "gptq"}, "quantization_config: quant_method 'gptq' is not supported; tandem loads "
                               "compressed-tensors"),
    ({"format": "marlin-24"}, "quantization_config: compressed-tensors int8 in format 'marlin-24' is not supported"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                 "strategy": "group"}}}},
     "quantization_config: compressed-tensors weights 4-bit int is not supported"),
    ({"ignore": ["lm_head", "model.layers.0.self_attn.k_proj"]},
     "quantization_config: model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, "
     "model.layers.0.self_attn.v_proj are one fused layer in tandem, and the checkpoint quantizes only some"),
])
def test_an_unsupported_quantization_config_is_refused_with_what_is_supported(changes: dict, message: str) -> None:
    with pytest.raises(Exception, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        LLM(_with_config("ct-int8", **changes))


def test_the_option_must_name_the_checkpoints_method() -> None:
    quantized, _ = _checkpoint("ct-int8")
    with pytest.raises(ValueError, match="quantization: 'fbgemm_fp8' was asked for, but the checkpoint is quantized "
                                         "with 'compressed-tensors'"):
        LLM(quantized, quantization="fbgemm_fp8")
    with pytest.raises(ValueError, match="quantization: 'compressed-tensors' names a checkpoint format, and this "
                                         "checkpoint has no quantization_config"):
        LLM(tiny_model("llama"), quantization="compressed-tensors")
    with pytest.raises(ValueError, match="quantization: must be one of fp8, fp8_weight_only, int8, "
                                         "compressed-tensors, fbgemm_fp8, got 'awq'"):
        LLM(tiny_model("llama"), quantization="awq")


def test_an_ignored_layer_loads_in_full_precision() -> None:
    """compressed-tensors' `ignore` (here a regex): those layers are full precision in the
    checkpoint and in the model; greedy output still equals transformers on the same weights."""
    from safetensors.torch import load_file, save_file

    quantized, reference = _checkpoint("ct-int8")
    path = _with_config("ct-int8", ignore=["lm_head", "re:.*mlp\\.down_proj"])
    tensors = load_file(os.path.join(path, "model.safetensors"))
    full = load_file(os.path.join(tiny_model("llama"), "model.safetensors"))
    for layer in (0, 1):
        name = f"model.layers.{layer}.mlp.down_proj"
        tensors[name + ".weight"] = full[name + ".weight"]
        del tensors[name + ".weight_scale"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    ref_tensors = load_file(os.path.join(reference, "model.safetensors"))
    for layer in (0, 1):
        ref_tensors[f"model.layers.{layer}.mlp.down_proj.weight"] = full[f"model.layers.{layer}.mlp.down_proj.weight"]
    mixed_ref = reference + "-down-full"
    import shutil

    shutil.copytree(reference, mixed_ref, dirs_exist_ok=True)
    save_file(ref_tensors, os.path.join(mixed_ref, "model.safetensors"))
    llm = LLM(path)
    try:
        assert llm.engine.executor.runner.model.layers[0].mlp.down_proj.quant is None
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(mixed_ref, PROMPTS, MAX_TOKENS)
    finally:
        llm.shutdown()


def test_block_wise_weight_only_equals_transformers_on_dequantized_weights() -> None:
    """Block scales without activation quantization: x stays as it is (only W8A8 rounds it)."""
    quantized, reference = _checkpoint("ct-fp8-block-wo", "llama", **BLOCK_MODEL)
    assert _greedy(quantized) == hf_greedy(reference, PROMPTS, MAX_TOKENS)


def test_block_wise_fp8_refuses_shards_that_are_not_whole_blocks() -> None:
    quantized, _ = _checkpoint("fp8-block", "llama", **BLOCK_MODEL)
    with pytest.raises(ValueError, match="quantization: a 128 x 64 weight shard does not split into 128 x 128 "
                                         "scale blocks"):
        # the tiny model's hidden size 64 is half a block
        LLM(_block_config_on(tiny_model("llama")))
    assert quantized


def _block_config_on(model: str) -> str:
    path = os.path.join(_ROOT, "block-on-small")
    import shutil

    shutil.copytree(model, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    from tests.model.quantized_checkpoints import FORMATS

    config["quantization_config"] = FORMATS["fp8-block"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize("fmt", ["ct-int8", "ct-fp8-weight-only"])
def test_weight_only_through_the_triton_kernels_equals_transformers(fmt: str) -> None:
    """attention_backend=triton: the layers' 8-bit products run the Triton kernel a GPU runs
    (interpreted here), up to its row limit, and the dequantized GEMM past it."""
    quantized, reference = _checkpoint(fmt)
    prompts = mixed_prompts(lengths=(5, 90))  # 95 rows in the first step: past the kernel's 64
    llm = LLM(quantized, attention_backend="triton")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(reference, prompts, MAX_TOKENS)
    finally:
        llm.shutdown()
