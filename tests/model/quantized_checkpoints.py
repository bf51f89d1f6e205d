"""Pre-quantized checkpoints in the formats people publish, written from a tiny model by the tests
(not by tandem's code), with the formats' real tensor names, dtypes, shapes and
`quantization_config`; and beside each, the same model with the *dequantized* weights in
float32, which transformers runs as the reference.

Formats (name -> what it writes):

    ct-fp8-channel       compressed-tensors float-quantized, channel weights [out, 1], dynamic token activations
    ct-fp8-tensor-static compressed-tensors float-quantized, tensor weights [1], static input_scale [1]
    ct-fp8-weight-only   compressed-tensors float-quantized, channel weights, no activation quantization
    ct-fp8-tensor-wo     compressed-tensors float-quantized, tensor weights (q, k, v each their own), weight-only
    ct-int8              compressed-tensors int-quantized, channel weights, weight-only (W8A16)
    ct-int8-packed       compressed-tensors pack-quantized 8-bit: weight_packed int32 [out, in / 4], weight_shape
    fbgemm-fp8           fbgemm_fp8: channel weight_scale [out, 1], activation_scale_ub
    fp8-block            quant_method fp8, weight_block_size [128, 128], weight_scale_inv [out / 128, in / 128]
    ct-fp8-block-wo      compressed-tensors float-quantized, block weights (weight_scale [out / 128, in / 128]),
                         no activation quantization
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8 = torch.float8_e4m3fn


def _ct_config(weights: dict, activations: dict | None, fmt: str, kv: bool = False) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "symmetric": True, "dynamic": False,
                                                 "group_size": None, "observer": "minmax", **weights},
             "input_activations": activations, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                "symmetric": True} if kv else None}


FP8_DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
FP8_STATIC_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
FORMATS: dict[str, dict] = {
    "ct-fp8-channel": _ct_config({"type": "float", "strategy": "channel"}, FP8_DYNAMIC_TOKEN, "float-quantized"),
    "ct-fp8-tensor-static": _ct_config({"type": "float", "strategy": "tensor"}, FP8_STATIC_TENSOR, "float-quantized"),
    "ct-fp8-weight-only": _ct_config({"type": "float", "strategy": "channel"}, None, "float-quantized"),
    "ct-fp8-tensor-wo": _ct_config({"type": "float", "strategy": "tensor"}, None, "float-quantized"),
    "ct-int8": _ct_config({"type": "int", "strategy": "channel"}, None, "int-quantized"),
    "ct-int8-packed": _ct_config({"type": "int", "strategy": "channel"}, None, "pack-quantized"),
    "fbgemm-fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "ct-fp8-block-wo": _ct_config({"type": "float", "strategy": "block", "block_structure": [128, 128]}, None,
                                  "float-quantized"),
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
}
# Static activation scales per projection (x / scale must stay within FP8's range for the test
# models' activations, which reach ~6; a few saturate at the smaller ones).
INPUT_SCALES = {"q_proj": 0.012, "k_proj": 0.012, "v_proj": 0.012, "o_proj": 0.01, "gate_proj": 0.015,
                "up_proj": 0.015, "down_proj": 0.02}
WEIGHT_ONLY = ("ct-fp8-weight-only", "ct-fp8-tensor-wo", "ct-int8", "ct-int8-packed")


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448.0, 448.0).to(FP8)


def _int8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).round().clamp(-127, 127).to(torch.int8)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 for 8 bits: value + 128 as a byte, four a word, value j at
    bits 8 * (j % 4) of word j // 4."""
    unsigned = (q.to(torch.int32) + 128).view(q.shape[0], -1, 4)
    words = torch.zeros(unsigned.shape[:2], dtype=torch.int64)
    for i in range(4):
        words |= unsigned[:, :, i].to(torch.int64) << (8 * i)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # the same 32 bits, signed


