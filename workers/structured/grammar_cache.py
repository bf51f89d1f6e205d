"""StructuredSpec -> a compiled grammar for one tokenizer (xgrammar), cached.

xgrammar was picked over llguidance by measurement (bench/RESULTS.md, "Structured outputs"):
on a 32,000-token vocabulary it fills a step's token mask in about 1 us against 5.5 us, and
compiles a small schema in under 3 ms. The compiler's own cache keys on the grammar text, so a
schema sent by every request of an agent compiles once per process.

JSON schemas compile without free whitespace (`any_whitespace=False`: ", " and ": " as
separators, as json.dumps writes them): a model that may put any whitespace between tokens can
fill its whole budget with it, and a client that asks for JSON wants JSON, not layout.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from tandem.workers.structured.spec import StructuredSpec

SEPARATORS = (", ", ": ")
MAX_COMPILED = 512  # grammars kept compiled per process (xgrammar's own cache keeps what it compiled too)


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe (compiles run on worker threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...] = (),
                 max_threads: int = 1) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.stop_token_ids = tuple(info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True)
        self._lock = threading.Lock()
        self._compiled: dict[StructuredSpec, Any] = {}

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar; ValueError saying why a spec cannot compile. A spec compiled
        before is a dictionary read, with no lock: the engine thread asks again for what a
        worker thread compiled ahead of it (AsyncEngine), and never waits for another compile."""
        compiled = self._compiled.get(spec)
        if compiled is not None:
            return compiled
        try:
            with self._lock:  # one compile at a time: each may use the compiler's threads
                compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"the {_NAMES[spec.kind]} cannot be compiled: {_reason(exc)}") from None
        if len(self._compiled) >= MAX_COMPILED:
            self._compiled.pop(next(iter(self._compiled)), None)  # the oldest
        self._compiled[spec] = compiled
        return compiled

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        if spec.kind == "json":
            try:
                schema = json.loads(spec.value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            return c.compile_grammar(_json_grammar(self._xgr, spec.value, strict=True))
        if spec.kind == "json_object":
            return c.compile_grammar(_json_grammar(self._xgr, '{"type": "object"}', strict=False))
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(choice) for choice in spec.choices()))
        return c.compile_grammar(spec.value)

    def matcher(self, compiled: Any, max_rollback_tokens: int = 0) -> Any:
        """A fresh matcher over `compiled`, able to take back up to `max_rollback_tokens` tokens."""
        return self._xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)

    def check(self, spec: StructuredSpec) -> None:
        """ValueError when `spec` cannot compile (the ingress's 400), or admits no output at all."""
        compiled = self.compile(spec)
        matcher = self.matcher(compiled)
        mask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        if not bool(mask.any()):
            raise ValueError(f"the {_NAMES[spec.kind]} admits no output")


# A string character in xgrammar's rule for length-bounded strings, which admits raw control
# characters, and the same class without them. RFC 8259 forbids U+0000-U+001F unescaped in a
# string (xgrammar's unbounded strings exclude them too): a strict parser (Python's json,
# pydantic) would refuse output that contained one.
_LOOSE_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _json_grammar(xgr: Any, schema: str, strict: bool) -> str:
    """The EBNF of a JSON schema, compact (", " and ": "), strings free of control characters."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS, strict_mode=strict)
    return str(grammar).replace(_LOOSE_CHAR, _JSON_CHAR)


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
          "grammar": "grammar"}


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its time and C++ source location ("[hh:mm:ss] file.cc:83: ...")."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text) or type(exc).__name__
