"""One compile per kernel variant, at start-up: no launch mid-run may need a new Triton
specialisation because a per-step view (positions, slots, block tables, lengths, query
starts: slices of a step's packed inputs at per-step offsets) happens to be 16-byte aligned
or not, or a per-step integer happens to be 1 or a multiple of 16."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")

from tandem.workers.core.request import SamplingParams  # noqa: E402
from tandem.workers.llm import LLM  # noqa: E402
from tandem.workers.runner.model_runner import ModelRunner  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.kernels.specializations import recorded_specializations  # noqa: E402

pytestmark = pytest.mark.slow  # a whole workload through Triton's interpreter: not in the fast loop


def test_a_varied_workload_needs_one_specialisation_per_kernel_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    # Decode steps go through the graph buckets' buffer as on CUDA (eagerly: no capture on CPU),
    # prefills are chunked (16-token budget) and mixed with decodes (padded to the mixed graphs'
    # buckets, and, in a second engine without them, at their own sizes), and pure-decode steps
    # run four passes in place, scheduled ahead: every way a step's views are cut.
    monkeypatch.setattr(ModelRunner, "_graph_mode", lambda self: "eager")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(1, 40))] for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 14), ignore_eos=True) for _ in prompts]
    with recorded_specializations() as seen:
        for mixed_step_graphs in (True, False):
            llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", attention_backend="triton",
                      max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_scheduler_steps=4,
                      overlap_steps=True, mixed_step_graphs=mixed_step_graphs)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            llm.shutdown()
    # The Llama layers rotate and write decode rows inside the decode launch; prefill rows with
    # _rope_write_kv_kernel.
    assert set(seen) == {"_rms_norm_kernel", "_rope_write_kv_kernel", "_prefill_kernel",
                         "_silu_and_mul_kernel", "_decode_split_kernel", "_decode_combine_kernel",
                         "_copy_pending_kernel"}
    for kernel, keys in seen.items():
        runtime = {key for key, _ in keys}
        assert len(runtime) == 1, f"{kernel}: {len(runtime)} runtime specialisations: {sorted(runtime)}"
    # Decode launches apply RoPE and write their rows' K/V themselves, except in mixed steps
    # padded to a graph bucket, where one rope_write_kv launch covers every token.
    decodes = {(dict(c)["ROPE"], dict(c)["DIRECT"]) for _, c in seen["_decode_split_kernel"]}
    # (ROPE, DIRECT): decode steps with one split (written directly) and several; the mixed
    # bucket's four decode rows, one split.
    assert decodes == {(True, True), (True, False), (False, True)}
    constexpr_variants = {kernel: len(keys) for kernel, keys in seen.items()}
    # RMSNorm with and without the residual.
    assert constexpr_variants == {"_rms_norm_kernel": 2, "_rope_write_kv_kernel": 1,
                                  "_prefill_kernel": 1, "_silu_and_mul_kernel": 1, "_decode_split_kernel": 3,
                                  "_decode_combine_kernel": 1, "_copy_pending_kernel": 1}