def _quantize(fmt: str, name: str, w: torch.Tensor, out: dict[str, torch.Tensor]) -> torch.Tensor:
    """Write `name`'s quantized tensors into `out`; return the dequantized float32 weight."""
    w = w.float()
    base = name.removesuffix(".weight")
    if fmt in ("fp8-block", "ct-fp8-block-wo"):
        rows, cols = w.shape[0] // 128, w.shape[1] // 128
        blocks = w.view(rows, 128, cols, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [rows, cols]
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        q = _fp8(w, full)
        out[name], out[base + (".weight_scale_inv" if fmt == "fp8-block" else ".weight_scale")] = q, scale
        return q.float() * full
    per_tensor = fmt in ("ct-fp8-tensor-static", "ct-fp8-tensor-wo")
    top = 127.0 if "int8" in fmt else 448.0
    scale = (w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)) / top
    q = _int8(w, scale) if "int8" in fmt else _fp8(w, scale)
    if fmt == "ct-int8-packed":
        out[base + ".weight_packed"] = pack_int8(q)
        out[base + ".weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
    else:
        out[name] = q
    out[base + ".weight_scale"] = scale.reshape(1) if per_tensor else scale.to(torch.float32)
    if fmt == "ct-fp8-tensor-static":
        # One input, one calibrated scale: q, k and v (and gate and up) see the same x.
        out[base + ".input_scale"] = torch.tensor([INPUT_SCALES[base.rsplit(".", 1)[-1]]], dtype=torch.float32)
    return q.float() * scale


def write_quantized(model_dir: str, fmt: str, root: str, kv_scales: dict[int, tuple[float, float]] | None = None
                    ) -> tuple[str, str]:
    """(quantized checkpoint dir, dequantized reference dir) for `model_dir` in format `fmt`, under
    `root`; with `kv_scales` (layer -> (k, v)) the checkpoint also carries self_attn.k_scale / v_scale.
    Written once per process: a cached transformers model may still map the reference's weights,
    and rewriting the file under it would hand it other bytes."""
    key = (model_dir, fmt, root, tuple(sorted((kv_scales or {}).items())))
    if key in _WRITTEN:
        return _WRITTEN[key]
    quant_dir, ref_dir = os.path.join(root, fmt), os.path.join(root, fmt + "-dequantized")
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if any(name.endswith(f"{linear}.weight") for linear in LINEARS):
            reference[name] = _quantize(fmt, name, tensor, quantized)
        else:
            quantized[name] = reference[name] = tensor
    for layer, (k, v) in (kv_scales or {}).items():
        quantized[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        quantized[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    for out_dir, out_tensors, quant_config in ((quant_dir, quantized, FORMATS[fmt]), (ref_dir, reference, None)):
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
        save_file({k: t.contiguous() for k, t in out_tensors.items()}, os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        if quant_config is not None:
            config["quantization_config"] = quant_config
            if kv_scales:
                config["quantization_config"] = dict(quant_config, kv_cache_scheme={
                    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True})
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f)
    _WRITTEN[key] = quant_dir, ref_dir
    return quant_dir, ref_dir


_WRITTEN: dict[tuple, tuple[str, str]] = {}


def fake_quant_activations(x: torch.Tensor, fmt: str, scale: float | None = None) -> torch.Tensor:
    """What W8A8 does to a linear layer's input: rounded to FP8 (per token, per 128-column group
    for block-wise FP8, or with the static scale) and back."""
    x32 = x.float()
    if fmt == "fp8-block":
        g = x32.reshape(*x32.shape[:-1], -1, 128)
        s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12 * 448.0) / 448.0
        return ((g / s).clamp(-448.0, 448.0).to(FP8).float() * s).reshape(x.shape).to(x.dtype)
    if scale is not None:
        return ((x32 / scale).clamp(-448.0, 448.0).to(FP8).float() * scale).to(x.dtype)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    if fmt == "fbgemm-fp8":
        amax = amax.clamp(max=FORMATS[fmt]["activation_scale_ub"])
    s = (amax / 448.0).clamp(min=1e-12)
    return ((x32 / s).clamp(-448.0, 448.0).to(FP8).float() * s).to(x.dtype)


def hf_w8a8_greedy(ref_dir: str, fmt: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers greedy output on the dequantized weights with every quantized layer's input
    fake-quantized as `fmt` does it: the W8A8 reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for name, module in model.named_modules():
        if any(name.endswith(linear) for linear in LINEARS):
            scale = INPUT_SCALES[name.rsplit(".", 1)[-1]] if fmt == "ct-fp8-tensor-static" else None
            module.register_forward_pre_hook(lambda m, args, s=scale: (fake_quant_activations(args[0], fmt, s),))
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs
