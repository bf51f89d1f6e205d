"""`bench latency`'s figures: hf_compiled null when not measured, the batch sweep on CUDA only."""

from __future__ import annotations

import torch

from tandem.bench import latency


def test_hf_compiled_figures_are_null_when_not_measured() -> None:
    assert latency.hf_compiled_figures([0.02], [None], None) == {
        "tpot_hf_compiled_ms": None, "tpot_ratio_vs_hf_compiled": None, "hf_compiled_error": None}
    assert latency.hf_compiled_figures([0.02], [None], "BackendCompilerFailed: no compiler")["hf_compiled_error"] == (
        "BackendCompilerFailed: no compiler")
    assert latency.hf_compiled_figures([0.02, 0.03], [0.01, 0.02], None) == {
        "tpot_hf_compiled_ms": 15.0, "tpot_ratio_vs_hf_compiled": 1.75, "hf_compiled_error": None}


def test_latency_sweeps_to_128_on_cuda_only() -> None:
    assert latency.default_shape(True, torch.device("cpu")) == latency.LATENCY_QUICK
    assert latency.default_shape(False, torch.device("cuda")).sweep_batches == (1, 2, 4, 8, 16, 32, 64, 128)
    assert latency.default_shape(False, torch.device("cuda")).prompt_len == latency.LATENCY_FULL.prompt_len
