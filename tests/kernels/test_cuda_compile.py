"""Every Triton kernel variant the engine launches builds for the GPUs it serves on (Hopper,
sm_90; Ampere, sm_80) with Triton's own compiler and ptxas, here, without a GPU: within the
architecture's shared memory and without spilling registers. The variants are the ones a CPU
run launched through the interpreter, in float32 (the tests' dtype) and in bfloat16 at the
bench models' head sizes (64: llama-1b, 128: llama-8b)."""

from __future__ import annotations

import os
import random

import pytest

triton = pytest.importorskip("triton")

from tandem.workers.core.request import SamplingParams  # noqa: E402
from tandem.workers.llm import LLM  # noqa: E402
from tandem.workers.runner.model_runner import ModelRunner  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.kernels.cuda_compile import SHARED_LIMIT, compile_all, variant  # noqa: E402
from tests.kernels.specializations import Launch, recorded_specializations  # noqa: E402


def _ptxas_present() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas"))


# With a GPU the kernels are compiled for it for real (and the CPU run below has no interpreter).
pytestmark = [pytest.mark.skipif(not _ptxas_present(), reason="Triton's NVIDIA backend (ptxas) is not installed"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"),
              pytest.mark.slow]  # compiles every kernel variant: not in the fast loop

# (dtype, model overrides): head_dim 16 (fp32, GQA 2), 64 (GQA 4), 128 (GQA 2).
WORKLOADS = [
    ("float32", {}),
    ("bfloat16", {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1}),
    ("bfloat16", {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}),
]


def _launches(monkeypatch: pytest.MonkeyPatch) -> set[Launch]:
    """The kernel launches of chunked prefills mixed with decodes and multi-step decodes
    scheduled ahead (decode steps through the graph buckets' buffer, eagerly), per workload."""
    monkeypatch.setattr(ModelRunner, "_graph_mode", lambda self: "eager")
    launches: set[Launch] = set()
    for dtype, overrides in WORKLOADS:
        rng = random.Random(0)
        prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
        params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 6), ignore_eos=True) for _ in prompts]
        with recorded_specializations(launches):
            llm = LLM(tiny_model("llama", **overrides), device="cpu", dtype=dtype, attention_backend="triton",
                      max_num_seqs=4, max_num_batched_tokens=16, block_size=16, num_scheduler_steps=4,
                      overlap_steps=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            llm.shutdown()
    return launches


def test_every_launched_variant_builds_for_hopper_and_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    variants = [variant(launch) for launch in sorted(_launches(monkeypatch), key=repr)]
    decodes = {(v["constexprs"]["HEAD_DIM"], v["constexprs"]["DIRECT"], v["constexprs"]["ROPE"])
               for v in variants if v["kernel"] == "_decode_split_kernel"}
    # At every head size decode rows apply RoPE in the attention launch, except in mixed steps
    # padded to a graph bucket, where they are rotated with the other tokens.
    for rope in (True, False):
        assert {d for d, _, fused in decodes if fused == rope} == {16, 64, 128}
    assert {v["kernel"] for v in variants} == {"_rms_norm_kernel", "_rope_write_kv_kernel", "_prefill_kernel",
                                               "_silu_and_mul_kernel", "_decode_split_kernel",
                                               "_decode_combine_kernel", "_copy_pending_kernel"}
    results = compile_all(variants, (90, 80))
    assert len(results) == 2 * len(variants)
    for result in results:
        where = f"{result['kernel']} sm_{result['arch']} {result['constexprs']}"
        assert "error" not in result, f"{where}: {result.get('error')}"
        assert result["shared"] <= SHARED_LIMIT[result["arch"]], where
        assert result["local_bytes"] == 0, f"{where}: spills {result['local_bytes']} bytes"
