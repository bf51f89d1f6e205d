"""How a model's linear weights are quantized: read from a pre-quantized checkpoint's
`quantization_config`, or chosen by the `quantization` option for a full-precision one.

One scheme covers every format tandem loads, because they differ only in names and layouts:

    weights       int8 or FP8 e4m3, one float32 scale per output row (per-tensor scales are
                  spread over their rows at load, which is exact), or per 128x128 block
    activations   None (weight-only: x stays in the model's dtype), "dynamic" (FP8 per token,
                  computed each step), or "static" (FP8, the checkpoint's per-tensor input_scale)

Supported (anything else is refused at load, with this list):

    compressed-tensors  format float-quantized (FP8: tensor / channel / block weights, static
                        tensor or dynamic token activations, or weight-only), int-quantized /
                        naive-quantized / pack-quantized 8-bit int weights without activations
    fbgemm_fp8          FP8 channel weights, dynamic per-token activations (capped by
                        activation_scale_ub)
    fp8                 block-wise FP8 (`weight_block_size`, `weight_scale_inv`), dynamic
                        activations, as DeepSeek and Qwen publish it
    online              "fp8", "fp8_weight_only", "int8": per-channel scales made at load
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED = ("compressed-tensors (FP8 float-quantized; 8-bit int-quantized, naive-quantized or pack-quantized "
             "weight-only)", "fbgemm_fp8", "fp8 with weight_block_size (block-wise FP8)",
             "online: fp8, fp8_weight_only, int8")
ONLINE_METHODS = ("fp8", "fp8_weight_only", "int8")


@dataclass(frozen=True)
class QuantScheme:
    weight_dtype: str  # "fp8" (float8_e4m3fn) or "int8"
    activations: str | None  # None (weight-only), "dynamic" (per token) or "static" (per tensor)
    # (rows, cols) of a weight block that shares one scale; None: one scale per output row.
    block: tuple[int, int] | None = None
    online: bool = False  # quantized at load from a full-precision checkpoint
    scale_name: str = "weight_scale"  # the checkpoint tensor beside each weight
    weight_name: str = "weight"  # "weight_packed" for compressed-tensors' pack-quantized
    packed_bits: int | None = None  # pack-quantized: values per int32 = 32 // packed_bits
    # fbgemm_fp8: dynamic activation scales are capped (its activation_scale_ub).
    activation_scale_ub: float | None = None
    method: str = ""  # the name the option and the logs use

    @property
    def weight_only(self) -> bool:
        return self.activations is None


def online_scheme(method: str) -> QuantScheme:
    """The scheme `quantization=method` gives a full-precision checkpoint."""
    if method == "fp8":
        return QuantScheme("fp8", "dynamic", online=True, method=method)
    if method == "fp8_weight_only":
        return QuantScheme("fp8", None, online=True, method=method)
    if method == "int8":
        return QuantScheme("int8", None, online=True, method=method)
    raise ValueError(f"quantization: {method!r} quantizes no full-precision checkpoint "
                     f"(online methods: {', '.join(ONLINE_METHODS)})")


def resolve_scheme(option: str | None, quantization_config: dict | None) -> QuantScheme | None:
    """The scheme of a model: its checkpoint's, or the option's for a full-precision one. An
    option that names another method than the checkpoint's is refused (vLLM's rule)."""
    if quantization_config is None:
        if option is None:
            return None
        if option not in ONLINE_METHODS:
            raise ValueError(f"quantization: {option!r} names a checkpoint format, and this checkpoint has no "
                             f"quantization_config (to quantize it at load use one of {', '.join(ONLINE_METHODS)})")
        return online_scheme(option)
    scheme = checkpoint_scheme(quantization_config)
    if option is not None and option not in (scheme.method, "fp8" if scheme.weight_dtype == "fp8" else None):
        raise ValueError(f"quantization: {option!r} was asked for, but the checkpoint is quantized with "
                         f"{scheme.method!r} (leave the option out to load it as it is)")
    return scheme


def checkpoint_scheme(config: dict) -> QuantScheme:
    """The scheme of a `quantization_config`, or a ValueError that lists what is supported."""
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fbgemm_fp8":
        ub = config.get("activation_scale_ub")
        return QuantScheme("fp8", "dynamic", activation_scale_ub=float(ub) if ub is not None else None,
                           method="fbgemm_fp8")
    if method == "fp8":
        block = config.get("weight_block_size")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            _refuse(config, "fp8 checkpoints with static activation scales")
        if block is None:
            _refuse(config, "fp8 without weight_block_size")
        return QuantScheme("fp8", "dynamic", block=(int(block[0]), int(block[1])), scale_name="weight_scale_inv",
                           method="fp8")
    _refuse(config, f"quant_method {method or None!r}")
    raise AssertionError  # unreachable: _refuse raises


def _compressed_tensors(config: dict) -> QuantScheme:
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        _refuse(config, f"compressed-tensors with {len(groups)} config groups (one group over Linear layers)")
    group = groups[0]
    targets = group.get("targets") or []
    if not any(t == "Linear" or str(t).endswith("Linear") for t in targets):
        _refuse(config, f"compressed-tensors targets {targets!r} (Linear)")
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fmt = config.get("format")
    bits, kind = weights.get("num_bits"), weights.get("type")
    if bits != 8 or kind not in ("float", "int") or not weights.get("symmetric", True) \
            or weights.get("dynamic", False):
        _refuse(config, f"compressed-tensors weights {bits}-bit {kind}"
                        + (" asymmetric" if not weights.get("symmetric", True) else "")
                        + (" dynamic" if weights.get("dynamic", False) else ""))
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure") or []
        block = (int(structure[0]), int(structure[1])) if len(structure) == 2 else None
        if block is None:
            _refuse(config, "compressed-tensors block weights without a block_structure")
    elif strategy not in ("tensor", "channel"):
        _refuse(config, f"compressed-tensors weight strategy {strategy!r} (tensor, channel, block)")
    if kind == "int":
        if acts is not None:
            _refuse(config, "compressed-tensors int8 weights with quantized activations (int8 is weight-only)")
        if fmt not in ("int-quantized", "naive-quantized", "pack-quantized"):
            _refuse(config, f"compressed-tensors int8 in format {fmt!r}")
        if block is not None:
            _refuse(config, "compressed-tensors block-wise int8 weights")
        packed = fmt == "pack-quantized"
        return QuantScheme("int8", None, weight_name="weight_packed" if packed else "weight",
                           packed_bits=8 if packed else None, method="compressed-tensors")
    if fmt not in ("float-quantized", "naive-quantized"):
        _refuse(config, f"compressed-tensors FP8 in format {fmt!r}")
    if acts is None:
        return QuantScheme("fp8", None, block=block, method="compressed-tensors")
    if acts.get("num_bits") != 8 or acts.get("type") != "float":
        _refuse(config, f"compressed-tensors activations {acts.get('num_bits')}-bit {acts.get('type')}")
    dynamic = bool(acts.get("dynamic", False))
    act_strategy = acts.get("strategy")
    if dynamic and act_strategy == "token":
        return QuantScheme("fp8", "dynamic", block=block, method="compressed-tensors")
    if dynamic and act_strategy == "group" and block is not None:
        return QuantScheme("fp8", "dynamic", block=block, method="compressed-tensors")
    if not dynamic and act_strategy == "tensor":
        return QuantScheme("fp8", "static", block=block, method="compressed-tensors")
    _refuse(config, f"compressed-tensors activations {'dynamic' if dynamic else 'static'} {act_strategy!r}")
    raise AssertionError


def ignored_modules(config: dict | None) -> tuple[str, ...]:
    """Module names (or `re:` patterns) the checkpoint leaves in full precision."""
    if not config:
        return ()
    names = config.get("ignore") or config.get("modules_to_not_convert") or []
    return tuple(str(n) for n in names)


def _refuse(config: dict[str, Any], what: str) -> None:
    raise ValueError(f"quantization_config: {what} is not supported; tandem loads {'; '.join(SUPPORTED)}")
