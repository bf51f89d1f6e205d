"""From a step's logits to its RunnerOutput: sampling, draft verification, logprobs.

Draft tokens (speculative decoding) are scored in the same pass. A greedy request keeps
drafts while they equal the target's argmax, then adds the target's next token: exactly
its own greedy run, so greedy output is unchanged by speculation. A sampled request's
drafts go through rejection sampling (seeded per request and position), which keeps the
target's distribution.

A step whose rows are all plain greedy (no penalties, no suppressed tokens, no logprobs:
the common case) takes the argmax on the device and copies the token ids into pinned
host memory without waiting: `PendingOutput.result()` waits for them, so the caller can
prepare the next step's host work while the device still runs this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.workers.core.request import PositionLogprobs, SamplingParams
from tandem.workers.core.scheduler_output import PendingOutput, RunnerOutput
from tandem.workers.sample.pass_sampler import PassLogprobs
from tandem.workers.sample.rejection_sampler import rejection_sample
from tandem.workers.sample.sampler import (
    Sampler,
    SamplingRow,
    argmax_rows,
    compute_logprobs,
    logprob_entry,
    suppressed_ids,
)
from tandem.workers.structured.bitmask import apply_token_masks


class SampledRequest(Protocol):
    """What sampling reads of a request's state in the runner."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class ScoredStep(Protocol):
    """What sampling reads of a step's inputs (the runner's `StepInputs`)."""

    req_ids: list[str]  # in the order their tokens appear
    logits_rows: list[list[int]]  # per request: token indices to score ([] = partial prefill)
    drafts: list[list[int]]


