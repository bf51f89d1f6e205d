"""Mixed-step graph buckets and the step each one takes (no capture: CPU)."""

from __future__ import annotations

import torch

from tandem.workers.runner.cuda_graphs import GraphLayout
from tandem.workers.runner.graph_inputs import mixed_layout
from tandem.workers.runner.mixed_graphs import MAX_PREFILLS, MixedGraphs, mixed_buckets


def test_buckets_grow_coarser_and_stop_at_the_largest_step() -> None:
    assert mixed_buckets(512) == [16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert mixed_buckets(2048) == mixed_buckets(512) + [640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    assert mixed_buckets(3000) == mixed_buckets(2048) + [2560, 3000]
    assert mixed_buckets(4096) == mixed_buckets(2048) + [2560, 3072, 3584, 4096]
    assert mixed_buckets(700) == mixed_buckets(512) + [640, 700]
    assert mixed_buckets(100) == [16, 32, 48, 64, 96, 100]
    assert mixed_buckets(40) == [16, 32, 40]
    assert mixed_buckets(16) == [16]


def test_a_step_pads_to_the_smallest_bucket_that_holds_its_tokens_and_chunks() -> None:
    layout = GraphLayout(max_batch=24, width=5, block_size=4, scratch_block=9, max_context=20)
    graphs = MixedGraphs(lambda *args: None, layout, max_tokens=100, device=torch.device("cpu"),
                         num_splits=lambda batch, context: 100 + batch)
    assert graphs.buckets == [16, 32, 48, 64, 96, 100]
    # Decode rows: as many as the bucket has tokens, at most max_num_seqs.
    assert graphs.decodes == {16: 16, 32: 24, 48: 24, 64: 24, 96: 24, 100: 24}
    target = graphs.target(num_tokens=17, num_prefills=2)
    assert (target.tokens, target.decodes, target.prefills, target.width, target.num_splits) == (32, 24, 16, 5, 124)
    assert target.buffer is graphs.buffer
    assert graphs.target(16, 1).tokens == 16
    assert graphs.target(101, 1) is None  # more tokens than the largest bucket: eager
    assert graphs.target(40, MAX_PREFILLS + 1) is None  # more prompt chunks than a graph holds: eager
    assert graphs.buffer.numel() == sum(mixed_layout(100, 24, MAX_PREFILLS, 5))
    # Capture's inputs: an all-padding step (no KV written, nothing attended, scored row 0).
    ids, positions, meta, logits_index = graphs.static_inputs(48)
    assert ids.shape == positions.shape == meta.slot_mapping.shape == (48,)
    assert bool((meta.slot_mapping == -1).all()) and logits_index.shape == (24 + MAX_PREFILLS,)
    gpu = meta.gpu
    assert gpu.fixed_layout and gpu.decode_block_tables.shape == (24, 5) and int(gpu.decode_seq_lens.sum()) == 0
    assert gpu.prefill_block_tables.shape == (MAX_PREFILLS, 5) and int(gpu.prefill_query_start.abs().sum()) == 0
    assert gpu.prefill_max_query_len == 48 and gpu.num_splits == 124
