"""Turns a batch of logits into next tokens (and logprobs), one row per request position.

Order of operations follows vLLM/HF where they agree: suppression, repetition penalty,
presence/frequency penalties, then greedy argmax or temperature -> top-k -> top-p -> min-p
-> sample. Logprobs are reported from the raw logits (vLLM's default), not the processed ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.workers.core.request import Logprob, PositionLogprobs, SamplingParams
from tandem.workers.kernels import cpu_kernels

_SEED_MASK = (1 << 63) - 1  # torch generators take a non-negative 64-bit seed
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplingRow:
    """One row of logits to sample: the next token of one request at one position."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before this position (penalties, seeding)
    suppress_token_ids: tuple[int, ...] = ()  # e.g. EOS/stop ids while below min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[PositionLogprobs | None]  # one per row; None when params.logprobs is None


def row_seed(seed: int, position: int) -> int:
    """Generator seed for a seeded request at output position `position`.

    Depends only on the request's seed and position, so a seeded request draws the same token
    whatever else is in the batch, and again after preemption and recompute.
    """
    return (seed * 1_000_003 + position) & _SEED_MASK


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A seeded request's generator at output position `position` (see row_seed)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(row_seed(seed, position))
    return gen


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab], given Exp(1) `noise` of the same shape:
    argmax(p / E) is an exact sample from p. `noise` is clamped in place."""
    # exponential_ can return exactly 0 (u == 0 in its inverse CDF); 0/0 would be NaN and win
    # argmax. Clamping keeps an allowed token the winner and a zero-prob token at 0.
    noise.clamp_min_(_TINY)
    return (probs / noise).argmax(-1)


def compute_logprobs(logits: torch.Tensor, token_ids: list[int],
                     num_top: list[int | None]) -> list[PositionLogprobs | None]:
    """Per row: the chosen token plus the top-`num_top[i]` tokens by log_softmax(logits[i]).

    Rows whose `num_top` is None get None (and cost nothing). Rank is 1 + the number of tokens
    with strictly greater logprob, so ties share a rank and the chosen token gets its true rank
    even when it falls outside the top N.
    """
    out: list[PositionLogprobs | None] = [None] * len(token_ids)
    rows = [i for i, n in enumerate(num_top) if n is not None]
    if not rows:
        return out
    device = logits.device
    chosen = torch.tensor([token_ids[i] for i in rows], dtype=torch.long, device=device)
    k = min(max(num_top[i] or 0 for i in rows), logits.shape[-1])
    found = logprob_tensors(logits.index_select(0, torch.tensor(rows, device=device)), chosen, k)
    # One device->host transfer per tensor rather than per element.
    c_lp, c_rank, t_lp, t_ids, t_rank = (t.tolist() for t in found)
    for j, i in enumerate(rows):
        out[i] = logprob_entry(token_ids[i], c_lp[j], c_rank[j], t_lp[j], t_ids[j], t_rank[j], num_top[i] or 0)
    return out


def suppressed_ids(params: SamplingParams, num_outputs: int, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids a row may not end with after `num_outputs` tokens: EOS (unless ignored) and its
    stop ids while it is below min_tokens, else none. A grammar row has none: its grammar
    decides where it ends (a complete grammar allows only EOS; suppressing it would leave nothing)."""
    if num_outputs >= params.min_tokens or params.structured is not None:
        return ()
    return (() if params.ignore_eos else tuple(eos_token_ids)) + tuple(params.stop_token_ids)


