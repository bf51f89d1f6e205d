"""The Triton attention kernels over an FP8 KV cache (through Triton's interpreter on CPU): the
writes store what `kv_quant.quantize` stores, bit for bit, and decode / prefill over FP8 blocks
equal the same kernels over a float cache of the dequantized values (exactly, in float32: the
tiles are dequantized in registers to the same floats). Small shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tandem.workers.kernels import kv_quant
from tandem.workers.kernels.triton_attention import decode_attention, prefill_attention, write_kv
from tandem.workers.kernels.triton_decode import DecodeRope
from tandem.workers.kernels.triton_ops import rope_write_kv
from tests.kernels.test_triton_attention import DEVICE, make_block_tables

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.25, 1.5


def _fp8_and_float_caches(num_slots: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    """(k8, v8, kf, vf): random FP8 caches and float32 caches holding their dequantized values."""
    k8 = kv_quant.quantize(torch.randn(num_slots, kv_heads, head_dim, generator=gen) * 2, K_SCALE, FP8).to(DEVICE)
    v8 = kv_quant.quantize(torch.randn(num_slots, kv_heads, head_dim, generator=gen) * 2, V_SCALE, FP8).to(DEVICE)
    return k8, v8, kv_quant.dequantize(k8, K_SCALE, torch.float32), kv_quant.dequantize(v8, V_SCALE, torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_write_kv_stores_what_torch_quantizes() -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(5, 2, 16, generator=gen).to(DEVICE) * 100  # some past 448 * scale: saturated
    value = torch.randn(5, 2, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 0, 7, 5], device=DEVICE)
    k8, v8 = (torch.zeros(8, 2, 16, dtype=FP8, device=DEVICE) for _ in range(2))
    write_kv(key, value, k8, v8, slots, K_SCALE, V_SCALE)
    real = slots >= 0
    assert torch.equal(_bits(k8[slots[real]]), _bits(kv_quant.quantize(key[real], K_SCALE, FP8)))
    assert torch.equal(_bits(v8[slots[real]]), _bits(kv_quant.quantize(value[real], V_SCALE, FP8)))
    assert not k8.float().isnan().any() and k8.float().abs().max() == 448.0
    assert _bits(k8[[1, 2, 4, 6]]).eq(0).all()  # slot -1 wrote nothing


def test_rope_write_kv_rotates_then_quantizes() -> None:
    gen = torch.Generator().manual_seed(1)
    n, heads, kv_heads, head_dim = 4, 4, 2, 16
    q = torch.randn(n, heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(DEVICE)
    cos, sin = (torch.randn(16, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    pos = torch.tensor([0, 5, 9, 3], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([6, 1, 2, 4], device=DEVICE)
    kf, vf = (torch.zeros(8, kv_heads, head_dim, device=DEVICE) for _ in range(2))
    rope_write_kv(q.clone(), k, v, cos, sin, pos, kf, vf, slots)
    k8, v8 = (torch.zeros(8, kv_heads, head_dim, dtype=FP8, device=DEVICE) for _ in range(2))
    rope_write_kv(q.clone(), k, v, cos, sin, pos, k8, v8, slots, K_SCALE, V_SCALE)
    assert torch.equal(_bits(k8), _bits(kv_quant.quantize(kf, K_SCALE, FP8)))
    assert torch.equal(_bits(v8), _bits(kv_quant.quantize(vf, V_SCALE, FP8)))


@pytest.mark.parametrize("num_splits,window", [(1, 0), (2, 5)])
def test_decode_over_fp8_equals_decode_over_dequantized_floats(num_splits: int, window: int) -> None:
    gen = torch.Generator().manual_seed(2 + num_splits)
    group, kv_heads, head_dim, bs, lens = 2, 2, 16, 4, [9, 3, 14]
    tables, num_blocks = make_block_tables(lens, bs, gen)
    k8, v8, kf, vf = _fp8_and_float_caches(num_blocks * bs, kv_heads, head_dim, gen)
    query = torch.randn(len(lens), group * kv_heads, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out, ref = torch.empty_like(query), torch.empty_like(query)
    decode_attention(query, k8, v8, tables, seq_lens, bs, head_dim ** -0.5, window, out, num_splits,
                     k_scale=K_SCALE, v_scale=V_SCALE)
    decode_attention(query, kf, vf, tables, seq_lens, bs, head_dim ** -0.5, window, ref, num_splits)
    assert torch.equal(out, ref)


def test_fused_rope_decode_writes_the_fp8_cache_as_rope_write_kv_does() -> None:
    gen = torch.Generator().manual_seed(4)
    group, kv_heads, head_dim, bs, lens = 2, 2, 16, 4, [7, 12]
    tables, num_blocks = make_block_tables(lens, bs, gen)
    k8, v8, _, _ = _fp8_and_float_caches(num_blocks * bs, kv_heads, head_dim, gen)
    batch, heads = len(lens), group * kv_heads
    q = torch.randn(batch, heads, head_dim, generator=gen).to(DEVICE)
    k, v = (torch.randn(batch, kv_heads, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    cos, sin = (torch.randn(16, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([tables[b, (n - 1) // bs].item() * bs + (n - 1) % bs for b, n in enumerate(lens)],
                         device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref_k8, ref_v8, ref_q, ref_out = k8.clone(), v8.clone(), q.clone(), torch.empty_like(q)
    rope_write_kv(ref_q, k, v, cos, sin, pos, ref_k8, ref_v8, slots, K_SCALE, V_SCALE)
    decode_attention(ref_q, ref_k8, ref_v8, tables, seq_lens, bs, 0.25, 0, ref_out, 2,
                     k_scale=K_SCALE, v_scale=V_SCALE)
    out = torch.empty_like(q)
    decode_attention(q.clone(), k8, v8, tables, seq_lens, bs, 0.25, 0, out, 2, DecodeRope(k, v, cos, sin, pos, slots),
                     K_SCALE, V_SCALE)
    assert torch.equal(_bits(k8), _bits(ref_k8)) and torch.equal(_bits(v8), _bits(ref_v8))
    assert torch.equal(out, ref_out)


def test_prefill_over_fp8_equals_prefill_over_dequantized_floats() -> None:
    gen = torch.Generator().manual_seed(5)
    group, kv_heads, head_dim, bs = 2, 2, 16, 4
    lens, q_lens = [11, 6], [4, 6]  # a chunk after 7 cached tokens, a fresh prompt
    tables, num_blocks = make_block_tables(lens, bs, gen)
    k8, v8, kf, vf = _fp8_and_float_caches(num_blocks * bs, kv_heads, head_dim, gen)
    query = torch.randn(sum(q_lens), group * kv_heads, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEVICE)
    out, ref = torch.empty_like(query), torch.empty_like(query)
    prefill_attention(query, k8, v8, tables, seq_lens, starts, max(q_lens), bs, 0.25, 0, out, K_SCALE, V_SCALE)
    prefill_attention(query, kf, vf, tables, seq_lens, starts, max(q_lens), bs, 0.25, 0, ref)
    assert torch.equal(out, ref)


@pytest.mark.slow  # the engine through Triton's interpreter
@pytest.mark.parametrize("graphs", [False, True])
def test_an_engine_on_the_kernels_gives_the_torch_paths_tokens(graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton path end to end over an FP8 cache (fused RoPE + KV write in decode, chunked
    prefill through `rope_write_kv` and the varlen kernel) against the torch path; with graphs,
    decode and mixed steps padded to the graph buckets (run eagerly: no capture on CPU), so the
    fixed-layout launches read and write FP8 too."""
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM
    from tandem.workers.runner.model_runner import ModelRunner
    from tests.conftest import mixed_prompts, tiny_model

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        if backend == "triton" and graphs:
            monkeypatch.setattr(ModelRunner, "_graph_mode", lambda self: "eager")
        llm = LLM(tiny_model("llama"), device=DEVICE, kv_cache_dtype="fp8", attention_backend=backend,
                  num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in mixed_prompts(lengths=(3, 17, 40))], params,
                            use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.slow  # compiles every FP8 variant for sm_90 with ptxas, without a GPU
