"""Decode steps as CUDA graphs: one captured forward (+ logits) per batch-size bucket.

A decode step's ~8 kernels per layer cost more to launch from Python than to run at small
batches. Each bucket (1, 2, 4, 8, then every 8 up to max_num_seqs) is captured once at
start-up; a decode batch is padded to the smallest bucket that holds it and replays it.

The graphs read one persistent int32 buffer, laid out as StepInputs packs a padded
decode step (workers/runner/step_inputs.py):

    | input_ids B | positions B | slot_mapping B | seq_lens B | block_tables B x width |

so a step's inputs arrive with one host-to-device copy straight into it. All buckets
share the buffer (their views start at offset 0 with their own B) and one memory pool,
captured largest first so the smaller ones reuse its blocks.

A pipeline stage captures its own layers: stage 0 reads the token ids above, a later stage
also reads a persistent hidden-state buffer [max bucket, hidden] that the previous stage's rows
are copied into before a replay; a stage before the last returns its rows' hidden states, the
last one logits. Sends and receives between stages stay outside the graphs.

Without capture (a capture that failed, or the runner's "eager" graph mode that CPU tests
use) the same buffers, bucketing and padding run eagerly. `enforce_eager` makes no graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from tandem.workers.model.attention import AttentionMetadata, KernelTables
from tandem.workers.runner.graph_inputs import GraphTarget
from tandem.workers.runner.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# (input_ids, positions, meta, the stage's input hidden states or None on stage 0) -> logits
# [rows, vocab] on the last stage, hidden states [rows, hidden] on any other
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None], torch.Tensor]


def capture_buckets(buckets: list[int], capture_one: Callable[[int, tuple[int, int]], None], pool: tuple[int, int],
                    device: torch.device, what: str, show_progress: bool) -> tuple[bool, int]:
    """`capture_one(bucket, pool)` for every bucket, largest first, with a progress bar: (whether
    every one was captured, the device memory they took). A failure (a collective that cannot be
    captured, for instance) is logged; the caller drops its graphs, and those steps run eagerly."""
    free_before = torch.cuda.mem_get_info(device)[0]
    started = time.perf_counter()
    captured = True
    try:
        for bucket in tqdm(sorted(buckets, reverse=True), desc=f"capturing {what} graphs", unit="graph",
                           disable=not show_progress, leave=False):
            capture_one(bucket, pool)
    except Exception as exc:  # a failed capture costs these graphs, not the engine
        logger.warning("%s graph capture failed (%s: %s); those steps run eagerly", what, type(exc).__name__, exc)
        captured = False
    torch.cuda.synchronize(device)
    memory = max(0, free_before - torch.cuda.mem_get_info(device)[0])
    logger.info("captured %s graphs (buckets %d..%d) in %.1f s, %.0f MiB", what, min(buckets), max(buckets),
                time.perf_counter() - started, memory / 2**20)
    return captured, memory


def capture_graph(forward: Callable[[], torch.Tensor], pool: tuple[int, int],
                  device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `forward()` in `pool`, and the output tensor its replays write. Two runs on a
    side stream first compile the kernels and settle cuBLAS's workspace outside the graph."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, the last one covering max_batch."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    if max_batch <= 8:
        return small + [max_batch] if max_batch not in small else small
    return small + list(range(8, max_batch + 8, 8))


@dataclass(frozen=True)
class GraphLayout:
    max_batch: int  # max_num_seqs: the largest bucket holds it
    width: int  # block-table columns: blocks of the longest sequence
    block_size: int
    scratch_block: int  # the block padding rows read and write
    max_context: int  # sizes the flash-decoding splits baked into each graph


class DecodeGraphs:
    def __init__(self, forward: Forward, layout: GraphLayout, device: torch.device,
                 num_splits: Callable[[int, int], int],
                 stage_input: tuple[int, torch.dtype] | None = None) -> None:
        """`stage_input`: (hidden size, dtype) of the hidden states a stage after the first reads."""
        self.forward = forward
        self.buckets = decode_buckets(layout.max_batch)
        self.width = layout.width
        self.block_size = layout.block_size
        self.scratch_block = layout.scratch_block
        self.max_context = layout.max_context
        self.device = device
        # Each bucket's flash-decoding splits, fixed at capture for its longest context: an
        # eager run of the bucket uses the same, so the two paths compute alike.
        self.splits = {b: num_splits(b, layout.max_context) for b in self.buckets}
        top = self.buckets[-1]
        # ... then up to 2 x B indices of tokens scheduled ahead (StepInputs.pending_dst/src) and
        # up to B scored rows (StepInputs.logits_index, where they are not the first rows).
        self.buffer = torch.zeros(7 * top + top * self.width, dtype=torch.int32, device=device)
        self.hidden_in: torch.Tensor | None = None
        if stage_input is not None:
            hidden_size, dtype = stage_input
            self.hidden_in = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each bucket's logits, or hidden states before the last stage
        self.memory_bytes = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def target(self, num_decodes: int) -> GraphTarget | None:
        """The bucket a decode step of `num_decodes` rows pads to, or None if none holds it."""
        for b in self.buckets:
            if b >= num_decodes:
                return GraphTarget(b, self.width, self.buffer, self.splits[b])
        return None

    def run(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """A padded decode step whose inputs are in the buffer: logits [bucket, vocab], or a stage
        before the last's hidden states [bucket, hidden]. `hidden`: the previous stage's rows, for
        a stage after the first (copied into the stage's input buffer; padding rows read zeros)."""
        batch = inputs.graph_batch
        stage_in = self._stage_input(batch, hidden)
        graph = self.graphs.get(batch)
        if graph is None:
            return self.forward(inputs.input_ids, inputs.positions, inputs.meta, stage_in)
        graph.replay()
        return self.outputs[batch]

    def _stage_input(self, batch: int, hidden: torch.Tensor | None) -> torch.Tensor | None:
        if self.hidden_in is None:
            return None
        rows = hidden.shape[0]
        stage_in = self.hidden_in[:batch]
        stage_in[:rows].copy_(hidden)
        stage_in[rows:].zero_()  # a layer may add into its input in place: padding rows start afresh
        return stage_in

    # ---- capture -------------------------------------------------------------------------------
    def capture(self, pool: tuple[int, int] | None = None, show_progress: bool = True) -> None:
        """Capture every bucket, largest first, into `pool` (a new one if None); a failure leaves
        decode steps eager, with a warning."""
        assert self.device.type == "cuda", "CUDA graphs need CUDA"
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        captured, self.memory_bytes = capture_buckets(self.buckets, self._capture_one, pool, self.device, "decode",
                                                      show_progress)
        if not captured:
            self.release()

    def _capture_one(self, batch: int, pool: tuple[int, int]) -> None:
        self._reset_buffer(batch)  # valid inputs at this bucket's offsets for the warm-up runs
        ids, positions, meta = self._static_inputs(batch)
        stage_in = self.hidden_in[:batch] if self.hidden_in is not None else None
        self.graphs[batch], self.outputs[batch] = capture_graph(
            lambda: self.forward(ids, positions, meta, stage_in), pool, self.device)

    def _static_inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the buffer as a step of `batch` rows sees them (the offsets StepInputs packs)."""
        b, w = batch, self.width
        ids, positions, slots, lens = (self.buffer[i * b:(i + 1) * b] for i in range(4))
        tables = self.buffer[4 * b:4 * b + b * w].view(b, w)
        gpu = KernelTables(decode_block_tables=tables, decode_seq_lens=lens,
                           num_splits=self.splits[b], prefill_block_tables=None,
                           prefill_seq_lens=None, prefill_query_start=None, prefill_max_query_len=0)
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=b, decode_block_tables=None, decode_seq_lens=None,
                                 prefills=[], block_size=self.block_size, gpu=gpu)
        return ids, positions, meta

    def _reset_buffer(self, batch: int) -> None:
        """Every row a padding row (scratch block, one key) while the graphs are captured."""
        b = batch
        self.buffer.zero_()
        self.buffer[2 * b:3 * b] = self.scratch_block * self.block_size
        self.buffer[3 * b:4 * b] = 1
        self.buffer[4 * b:4 * b + b * self.width].view(b, self.width)[:, 0] = self.scratch_block

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
