"""Linear layers on MKL's packed weights: the products of F.linear (to float32 rounding) for
every input shape the model produces, single rows left to the plain weight, and the engine
using them by default on CPU float32 (every greedy-equality test then runs on them)."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.cpu_gemm import PackedWeight, mkl_gemm


@pytest.fixture(scope="module")
def module():
    mod = mkl_gemm()
    assert mod is not None, "MKL's packed GEMM did not build (see the log); torch here has MKL"
    return mod


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(module, rows, bias) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    got = PackedWeight(module, weight).linear(x, b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_strided_and_batched_inputs_and_an_out_buffer(module) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 32, generator=gen)
    packed = PackedWeight(module, weight.t().contiguous().t())  # the fast-GEMM layout's strides
    wide = torch.randn(10, 40, generator=gen)
    x = wide[:, :32]  # rows 40 apart, as a view of a fused projection
    torch.testing.assert_close(packed.linear(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 32, generator=gen)
    torch.testing.assert_close(packed.linear(x3), x3 @ weight.t(), rtol=1e-5, atol=1e-5)
    broadcast = torch.randn(1, 32, generator=gen).expand(4, 32)  # rows 0 apart
    torch.testing.assert_close(packed.linear(broadcast), broadcast @ weight.t(), rtol=1e-5, atol=1e-5)
    out = torch.full((10, 48), 7.0)
    assert packed.linear(x, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_one_row_stays_on_the_plain_weight(module) -> None:
    packed = PackedWeight(module, torch.randn(16, 8))
    assert not packed.takes(torch.randn(1, 8)) and not packed.takes(torch.randn(1, 1, 8))
    assert packed.takes(torch.randn(2, 8))


def test_the_engine_packs_its_weights_by_default(module) -> None:
    from tandem.workers.llm import LLM
    from tests.conftest import tiny_model

    packed_llm = LLM(tiny_model("llama"))  # held: an LLM dropped shuts its engine down at once
    plain_llm = LLM(tiny_model("llama"), cpu_packed_weights=False)
    packed = packed_llm.engine.executor.runner.model
    plain = plain_llm.engine.executor.runner.model
    layer = packed.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                   packed.lm_head):
        assert linear.packed is not None
    assert plain.layers[0].mlp.down_proj.packed is None and plain.lm_head.packed is None
