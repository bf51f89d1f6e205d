"""The Triton kernels (attention, RMSNorm, RoPE, SiLU-and-mul), switched on once per process.

They run on CUDA when the attention backend is "auto" or "triton" and Triton imports.
With `TRITON_INTERPRET=1` the same kernels run on CPU tensors through Triton's
interpreter: that is how the tests check them, and the whole engine through them, on a
machine without a GPU. Layers ask `active_for(tensor)`, as they ask the CPU kernels.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

ACTIVE: ModuleType | None = None
_ON_CPU = False  # a CPU model loaded with attention_backend="triton" (interpreted kernels)
_BACKENDS = ("auto", "torch", "triton")


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def wanted(backend: str, device: torch.device) -> bool:
    """Whether a model on `device` runs the Triton kernels (ValueError if asked and impossible)."""
    if backend not in _BACKENDS:
        raise ValueError(f"attention_backend: must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    # Triton is imported only here, on the way to running its kernels: kernels defined while
    # TRITON_INTERPRET is unset are compiled for a GPU for good.
    if (device.type == "cuda" or interpreted()) and triton_available():
        return True
    if backend == "triton":
        raise ValueError("attention_backend: triton needs the triton package and a CUDA device "
                         "(or TRITON_INTERPRET=1 to interpret the kernels on CPU)")
    return False


def configure(use: bool, device: torch.device) -> None:
    """Called by each model load: CUDA models switch the ops on for CUDA tensors; a CPU model
    decides whether CPU tensors go through the interpreted kernels (only when it asked)."""
    global ACTIVE, _ON_CPU
    if use:
        from tandem.workers.kernels import triton_ops

        ACTIVE = triton_ops
    if device.type == "cpu":
        _ON_CPU = use


def active_for(t: torch.Tensor) -> ModuleType | None:
    """The fused Triton ops if they are on for `t`'s device."""
    if ACTIVE is not None and (t.device.type == "cuda" or (_ON_CPU and interpreted())):
        return ACTIVE
    return None


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (what flash-decoding splits fill)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 4
