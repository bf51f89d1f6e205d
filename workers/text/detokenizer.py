"""Incremental detokenization and stop-string handling for one request.

Decoding every step from scratch costs O(output length) per token, and decoding only
the newest token is wrong twice over: byte-level BPE tokens can hold part of a UTF-8
character, and SentencePiece-style tokenizers decide a token's leading space from
its neighbours. So, like vLLM and TGI, we decode a short sliding window of ids:
``ids[prefix_offset:read_offset]`` is text already emitted, ``ids[prefix_offset:]``
is that text plus the new part, and the difference between the two is the new text.

A byte-level BPE tokenizer needs no window: its tokens' bytes do not depend on their
neighbours, so each token's bytes go to an incremental UTF-8 decoder (`byte_tokens.py`), which
holds back only an incomplete character. Any other fast tokenizer takes tokenizers'
`DecodeStream`, which runs the window in Rust, seeded with the same prompt tail: one call a
token where the Python window makes two decodes and their list slices. Text it holds back (an
incomplete character, a skipped special token) is what `finish` flushes, from the ids this
class keeps either way.
"""
from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

from tandem.workers.text.byte_tokens import byte_tokens

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the Python window does it all
    DecodeStream = None

# How many prompt tokens seed the window, so the first output token decodes with the
# same spacing it has in context.
_PROMPT_WINDOW = 5
_REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to
# The text is kept as committed pieces and a live tail: appending to one growing string copies
# it whole each time (an attribute's `+=` is never done in place), quadratic in the output's
# length. The tail is committed once it is longer than this.
_TAIL_CHARS = 2048


