"""Mixed steps as CUDA graphs: prompt chunks beside decodes, one captured forward (+ the
scored rows' logits) per token-count bucket.

A step that admits a request carries a prompt chunk beside the running decodes. Run eagerly
it launches every kernel from Python (about 165 for a 16-layer Llama), which at a few hundred
tokens takes the host longer than the GPU takes to run them, so under a stream of arrivals
the decodes wait on the host at every admission. Each bucket (16 tokens up to
`max_mixed_graph_tokens`, 2048 by default, never past the step budget) is captured once at
start-up; a step of up to `MAX_PREFILLS` prompt chunks and at most the bucket's tokens is
padded to it and replays it. Larger steps run eagerly. Even a 2048-token step of a 1B model
is host-bound when eager: with graphs up to 2048 tokens instead of 512, the offline set ran
1.26x faster on an H100 and its GPU's busy share rose from 0.84 to 0.89 (bench/RESULTS.md).

A bucket of T tokens holds D = min(max_num_seqs, T) decode rows and `MAX_PREFILLS` prefill
sequences; the step's inputs land in one persistent int32 buffer laid out as
`graph_inputs.mixed_layout` says, with one host-to-device copy. Attention runs over the padded
shapes (`KernelTables.fixed_layout`): padding tokens write no KV, padding rows and sequences
attend to nothing. The graphs share the decode graphs' memory pool and are captured before
them (their activations are the larger).

Without capture (the runner's "eager" graph mode, which CPU tests use) the same buffer,
bucketing and padding run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.workers.model.attention import AttentionMetadata
from tandem.workers.runner.cuda_graphs import GraphLayout, capture_buckets, capture_graph
from tandem.workers.runner.graph_inputs import MixedTarget, mixed_layout, mixed_step_views
from tandem.workers.runner.step_inputs import StepInputs

# (input_ids, positions, meta, logits_index) -> logits [len(logits_index), vocab]
MixedForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]

# Prompt chunks a mixed graph holds: a step admitting more runs eagerly.
MAX_PREFILLS = 16


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to `max_tokens` (the last one; a step never holds more): every 16 to
    64, every 32 to 256, every 64 to 512, every 128 to 1024, every 256 to 2048, every 512
    beyond. A step pads by at most an eighth of its tokens past 64."""
    steps = [*range(16, 65, 16), *range(96, 257, 32), *range(320, 513, 64), *range(640, 1025, 128),
             *range(1280, 2049, 256), *range(2560, max(max_tokens, 2560) + 1, 512)]
    return [b for b in steps if b < max_tokens] + [max_tokens]


class MixedGraphs:
    def __init__(self, forward: MixedForward, layout: GraphLayout, max_tokens: int, device: torch.device,
                 num_splits: Callable[[int, int], int]) -> None:
        self.forward = forward
        self.buckets = mixed_buckets(max_tokens)
        self.width = layout.width
        self.block_size = layout.block_size
        self.device = device
        self.decodes = {t: min(layout.max_batch, t) for t in self.buckets}
        # Each bucket's flash-decoding splits, fixed at capture for the longest context.
        self.splits = {t: num_splits(self.decodes[t], layout.max_context) for t in self.buckets}
        top = self.buckets[-1]
        self.buffer = torch.zeros(sum(mixed_layout(top, self.decodes[top], MAX_PREFILLS, self.width)),
                                  dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0

    def target(self, num_tokens: int, num_prefills: int) -> MixedTarget | None:
        """The bucket a mixed step of `num_tokens` tokens with `num_prefills` prompt chunks pads
        to, or None if none holds it (its decodes always fit: D >= min(max_num_seqs, tokens))."""
        if num_prefills > MAX_PREFILLS:
            return None
        for t in self.buckets:
            if t >= num_tokens:
                return MixedTarget(t, self.decodes[t], MAX_PREFILLS, self.width, self.buffer, self.splits[t])
        return None

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [D + MAX_PREFILLS, vocab] of a padded mixed step whose inputs are in the buffer:
        its scored rows first, in order."""
        graph = self.graphs.get(inputs.graph_tokens)
        if graph is None:
            return self.forward(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_index)
        graph.replay()
        return self.logits[inputs.graph_tokens]

    # ---- capture -------------------------------------------------------------------------------
    def capture(self, pool: tuple[int, int], show_progress: bool = True) -> None:
        """Capture every bucket, largest first, into `pool`; a failure leaves mixed steps eager."""
        captured, self.memory_bytes = capture_buckets(self.buckets, self._capture_one, pool, self.device,
                                                      "mixed-step", show_progress)
        if not captured:
            self.release()

    def _capture_one(self, tokens: int, pool: tuple[int, int]) -> None:
        ids, positions, meta, logits_index = self.static_inputs(tokens)
        self.graphs[tokens], self.logits[tokens] = capture_graph(
            lambda: self.forward(ids, positions, meta, logits_index), pool, self.device)

    def static_inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Views of the buffer as a step of the bucket sees them, holding an all-padding step:
        no token writes KV, no row or sequence attends."""
        self.buffer.zero_()
        ids, positions, meta, logits_index, _, _ = mixed_step_views(
            self.buffer, self.target(tokens, 0), self.block_size)
        meta.slot_mapping.fill_(-1)
        return ids, positions, meta, logits_index

    def release(self) -> None:
        self.graphs.clear()
        self.logits.clear()
