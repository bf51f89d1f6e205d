"""The ingress's text work: a text that cannot fit is refused before it is tokenized, and a
long one is tokenized on the text pool, never on the event loop."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from tandem.router.text_work import INLINE_CHARS, TextWork


class FakeTokenizer:
    """One token per word; the vocabulary's longest entry is 5 characters."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bb": 1, "hello": 2}

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        self.threads.append(threading.current_thread().name)
        ids = [len(w) for w in text.split()]
        return SimpleNamespace(input_ids=([1] if add_special_tokens else []) + ids)

    def decode(self, token_ids: list[int]) -> str:
        self.threads.append(threading.current_thread().name)
        return " ".join("x" * t for t in token_ids)


def test_a_text_that_cannot_fit_is_refused_before_tokenizing() -> None:
    tok = FakeTokenizer()
    work = TextWork(tok, max_model_len=10)  # at most 5 x 10 characters can fit
    assert work.max_chars == 50
    assert asyncio.run(work.tokenize("a" * 50, "prompt")) == [1, 50]
    with pytest.raises(ValueError, match="^prompt: this model's maximum context length is 10 tokens, but the "
                                         "text has 51 characters, more than that many tokens can hold$"):
        asyncio.run(work.tokenize("a" * 51, "prompt"))
    assert len(tok.threads) == 1  # the refused text was never tokenized
    work.shutdown()


def test_short_texts_are_tokenized_on_the_loop_and_long_ones_on_the_pool() -> None:
    tok = FakeTokenizer()
    work = TextWork(tok, max_model_len=10_000)
    long_text = "hello " * (INLINE_CHARS // 6 + 1)

    async def run() -> list:
        return [await work.tokenize("hello a", "prompt", add_special_tokens=False),
                len(await work.tokenize(long_text, "prompt")),
                await work.decode([1, 2])]

    assert asyncio.run(run()) == [[5, 1], INLINE_CHARS // 6 + 2, "x xx"]
    assert tok.threads[0] == threading.current_thread().name
    assert tok.threads[1].startswith("tandem-text")
    assert tok.threads[2] == threading.current_thread().name
    work.shutdown()


def test_chat_messages_too_long_are_refused_before_the_template_runs() -> None:
    work = TextWork(FakeTokenizer(), max_model_len=10)
    with pytest.raises(ValueError, match="^messages: this model's maximum context length is 10 tokens"):
        asyncio.run(work.render_chat([{"role": "user", "content": "a" * 30}, {"role": "user", "content": "b" * 30}],
                                     "messages"))
    work.shutdown()
