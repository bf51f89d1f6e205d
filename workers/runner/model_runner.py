"""Turns a step message into tensors, runs this stage's layers, and (last stage) samples.

The runner keeps each request's token ids and block table, updated from the
scheduler's diffs (request_state.py); it never decides anything on its own. A step's
inputs reach the device in one copy (step_inputs.py); on CUDA, decode steps replay
captured graphs (cuda_graphs.py, graph_steps.py) and greedy steps leave their sampled
tokens in flight (step_sampler.py), so the caller can do the next step's host work meanwhile.

The KV cache (kv_cache.py) holds one block more than the pool hands out: the scratch block,
which padding rows of a graph batch read and write, and which no request ever holds.
"""

from __future__ import annotations

import logging

import torch

from tandem.workers.config import EngineConfig
from tandem.workers.core.request import PENDING_TOKEN, PositionLogprobs
from tandem.workers.core.scheduler_output import PendingOutput, RunnerOutput, SchedulerOutput
from tandem.workers.distributed.parallel import ParallelContext
from tandem.workers.kernels import cpu_kernels, gpu_kernels, kv_quant
from tandem.workers.kernels.decode_splits import default_num_splits
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.model.layers import pack_cpu_weights, use_fast_gemm_layout
from tandem.workers.model.llama import LlamaForCausalLM
from tandem.workers.model.loader import load_weights
from tandem.workers.quant.memory import log_weights
from tandem.workers.quant.scheme import resolve_scheme
from tandem.workers.runner import gpu_memory
from tandem.workers.runner.block_table import BlockTable
from tandem.workers.runner.cuda_graphs import DecodeGraphs, GraphLayout
from tandem.workers.runner.graph_steps import graph_logits, graph_target
from tandem.workers.runner.kv_cache import ExportedKV, KVCache
from tandem.workers.runner.mixed_graphs import MixedGraphs
from tandem.workers.runner.request_state import CachedRequestState, apply_step_diffs, fill_placeholders
from tandem.workers.runner.step_inputs import InputBuilder, StepInputs, advance_decodes, copy_pending
from tandem.workers.sample.pass_sampler import PassSampler
from tandem.workers.sample.sampler import Sampler, compute_logprobs
from tandem.workers.sample.step_sampler import StepSampler
from tandem.workers.structured.bitmask import apply_token_masks

