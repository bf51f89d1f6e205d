"""GPU memory: how much the KV cache may take, and giving it all back at shutdown.

The KV cache gets what `gpu_memory_utilization` of the card leaves once everything else
this engine needs is counted: the weights (already loaded), the peak activations of the
largest step the scheduler may send (a prefill of `max_num_batched_tokens` tokens over
up to `max_num_seqs` sequences, profiled with a one-block KV cache whose block tables
all point at block 0, scoring one slice of prompt positions for `prompt_logprobs`), and,
with CUDA graphs, their private pool (as large as the largest decode step's activations).
Whatever else is on the card (the CUDA context, another process, an earlier engine not yet
collected) counts as used, so the card's total use stays under the fraction.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from tandem.workers.config import SchedulerConfig
from tandem.workers.core.request import SamplingParams
from tandem.workers.core.scheduler_output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from tandem.workers.runner.model_runner import ModelRunner


PROFILED_TOP_LOGPROBS = 20  # the top-k of a profiled prompt-logprob slice (the API's max_logprobs default)


def kv_budget(device: torch.device, utilization: float, reserve: int) -> int:
    """Bytes the KV cache may take: the card's allowed use, less what is in use now and `reserve`."""
    release(device)  # an engine nobody holds any more (graphs, caches in reference cycles) frees its memory
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total * utilization) - (total - free) - reserve)


@torch.inference_mode()
def profile_steps(runner: ModelRunner, sched: SchedulerConfig) -> tuple[int, int]:
    """(peak activation bytes of the largest prefill step, of the largest decode step)."""
    from tandem.workers.runner.block_table import BlockTable
    from tandem.workers.runner.step_inputs import InputBuilder

    device = runner.device
    saved = [(a.key_cache, a.value_cache) for a in runner.model.attention_layers]
    for attn in runner.model.attention_layers:  # one block plus the scratch block, in the cache's dtype
        shape = (2 * runner.block_size, attn.num_kv_heads, attn.head_dim)
        attn.key_cache = torch.zeros(shape, dtype=runner.kv_dtype, device=device)
        attn.value_cache = torch.zeros(shape, dtype=runner.kv_dtype, device=device)
    builder = InputBuilder(runner.block_size, device, 1, runner.use_gpu_kernels, lambda b, c: 1)
    table = BlockTable(runner._max_blocks_per_seq())  # all zeros: every block is block 0
    try:
        num_tokens = min(sched.max_num_batched_tokens, runner.max_model_len * sched.max_num_seqs)
        num_seqs = max(1, min(sched.max_num_seqs, num_tokens))
        # A prefill step may score its prompt positions (prompt_logprobs): one slice of those
        # rows' logits and log-softmax is in its peak (ModelRunner.prompt_logprobs).
        prefill = _peak_of(runner, builder, table, _dummy_step(num_tokens, num_seqs, runner.max_model_len, 0),
                           score_prompt=True)
        # A decode step's activations hardly depend on its context: a short one stands for all.
        context = min(runner.max_model_len, 4 * runner.block_size)
        decode = _peak_of(runner, builder, table, _dummy_step(sched.max_num_seqs, sched.max_num_seqs, context,
                                                              context - 1))
    finally:
        for attn, (k, v) in zip(runner.model.attention_layers, saved):
            attn.key_cache, attn.value_cache = k, v
    return prefill, decode


def _dummy_step(num_tokens: int, num_seqs: int, max_len: int, computed: int) -> tuple[SchedulerOutput, dict]:
    """A step of num_seqs sequences sharing num_tokens tokens (each at most max_len), every one of
    whose blocks is block 0; `computed` tokens of each already cached (a decode when num == 1)."""
    from tandem.workers.runner.request_state import CachedRequestState

    base, extra = divmod(num_tokens, num_seqs)
    out = SchedulerOutput(step_id=-1)
    states = {}
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for i in range(num_seqs):
        num = min(base + (i < extra), max_len - computed)
        req_id = f"profile-{i}"
        length = computed + num
        states[req_id] = CachedRequestState([0] * length, [], params, [0] * length, row=0)
        out.new_requests.append(NewRequestData(req_id, [0] * length, [], params, [0] * length, computed))
        out.num_scheduled_tokens[req_id] = num
    return out, states


def _peak_of(runner: ModelRunner, builder, table, step: tuple[SchedulerOutput, dict],
             score_prompt: bool = False) -> int:
    out, states = step
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    inputs = builder.build(out, states, table)
    model = runner.model
    hidden = None
    if not runner.ctx.is_first_stage:
        hidden = torch.zeros(inputs.input_ids.shape[0], runner.hf_config.hidden_size, dtype=runner.dtype,
                             device=device)
    hidden = model(inputs.input_ids if runner.ctx.is_first_stage else None, inputs.positions, inputs.meta, hidden)
    if runner.ctx.is_last_stage:
        logits = model.compute_logits(hidden[inputs.logits_index])
        logits.float().argmax(-1)  # the sampler's float32 copy of the logits
        if score_prompt:
            from tandem.workers.sample.sampler import logprob_tensors

            rows = min(runner.prompt_logprob_rows, hidden.shape[0])
            scored = model.compute_logits(hidden[:rows])
            logprob_tensors(scored, torch.zeros(rows, dtype=torch.long, device=device), PROFILED_TOP_LOGPROBS)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del inputs, hidden
    torch.cuda.empty_cache()
    return peak


def release(device: torch.device) -> None:
    """Collect what the caller dropped and hand the cached device memory back to the driver."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