def test_every_fp8_variant_builds_for_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before sm_89 Triton has no float8e4nv: such GPUs run an FP8 cache on the torch path
    (ModelRunner._kernels_take_kv_dtype), so Hopper is the target here."""
    import os
    import random

    from tests.kernels.test_cuda_compile import _ptxas_present
    if not _ptxas_present() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's NVIDIA backend (ptxas) and its interpreter")
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM
    from tandem.workers.runner.model_runner import ModelRunner
    from tests.conftest import tiny_model
    from tests.kernels.cuda_compile import SHARED_LIMIT, compile_all, variant
    from tests.kernels.specializations import recorded_specializations

    monkeypatch.setattr(ModelRunner, "_graph_mode", lambda self: "eager")
    launches = set()
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    with recorded_specializations(launches):
        llm = LLM(tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=1), device="cpu",
                  dtype="bfloat16", attention_backend="triton", kv_cache_dtype="fp8", num_kv_blocks=64,
                  max_num_seqs=4, max_num_batched_tokens=16, block_size=16, num_scheduler_steps=4, overlap_steps=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.shutdown()
    variants = [v for v in (variant(launch) for launch in sorted(launches, key=repr))
                if v["kernel"] in ("_rope_write_kv_kernel", "_prefill_kernel", "_decode_split_kernel")]
    assert {v["constexprs"]["KV_FP8"] for v in variants} == {True}
    for result in compile_all(variants, (90,)):
        where = f"{result['kernel']} sm_90 {result['constexprs']}"
        assert "error" not in result, f"{where}: {result.get('error')}"
        assert result["shared"] <= SHARED_LIMIT[90] and result["local_bytes"] == 0, where
