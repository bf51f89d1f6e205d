"""SimulatedExecutor: a device that waits instead of running the model (`simulated_step_ms`).

A step's forward pass becomes a wait of BASE + PER_SEQ x (requests in the step) ms on one
simulated device, whose steps queue behind each other as a GPU's do. No weights are loaded;
the scheduler, the KV blocks, the detokenizer and the outputs all run for real, so the
serving path can be measured on any machine at a GPU's step rate.

Tokens depend on the prompt and the output position alone, whatever the sampling options:

    key   = first 8 bytes (little-endian) of blake2b(prompt ids as int64)
    token = allowed[splitmix64(key + (position + 1) * 0x9E3779B97F4A7C15) % len(allowed)]

`allowed` is every id below vocab_size but the special ones (EOS, BOS, the tokenizer's), so
a request always runs to max_tokens (or a stop string), and a preempted request resumes
exactly where it was.

A multi-step step (`num_scheduler_steps` K: K forward passes of decodes, as the GPU runner
runs them) waits K times a step's time and gives each request the tokens of its next K
positions, so its output is the same whatever K is.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.cluster.placement import DevicePin
from tandem.workers.config import EngineConfig
from tandem.workers.core.request import Logprob, PositionLogprobs, SamplingParams
from tandem.workers.core.scheduler_output import PendingOutput, RunnerOutput, SchedulerOutput
from tandem.workers.executor.abstract import InProcess
from tandem.workers.kernels import kv_quant
from tandem.workers.model.cost import ModelCost
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.runner.kv_cache import ExportedKV
from tandem.workers.structured.bitmask import allowed_tokens

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """splitmix64's finaliser: consecutive inputs give unrelated 64-bit outputs."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def prompt_key(prompt_token_ids: list[int]) -> int:
    """A prompt's 64-bit key: stable across processes and runs (no PYTHONHASHSEED)."""
    digest = hashlib.blake2b(array("q", prompt_token_ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def tokenizer_special_ids(tokenizer: Any) -> set[int]:
    """The ids a tokenizer calls special: its named ones and every added token marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special)
    return ids


@dataclass(slots=True)
class _SimRequest:
    key: int  # seeds its tokens (prompt_key)
    prompt_token_ids: list[int]
    params: SamplingParams
    num_tokens: int  # prompt and output tokens sent so far (placeholders of a step ahead included)
    # What a GPU runner asks of every row every step (`_tokens_on_device`), derived once from params.
    plain: bool = field(init=False)  # greedy, no penalties, no logprobs
    penalized: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.penalized = params.needs_penalties
        self.plain = params.is_greedy and not self.penalized and params.logprobs is None


class SimulatedExecutor(InProcess):
    """One simulated device in this process: steps wait, tokens are computed (see the module)."""

    device_type = "sim"  # neither "cuda" nor "cpu": config.ASYNC_DEVICE_TYPES treats it as a GPU

    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, *, special_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        assert config.model.simulated_step_ms is not None
        self.base_ms, self.per_seq_ms = config.model.simulated_step_ms
        self.vocab_size = hf_config.vocab_size
        excluded = {*special_token_ids, *hf_config.eos_token_ids}
        if hf_config.bos_token_id is not None:
            excluded.add(hf_config.bos_token_id)
        self.allowed = array("q", (i for i in range(self.vocab_size) if i not in excluded))
        if not self.allowed:
            raise ValueError("simulated_step_ms: the vocabulary has nothing but special tokens")
        # KV sized as a runner sizes it, in the dtype the cache would have on the GPU it stands for.
        itemsize = kv_quant.cache_dtype(config.cache.kv_cache_dtype,
                                        hf_config.resolve_dtype(config.model.dtype, torch.device("cuda"))).itemsize
        self._block_bytes = ModelCost.from_hf_config(hf_config, itemsize).kv_bytes_per_token * config.cache.block_size
        self.num_kv_blocks = config.cache.num_kv_blocks or self._default_blocks(config, hf_config)
        if self.num_kv_blocks < 1:
            raise ValueError(f"kv_cache_memory: too small for one KV block ({self._block_bytes} bytes per block)")
        self._clock = clock
        self.wait = sleep  # how the thread spends a step's time (a benchmark may spin instead)
        self._busy_until = 0.0  # when the device finishes the last step launched (clock seconds)
        self.requests: dict[str, _SimRequest] = {}

    def _default_blocks(self, config: EngineConfig, hf_config: HFModelConfig) -> int:
        """`kv_cache_memory`'s blocks when it is given; else room for `max_num_seqs` sequences of
        the longest length: the device it stands for has the memory of a GPU, and blocks here
        are bookkeeping only, so the cache never limits the simulated batch unless asked to."""
        if config.cache.kv_cache_memory is not None:
            return config.cache.kv_cache_memory // self._block_bytes
        max_len = config.model.max_model_len or hf_config.max_position_embeddings
        return config.scheduler.max_num_seqs * -(-max_len // config.cache.block_size)

    # ---- tokens --------------------------------------------------------------------------------
    def token(self, key: int, position: int) -> int:
        """The output token at `position` (0 = the first) of the prompt whose key is `key`."""
        return self.allowed[splitmix64(key + (position + 1) * _GOLDEN) % len(self.allowed)]

    def logprobs_entry(self, token: int, num_top: int) -> PositionLogprobs:
        """`token` as the argmax (logprob 0.0, rank 1) and `num_top` - 1 runners-up at -1, -2, ...:
        the sampler's shape for a token among its top `num_top`."""
        entry = {token: Logprob(0.0, 1)}
        for rank in range(2, num_top + 1):
            entry[(token + rank - 1) % self.vocab_size] = Logprob(1.0 - rank, rank)
        return entry

    # ---- steps ---------------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(step).result()

    def execute_async(self, step: SchedulerOutput) -> PendingOutput:
        """The step's output, made now; `result()` waits until the device would have run it."""
        self._apply_diffs(step)
        if step.is_empty:
            return PendingOutput.done(RunnerOutput([], [], []))
        output, computed = self._output(step)
        start = max(self._clock(), self._busy_until)  # a step launched ahead queues behind the last
        pass_ms = self.base_ms + self.per_seq_ms * len(step.num_scheduled_tokens)
        deadline = start + step.num_steps * pass_ms / 1000.0
        self._busy_until = deadline

        def finish() -> RunnerOutput:
            remaining = deadline - self._clock()
            if remaining > 0:
                self.wait(remaining)
            return output

        pending = PendingOutput(finish)
        pending.on_device = self._tokens_on_device(step, output, computed)
        return pending

    def _apply_diffs(self, step: SchedulerOutput) -> None:
        """Requests in and out, and each one's token count, as the runner applies its diffs."""
        for req_id in step.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in step.new_requests:
            self.requests[new.req_id] = _SimRequest(prompt_key(new.prompt_token_ids), new.prompt_token_ids,
                                                    new.sampling_params,
                                                    len(new.prompt_token_ids) + len(new.output_token_ids))
        for diff in step.cached_requests:
            self.requests[diff.req_id].num_tokens += len(diff.new_token_ids)

    def _output(self, step: SchedulerOutput) -> tuple[RunnerOutput, dict[str, int]]:
        """The step's RunnerOutput, and each request's computed tokens before the step."""
        computed = {r.req_id: r.num_computed_tokens for group in (step.new_requests, step.cached_requests)
                    for r in group}
        req_ids = list(step.num_scheduled_tokens)
        sampled: list[list[int]] = []
        logprobs: list[list[PositionLogprobs] | None] = []
        prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = {}
        has_masks = bool(step.token_masks)  # a dict of grammar rows' masks, or the call that makes it
        num_passes = step.num_steps  # > 1: every request a decode, none a grammar row (the scheduler's rule)
        for req_id, num in step.num_scheduled_tokens.items():
            req, start = self.requests[req_id], computed[req_id]
            params, num_prompt = req.params, len(req.prompt_token_ids)
            if params.prompt_logprobs is not None and start < num_prompt - 1:
                # Position p's logits score prompt token p + 1 (as in the runner's prompt rows).
                last = min(start + num, num_prompt - 1)
                prompt_logprobs[req_id] = (start + 1, [self.logprobs_entry(t, params.prompt_logprobs)
                                                       for t in req.prompt_token_ids[start + 1:last + 1]])
            if start + num < req.num_tokens:  # a prompt chunk that is not the last
                sampled.append([])
                logprobs.append(None)
                continue
            # One token a pass, at the request's next positions.
            position = req.num_tokens - num_prompt
            tokens = [self.token(req.key, position + i) for i in range(num_passes)]
            mask = step.resolved_token_masks().get(req_id) if has_masks else None
            if mask is not None:  # a grammar's: the same hash, over the tokens it allows
                allowed = allowed_tokens(mask[:1], self.vocab_size, torch.device("cpu"))[0].nonzero()[:, 0].tolist()
                tokens = [allowed[splitmix64(req.key + (position + 1) * _GOLDEN) % len(allowed)]]
            sampled.append(tokens)
            logprobs.append(None if params.logprobs is None else
                            [self.logprobs_entry(token, params.logprobs) for token in tokens])
        return RunnerOutput(req_ids, sampled, logprobs, prompt_logprobs=prompt_logprobs), computed

    def _tokens_on_device(self, step: SchedulerOutput, output: RunnerOutput,
                          computed: dict[str, int]) -> frozenset[str] | None:
        """The requests whose tokens a GPU runner would leave on the device for a step scheduled
        ahead (ModelRunner.launch_batch): every scored one when the step is all plain greedy
        with no prompt logprobs, or all decodes without penalties; otherwise none."""
        scored = [req_id for req_id, tokens in zip(output.req_ids, output.sampled_token_ids) if tokens]
        requests = self.requests
        rows = [requests[req_id] for req_id in scored]
        if not scored or step.token_masks or any(row.params.logit_bias for row in rows):
            # Logit biases are the host sampler's; grammar rows' tokens a GPU runner may keep on the
            # device, but this device keeps them on the host: the step after them is collected first.
            return None
        if not output.prompt_logprobs and all(
                row.plain and row.num_tokens - len(row.prompt_token_ids) >= row.params.min_tokens for row in rows):
            return frozenset(scored)  # plain greedy
        decodes = all(num == 1 and computed[req_id] >= len(requests[req_id].prompt_token_ids)
                      for req_id, num in step.num_scheduled_tokens.items())
        if decodes and not any(row.penalized for row in rows):
            return frozenset(scored)
        return None

    # ---- KV: bookkeeping only, the simulated device holds none ---------------------------------
    def kv_bytes_per_block(self) -> int:
        return self._block_bytes

    def init_host_cache(self, num_slots: int) -> None:
        """Nothing to allocate: host saves and loads move no data here (the hashes stay real)."""

    def export_blocks(self, block_ids: list[int]) -> list[Any]:
        """No KV to read: one rank's export in the runner's layout [layers, 2, blocks, ...], of no layers."""
        return [ExportedKV(torch.empty((0, 2, len(block_ids))), ())]

    def import_host_blocks(self, slots: list[int], per_rank: list[Any]) -> None:
        """Nothing to write: the importing group's host tier records the blocks' hashes."""

    # ---- the group's processes: there are none but this one ---------------------------------------
    def device_pins(self) -> list[DevicePin]:
        return []

    def shutdown(self) -> None:
        self.requests.clear()