@dataclass
class StepSampler:
    sampler: Sampler
    eos_token_ids: tuple[int, ...]

    def sample(self, inputs: ScoredStep, logits: torch.Tensor | None, states: dict[str, SampledRequest],
               prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]],
               plain_greedy: bool | None = None, token_masks: dict[str, torch.Tensor] | None = None) -> PendingOutput:
        """logits: [scored rows, vocab], the rows of `inputs.logits_rows` flattened in order;
        `plain_greedy`: `all_plain_greedy` of the step, if the caller has it already;
        `token_masks`: grammar rows' bitmasks (SchedulerOutput.token_masks)."""
        if logits is None:
            return PendingOutput.done(RunnerOutput(inputs.req_ids, [[] for _ in inputs.req_ids],
                                                   [None] * len(inputs.req_ids), prompt_logprobs=prompt_logprobs))
        if token_masks:
            self._mask(inputs, logits, token_masks)
        if plain_greedy is None:
            plain_greedy = self.all_plain_greedy(inputs, states)
        if not prompt_logprobs and plain_greedy:
            return self._greedy_async(inputs, logits)
        rows: list[SamplingRow] = []
        for req_id, idx, draft in zip(inputs.req_ids, inputs.logits_rows, inputs.drafts):
            state = states[req_id]
            for j in range(len(idx)):
                outputs = state.output_token_ids + draft[:j]
                rows.append(SamplingRow(state.sampling_params, state.prompt_token_ids, outputs,
                                        suppressed_ids(state.sampling_params, len(outputs), self.eos_token_ids)))
        result = self.sampler(logits, rows)
        return PendingOutput.done(self._assemble(inputs, result.token_ids, result.logprobs, logits, rows,
                                                 prompt_logprobs))

    def all_plain_greedy(self, inputs: ScoredStep, states: dict[str, SampledRequest]) -> bool:
        """Every scored row greedy with nothing else to compute (no penalties, logprobs or
        min_tokens): one argmax samples the step."""
        for req_id, idx in zip(inputs.req_ids, inputs.logits_rows):
            if not idx:
                continue
            state = states[req_id]
            p = state.sampling_params
            # A grammar row is plain greedy too: its mask is applied to the logits in place first.
            if not p.is_greedy or p.needs_penalties or p.logprobs is not None or p.logit_bias or \
                    len(state.output_token_ids) < p.min_tokens:
                return False
        return True

    @staticmethod
    def _mask(inputs: ScoredStep, logits: torch.Tensor, token_masks: dict[str, torch.Tensor]) -> None:
        """Grammar rows' disallowed tokens -inf, in place, before anything reads the logits: the
        sampled token, a draft's verification and the logprobs all see the grammar (vLLM's
        logprobs do too)."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        k = 0
        for req_id, idx in zip(inputs.req_ids, inputs.logits_rows):
            mask = token_masks.get(req_id)
            if mask is not None and idx:
                rows.extend(range(k, k + len(idx)))
                masks.append(mask[:len(idx)])
            k += len(idx)
        if rows:
            apply_token_masks(logits, rows, torch.cat(masks))

    def _greedy_async(self, inputs: ScoredStep, logits: torch.Tensor) -> PendingOutput:
        tokens = argmax_rows(logits)  # ties -> lowest id, as the sampler's greedy rows
        num = tokens.shape[0]
        if tokens.device.type != "cuda":
            ids = tokens.tolist()
            pending = PendingOutput.done(self._assemble(inputs, ids, [None] * num, None, None, {}))
        else:
            host = torch.empty(num, dtype=torch.long, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            pending = PendingOutput(lambda: self._assemble(inputs, host.tolist(), [None] * num, None, None, {}),
                                    event)
        pending.device_tokens = tokens  # the next step may read them where they are
        return pending

    def collect_steps(self, req_ids: list[str], tokens: torch.Tensor,
                      logprobs: PassLogprobs | None = None) -> PendingOutput:
        """A multi-step step's output from its sampled tokens ([requests, passes], on the device)
        and the logprobs of the rows that ask for them: one copy each to the host, waited for by
        `result()`."""
        on_device = [tokens, *(logprobs.tensors if logprobs is not None else ())]

        def assemble(host: list[torch.Tensor]) -> RunnerOutput:
            token_ids = host[0].tolist()
            out_logprobs: list[list | None] = [None] * len(req_ids)
            if logprobs is not None:
                c_lp, c_rank, t_lp, t_ids, t_rank = (t.tolist() for t in host[1:])
                for j, (i, num_top) in enumerate(zip(logprobs.rows, logprobs.num_top)):
                    out_logprobs[i] = [logprob_entry(token, c_lp[j][a], c_rank[j][a], t_lp[j][a], t_ids[j][a],
                                                     t_rank[j][a], num_top) for a, token in enumerate(token_ids[i])]
            return RunnerOutput(req_ids, token_ids, out_logprobs)

        if tokens.device.type != "cuda":
            return PendingOutput.done(assemble(on_device))
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in on_device]
        for dst, src in zip(host, on_device):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingOutput(lambda: assemble(host), event)

    def _assemble(self, inputs: ScoredStep, token_ids: list[int], logprobs: list, logits: torch.Tensor | None,
                  rows: list[SamplingRow] | None,
                  prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]]) -> RunnerOutput:
        if rows is None and not prompt_logprobs and len(token_ids) == len(inputs.req_ids) and not any(inputs.drafts):
            # Plain greedy, one scored row a request and no drafts (every decode step): the
            # request's token is its row's.
            return RunnerOutput(inputs.req_ids, [[token] for token in token_ids], logprobs)
        sampled: list[list[int]] = []
        out_logprobs: list[list | None] = []
        num_drafts = num_accepted = 0
        k = 0
        for idx, draft in zip(inputs.logits_rows, inputs.drafts):
            tokens = token_ids[k:k + len(idx)]
            lps = logprobs[k:k + len(idx)]
            if draft and rows is not None and not rows[k].params.is_greedy:
                tokens, lps = self._verify_sampled(logits[k:k + len(idx)], rows[k:k + len(idx)], draft)
            else:
                # Greedy: keep drafts while they equal the target's argmax, then its next token.
                accepted = 0
                while accepted < len(draft) and tokens[accepted] == draft[accepted]:
                    accepted += 1
                tokens, lps = tokens[:accepted + 1], lps[:accepted + 1]
            k += len(idx)
            sampled.append(tokens if idx else [])
            out_logprobs.append(lps if idx and lps[0] is not None else None)
            num_drafts += len(draft)
            num_accepted += len(tokens) - 1 if idx and draft else 0
        return RunnerOutput(inputs.req_ids, sampled, out_logprobs, num_drafts, num_accepted, prompt_logprobs)

    def _verify_sampled(self, logits: torch.Tensor, rows: list[SamplingRow],
                        draft: list[int]) -> tuple[list[int], list]:
        """Rejection-sample a sampled request's drafts against its processed target distribution."""
        probs = self.sampler.probs(logits, rows)
        # Seeded from (seed, first draft position): reproducible whatever the batch.
        tokens = rejection_sample(probs, draft, None, self.sampler.generator_for(rows[0], logits.device))
        num_top = rows[0].params.logprobs
        lps = compute_logprobs(logits[:len(tokens)], tokens, [num_top] * len(tokens))
        return tokens, lps