def logprob_tensors(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """compute_logprobs' device work for rows of logits [rows, vocab] and their chosen tokens
    [rows]: the chosen token's logprob [rows] and rank [rows], the top-k logprobs, ids and
    ranks [rows, k]. No host sync: a multi-step step's passes keep theirs on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(1, chosen[:, None])
    # One comparison pass over the vocab per row; no full sort needed for the rank.
    chosen_rank = (lp > chosen_lp).sum(-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1)
    # Anything strictly above a top-k value is itself in the top k, so a k x k comparison gives
    # exact ranks for the top tokens (ties included) without touching the vocab again.
    top_rank = (top_lp[:, None, :] > top_lp[:, :, None]).sum(-1) + 1
    return chosen_lp[:, 0], chosen_rank, top_lp, top_ids, top_rank


def logprob_entry(token: int, chosen_lp: float, chosen_rank: int, top_lp: list[float], top_ids: list[int],
                  top_rank: list[int], num_top: int) -> PositionLogprobs:
    """One position's logprobs from logprob_tensors' values for its row (on the host)."""
    entry: PositionLogprobs = {token: Logprob(chosen_lp, chosen_rank)}
    for t in range(min(num_top, len(top_ids))):
        entry.setdefault(top_ids[t], Logprob(top_lp[t], top_rank[t]))
    return entry


class Sampler:
    """Stateless apart from the generator used for unseeded rows."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        # One generator per device: a CPU generator cannot drive CUDA kernels and vice versa.
        self._generators: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on `device`."""
        return self._generator(device)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput([], [])
        token_ids = self._choose(logits, rows).tolist()
        logprobs = compute_logprobs(logits, token_ids, [r.params.logprobs for r in rows])
        return SamplerOutput(token_ids, logprobs)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Each row's next token."""
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampled and not any(r.suppress_token_ids or r.params.needs_penalties or r.params.logit_bias
                                   for r in rows):
            # Plain greedy, the common case: nothing modifies the logits, so no copy of them.
            return argmax_rows(logits.float())
        # Work on a float32 copy: the caller's logits stay raw for the logprobs (and for anyone
        # else holding them), and bf16/fp16 lose too much precision for the filters.
        x = logits.to(torch.float32, copy=True)
        self._suppress(x, rows)
        self._apply_logit_bias(x, rows)
        self._apply_penalties(x, rows)

        device = x.device
        chosen = torch.empty(len(rows), dtype=torch.long, device=device)
        if greedy:
            gi = torch.tensor(greedy, device=device)
            chosen[gi] = argmax_rows(x.index_select(0, gi))  # ties -> lowest id
        if sampled:
            si = torch.tensor(sampled, device=device)
            chosen[si] = self._sample(x.index_select(0, si), [rows[i] for i in sampled])
        return chosen

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from, after every processing step: [rows, vocab].

        Greedy rows are point masses on their argmax. Speculative verification compares
        draft tokens against these.
        """
        x = logits.to(torch.float32, copy=True)
        self._suppress(x, rows)
        self._apply_logit_bias(x, rows)
        self._apply_penalties(x, rows)
        out = torch.empty_like(x)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            gi = torch.tensor(greedy, device=x.device)
            out[gi] = torch.nn.functional.one_hot(x.index_select(0, gi).argmax(-1), x.shape[-1]).float()
        if sampled:
            si = torch.tensor(sampled, device=x.device)
            out[si] = torch.softmax(self._filtered(x.index_select(0, si), [rows[i] for i in sampled]), dim=-1)
        return out

    def generator_for(self, row: SamplingRow, device: torch.device) -> torch.Generator:
        """The row's own generator when seeded (reproducible), else the shared one."""
        if row.params.seed is None:
            return self._generator(device)
        return seeded_generator(row.params.seed, len(row.output_token_ids), device)

    @staticmethod
    def _suppress(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = x.shape[-1]
        pairs = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids if 0 <= t < vocab]
        if pairs:
            r_idx, c_idx = zip(*pairs)
            x[torch.tensor(r_idx, device=x.device), torch.tensor(c_idx, device=x.device)] = float("-inf")

    @staticmethod
    def _apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """OpenAI's logit_bias: each listed token's logit moved by its bias (ids past the
        vocabulary were refused at the ingress; here they are skipped)."""
        vocab = x.shape[-1]
        pairs = [(i, t, b) for i, r in enumerate(rows) if r.params.logit_bias
                 for t, b in r.params.logit_bias.items() if t < vocab]
        if pairs:
            r_idx, c_idx, bias = zip(*pairs)
            x.index_put_((torch.tensor(r_idx, device=x.device), torch.tensor(c_idx, device=x.device)),
                         torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)

    @staticmethod
    def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        # Penalised rows are usually few; a loop over rows (vectorised within each row) keeps
        # this simple without building ragged batch tensors.
        vocab, device = x.shape[-1], x.device
        for i, row in enumerate(rows):
            p = row.params
            if not p.needs_penalties:
                continue
            if p.repetition_penalty != 1.0:
                # HF semantics: every token seen in prompt or output, each penalised once.
                seen = torch.tensor(row.prompt_token_ids + row.output_token_ids,
                                    dtype=torch.long, device=device).unique()
                seen = seen[(seen >= 0) & (seen < vocab)]
                vals = x[i, seen]
                x[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                         vals * p.repetition_penalty)
            if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and row.output_token_ids:
                # OpenAI semantics: generated tokens only; unique() makes the indices distinct so
                # the in-place subtract is well defined.
                ids, counts = torch.tensor(row.output_token_ids, dtype=torch.long,
                                           device=device).unique(return_counts=True)
                keep = (ids >= 0) & (ids < vocab)
                ids, counts = ids[keep], counts[keep]
                x[i, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty

    @staticmethod
    def _filtered(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, then top-k / top-p / min-p as -inf masks."""
        vocab, device = x.shape[-1], x.device
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)
        x = x / temps[:, None]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        # The sort is the expensive part; skip it when no row filters anything.
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p) or any(m > 0.0 for m in min_p):
            x = _filter(x, top_k, top_p, min_p)
        return x

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab, device = x.shape[-1], x.device
        probs = torch.softmax(self._filtered(x, rows), dim=-1)

        # Exponential race: argmax(p / E) with E ~ Exp(1) is an exact sample from p, and the
        # noise for a seeded row depends only on its own generator, never on its neighbours.
        noise = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            ui = torch.tensor(unseeded, device=device)
            noise[ui] = torch.empty((len(unseeded), vocab), device=device).exponential_(
                generator=self._generator(device))
        for j, r in enumerate(rows):
            if r.params.seed is not None:
                gen = seeded_generator(r.params.seed, len(r.output_token_ids), device)
                noise[j] = torch.empty(vocab, device=device).exponential_(generator=gen)
        return exponential_race(probs, noise)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of [rows, vocab] float32 logits: ties to the lowest id, NaN wins."""
    kernels = cpu_kernels.active_for(x)
    if kernels is not None and x.is_contiguous():
        return kernels.argmax_rows(x)  # one pass: torch's argmax makes several
    return x.argmax(-1)


def _filter(x: torch.Tensor, top_k: list[int] | torch.Tensor, top_p: list[float] | torch.Tensor,
            min_p: list[float] | torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p, then min-p, as -inf masks on temperature-scaled logits [rows, vocab]."""
    device, vocab = x.device, x.shape[-1]
    # Stable sort so ties break towards the lower id on every device, keeping seeded runs
    # reproducible.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(vocab, device=device)[None, :]
    # as_tensor: a pass of a multi-step step hands these in on the device already.
    k = torch.as_tensor(top_k, device=device)[:, None]
    sorted_x = sorted_x.masked_fill(pos >= k, float("-inf"))

    probs = torch.softmax(sorted_x, dim=-1)
    p = torch.as_tensor(top_p, dtype=torch.float32, device=device)[:, None]
    # Keep a token while the mass strictly before it is still short of top_p: the smallest
    # prefix reaching top_p. The first token is always kept: its prefix mass is 0, and a top_p
    # below float32's range (1e-300) is 0 too.
    before = probs.cumsum(-1) - probs
    drop = (before >= p) & (p < 1.0) & (pos > 0)  # top_p == 1 must keep everything despite rounding

    # min-p compares against the max prob; that ratio is unchanged by renormalising after
    # top-p (the max token is never dropped), so the same probs serve both.
    m = torch.as_tensor(min_p, dtype=torch.float32, device=device)[:, None]
    drop |= probs < m * probs[:, :1]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    # `order` is a permutation per row, so the scatter overwrites every position.
    return torch.empty_like(x).scatter_(1, order, sorted_x)
