"""The micro-chunked layer path (used when TP > 1 with overlap on) computes what the serial
path does, whatever the chunk boundaries cut: decodes, fresh prompts, prompts continuing a
cached prefix. Run in one process (TP = 1 collectives are no-ops) so any split is cheap to try."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.distributed.parallel import ParallelContext
from tandem.workers.llm import LLM
from tandem.workers.model.overlap import chunk_bounds, split_metadata
from tests.conftest import hf_greedy, mixed_prompts, tiny_model


@pytest.fixture
def chunked_everywhere(monkeypatch) -> list[int]:
    """Make the single-process model take the overlapped path (its all-reduces are no-ops);
    yields the chunk counts of the forward passes that took it."""
    from tandem.workers.model.llama import LlamaForCausalLM

    calls: list[int] = []
    original = LlamaForCausalLM._forward_overlapped

    def spy(self, positions, x, meta, num_chunks):
        calls.append(num_chunks)
        return original(self, positions, x, meta, num_chunks)

    monkeypatch.setattr(ParallelContext, "overlaps_comm", property(lambda self: self.num_overlap_chunks > 1))
    monkeypatch.setattr(LlamaForCausalLM, "_forward_overlapped", spy)
    return calls


def test_chunk_bounds() -> None:
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(2, 2) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("num_chunks", [2, 3])
# The Triton kernels run interpreted on CPU: those cases are not in the fast loop; they start no
# Ray, so they run beside the suite's Ray lane (tests/conftest.py).
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=[pytest.mark.slow, pytest.mark.no_ray])])
def test_chunked_layers_match_transformers(chunked_everywhere, arch: str, num_chunks: int, backend: str) -> None:
    """On the Triton backend each chunk carries its own cut of the kernel tables (interpreted
    kernels on CPU)."""
    if backend == "triton":
        pytest.importorskip("triton")
    # One layer: the chunks cut each forward pass the same way whatever the depth.
    model = tiny_model(arch, num_hidden_layers=1, **({"sliding_window": 8} if arch == "mistral" else {}))
    prompts = mixed_prompts(seed=6)
    # A 24-token budget mixes decodes with prefill pieces, so chunk edges fall everywhere.
    llm = LLM(model, max_num_batched_tokens=24, max_num_seqs=4, block_size=4, attention_backend=backend)
    ctx = llm.engine.executor.runner.ctx
    ctx.num_overlap_chunks, ctx.min_chunk_tokens = num_chunks, 1  # chunk even one-token decode steps
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, 12)
    assert len(chunked_everywhere) > 12 and set(chunked_everywhere) <= {2, num_chunks}  # decodes too
    llm.engine.pool.check_all_free()


def test_chunked_hidden_states_equal_serial(chunked_everywhere) -> None:
    """One mixed step (2 decodes, a prompt continuing a cached prefix, a fresh prompt) through
    both paths; chunk edges cut the decodes and both prompts."""
    from tandem.workers.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    llm = LLM(tiny_model("llama"), block_size=4, num_kv_blocks=64)
    runner = llm.engine.executor.runner
    params = SamplingParams(temperature=0.0)
    warm = SchedulerOutput(0, new_requests=[
        NewRequestData("d0", list(range(20, 29)), [], params, [0, 1, 2], 0),
        NewRequestData("d1", list(range(40, 46)), [], params, [3, 4], 0),
        NewRequestData("p", list(range(60, 80)), [], params, [5, 6, 7, 8, 9], 0)],
        num_scheduled_tokens={"d0": 9, "d1": 6, "p": 8})
    runner.execute(warm)  # fills KV: d0 and d1 fully, p's first 8 tokens
    step = SchedulerOutput(1, new_requests=[NewRequestData("f", list(range(90, 101)), [], params, [10, 11, 12], 0)],
                           cached_requests=[CachedRequestData("d0", [7], [], 9, 3),
                                            CachedRequestData("d1", [8], [], 6, 2),
                                            CachedRequestData("p", [], [], 8, 5)],
                           num_scheduled_tokens={"d0": 1, "d1": 1, "p": 12, "f": 11})
    runner.update_states(step)
    inputs = runner.prepare_inputs(step)
    assert inputs.meta.num_decodes == 2 and len(inputs.meta.prefills) == 2
    ctx = runner.ctx
    ctx.min_chunk_tokens = 1
    results = {}
    with torch.inference_mode():
        for n in (1, 2, 3, 5):
            ctx.num_overlap_chunks = n
            results[n] = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            metas = split_metadata(inputs.meta, chunk_bounds(len(inputs.input_ids), n))
            assert sum(len(m.slot_mapping) for m in metas) == len(inputs.input_ids)
    assert chunked_everywhere == [2, 3, 5]
    for n in (2, 3, 5):
        torch.testing.assert_close(results[n], results[1], rtol=1e-5, atol=1e-5)


def test_chunks_cut_the_kernel_tables() -> None:
    """A step of 2 decodes, then prefills of 4 and 3 tokens (contexts ending at 12 and 3), cut
    at tokens 3 and 6: every chunk's tables hold its own rows, lengths and query offsets."""
    from tandem.workers.model.attention import AttentionMetadata, KernelTables, PrefillSeq

    i32 = torch.int32
    tables = KernelTables(
        decode_block_tables=torch.tensor([[1, 2], [3, 0]], dtype=i32), decode_seq_lens=torch.tensor([7, 2], dtype=i32),
        num_splits=2, prefill_block_tables=torch.tensor([[4, 5, 6], [7, 0, 0]], dtype=i32),
        prefill_seq_lens=torch.tensor([12, 3], dtype=i32), prefill_query_start=torch.tensor([0, 4, 7], dtype=i32),
        prefill_max_query_len=4)
    meta = AttentionMetadata(slot_mapping=torch.arange(9), num_decodes=2, decode_block_tables=None,
                             decode_seq_lens=None, prefills=[PrefillSeq(2, 4, 12, [4, 5, 6]), PrefillSeq(6, 3, 3, [7])],
                             block_size=4, gpu=tables)
    first, second, third = split_metadata(meta, [(0, 3), (3, 6), (6, 9)])
    g = first.gpu  # both decodes, then the prefill's first token (its context ends at 9)
    assert first.num_decodes == 2 and g.decode_block_tables.tolist() == [[1, 2], [3, 0]]
    assert g.decode_seq_lens.tolist() == [7, 2] and g.num_splits == 2
    assert g.prefill_block_tables.tolist() == [[4, 5, 6]] and g.prefill_seq_lens.tolist() == [9]
    assert g.prefill_query_start.tolist() == [0, 1] and g.prefill_max_query_len == 1
    g = second.gpu  # the first prefill's other 3 tokens
    assert second.num_decodes == 0 and g.decode_block_tables is None and g.decode_seq_lens is None
    assert g.prefill_block_tables.tolist() == [[4, 5, 6]] and g.prefill_seq_lens.tolist() == [12]
    assert g.prefill_query_start.tolist() == [0, 3] and g.prefill_max_query_len == 3
    g = third.gpu  # the second prefill, whole
    assert g.prefill_block_tables.tolist() == [[7, 0, 0]] and g.prefill_seq_lens.tolist() == [3]
    assert g.prefill_query_start.tolist() == [0, 3]
    decodes_only = split_metadata(AttentionMetadata(slot_mapping=torch.arange(2), num_decodes=2,
                                                    decode_block_tables=None, decode_seq_lens=None, block_size=4,
                                                    gpu=tables), [(0, 1), (1, 2)])
    assert [m.gpu.decode_block_tables.tolist() for m in decodes_only] == [[[1, 2]], [[3, 0]]]
    assert all(m.gpu.prefill_block_tables is None for m in decodes_only)
