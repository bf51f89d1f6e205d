"""Sampling for the forward passes of a multi-step step, set up once for all of them.

A pass must not copy anything from the host to the device: a copy from pageable memory
waits for the device to finish everything queued before it, which would serialise the
passes with the host. So every row's parameters (temperature, top-k/p, min-p, which rows
are greedy, which are seeded) go to the device once, when the step starts, through pinned
memory without waiting (the step before may still be running: it was scheduled ahead of
this one), and each pass then samples with device work alone.

Rows are what `Sampler` does for the same requests one step at a time: plain greedy rows
take the argmax; sampled rows the exponential race over their filtered distribution, a
seeded row's noise drawn from its own generator seeded from (seed, output position), so a
seeded request gets the same tokens in multi-step steps as without them. Rows asking for
logprobs get them from the raw logits, as `compute_logprobs` computes them, kept on the
device pass by pass (`logprobs()`) and copied to the host with the tokens. Penalised rows
have their penalties applied first (pass_penalties.py), after a row below its min_tokens
has its EOS and stop ids suppressed, pass by pass until it reaches min_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.sample.pass_penalties import PassPenalties
from tandem.workers.sample.sampler import (
    _filter,
    argmax_rows,
    exponential_race,
    logprob_tensors,
    seeded_generator,
    suppressed_ids,
)


@dataclass
class PassLogprobs:
    """The logprobs of a multi-step step's rows that ask for them, every pass, on the device."""

    rows: list[int]  # their rows among the step's
    num_top: list[int]  # each one's `logprobs`
    # logprob_tensors' five, each stacked over the passes: [rows, passes] or [rows, passes, k]
    tensors: tuple[torch.Tensor, ...]


