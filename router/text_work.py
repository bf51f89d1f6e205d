"""TextWork: the ingress's tokenizing, chat templates and decoding, kept off its event loop.

One ingress event loop carries every stream of its replica, so nothing slow may run on it:
a long prompt's tokenizing (seconds for megabytes; the tokenizer releases the GIL while it
works) runs on a small thread pool, and a text too long to fit the context is refused
before any of it is tokenized. No token covers more characters than the vocabulary's
longest entry, so a text needs at least len(text) / that many tokens: past
`max_model_len` of them it cannot fit, whatever it says. Short texts are tokenized on the
loop, where a thread hop would cost more than the work.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

INLINE_CHARS = 2048  # shorter texts: tokenized on the loop (tens of microseconds)
_WORKERS = 2
T = TypeVar("T")


class TextWork:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = max(1, longest) * max_model_len  # a longer text has more tokens than fit
        self._pool: ThreadPoolExecutor | None = None  # made at first use, again after a shutdown

    def check_length(self, num_chars: int, field: str) -> None:
        """ValueError naming `field` when a text of `num_chars` cannot fit the context."""
        if num_chars > self.max_chars:
            raise ValueError(f"{field}: this model's maximum context length is {self.max_model_len} tokens, but "
                             f"the text has {num_chars} characters, more than that many tokens can hold")

    async def tokenize(self, text: str, field: str, *, add_special_tokens: bool = True) -> list[int]:
        self.check_length(len(text), field)
        return await self._run(len(text), lambda: list(self.tokenizer(
            text, add_special_tokens=add_special_tokens).input_ids))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(len(token_ids) * 4, lambda: self.tokenizer.decode(token_ids))

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's vocabulary entry, as the tokenizer spells it (byte-level or SentencePiece)."""
        return await self._run(len(token_ids) * 4, lambda: list(self.tokenizer.convert_ids_to_tokens(token_ids)))

    async def render_chat(self, messages: list[dict[str, Any]], field: str, *, add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template's text, tokenized (the template writes any special tokens itself,
        so `add_special_tokens` adds the tokenizer's on top only when asked, as vLLM's /tokenize).
        `tools`: OpenAI's tool definitions, which the template renders in its own way."""
        chars = sum(len(str(m.get("content") or "")) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        self.check_length(chars, field)

        def render() -> list[int]:
            text = chat_text(self.tokenizer, messages, add_generation_prompt, tools)
            self.check_length(len(text), field)
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

        return await self._run(chars, render)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work` on the pool whatever its size: for C++ work whose time no size foretells (a
        grammar's compile, router/grammar_check.py)."""
        if self._pool is None:
            # Again after a shutdown too: an app whose lifespan ends and starts again (a test
            # client per request) serves on; a stopping replica gets no more requests.
            self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="tandem-text")
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    async def _run(self, size: int, work: Callable[[], T]) -> T:
        if size <= INLINE_CHARS:
            return work()
        return await self.off_loop(work)

    def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
              tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template's text; ValueError naming `messages` when the template refuses them (a
    template raises for a conversation it cannot write, such as roles out of order: the client's
    mistake, a 400)."""
    from jinja2 import TemplateError

    from tandem.workers.text.tokenizer import apply_chat_template

    try:
        if not tools:
            return apply_chat_template(tokenizer, messages, add_generation_prompt)
        if getattr(tokenizer, "chat_template", None) is None:  # as apply_chat_template says it
            raise ValueError("messages: this model's tokenizer has no chat template")
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as exc:
        raise ValueError(f"messages: the model's chat template refused them: {exc}") from None
