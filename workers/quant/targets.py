"""Which layers of a stage are quantized, and the checkpoint tensors their scales load from.

A checkpoint may leave layers in full precision (compressed-tensors' `ignore`, fbgemm's
`modules_to_not_convert`: exact names, `re:` patterns, or a trailing part of the name). A fused
layer (q|k|v, gate|up) is one GEMM, so its parts must agree; a checkpoint that quantizes some
parts of one and not the others is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tandem.workers.quant.scheme import QuantScheme

# module path in a decoder layer -> its scheme (None: full precision)
LayerQuant = Callable[[str], "QuantScheme | None"]


def is_ignored(name: str, ignore: tuple[str, ...]) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False


def layer_quant(scheme: QuantScheme | None, ignore: tuple[str, ...], prefix: str,
                layer_weights: tuple[tuple[str, str, int], ...]) -> LayerQuant:
    """For one decoder layer (checkpoint names under `prefix`): module path -> its scheme."""

    def quant(path: str) -> QuantScheme | None:
        if scheme is None:
            return None
        names = [prefix + suffix for suffix, module_path, _ in layer_weights if module_path == path]
        ignored = [is_ignored(name, ignore) for name in names]
        if all(ignored):
            return None
        if any(ignored):
            raise ValueError(f"quantization_config: {', '.join(names)} are one fused layer in tandem, and the "
                             "checkpoint quantizes only some of them")
        return scheme

    return quant


def scale_targets(module: Any, name: str, part: int) -> dict[str, tuple[Any, Any, int]]:
    """Checkpoint tensor -> (parameter, loader, part) of a quantized layer's weight and scales,
    for the checkpoint module `name` (e.g. model.layers.0.self_attn.q_proj)."""
    scheme: QuantScheme = module.quant
    targets = {f"{name}.{scheme.weight_name}": (module.weight, module.weight_loader, part)}
    if not scheme.online:
        targets[f"{name}.{scheme.scale_name}"] = (module.weight_scale, module.weight_loader, part)
        if module.input_scale is not None:
            targets[f"{name}.input_scale"] = (module.input_scale, module.weight_loader, part)
    return targets
