"""GrammarCheck: the ingress compiles a request's StructuredSpec before any group sees it.

A spec that cannot compile (a regex with an open parenthesis, a schema feature xgrammar does
not have) or that admits no output at all is the client's mistake: found here it is a 400 (gRPC
INVALID_ARGUMENT) naming the field it came from and saying xgrammar's reason, and it costs no
group a seat or a step. The group compiles it again against its own compiler (its cache is per
process); the ingress's cache makes the agent that sends one schema with every request pay its
compile here once.

The compiler is made from the model's tokenizer on first use, once per ingress replica
(xgrammar reads the whole vocabulary: 0.2 s for the 4,096-token demo model here, more for a
large one; a server nobody asks for structure never pays it), and every compile runs on
TextWork's thread pool: xgrammar's time depends on the schema, not on any size the event loop
could check first.
"""

from __future__ import annotations

import threading

from tandem.router.text_work import TextWork
from tandem.workers.structured.grammar_cache import GrammarCompiler
from tandem.workers.structured.spec import StructuredSpec


class GrammarCheck:
    def __init__(self, text: TextWork, vocab_size: int, stop_token_ids: tuple[int, ...] = ()) -> None:
        """`stop_token_ids`: the model's end-of-sequence ids (the grammar's end admits them)."""
        self.text = text
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the pool's threads may both be first

    async def check(self, spec: StructuredSpec, field: str) -> None:
        """ValueError naming `field` when `spec` cannot compile or admits no output."""
        try:
            await self.text.off_loop(lambda: self.compiler().check(spec))
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None

    def compiler(self) -> GrammarCompiler:
        """The compiler over this model's tokenizer, made the first time (on a pool thread)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.text.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._compiler