def find_stop(text: str, start: int, stop: list[str]) -> tuple[str, int] | None:
    """Earliest occurrence in ``text`` of any string in ``stop`` that ends after ``start``.

    An occurrence qualifies when it overlaps ``text[start:]``; anything ending at or
    before ``start`` was already examined by an earlier call. So each stop string is
    searched from ``start - len(s) + 1``, which keeps the work O(new text). Returns
    ``(stop_string, index)``; on a tie in position the one listed first wins.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        if not s:
            continue  # an empty stop string would match everywhere
        idx = text.find(s, max(0, start - len(s) + 1))
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    return best


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, one step at a time."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes exactly what its decode() does without the
        # cleanup; calling it directly skips transformers' per-id type checks, which cost more
        # than the decode itself for the few ids of one step.
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if isinstance(backend, Tokenizer) else None
        self._skip_special = skip_special_tokens
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Only the window tail of the prompt matters; the full ids list holds just that
        # tail plus the output, so the offsets index into it.
        window = list(prompt_token_ids[-_PROMPT_WINDOW:])
        self._ids: list[int] = window
        self._prefix_offset = 0
        self._read_offset = len(window)
        # tokenizers' stream is built at the first `add_tokens`: a request that only wants its
        # final text (`add_tokens_unread`, one decode at the end) never pays for one.
        self._stream = None
        # A byte-level vocabulary's tokens as bytes (None: another tokenizer); the UTF-8 decoder
        # they go through is made at the first `add_tokens`, like the stream.
        self._tables = byte_tokens(tokenizer)
        self._bytes = None if self._tables is None else self._tables.table(skip_special_tokens)
        self._utf8: Callable[..., str] | None = None
        self._stream_due = self._backend is not None and self._bytes is None
        self._unread = False  # add_tokens_unread was called: the stream has not seen those ids
        self._held: list[int] = []  # a byte-level vocabulary's ids not decoded yet (no stop strings)
        self._num_output_tokens = 0
        # The text: `_done` (committed pieces, `_base` characters in all) then `_text`, the tail,
        # which holds everything a stop string or its holdback can still touch (the last
        # `_lookback` characters) and, once streaming, what stream_delta has not handed out.
        # Offsets below (old_len, _streamed) count from the tail's start.
        self._text = ""
        self._done: list[str] = []
        self._base = 0
        self._lookback = max((len(s) for s in self._stop), default=1) - 1
        self._streaming = False  # stream_delta has been called
        # Chars of the tail already handed out by stream_delta; negative when text committed
        # before the first call was never handed out.
        self._streamed = 0
        self._stopped: str | None = None
        self._flushed = False

    # -- decoding ---------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        # decode() (rather than convert_tokens_to_string) handles added tokens and
        # special-token skipping the same way a full decode does. Cleanup of
        # tokenization spaces is off because it rewrites text across window
        # boundaries (" ." -> "."), which would make the window diff inconsistent.
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _step(self, flush: bool = False) -> str | None:
        """New text from the ids past read_offset: "" when they add none (a skipped special
        token), None while their last character is incomplete (both keep the offsets)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means the last bytes may be the start of a character the next
        # token completes: wait (keeping the offsets) rather than emit a replacement char.
        # A skipped special token adds no text; waiting for it is harmless too.
        if new_text.endswith(_REPLACEMENT) and not flush:
            return None
        if len(new_text) <= len(prefix_text):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def add_tokens(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears in the output text
        (only checked once at least min_tokens output tokens exist), else None.
        After a stop string is found the text is truncated: it ends right before the stop
        string (or right after it when include_stop_str_in_output) and later calls must
        not be made."""
        if self._stopped is not None or self._flushed:
            raise RuntimeError("add_tokens called after the request finished")
        self._num_output_tokens += len(new_token_ids)
        if self._bytes is not None:
            if not self._stop:
                # No stop string reads the text as it grows, and a token's bytes do not depend on
                # its neighbours: the ids wait for the next reader, which decodes them in one call
                # (a paced stream's output carries several steps' tokens).
                self._held += new_token_ids
                return None
            old_len = len(self._text)
            self._add_bytes(new_token_ids)
            return self._check_stop(old_len)
        old_len = len(self._text)
        if self._stream_due:
            self._stream_due = False
            if not self._unread:  # the ids are still the prompt's tail alone
                self._stream = _decode_stream(self._backend, self._ids, self._skip_special)
        if self._stream is not None:
            # One token at a time, so an incomplete character holds back only itself. Ids the
            # stream holds back stay past _read_offset (prefix 0), for finish() to flush.
            for tid in new_token_ids:
                self._ids.append(tid)
                text = self._stream.step(self._backend, tid)
                if text is not None:
                    self._text += text
                    self._read_offset = len(self._ids)
            return self._check_stop(old_len)
        # Several tokens (speculation, multi-step decoding): one window decode for them all.
        # Where that holds text back (an incomplete character at the end), one token at a
        # time instead, so the incomplete character holds back only itself, not the step.
        if len(new_token_ids) > 1:
            self._ids.extend(new_token_ids)
            text = self._step()
            if text is not None:
                self._text += text
                return self._check_stop(old_len)
            del self._ids[len(self._ids) - len(new_token_ids):]
        parts: list[str] = []
        for tid in new_token_ids:
            self._ids.append(tid)
            parts.append(self._step() or "")
        self._text += "".join(parts)
        return self._check_stop(old_len)

    def _add_bytes(self, token_ids: list[int]) -> None:
        """A byte-level vocabulary's tokens, through the incremental UTF-8 decoder, onto the text."""
        decode = self._utf8
        if decode is None:
            assert not self._unread, "a request's tokens are either all read or all unread"
            decode = self._utf8 = codecs.getincrementaldecoder("utf-8")("replace").decode
        table = self._bytes
        try:
            data = table[token_ids[0]] if len(token_ids) == 1 else b"".join([table[tid] for tid in token_ids])
        except IndexError:  # an id past the vocabulary (a model's padded rows) decodes to nothing
            data = b"".join([table[tid] for tid in token_ids if tid < len(table)])
        text = decode(data)
        if text:
            self._text += text

    def _read_held(self) -> None:
        """Decode the ids `add_tokens` held (before anything reads the text)."""
        held, self._held = self._held, []
        self._add_bytes(held)
        if len(self._text) > _TAIL_CHARS:
            self._commit()

    def add_tokens_unread(self, new_token_ids: list[int]) -> None:
        """Append tokens without decoding them; `finish` decodes them all in one pass, to the
        same text. Only for a request that watches no stop string (that needs the text as it
        grows) and streams nothing."""
        assert not self._stop, "stop strings need the text as it grows"
        assert self._stream is None and self._utf8 is None, "a request's tokens are either all read or all unread"
        self._unread = True
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)

    def finish(self) -> str | None:
        """Emit any bytes still held as an incomplete character (as U+FFFD, like a full
        decode would). Called by ``stream_delta(finished=True)``; call it before reading
        ``output_text`` for a request that ended without streaming. Idempotent; returns
        a stop string if the flushed text completed one."""
        if self._flushed or self._stopped is not None:
            return self._stopped
        if self._held:
            self._read_held()
        self._flushed = True
        old_len = len(self._text)
        if self._utf8 is not None:  # bytes of an incomplete character, as U+FFFD
            self._text += self._utf8(b"", True)
            return self._check_stop(old_len)
        if self._read_offset == len(self._ids):
            return None
        self._text += self._step(flush=True) or ""
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> str | None:
        """After text was added (the tail was old_len characters before): the stop string it
        completed, if any; then the tail is committed if it has grown long."""
        stop = self._find_stop(old_len) if self._stop and self._num_output_tokens >= self._min_tokens else None
        if len(self._text) > _TAIL_CHARS:
            self._commit()
        return stop

    def _find_stop(self, old_len: int) -> str | None:
        # The tail holds at least `_lookback` characters before old_len (or all of the text):
        # every stop string that ends after old_len starts in it.
        if len(self._text) == old_len:
            return None
        found = find_stop(self._text, old_len, self._stop)
        if found is None:
            return None
        s, idx = found
        self._text = self._text[: idx + len(s)] if self._include_stop else self._text[:idx]
        self._stopped = s
        return s

    # -- outputs ----------------------------------------------------------------------

    def _commit(self) -> None:
        """Move the tail's head into `_done`, keeping what a stop string can still reach and,
        once streaming, what stream_delta has not handed out."""
        cut = len(self._text) - self._lookback
        if self._streaming:
            cut = min(cut, self._streamed)
        if cut > 0:
            self._done.append(self._text[:cut])
            self._text = self._text[cut:]
            self._base += cut
            self._streamed -= cut

    @property
    def output_text(self) -> str:
        """Full text so far (after any stop truncation)."""
        if self._held:
            self._read_held()
        if not self._done:
            return self._text
        if len(self._done) > 1:
            self._done = ["".join(self._done)]  # joined once; a later call joins two pieces
        return self._done[0] + self._text

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        # With include_stop_str_in_output the client gets the stop string anyway, so a
        # partial one is harmless and nothing needs holding back.
        if not self._stop or self._include_stop or self._stopped is not None:
            return 0
        longest = min(max(len(s) for s in self._stop) - 1, len(self._text))
        for k in range(longest, 0, -1):
            tail = self._text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stop):
                return k
        return 0

    def stream_delta(self, finished: bool) -> str:
        """Text not yet returned by earlier stream_delta calls. While not finished, holds
        back a trailing part of the text that could still be the beginning of a stop
        string, so a streaming client never sees a partial stop string; when
        finished=True returns everything that remains."""
        if finished:
            self.finish()
            end = len(self._text)
        else:
            if self._held:
                self._read_held()
            end = len(self._text) - self._holdback()
        # A held-back suffix is never shown, and a stop string can only start inside
        # one, so truncation never cuts below _streamed; max() just guards the invariant.
        end = max(end, self._streamed)
        if self._streamed >= 0:
            delta = self._text[self._streamed : end]
        else:  # the first call after text was committed unstreamed (a caller that streams late)
            delta = self.output_text[self._base + self._streamed : self._base + end]
        self._streamed = end
        self._streaming = True
        return delta

    def decode_token(self, token_id: int) -> str:
        """Text of a single token for logprobs display (special tokens shown, and a
        token holding part of a character shows U+FFFD)."""
        if self._tables is not None and 0 <= token_id < len(self._tables.all):
            return self._tables.all[token_id].decode("utf-8", "replace")
        return self._tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


def _decode_stream(backend: Tokenizer, prompt_tail: list[int], skip_special_tokens: bool) -> Any:
    """tokenizers' incremental decoder seeded with the prompt's tail, or None where this
    tokenizers has none or cannot seed one (its window would then lack the prompt's context).
    A tail that ends inside a character (its text ends in U+FFFD) is not a prefix DecodeStream
    keeps: it would hand the tail's own text out with the first token, so such a request takes
    the Python window."""
    if DecodeStream is None:
        return None
    if backend.decode(prompt_tail, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
        return None
    try:
        return DecodeStream(ids=prompt_tail, skip_special_tokens=skip_special_tokens)
    except TypeError:
        return None
