"""The torch attention path over an FP8 KV cache: exactly the attention over a float cache that
holds the dequantized values (the same floats reach SDPA), decodes, chunked and fresh prefills."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels import cpu_kernels, kv_quant
from tandem.workers.model.attention import AttentionMetadata, PrefillSeq, paged_attention

BS, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 8
FP8 = torch.float8_e4m3fn


class Layer:
    """What `bind_scales` points a cache at: an attention layer's two scales."""

    def __init__(self, k_scale: float, v_scale: float) -> None:
        self.k_scale, self.v_scale = k_scale, v_scale


@pytest.fixture(params=["torch", "kernel"])
def decode_path(request, monkeypatch) -> str:
    """With the CPU decode kernel active too: an FP8 cache must still take the torch path."""
    kernel = None
    if request.param == "kernel":
        kernel = cpu_kernels.compiled_kernels()
        assert kernel is not None, "the CPU kernel did not build (see the log)"
    monkeypatch.setattr(cpu_kernels, "ACTIVE", kernel)
    return request.param


def _step(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              AttentionMetadata]:
    """Decodes of lengths 5 and 9, a chunk of 3 after 6 cached tokens, a fresh prompt of 5."""
    g = torch.Generator().manual_seed(seed)
    decode_lens, chunk, fresh = [5, 9], (6, 3), 5
    num_blocks = 12
    perm = torch.randperm(num_blocks, generator=g).tolist()
    caches = [torch.randn(num_blocks * BS, KV_HEADS, HEAD_DIM, generator=g) * 3 for _ in range(2)]
    tables = [[perm.pop() for _ in range(-(-n // BS))] for n in decode_lens + [sum(chunk), fresh]]
    ctx_lens, q_lens = decode_lens + [sum(chunk), fresh], [1, 1, chunk[1], fresh]
    slots = torch.cat([torch.tensor([t[p // BS] * BS + p % BS for p in range(n - q, n)])
                       for t, n, q in zip(tables, ctx_lens, q_lens)])
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
    key, value = (torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g) * 3 for _ in range(2))
    prefills = [PrefillSeq(2, chunk[1], sum(chunk), tables[2]), PrefillSeq(2 + chunk[1], fresh, fresh, tables[3])]
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=2, decode_block_tables=tables[:2],
                             decode_seq_lens=decode_lens, prefills=prefills, block_size=BS)
    return query, key, value, caches[0], caches[1], meta


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.03125, 0.375)])
def test_fp8_cache_equals_a_float_cache_of_the_dequantized_values(window: int | None, k_scale: float,
                                                                   v_scale: float, decode_path: str) -> None:
    query, key, value, key_cache, value_cache, meta = _step(seed=3)
    k8, v8 = kv_quant.quantize(key_cache, k_scale, FP8), kv_quant.quantize(value_cache, v_scale, FP8)
    layer = Layer(k_scale, v_scale)
    kv_quant.bind_scales(k8, layer)
    # The reference: float caches and this step's K/V holding exactly what the FP8 cache gives back.
    kf, vf = kv_quant.dequantize(k8, k_scale, torch.float32), kv_quant.dequantize(v8, v_scale, torch.float32)
    kf0, vf0 = kf.clone(), vf.clone()
    out = paged_attention(query, key, value, k8, v8, meta, HEAD_DIM ** -0.5, window)
    _, _, _, _, _, meta_ref = _step(seed=3)
    key_ref = kv_quant.dequantize(kv_quant.quantize(key, k_scale, FP8), k_scale, torch.float32)
    value_ref = kv_quant.dequantize(kv_quant.quantize(value, v_scale, FP8), v_scale, torch.float32)
    ref = paged_attention(query, key_ref, value_ref, kf, vf, meta_ref, HEAD_DIM ** -0.5, window)

    # The write quantized this step's K/V into their slots, and nothing else changed.
    assert torch.equal(kv_quant.dequantize(k8, k_scale, torch.float32), kf)
    assert torch.equal(kv_quant.dequantize(v8, v_scale, torch.float32), vf)
    assert not torch.equal(kf, kf0) and not torch.equal(vf, vf0)
    if decode_path == "torch":
        assert torch.equal(out, ref)  # the same floats reach the same SDPA calls
    else:  # the reference's decodes went through the C++ kernel: float32 rounding apart
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert meta.decode_groups_by_window and not meta_ref.decode_groups_by_window  # FP8: torch decode path


def test_fp8_cache_is_close_to_the_float_cache() -> None:
    """The rounding's cost (K/V of std 3, scale 1): e4m3 keeps 3 mantissa bits (<= 6.25% a value);
    measured: mean error 2.6% of the mean output, largest 0.36."""
    query, key, value, key_cache, value_cache, meta = _step(seed=5)
    k8, v8 = kv_quant.quantize(key_cache, 1.0, FP8), kv_quant.quantize(value_cache, 1.0, FP8)
    out = paged_attention(query, key, value, k8, v8, meta, HEAD_DIM ** -0.5)
    _, _, _, _, _, meta_ref = _step(seed=5)
    ref = paged_attention(query, key, value, key_cache, value_cache, meta_ref, HEAD_DIM ** -0.5)
    err = (out - ref).abs()
    assert err.mean() < 0.04 * ref.abs().mean() and err.max() < 0.5
