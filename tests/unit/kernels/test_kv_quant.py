"""The FP8 KV cache's helpers (workers/kernels/kv_quant.py): dtype, quantize / dequantize, scales."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels import kv_quant


def test_cache_dtype_follows_the_option() -> None:
    assert kv_quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_quant.cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn


def test_values_on_the_scaled_grid_round_trip_exactly() -> None:
    grid = torch.tensor([0.0, 0.5, -1.0, 1.125, 448.0, -448.0, 2.0 ** -9, 0.015625])  # e4m3fn values
    for scale in (1.0, 0.25, 3.0):
        x = grid * scale
        q = kv_quant.quantize(x, scale, torch.float8_e4m3fn)
        assert q.dtype == torch.float8_e4m3fn
        assert torch.equal(kv_quant.dequantize(q, scale, torch.float32), x)


def test_quantize_divides_clamps_and_rounds_to_nearest() -> None:
    x = torch.tensor([1.06, 1.07, 1000.0, -1e9, 3.0])
    q = kv_quant.quantize(x, 2.0, torch.float8_e4m3fn)  # x / 2: 0.53, 0.535 (step 1/16 there), 500 -> 448
    assert q.float().tolist() == [0.5, 0.5625, 448.0, -448.0, 1.5]
    assert not q.float().isnan().any()  # an outlier saturates, never NaN
    assert kv_quant.dequantize(q, 2.0, torch.bfloat16).tolist() == [1.0, 1.125, 896.0, -896.0, 3.0]


def test_a_float_cache_stores_and_reads_values_as_they_are() -> None:
    x = torch.randn(5)
    assert torch.equal(kv_quant.quantize(x, 0.5, torch.float32), x)
    assert kv_quant.dequantize(x, 0.5, torch.float32) is x


def test_scales_are_read_from_the_layer_when_asked() -> None:
    class Layer:
        k_scale, v_scale = 1.0, 1.0

    layer = Layer()
    cache = torch.zeros(4, 2, 8, dtype=torch.float8_e4m3fn)
    assert kv_quant.scales_of(cache) == (1.0, 1.0)  # not bound yet
    kv_quant.bind_scales(cache, layer)
    layer.k_scale, layer.v_scale = 0.5, 2.0  # set after the cache exists (a loader's order)
    assert kv_quant.scales_of(cache) == (0.5, 2.0)
    assert kv_quant.scales_of(torch.zeros(4, 2, 8)) == (1.0, 1.0)  # a float cache has none
    del layer
    assert kv_quant.scales_of(cache) == (1.0, 1.0)  # a weak reference: no cycle keeps the layer


def test_checkpoint_scales_become_python_floats() -> None:
    assert kv_quant.as_float_scale(torch.tensor(0.125)) == 0.125
    assert kv_quant.as_float_scale(torch.tensor([0.25], dtype=torch.bfloat16)) == 0.25
    assert kv_quant.as_float_scale(2) == 2.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            kv_quant.as_float_scale(bad)


def test_storage_views_fp8_as_bytes() -> None:
    cache = torch.zeros(4, 3, dtype=torch.float8_e4m3fn)
    rows = kv_quant.quantize(torch.full((2, 3), 1.5), 1.0, cache.dtype)
    kv_quant.storage(cache).index_copy_(0, torch.tensor([3, 0]), kv_quant.storage(rows))
    assert cache.float().tolist() == [[1.5] * 3, [0.0] * 3, [0.0] * 3, [1.5] * 3]
