"""Each token of a byte-level BPE vocabulary as the bytes it stands for.

A tokenizer whose decoder is tokenizers' `ByteLevel` alone (GPT-2's scheme: Llama 3, Qwen2,
Mistral NeMo, GPT-NeoX, the project's demo and test models) decodes ids by joining each
token's bytes and reading them as UTF-8, an invalid sequence becoming U+FFFD. No token's
bytes depend on its neighbours, so a request's text is its tokens' bytes fed one at a time
to an incremental UTF-8 decoder: a list index and one C call a token, where tokenizers'
`DecodeStream` decodes a window of ids twice in Rust (the detokenizer's costliest call per
token). The text is `decode(ids)`'s exactly (tests/unit/text/test_byte_tokens.py checks
every id of the test tokenizers and random sequences of them).

What `decode` does, and so what the table holds: a token's string is the added token's
content or the model's vocabulary entry; each of its characters maps back to one byte
through GPT-2's byte-to-character table, and a string with a character outside that table
(an added token's plain text) stands for its own UTF-8 bytes. Skipping special tokens skips
every id whose string is a special added token's content.
"""
from __future__ import annotations

import weakref
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel


def _char_to_byte() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: the printable Latin-1 bytes stand for
    themselves and the other 68 bytes for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in set(printable))
    chars.update((chr(256 + n), b) for n, b in enumerate(others))
    return chars


_CHAR_TO_BYTE = _char_to_byte()


def _token_bytes(token: str) -> bytes:
    try:
        return bytes([_CHAR_TO_BYTE[c] for c in token])
    except KeyError:
        return token.encode()


class ByteTokens:
    """One tokenizer's ids as bytes, special tokens kept (`all`) and skipped (`skipping`)."""

    __slots__ = ("all", "skipping", "__weakref__")

    def __init__(self, backend: Tokenizer) -> None:
        added = backend.get_added_tokens_decoder()
        special = {token.content for token in added.values() if token.special}
        self.all: list[bytes] = []
        self.skipping: list[bytes] = []
        size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        for token_id in range(size):
            token = backend.id_to_token(token_id)
            data = b"" if token is None else _token_bytes(token)  # an id the vocabulary lacks decodes to nothing
            self.all.append(data)
            self.skipping.append(b"" if token in special else data)

    def table(self, skip_special_tokens: bool) -> list[bytes]:
        return self.skipping if skip_special_tokens else self.all


_TABLES: weakref.WeakKeyDictionary[Any, ByteTokens | None] = weakref.WeakKeyDictionary()


def byte_tokens(tokenizer: Any) -> ByteTokens | None:
    """The table of a transformers fast tokenizer whose decoder is ByteLevel alone (built once
    per tokenizer object); None for any other tokenizer, which keeps the decode window."""
    try:
        return _TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # an object without weak references: built each time it is asked
        return _build(tokenizer)
    table = _TABLES[tokenizer] = _build(tokenizer)
    return table


def _build(tokenizer: Any) -> ByteTokens | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or not isinstance(backend.decoder, ByteLevel):
        return None
    return ByteTokens(backend)
