"""Repetition, frequency and presence penalties for a multi-step step's passes, on the device.

One step at a time, `Sampler` reads a penalised row's prompt and outputs from the host. A
multi-step step's passes cannot: their tokens stay on the device until the step ends. So each
penalised row's tokens go to the device once, when the step starts, as two [rows, vocab]
tables (which tokens the row has seen, prompt and outputs, for the repetition penalty; how
often it has generated each, for frequency and presence), every pass applies the penalties
from them with the arithmetic of `Sampler._apply_penalties`, and then adds the token it chose.
So a penalised request gets the same tokens in multi-step steps as one step at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.workers.core.request import SamplingParams

Upload = Callable[[list, torch.dtype], torch.Tensor]  # host values -> a device tensor, without waiting


class PassPenalties:
    def __init__(self, rows: list[int], params: list[SamplingParams], prompts: list[list[int]],
                 outputs: list[list[int]], upload: Upload) -> None:
        """`rows`: the penalised rows among the step's; `params`, `prompts`, `outputs`: theirs,
        the outputs as the host knows them before the step (no placeholders: a step with a
        penalised row is never scheduled ahead of its tokens)."""
        self._index = upload(rows, torch.long)
        self._num_rows = len(rows)
        self._rep = upload([p.repetition_penalty for p in params], torch.float32)[:, None]
        self._freq = upload([p.frequency_penalty for p in params], torch.float32)[:, None]
        self._presence = upload([p.presence_penalty for p in params], torch.float32)[:, None]
        self._use_rep = any(p.repetition_penalty != 1.0 for p in params)
        self._use_counts = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        seen = [(j, t) for j, (prompt, out) in enumerate(zip(prompts, outputs)) for t in (*prompt, *out) if t >= 0]
        made = [(j, t) for j, out in enumerate(outputs) for t in out if t >= 0]
        self._seen_pairs = [upload([p[k] for p in seen], torch.long) for k in (0, 1)]
        self._made_pairs = [upload([p[k] for p in made], torch.long) for k in (0, 1)]
        self._seen: torch.Tensor | None = None  # [rows, vocab] bool, made at the first pass
        self._counts: torch.Tensor | None = None  # [rows, vocab] float32

    def apply(self, x: torch.Tensor) -> None:
        """Penalise the penalised rows of `x` [step rows, vocab] (float32, in place)."""
        if self._seen is None:
            self._seen, self._counts = self._tables(x.shape[-1], x.device)
        xp = x.index_select(0, self._index)
        if self._use_rep:  # HF: every token seen in prompt or output, each penalised once
            xp = torch.where(self._seen, torch.where(xp > 0, xp / self._rep, xp * self._rep), xp)
        if self._use_counts:  # OpenAI: generated tokens only, per occurrence and once
            xp = xp - (self._freq * self._counts + self._presence * (self._counts > 0))
        x.index_copy_(0, self._index, xp)

    def add(self, chosen: torch.Tensor) -> None:
        """The pass's chosen tokens (one per step row) join what the penalised rows have seen and made."""
        tokens = chosen.index_select(0, self._index)
        rows = torch.arange(self._num_rows, device=tokens.device)
        self._seen[rows, tokens] = True
        self._counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)

    def _tables(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Ids past the vocabulary land in one spare column, cut off after: no host sync to drop them.
        seen = torch.zeros((self._num_rows, vocab + 1), dtype=torch.bool, device=device)
        counts = torch.zeros((self._num_rows, vocab + 1), dtype=torch.float32, device=device)
        rows, ids = self._seen_pairs
        seen[rows, ids.clamp(max=vocab)] = True
        rows, ids = self._made_pairs
        counts.index_put_((rows, ids.clamp(max=vocab)), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        return seen[:, :vocab], counts[:, :vocab]
