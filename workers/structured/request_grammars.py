"""The engine's grammar matchers, one per sequence with a StructuredSpec: what each may say next.

The engine owns them because the scheduler is the single source of truth for tokens (docs/
architecture.md, "The step contract"): a matcher advances with every token the scheduler keeps
(`accept`), drafts are cut at the first token the grammar refuses before they are scheduled
(`trim_drafts`), and each step carries, per sequence it samples, one bitmask row per position
it scores: its next token's, then one after each draft token (`masks`), the matcher walked
through the drafts and rolled back. A step that samples a grammar row is sampled on the host,
so the next step is never scheduled before its tokens are accepted here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tandem.workers.structured.bitmask import num_words
from tandem.workers.structured.grammar_cache import GrammarCompiler
from tandem.workers.structured.spec import StructuredSpec

logger = logging.getLogger(__name__)


class RequestGrammars:
    def __init__(self, compiler: GrammarCompiler, max_rollback_tokens: int = 0) -> None:
        self.compiler = compiler
        self.max_rollback_tokens = max_rollback_tokens
        self._matchers: dict[str, Any] = {}  # sequence id -> xgrammar GrammarMatcher
        self._words = num_words(compiler.vocab_size)
        # Tokens a matcher took before the scheduler kept them (`accept_early`), per sequence.
        self._early: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def add(self, seq_ids: list[str], spec: StructuredSpec) -> None:
        """A matcher for each sequence of a request (ValueError when the spec cannot compile)."""
        compiled = self.compiler.compile(spec)
        for seq_id in seq_ids:
            self._matchers[seq_id] = self.compiler.matcher(compiled, self.max_rollback_tokens)

    def remove(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)
        self._early.pop(seq_id, None)

    def accept_early(self, seq_id: str, token_ids: list[int]) -> None:
        """Advance over a step's sampled tokens before the scheduler takes them (the next step,
        scheduled ahead, needs its mask now); `accept` then skips them."""
        if seq_id in self._matchers:
            self.accept(seq_id, token_ids)
            self._early[seq_id] = self._early.get(seq_id, 0) + len(token_ids)

    def accept(self, seq_id: str, token_ids: list[int]) -> bool:
        """Advance over tokens the scheduler kept; True when the grammar is complete (the
        sequence ends there) or refuses a token (it cannot go on)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        skip = self._early.pop(seq_id, 0)
        for token in token_ids[skip:]:
            if matcher.is_terminated():
                return True
            if not matcher.accept_token(token):
                logger.error("sequence %s: token %d is outside its grammar; the sequence ends here", seq_id, token)
                return True
        return matcher.is_terminated()

    def trim_drafts(self, requests: list[Any]) -> None:
        """Cut each grammar sequence's draft tokens at the first its grammar refuses (the target
        could never accept it, so scoring it and those after it is wasted work)."""
        for req in requests:
            matcher = self._matchers.get(req.request_id)
            if matcher is None or not req.spec_token_ids:
                continue
            kept = 0
            for token in req.spec_token_ids:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                kept += 1
            if kept:
                matcher.rollback(kept)
            del req.spec_token_ids[kept:]

    def masks(self, num_scheduled_tokens: dict[str, int],
              spec_token_ids: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Per scheduled grammar sequence: [1 + drafts, words] int32 bitmasks, its next token's
        row first and one after each draft token (the workers use the rows they score)."""
        out: dict[str, torch.Tensor] = {}
        for seq_id in num_scheduled_tokens:
            matcher = self._matchers.get(seq_id)
            if matcher is None:
                continue
            drafts = spec_token_ids.get(seq_id, ())
            bitmask = torch.zeros((1 + len(drafts), self._words), dtype=torch.int32)
            if matcher.is_terminated():  # ended by the token taken early: this row's token is dropped
                out[seq_id] = bitmask.fill_(-1)
                continue
            matcher.fill_next_token_bitmask(bitmask, 0)
            accepted = 0
            for j, token in enumerate(drafts, start=1):
                if not matcher.accept_token(token):  # trimmed before scheduling: not reached
                    bitmask[j:] = -1  # rows no verification reaches: allow every token
                    break
                accepted += 1
                matcher.fill_next_token_bitmask(bitmask, j)
            if accepted:
                matcher.rollback(accepted)
            out[seq_id] = bitmask
        return out
