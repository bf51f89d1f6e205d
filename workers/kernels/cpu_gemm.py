"""Linear layers on MKL's packed weights (csrc/mkl_gemm.cpp), for CPU float32 models.

`torch.mm` gives MKL a plain weight, which MKL re-packs into its panel layout on every call.
`pack_linear_weights` packs each linear layer's weight once, at load; the layers then run
products of two or more rows on the packed copy (figures in bench/RESULTS.md).

A single row (batch-1 decode) stays on the plain weight: there the product only streams the
weight, and the packed copy, padded by a few MB, streams slower. So the plain weights stay,
and the packed copies cost memory on top (MKL pads each by a few MB; a large model's packed
copies take about as much again as its linear weights).
`ModelConfig.cpu_packed_weights=False` turns packing off. Where MKL's packing entry points
are missing (non-x86 builds of torch) nothing is packed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tandem.workers.kernels.cpu_kernels import CompiledExtension

logger = logging.getLogger(__name__)

# The row count MKL tunes the packed layout for; any count may use it (a decode batch).
PACK_ROWS_HINT = 64

_MKL_GEMM = CompiledExtension("MKL's packed GEMM", "tandem_mkl_gemm", ("mkl_gemm.cpp",),
                              "linear layers use torch.mm", variants=(("", ["-O2"], []),),
                              usable=torch.backends.mkl.is_available)


def mkl_gemm() -> Any:
    """The compiled packed-GEMM module, or None where it cannot be had (no MKL in this torch,
    no compiler, or an MKL without the packing entry points)."""
    return _MKL_GEMM.get()


# Products with fewer rows run on the plain weight (see above).
MIN_PACKED_ROWS = 2


class PackedWeight:
    """A linear weight [out_features, in_features] in MKL's packed layout."""

    def __init__(self, module: Any, weight: torch.Tensor) -> None:
        self.module = module
        self.out_features, self.in_features = weight.shape
        self.data = module.pack_weight(weight, PACK_ROWS_HINT)
        self.num_bytes = self.data.numel() * self.data.element_size()

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x [..., in_features] runs faster here than on the plain weight."""
        return x.numel() >= MIN_PACKED_ROWS * self.in_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) for x [..., in_features]; into `out` ([rows, out_features]) if given."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < self.in_features):
            x2 = x2.contiguous()  # MKL takes rows at a stride >= their length (not broadcast)
        if out is None:
            out = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype)
        if bias is not None:
            out.copy_(bias.expand_as(out))  # accumulated onto: bias + x W^T, as addmm does
        self.module.packed_linear(x2, self.data, self.out_features, out, bias is not None)
        return out.view(*lead, self.out_features)


def pack_linear_weights(model: nn.Module, linear_types: tuple[type, ...]) -> int:
    """Give every module of `linear_types` in `model` (CPU float32 weights) a packed copy of its
    weight as `.packed`; returns how many were packed."""
    module = mkl_gemm()
    if module is None:
        return 0
    num, num_bytes = 0, 0
    for layer in model.modules():
        if isinstance(layer, linear_types) and layer.weight.device.type == "cpu" and \
                layer.weight.dtype == torch.float32:
            layer.packed = PackedWeight(module, layer.weight.data)
            num, num_bytes = num + 1, num_bytes + layer.packed.num_bytes
    logger.info("packed %d linear weights for MKL (%.0f MB more memory)", num, num_bytes / 2**20)
    return num