# Prompt positions scored at once: their logits and log-softmax are vocabulary-wide float32
# rows (128k vocabulary: 0.5 MiB each), so a step's whole prefill chunk at once (thousands of
# rows) could take gigabytes. This many at a time bounds it; the KV cache is sized with one
# such slice in the profiled peak (gpu_memory.profile_steps).
PROMPT_LOGPROB_ROWS = 256

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, model_dir: str, ctx: ParallelContext,
                 device: torch.device) -> None:
        self.config = config
        self.hf_config = hf_config
        self.model_dir = model_dir
        self.ctx = ctx
        self.device = device
        self.dtype = hf_config.resolve_dtype(config.model.dtype, device)
        self.kv_dtype = kv_quant.cache_dtype(config.cache.kv_cache_dtype, self.dtype)  # the model's, or FP8
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len or hf_config.max_position_embeddings
        self.states: dict[str, CachedRequestState] = {}
        self.prompt_logprob_rows = PROMPT_LOGPROB_ROWS
        self.sampler = Sampler(seed=config.model.seed)
        self.step_sampler = StepSampler(self.sampler, hf_config.eos_token_ids)
        self.model: LlamaForCausalLM | None = None
        self.kv_cache: KVCache | None = None  # made with the model (it lives in the attention layers)
        self.use_gpu_kernels = (gpu_kernels.wanted(config.model.attention_backend, device)
                                and self._kernels_take_kv_dtype(config.model.attention_backend))
        self.block_table = BlockTable(self._max_blocks_per_seq())
        self.builder: InputBuilder | None = None  # made with the KV cache (it knows the scratch block)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None  # steps with prompt chunks beside decodes
        self.activation_bytes = 0  # CUDA: peak activation memory of the largest step (profiled)
        # The last step's sampled tokens where they are (device), and request -> index among
        # them (of its last pass, for a multi-step step): a step scheduled ahead reads its
        # pending tokens from here. And that step's output, which fills the placeholders.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._last_output: PendingOutput | None = None

    # ---- set-up ----------------------------------------------------------------------------
    def load_model(self, show_progress: bool = True) -> None:
        torch.manual_seed(self.config.model.seed)
        # Positions up to max_model_len plus room for draft tokens past the last one.
        max_positions = self.max_model_len + self.config.scheduler.num_lookahead_slots + 1
        scheme = resolve_scheme(self.config.model.quantization, self.hf_config.quantization_config)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.hf_config, self.ctx, self.dtype, max_positions, scheme)
        load_weights(self.model, self.model_dir, revision=self.config.model.revision, show_progress=show_progress,
                     kv_scales=self.config.cache.kv_cache_dtype != "auto")
        self.model.quantize_loaded()
        log_weights(self.model, scheme, self.device)
        use_fast_gemm_layout(self.model)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            cpu_kernels.activate()
            if self.config.model.cpu_packed_weights:
                pack_cpu_weights(self.model)
        gpu_kernels.configure(self.use_gpu_kernels, self.device)
        self.model.eval()
        for attn in self.model.attention_layers:  # the kernels take python floats (a loader may set tensors)
            attn.k_scale, attn.v_scale = kv_quant.as_float_scale(attn.k_scale), kv_quant.as_float_scale(attn.v_scale)
        self.kv_cache = KVCache(self.model, self.block_size, self.kv_dtype, self.device)

    def kv_bytes_per_block(self) -> int:
        return self.kv_cache.bytes_per_block()

    def available_kv_memory(self) -> int:
        cache = self.config.cache
        if self.device.type == "cuda":
            # The largest steps the scheduler may send, profiled without a KV cache: what
            # they allocate must stay free beside it (graphs: their own pool, as large as
            # the largest decode step's, or mixed step's, which is at most a prefill's).
            prefill, decode = gpu_memory.profile_steps(self, self.config.scheduler)
            self.activation_bytes = prefill
            graphs = 0
            if self._graph_mode() == "capture":
                graphs = max(decode, prefill) if self._mixed_graphs_wanted() else decode
            reserve = prefill + graphs
            return gpu_memory.kv_budget(self.device, cache.gpu_memory_utilization, reserve)
        from tandem.workers.config import DEFAULT_CPU_KV_CACHE_BYTES
        return cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES

    @property
    def num_blocks(self) -> int:
        """KV blocks allocated for the pool (0 before `init_kv_cache`)."""
        return self.kv_cache.num_blocks if self.kv_cache is not None else 0

    def num_blocks_fit(self) -> int:
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        return self.available_kv_memory() // self.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int, show_progress: bool = False) -> None:
        """num_blocks for the pool, plus the scratch block (id num_blocks) for padding rows."""
        self._kv_heads = self.model.attention_layers[0].num_kv_heads
        self.kv_cache.allocate(num_blocks)
        self.builder = InputBuilder(self.block_size, self.device, num_blocks, self.use_gpu_kernels,
                                    self._num_splits, host_lists=self.ctx.overlaps_comm)
        mode = self._graph_mode()
        if mode is not None:
            layout = GraphLayout(self.config.scheduler.max_num_seqs, self._max_blocks_per_seq(self._capture_len()),
                                 self.block_size, num_blocks, self._capture_len())
            stage_input = None if self.ctx.is_first_stage else (self.hf_config.hidden_size, self.dtype)
            self.graphs = DecodeGraphs(self._decode_forward, layout, self.device, self._num_splits, stage_input)
            if self._mixed_graphs_wanted():
                max_tokens = min(self.config.scheduler.max_num_batched_tokens,
                                 self.config.model.max_mixed_graph_tokens)
                self.mixed_graphs = MixedGraphs(self._mixed_forward, layout, max_tokens, self.device,
                                                self._num_splits)
            if mode == "capture":
                with torch.inference_mode():
                    pool = torch.cuda.graph_pool_handle()  # one pool: the larger mixed graphs first
                    if self.mixed_graphs is not None:
                        self.mixed_graphs.capture(pool, show_progress)
                    self.graphs.capture(pool, show_progress)

    def _kernels_take_kv_dtype(self, backend: str) -> bool:
        """Triton's float8e4nv needs sm_89 or later (Ada, Hopper): on an older GPU an FP8 cache
        goes to the torch path (dequantized as it is gathered), or a ValueError if Triton was asked."""
        if (not kv_quant.is_fp8(self.kv_dtype) or self.device.type != "cuda"
                or torch.cuda.get_device_capability(self.device) >= (8, 9)):
            return True
        if backend == "triton":
            raise ValueError("attention_backend: triton reads an FP8 KV cache on sm_89 or later GPUs only "
                             "(use kv_cache_dtype auto, or attention_backend torch)")
        logger.warning("kv_cache_dtype fp8 on a GPU before sm_89: attention takes the torch path")
        return False

    def _graph_mode(self) -> str | None:
        """"capture" (CUDA, the Triton kernels, not enforce_eager): decode steps replay CUDA graphs,
        each pipeline stage its own layers'; None: no bucketing. "eager" pads decode steps to the
        same buckets and runs them without capture: tests use it to run the graph path on CPU."""
        if self.config.model.enforce_eager:
            return None
        if self.device.type == "cuda" and self.use_gpu_kernels:
            return "capture"
        return None

    def _mixed_graphs_wanted(self) -> bool:
        """Mixed steps get graphs where decode steps do, unless turned off (`mixed_step_graphs`):
        on the Triton kernels (their padded layout is the kernels'), in one process's forward
        (TP's overlapped micro-chunks cut a step's tensors at run time), in one stage (a mixed
        graph keeps only its scored rows, where a stage before the last hands on every row)."""
        return (self._graph_mode() is not None and self.use_gpu_kernels and self.config.model.mixed_step_graphs
                and not self.ctx.overlaps_comm and self.ctx.pp_size == 1)

    def _max_blocks_per_seq(self, max_len: int | None = None) -> int:
        max_len = (max_len or self.max_model_len) + self.config.scheduler.num_lookahead_slots + 1
        return -(-max_len // self.block_size)

    def _capture_len(self) -> int:
        """The longest sequence a decode graph takes (longer ones' steps run eagerly)."""
        return min(self.max_model_len, self.config.model.max_seq_len_to_capture)

    def _num_splits(self, batch: int, max_context: int) -> int:
        """Flash-decoding splits of a decode step (asked every eager step: kept cheap)."""
        return default_num_splits(batch, self._kv_heads, max_context, self.block_size, gpu_kernels.num_sms())

    def release(self) -> None:
        """Drop the model, caches and graphs, and give their device memory back."""
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.mixed_graphs = None
        self.builder = None
        self.model = None
        self.kv_cache = None
        self.states.clear()
        gpu_memory.release(self.device)

    # ---- the host KV tier and block transfer (kv_cache.py) ---------------------------------------
    def init_host_cache(self, num_slots: int) -> None:
        self.kv_cache.init_host_cache(num_slots)

    def export_blocks(self, block_ids: list[int]) -> ExportedKV:
        return self.kv_cache.export_blocks(block_ids)

    def import_host_blocks(self, slots: list[int], blocks: ExportedKV) -> None:
        self.kv_cache.import_host_blocks(slots, blocks)

    # ---- one step ----------------------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        if out.host_saves or out.host_loads:
            self.kv_cache.apply_host_copies(out.host_saves, out.host_loads)
        placeholders = apply_step_diffs(self.states, self.block_table, out)
        if placeholders:
            self._last_output.then(lambda output: fill_placeholders(placeholders, output))

    def prepare_inputs(self, out: SchedulerOutput, passes_after: int = 0) -> StepInputs:
        """A step's inputs (its first pass's, for a multi-step step: `passes_after` more follow)."""
        source = self._last_sampled[1] if self._last_sampled is not None else None
        inputs = self.builder.build(out, self.states, self.block_table,
                                    graph_target(self.graphs, self.mixed_graphs, out, self.states), source,
                                    passes_after=passes_after)
        if inputs.pending_dst is not None:  # tokens scheduled ahead: from the last step's output
            copy_pending(inputs, self._last_sampled[0])
        return inputs

    def _keep_sampled(self, pending: PendingOutput, tokens: torch.Tensor | None, where: dict[str, int]) -> None:
        """Remember where a step's sampled tokens are (`tokens[where[req_id]]`, the last pass's
        for a multi-step step) for a step scheduled ahead on them."""
        self._last_output = pending
        self._last_sampled = None
        if tokens is not None:
            self._last_sampled = (tokens, where)
            pending.on_device = frozenset(where)

    def execute(self, out: SchedulerOutput, hidden: torch.Tensor | None = None) -> RunnerOutput | torch.Tensor | None:
        """Run one step. Non-last pipeline stages return hidden states for the next stage."""
        self.update_states(out)
        return self.execute_batch(out, hidden)

    def launch(self, out: SchedulerOutput) -> PendingOutput | None:
        """Run one whole step (a single stage) without waiting for its sampled tokens."""
        self.update_states(out)
        return self.launch_batch(out)

    def execute_batch(self, out: SchedulerOutput,
                      hidden: torch.Tensor | None = None) -> RunnerOutput | torch.Tensor | None:
        """Run requests whose state is already up to date (a step, or one micro-batch of it).

        The last stage's TP rank 0 samples; its other TP ranks only take part in the logits
        gather and return None.
        """
        result = self.launch_batch(out, hidden)
        return result.result() if isinstance(result, PendingOutput) else result

    @torch.inference_mode()
    def launch_batch(self, out: SchedulerOutput,
                     hidden: torch.Tensor | None = None) -> PendingOutput | torch.Tensor | None:
        if out.is_empty:
            return PendingOutput.done(RunnerOutput([], [], [])) if self.ctx.tp_rank == 0 else None
        if out.num_steps > 1:
            return self._launch_steps(out)
        inputs = self.prepare_inputs(out)
        plain_greedy = None  # the sampler works it out, on the rank that samples
        if self.ctx.tp_size == 1 and self.ctx.pp_size == 1:
            plain_greedy = self.step_sampler.all_plain_greedy(inputs, self.states)
            if not plain_greedy and self._decodes_sampled_on_device(out, inputs):
                return self._launch_steps(out, inputs)
        if inputs.in_graph and not self.ctx.is_last_stage:  # a decode graph of this stage's layers
            # A copy: the next replay of the bucket overwrites its output while this is being sent.
            return self.graphs.run(inputs, hidden)[:out.total_num_scheduled_tokens].clone()
        if inputs.in_graph:
            logits = graph_logits(self.graphs, self.mixed_graphs, inputs, hidden)
            hidden = None
        else:
            hidden = self.model(inputs.input_ids if self.ctx.is_first_stage else None, inputs.positions,
                                inputs.meta, hidden)
            if not self.ctx.is_last_stage:
                return hidden
            logits = self.model.compute_logits(hidden[inputs.logits_index]) if inputs.num_scored else None
        prompt_logprobs = self.prompt_logprobs(inputs, hidden)
        if self.ctx.tp_rank != 0:
            return None
        # Deferred masks wait here for the last step's tokens: this step's forward is launched.
        pending = self.step_sampler.sample(inputs, logits, self.states, prompt_logprobs, plain_greedy,
                                           out.resolved_token_masks())
        where: dict[str, int] = {}
        if pending.device_tokens is not None:  # a step may be scheduled ahead on them: where each is
            index = 0
            for req_id, rows in zip(inputs.req_ids, inputs.logits_rows, strict=True):
                if len(rows) == 1:
                    where[req_id] = index
                index += len(rows)
        self._keep_sampled(pending, pending.device_tokens, where)
        return pending

    def _decodes_sampled_on_device(self, out: SchedulerOutput, inputs: StepInputs) -> bool:
        """Whether a one-pass step that the host sampler would take (a sampled row, penalties,
        logprobs, a row below its min_tokens) is all decodes (one token each: no prompt chunk,
        no drafts). Then it runs as a multi-step step of one pass: `PassSampler` samples on the
        device and the tokens stay there, so the next step can be scheduled ahead of them
        rather than after the host sampler's synchronous copy. In one process only (TP and PP
        groups sample on the host)."""
        if inputs.meta.prefills or out.spec_token_ids:
            return False
        for group in (out.cached_requests, out.new_requests):
            for r in group:
                if self.states[r.req_id].sampling_params.logit_bias:
                    return False  # the host sampler's work
                if r.num_computed_tokens < len(self.states[r.req_id].prompt_token_ids):
                    return False  # the prompt's last token (it may score prompt logprobs)
        return True

    def _launch_steps(self, out: SchedulerOutput, inputs: StepInputs | None = None) -> PendingOutput:
        """A multi-step step: `out.num_steps` forward passes of decodes, each fed the tokens
        the pass before it sampled (`PassSampler`), where they are (the device); every pass is
        launched before any token comes back. `inputs`: the first pass's, if built already. On
        the GPU kernels' tables a pass moves the last one's inputs on in place (a few device
        ops, no host work per request); otherwise, or where a pass leaves the CUDA graphs (a
        context past the capture length), its inputs are built again, as a step scheduled
        ahead is: each request's next token a PENDING_TOKEN, copied in on the device."""
        assert self.ctx.pp_size == 1 and self.ctx.tp_size == 1, "multi-step decoding runs in one process"
        num_steps = out.num_steps
        if inputs is None:
            inputs = self.prepare_inputs(out, passes_after=num_steps - 1)
        req_ids = inputs.req_ids
        where = {req_id: i for i, req_id in enumerate(req_ids)}  # a request's row among a pass's tokens
        states = [self.states[req_id] for req_id in req_ids]
        outputs = [state.output_token_ids for state in states]
        sample = PassSampler([state.sampling_params for state in states], [state.prompt_token_ids for state in states],
                             outputs, self.device, self.sampler.shared_generator(self.device),
                             self.step_sampler.eos_token_ids)
        # A pass stays in the graphs while its longest context is within the capture length.
        graph_passes = 0
        if inputs.graph_batch is not None:
            longest = max(r.num_computed_tokens for group in (out.cached_requests, out.new_requests) for r in group)
            graph_passes = self.graphs.max_context - longest
        num_placeholders = 0
        sampled: list[torch.Tensor] = []
        for advance in range(num_steps):
            if advance:
                graph = self.graphs.target(len(req_ids)) if advance < graph_passes else None
                if inputs.meta.gpu is not None and (graph is None) == (inputs.graph_batch is None):
                    advance_decodes(inputs, sampled[-1], self.block_size)
                else:
                    for tokens in outputs:  # the tokens sampled so far, as the runner sees them
                        tokens.extend([PENDING_TOKEN] * (advance - num_placeholders))
                    num_placeholders = advance
                    inputs = self.builder.build(out, self.states, self.block_table, graph, where, advance,
                                                num_steps - 1 - advance)
                    copy_pending(inputs, sampled[-1])
            logits = self.forward(inputs)
            if out.token_masks:  # grammar rows: a step of one pass (the scheduler grants them no more)
                assert num_steps == 1, "a multi-step step carries no grammar rows"
                masks = out.resolved_token_masks()  # deferred ones wait here, the forward launched
                rows = [where[req_id] for req_id in masks]
                apply_token_masks(logits, rows, torch.cat([masks[req_id][:1] for req_id in masks]))
            sampled.append(sample(logits, advance))
        if num_placeholders:
            for tokens in outputs:  # the scheduler's next diff sends the tokens (or placeholders)
                del tokens[len(tokens) - num_placeholders:]
        pending = self.step_sampler.collect_steps(req_ids, torch.stack(sampled, dim=1), sample.logprobs())
        # Penalties read every token so far: the next step waits for these on the host.
        self._keep_sampled(pending, sampled[-1] if sample.penalties is None else None, where)
        return pending

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                        hidden: torch.Tensor | None) -> torch.Tensor:
        """What a decode CUDA graph captures: this stage's layers at every (padded) row, and their
        logits on the last stage (hidden states before it)."""
        hidden = self.model(input_ids if self.ctx.is_first_stage else None, positions, meta, hidden)
        return self.model.compute_logits(hidden) if self.ctx.is_last_stage else hidden

    def _mixed_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                       logits_index: torch.Tensor) -> torch.Tensor:
        """A mixed step's logits at its (padded) scored rows: what a mixed CUDA graph captures."""
        return self.model.compute_logits(self.model(input_ids, positions, meta)[logits_index])

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The bare model on prepared inputs (graph replay for graph steps), logits of the
        scored rows: what benchmarks compare the whole engine step against."""
        if inputs.in_graph:
            return graph_logits(self.graphs, self.mixed_graphs, inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_index])

    def prompt_logprobs(self, inputs: StepInputs,
                        hidden: torch.Tensor | None) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        """Logprobs of the prompt tokens this step's chunks score (every TP rank joins the gather)."""
        if not inputs.prompt_rows:
            return {}
        rows = [r for _, _, req_rows, _ in inputs.prompt_rows for r in req_rows]
        targets = [t for _, _, _, tokens in inputs.prompt_rows for t in tokens]
        num_top = [self.states[req_id].sampling_params.prompt_logprobs
                   for req_id, _, req_rows, _ in inputs.prompt_rows for _ in req_rows]
        entries: list[PositionLogprobs | None] = []
        step = self.prompt_logprob_rows
        for at in range(0, len(rows), step):  # the same slices on every TP rank (each joins the gather)
            logits = self.model.compute_logits(hidden[torch.tensor(rows[at:at + step], device=self.device)])
            if self.ctx.tp_rank == 0:
                entries += compute_logprobs(logits, targets[at:at + step], num_top[at:at + step])
            del logits
        if self.ctx.tp_rank != 0:
            return {}
        out, k = {}, 0
        for req_id, first, req_rows, _ in inputs.prompt_rows:
            out[req_id] = (first, entries[k:k + len(req_rows)])
            k += len(req_rows)
        return out