class PassSampler:
    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
                 device: torch.device, shared: torch.Generator, eos_token_ids: tuple[int, ...] = ()) -> None:
        """`params`, `prompts` and `outputs` (the tokens generated before the step, read here
        and not kept) of each row, in order; `shared`: the generator of unseeded rows;
        `eos_token_ids`: what a row below its min_tokens may not end with (nor its stop ids)."""
        num_outputs = [len(out) for out in outputs]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        self.num_rows = len(params)
        self.shared = shared
        self.device = device
        self.greedy = [i for i, p in enumerate(params) if p.is_greedy]
        self.sampled = sampled
        pin = device.type == "cuda"

        def as_device(values: list, dtype: torch.dtype) -> torch.Tensor:
            # The pinned block is not reused before the copy has read it (torch's host allocator).
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

        # min_tokens: (passes it lasts, row, id) for each id a row may not end with yet, most
        # passes first, so that a pass's pairs are a prefix of them (sliced, no upload a pass).
        self._suppressed = sorted(((p.min_tokens - n, i, t) for i, (p, n) in enumerate(zip(params, num_outputs))
                                   for t in suppressed_ids(p, n, eos_token_ids)), key=lambda q: -q[0])
        self._suppressed_at: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids), at the first pass
        self._as_device = as_device
        penalised = [i for i, p in enumerate(params) if p.needs_penalties]
        self.penalties = PassPenalties(penalised, [params[i] for i in penalised], [prompts[i] for i in penalised],
                                       [outputs[i] for i in penalised], as_device) if penalised else None
        self._logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self._logprob_passes: list[tuple[torch.Tensor, ...]] = []
        if self._logprob_rows:
            self._num_top = [params[i].logprobs for i in self._logprob_rows]
            self._logprob_index = as_device(self._logprob_rows, torch.long)
        if not sampled:
            return
        self._greedy_index = as_device(self.greedy, torch.long)
        self._sampled_index = as_device(sampled, torch.long)
        rows = [params[i] for i in sampled]
        self._temps = as_device([p.temperature for p in rows], torch.float32)[:, None]
        vocab_limit = 1 << 30
        top_k = [p.top_k if p.top_k > 0 else vocab_limit for p in rows]
        self._filters = any(p.top_k > 0 for p in rows) or any(p.top_p < 1.0 for p in rows) \
            or any(p.min_p > 0.0 for p in rows)
        self._top_k = as_device(top_k, torch.long)
        self._top_p = as_device([p.top_p for p in rows], torch.float32)
        self._min_p = as_device([p.min_p for p in rows], torch.float32)
        # Seeded rows: (their row among the sampled ones, seed, outputs before the step).
        self._seeded = [(j, rows[j].seed, num_outputs[i]) for j, i in enumerate(sampled) if rows[j].seed is not None]
        unseeded = [j for j, p in enumerate(rows) if p.seed is None]
        self._unseeded_index = as_device(unseeded, torch.long) if unseeded else None

    def __call__(self, logits: torch.Tensor, advance: int) -> torch.Tensor:
        """Pass `advance`'s token of every row from its logits [rows, vocab] (on the device)."""
        chosen = self._choose(logits, advance)
        if self._logprob_rows:
            index = self._logprob_index
            k = min(max(self._num_top), logits.shape[-1])
            found = logprob_tensors(logits.index_select(0, index), chosen.index_select(0, index), k)
            self._logprob_passes.append(found)
        return chosen

    def logprobs(self) -> PassLogprobs | None:
        """The passes' logprobs so far, for the rows that ask for them (None: no row does)."""
        if not self._logprob_rows:
            return None
        stacked = tuple(torch.stack(parts, dim=1) for parts in zip(*self._logprob_passes))
        return PassLogprobs(self._logprob_rows, self._num_top, stacked)

    def _choose(self, logits: torch.Tensor, advance: int) -> torch.Tensor:
        num_suppressed = self._num_suppressed(advance, logits.shape[-1])
        if self.penalties is None and not num_suppressed:
            return self._choose_from(logits.float(), advance)
        # A copy: the raw logits stay for the logprobs. Suppression, then penalties, as Sampler.
        x = logits.to(torch.float32, copy=True)
        if num_suppressed:
            rows, ids = self._suppressed_at
            x[rows[:num_suppressed], ids[:num_suppressed]] = float("-inf")
        if self.penalties is not None:
            self.penalties.apply(x)
        chosen = self._choose_from(x, advance)
        if self.penalties is not None:
            self.penalties.add(chosen)
        return chosen

    def _num_suppressed(self, advance: int, vocab: int) -> int:
        """How many (row, id) pairs pass `advance` suppresses: the first that many of them."""
        if not self._suppressed:
            return 0
        if self._suppressed_at is None:  # the first pass: ids past the vocabulary go, as Sampler drops them
            self._suppressed = [q for q in self._suppressed if 0 <= q[2] < vocab]
            self._suppressed_at = (self._as_device([q[1] for q in self._suppressed], torch.long),
                                   self._as_device([q[2] for q in self._suppressed], torch.long))
        return sum(1 for until, _, _ in self._suppressed if until > advance)

    def _choose_from(self, x: torch.Tensor, advance: int) -> torch.Tensor:
        if not self.sampled:
            return argmax_rows(x)
        chosen = torch.empty(self.num_rows, dtype=torch.long, device=self.device)
        if self.greedy:
            chosen.index_copy_(0, self._greedy_index, argmax_rows(x.index_select(0, self._greedy_index)))
        xs = x.index_select(0, self._sampled_index) / self._temps
        vocab = xs.shape[-1]
        if self._filters:
            xs = _filter(xs, self._top_k.clamp(max=vocab), self._top_p, self._min_p)
        probs = torch.softmax(xs, dim=-1)
        noise = torch.empty_like(probs)
        if self._unseeded_index is not None:
            draws = torch.empty((self._unseeded_index.shape[0], vocab), device=self.device)
            noise.index_copy_(0, self._unseeded_index, draws.exponential_(generator=self.shared))
        for j, seed, num_outputs in self._seeded:
            gen = seeded_generator(seed, num_outputs + advance, self.device)
            noise[j] = torch.empty(vocab, device=self.device).exponential_(generator=gen)
        chosen.index_copy_(0, self._sampled_index, exponential_race(probs, noise))
        return chosen
