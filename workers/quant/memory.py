"""What a stage's weights take in memory, at their stored size: what quantization frees goes to
the KV cache (a GPU's is sized from the memory left after loading; workers/runner/gpu_memory.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tandem.workers.quant.scheme import QuantScheme

logger = logging.getLogger(__name__)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, as stored (8-bit weights at one byte each)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def log_weights(model: nn.Module, scheme: QuantScheme | None, device: torch.device) -> int:
    """Log the stage's weight memory and how its linear layers are stored; returns the bytes."""
    num_bytes = weight_bytes(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # an online scheme's full-precision weights go back to the pool
    how = "unquantized" if scheme is None else (
        f"{scheme.method or scheme.weight_dtype}: {scheme.weight_dtype} weights, "
        + (f"{scheme.activations} FP8 activations" if scheme.activations else "weight-only")
        + (f", {scheme.block[0]}x{scheme.block[1]} scale blocks" if scheme.block else "")
        + (" (quantized at load)" if scheme.online else ""))
    logger.info("weights: %.3f GB (%s)", num_bytes / 1e9, how)
    return num_bytes
