"""Turns a step message into tensors, runs this stage's layers, and (last stage) samples.

The runner keeps each request's token ids and block table, updated from the
scheduler's diffs; it never decides anything on its own. Draft tokens (speculative
decoding) are scored in the same pass: the target samples at every draft position
and keeps drafts while they equal its own sample, then adds one more token. That
is exactly the target's own sampling run, position by position, so greedy and
seeded outputs are unchanged by speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.workers.config import EngineConfig
from tandem.workers.kernels import cpu_kernels
from tandem.workers.model.attention import AttentionMetadata, PrefillSeq
from tandem.workers.kernels.huge_pages import zeros_huge
from tandem.workers.model.layers import pack_cpu_weights, use_fast_gemm_layout
from tandem.workers.model.loader import load_weights
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.model.llama import LlamaForCausalLM
from tandem.workers.distributed.parallel import ParallelContext
from tandem.workers.core.request import PositionLogprobs, SamplingParams
from tandem.workers.sample.rejection_sampler import rejection_sample
from tandem.workers.sample.sampler import Sampler, SamplingRow, compute_logprobs
from tandem.workers.core.scheduler_output import RunnerOutput, SchedulerOutput


@dataclass
class CachedRequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class StepInputs:
    """One step's tensors, plus which rows of the last hidden states to score."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    req_ids: list[str]  # in the order their tokens appear
    logits_rows: list[list[int]]  # per request: token indices to score ([] = partial prefill)
    drafts: list[list[int]]
    # Requests asking for prompt logprobs: (req_id, first prompt index scored, token rows, prompt tokens)
    prompt_rows: list[tuple[str, int, list[int], list[int]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, model_dir: str, ctx: ParallelContext,
                 device: torch.device) -> None:
        self.config = config
        self.hf_config = hf_config
        self.model_dir = model_dir
        self.ctx = ctx
        self.device = device
        self.dtype = hf_config.resolve_dtype(config.model.dtype, device)
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len or hf_config.max_position_embeddings
        self.states: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(seed=config.model.seed)
        self.model: LlamaForCausalLM | None = None
        self.num_blocks = 0
        self.host_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- set-up ----------------------------------------------------------------------------
    def load_model(self, show_progress: bool = True) -> None:
        torch.manual_seed(self.config.model.seed)
        # Positions up to max_model_len plus room for draft tokens past the last one.
        max_positions = self.max_model_len + self.config.scheduler.num_lookahead_slots + 1
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.hf_config, self.ctx, self.dtype, max_positions)
        load_weights(self.model, self.model_dir, show_progress=show_progress)
        use_fast_gemm_layout(self.model)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            cpu_kernels.activate()
            if self.config.model.cpu_packed_weights:
                pack_cpu_weights(self.model)
        self.model.eval()

    def kv_bytes_per_block(self) -> int:
        attn = self.model.attention_layers[0]
        per_layer = 2 * self.block_size * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize
        return per_layer * len(self.model.layers)

    def available_kv_memory(self) -> int:
        cache = self.config.cache
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            return max(0, int(total * cache.gpu_memory_utilization) - used_by_others)
        from tandem.workers.config import DEFAULT_CPU_KV_CACHE_BYTES
        return cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES

    def num_blocks_fit(self) -> int:
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        return self.available_kv_memory() // self.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        for attn in self.model.attention_layers:
            shape = (num_blocks * self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.key_cache, attn.value_cache = (self._zeros(shape) for _ in range(2))

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":  # decode reads blocks scattered over the cache: huge pages
            return zeros_huge(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- the host KV tier and block transfer (host_tier.py) -----------------------------------
    def init_host_cache(self, num_slots: int) -> None:
        """Host-memory slots for evicted KV blocks: per layer, K and V of this rank's shard."""
        pin = self.device.type == "cuda"  # pinned pages: the copies run at full PCIe speed
        self.host_cache = [
            tuple(torch.zeros((num_slots, self.block_size, attn.num_kv_heads, attn.head_dim), dtype=self.dtype,
                              pin_memory=pin) for _ in range(2))
            for attn in self.model.attention_layers]

    def _block_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        views = []
        for attn in self.model.attention_layers:
            shape = (self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            views.append((attn.key_cache.view(shape), attn.value_cache.view(shape)))
        return views

    @torch.inference_mode()
    def apply_host_copies(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Saves (device block -> host slot) first, then loads (host slot -> device block)."""
        for pairs, to_host in ((saves, True), (loads, False)):
            if not pairs:
                continue
            src, dst = zip(*pairs)
            for device_kv, host_kv in zip(self._block_views(), self.host_cache):
                for dev, host in zip(device_kv, host_kv):
                    if to_host:
                        blocks = torch.tensor(src, device=self.device)
                        host.index_copy_(0, torch.tensor(dst), dev.index_select(0, blocks).to("cpu"))
                    else:
                        rows = host.index_select(0, torch.tensor(src)).to(self.device, non_blocking=True)
                        dev.index_copy_(0, torch.tensor(dst, device=self.device), rows)

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's KV of some device blocks, on the CPU: [layers, 2, blocks, block_size, heads, dim]."""
        index = torch.tensor(block_ids, device=self.device)
        return torch.stack([torch.stack([kv.index_select(0, index) for kv in layer])
                            for layer in self._block_views()]).to("cpu")

    @torch.inference_mode()
    def import_host_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        """Write blocks exported by another group (same layout) into host slots."""
        index = torch.tensor(slots)
        for layer, host_kv in zip(data, self.host_cache):
            for part, host in zip(layer, host_kv):
                host.index_copy_(0, index, part.to(host.dtype))

    # ---- one step ----------------------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        if out.host_saves or out.host_loads:
            self.apply_host_copies(out.host_saves, out.host_loads)
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.new_requests:
            self.states[new.req_id] = CachedRequestState(
                list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params, list(new.block_ids))
        for diff in out.cached_requests:
            state = self.states[diff.req_id]
            state.output_token_ids.extend(diff.new_token_ids)
            del state.block_ids[diff.num_kept_blocks:]
            state.block_ids.extend(diff.new_block_ids)

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        computed = {r.req_id: r.num_computed_tokens for r in out.new_requests}
        computed.update({r.req_id: r.num_computed_tokens for r in out.cached_requests})
        # Decodes (exactly one new token, no drafts) first: they batch into one attention call.
        order = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        num_decodes = sum(1 for r in order if out.num_scheduled_tokens[r] == 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[list[int]] = []
        drafts: list[list[int]] = []
        prefills: list[PrefillSeq] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prompt_rows: list[tuple[str, int, list[int], list[int]]] = []
        for req_id in order:
            state = self.states[req_id]
            start, num = computed[req_id], out.num_scheduled_tokens[req_id]
            draft = out.spec_token_ids.get(req_id, [])
            tokens = state.token_ids()
            seq_tokens = tokens[start:start + num - len(draft)] + draft
            q_start = len(input_ids)
            input_ids.extend(seq_tokens)
            pos = range(start, start + num)
            positions.extend(pos)
            table = state.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            end = start + num
            if end - len(draft) >= len(tokens):  # reaches the last known token: sample
                logits_rows.append(list(range(q_start + num - 1 - len(draft), q_start + num)))
            else:
                logits_rows.append([])
            drafts.append(draft)
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                # Position p's logits score prompt token p + 1.
                last = min(end, num_prompt - 1)
                prompt_rows.append((req_id, start + 1, list(range(q_start, q_start + last - start)),
                                    state.prompt_token_ids[start + 1:last + 1]))
            if num == 1:
                decode_tables.append(table[:(end + bs - 1) // bs])
                decode_lens.append(end)
            else:
                prefills.append(PrefillSeq(q_start, num, end, torch.tensor(
                    table[:(end + bs - 1) // bs], dtype=torch.long, device=self.device)))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=num_decodes,
            decode_block_tables=decode_tables or None,
            decode_seq_lens=decode_lens or None,
            prefills=prefills,
            block_size=bs,
        )
        return StepInputs(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                          torch.tensor(positions, dtype=torch.long, device=self.device),
                          meta, order, logits_rows, drafts, prompt_rows)

    def execute(self, out: SchedulerOutput, hidden: torch.Tensor | None = None) -> RunnerOutput | torch.Tensor | None:
        """Run one step. Non-last pipeline stages return hidden states for the next stage."""
        self.update_states(out)
        return self.execute_batch(out, hidden)

    @torch.inference_mode()
    def execute_batch(self, out: SchedulerOutput,
                      hidden: torch.Tensor | None = None) -> RunnerOutput | torch.Tensor | None:
        """Run requests whose state is already up to date (a step, or one micro-batch of it).

        The last stage's TP rank 0 samples; its other TP ranks only take part in the logits
        gather and return None.
        """
        if out.is_empty:
            return RunnerOutput([], [], []) if self.ctx.tp_rank == 0 else None
        inputs = self.prepare_inputs(out)
        hidden = self.model(inputs.input_ids if self.ctx.is_first_stage else None, inputs.positions,
                            inputs.meta, hidden)
        if not self.ctx.is_last_stage:
            return hidden
        return self.sample(inputs, hidden)

    def prompt_logprobs(self, inputs: StepInputs,
                        hidden: torch.Tensor) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        """Logprobs of the prompt tokens this step's chunks score (every TP rank joins the gather)."""
        if not inputs.prompt_rows:
            return {}
        rows = [r for _, _, req_rows, _ in inputs.prompt_rows for r in req_rows]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        if self.ctx.tp_rank != 0:
            return {}
        targets = [t for _, _, _, tokens in inputs.prompt_rows for t in tokens]
        num_top = [self.states[req_id].sampling_params.prompt_logprobs
                   for req_id, _, req_rows, _ in inputs.prompt_rows for _ in req_rows]
        entries = compute_logprobs(logits, targets, num_top)
        out, k = {}, 0
        for req_id, first, req_rows, _ in inputs.prompt_rows:
            out[req_id] = (first, entries[k:k + len(req_rows)])
            k += len(req_rows)
        return out

    def sample(self, inputs: StepInputs, hidden: torch.Tensor) -> RunnerOutput | None:
        prompt_logprobs = self.prompt_logprobs(inputs, hidden)
        flat_rows = [i for rows in inputs.logits_rows for i in rows]
        if not flat_rows:
            if self.ctx.tp_rank != 0:
                return None
            return RunnerOutput(inputs.req_ids, [[] for _ in inputs.req_ids], [None] * len(inputs.req_ids),
                                prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(flat_rows, device=self.device)])
        if self.ctx.tp_rank != 0:
            return None
        rows: list[SamplingRow] = []
        for req_id, idx, draft in zip(inputs.req_ids, inputs.logits_rows, inputs.drafts):
            state = self.states[req_id]
            for j in range(len(idx)):
                outputs = state.output_token_ids + draft[:j]
                rows.append(SamplingRow(state.sampling_params, state.prompt_token_ids, outputs,
                                        self._suppressed(state.sampling_params, len(outputs))))
        result = self.sampler(logits, rows)
        sampled: list[list[int]] = []
        logprobs: list[list | None] = []
        num_drafts = num_accepted = 0
        k = 0
        for idx, draft in zip(inputs.logits_rows, inputs.drafts):
            tokens = result.token_ids[k:k + len(idx)]
            lps = result.logprobs[k:k + len(idx)]
            if draft and not rows[k].params.is_greedy:
                tokens, lps = self._verify_sampled(logits[k:k + len(idx)], rows[k:k + len(idx)], draft)
            else:
                # Greedy: keep drafts while they equal the target's argmax, then its next token.
                accepted = 0
                while accepted < len(draft) and tokens[accepted] == draft[accepted]:
                    accepted += 1
                tokens, lps = tokens[:accepted + 1], lps[:accepted + 1]
            k += len(idx)
            sampled.append(tokens if idx else [])
            logprobs.append(lps if idx and lps[0] is not None else None)
            num_drafts += len(draft)
            num_accepted += len(tokens) - 1 if idx and draft else 0
        return RunnerOutput(inputs.req_ids, sampled, logprobs, num_drafts, num_accepted, prompt_logprobs)

    def _verify_sampled(self, logits: torch.Tensor, rows: list[SamplingRow],
                        draft: list[int]) -> tuple[list[int], list]:
        """Rejection-sample a sampled request's drafts against its processed target distribution."""
        probs = self.sampler.probs(logits, rows)
        # Seeded from (seed, first draft position): reproducible whatever the batch.
        tokens = rejection_sample(probs, draft, None, self.sampler.generator_for(rows[0], logits.device))
        num_top = rows[0].params.logprobs
        lps = compute_logprobs(logits[:len(tokens)], tokens, [num_top] * len(tokens))
        return tokens, lps

    def _suppressed(self, params: SamplingParams, num_outputs: int) -> tuple[int, ...]:
        if num_outputs >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.hf_config.eos_token_ids
        return tuple(eos) + tuple(params.stop_token_ids)
