"""Tests for tandem.workers.text.detokenizer with a tiny byte-level BPE tokenizer trained in memory."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.workers.text import detokenizer
from tandem.workers.text.detokenizer import IncrementalDetokenizer, find_stop

SENTENCES = [
    "héllo wörld",
    "日本語のテキスト",
    "emoji 😀🎉",
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a plain English sentence.",
    "STOP here and stop there",
] * 10
SAMPLE = "héllo wörld 日本語 😀 ok 🎉 the end. Ünïcödé ∑ 中文"


@pytest.fixture(autouse=True, params=["byte-table", "rust-stream", "python-window"])
def window(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs through the byte table (what a byte-level BPE tokenizer takes), through
    tokenizers' DecodeStream (any other fast tokenizer) and through the Python window (a
    tokenizers without DecodeStream, or a slow tokenizer): the same text each way."""
    if request.param != "byte-table":
        monkeypatch.setattr(detokenizer, "byte_tokens", lambda tokenizer: None)
    if request.param == "python-window":
        monkeypatch.setattr(detokenizer, "DecodeStream", None)
    return request.param


def test_a_fast_tokenizer_decodes_through_the_rust_stream(tok: PreTrainedTokenizerFast, window: str) -> None:
    detok = IncrementalDetokenizer(tok, enc(tok, "say"))
    assert detok._stream is None  # built at the first tokens read
    detok.add_tokens(enc(tok, " hi"))
    assert (detok._stream is not None) == (window == "rust-stream")
    assert detok.output_text == " hi"
    # A prompt ending inside a character: DecodeStream would hand that text out again.
    split = enc(tok, "emoji 😀")[:-1]
    assert tok.decode(split).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, split)
    detok.add_tokens(enc(tok, " hi"))
    assert detok._stream is None


def test_a_request_that_reads_no_tokens_builds_no_stream(tok: PreTrainedTokenizerFast) -> None:
    """A final-only request's tokens are decoded once at the end: no incremental decoder."""
    detok = IncrementalDetokenizer(tok, enc(tok, "say"))
    detok.add_tokens_unread(enc(tok, " hi there"))
    assert detok.finish() is None
    assert detok._stream is None and detok.output_text == " hi there"


def test_random_prompts_and_outputs_give_the_same_text_both_ways(tok: PreTrainedTokenizerFast, window: str) -> None:
    """Any prompt tail (split characters, special tokens) and any output: the Rust stream's text
    is the Python window's, token by token and at the end."""
    if window == "python-window":
        return  # one comparison of the two is enough
    rng = random.Random(3)
    for _ in range(400):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
        out = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 10))]
        skip = rng.random() < 0.5
        texts = []
        for stream in (detokenizer.DecodeStream, None):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(detokenizer, "DecodeStream", stream)
                detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
                steps = [detok.stream_delta(False) for t in out if detok.add_tokens([t]) is None]
                texts.append((steps, detok.stream_delta(True), detok.output_text))
        assert texts[0] == texts[1], (prompt, out, skip)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(SENTENCES, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|bos|>", eos_token="<|eos|>")


def enc(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream_all(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[str, list[str]]:
    """Feed ids `chunk` at a time, collecting stream deltas; returns (joined text, deltas)."""
    deltas: list[str] = []
    for i in range(0, len(ids), chunk):
        detok.add_tokens(ids[i : i + chunk])
        deltas.append(detok.stream_delta(finished=False))
    deltas.append(detok.stream_delta(finished=True))
    return "".join(deltas), deltas


def test_split_multibyte_characters_never_emit_replacement(tok: PreTrainedTokenizerFast) -> None:
    ids = enc(tok, SAMPLE)
    # The premise of the test: some character is split over several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, enc(tok, "prompt:"))
    deltas = []
    for i in ids:
        assert detok.add_tokens([i]) is None
        deltas.append(detok.stream_delta(finished=False))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == SAMPLE
    assert detok.output_text == SAMPLE
    assert detok.stream_delta(finished=True) == ""


@pytest.mark.parametrize("group", [2, 4, 8])
def test_groups_of_tokens_decode_as_one_token_at_a_time_does(tok: PreTrainedTokenizerFast, group: int) -> None:
    """Several tokens a step (multi-step decoding, drafts) take one window decode; a group that
    ends inside a character falls back to one token at a time, holding back only that character."""
    ids = enc(tok, SAMPLE)
    one, grouped = IncrementalDetokenizer(tok, enc(tok, "prompt:")), IncrementalDetokenizer(tok, enc(tok, "prompt:"))
    for i in range(0, len(ids), group):
        for tid in ids[i:i + group]:
            one.add_tokens([tid])
        grouped.add_tokens(ids[i:i + group])
        assert grouped.output_text == one.output_text, i
        assert "\ufffd" not in grouped.stream_delta(finished=False)
    assert grouped.output_text == SAMPLE


def _random_sequence(rng: random.Random, tok: PreTrainedTokenizerFast, base: list[int]) -> list[int]:
    kind = rng.randrange(4)
    if kind == 0:  # a random slice of real text: may start or end mid-character
        a = rng.randrange(len(base))
        return base[a : rng.randrange(a, len(base) + 1)]
    if kind == 1:  # real text with a few perturbations (dropped / duplicated / random ids)
        seq = list(base[: rng.randrange(1, len(base) + 1)])
        for _ in range(rng.randrange(1, 4)):
            pos = rng.randrange(len(seq) + 1)
            op = rng.randrange(3)
            if op == 0 and seq:
                del seq[min(pos, len(seq) - 1)]
            elif op == 1 and seq:
                seq.insert(pos, seq[min(pos, len(seq) - 1)])
            else:
                seq.insert(pos, rng.randrange(len(tok)))
        return seq
    if kind == 2:  # concatenation of two slices
        a, b = sorted(rng.sample(range(len(base) + 1), 2))
        c, d = sorted(rng.sample(range(len(base) + 1), 2))
        return base[a:b] + base[c:d]
    return [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 25))]  # pure noise


@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_equals_full_decode_random(tok: PreTrainedTokenizerFast, skip_special: bool) -> None:
    rng = random.Random(0)
    base = enc(tok, SAMPLE + " " + SAMPLE[::-1])
    prompt = enc(tok, "the quick brown fox ")
    for _ in range(300):
        ids = _random_sequence(rng, tok, base)
        if rng.random() < 0.3:
            ids = ids + [tok.eos_token_id]
        chunk = rng.choice([1, 1, 2, 3, 7])
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special)
        text, _ = stream_all(detok, ids, chunk)
        expected = tok.decode(ids, skip_special_tokens=skip_special)
        assert text == expected, (ids, chunk)
        assert detok.output_text == expected


@pytest.mark.parametrize("skip_special", [True, False])
def test_unread_tokens_decode_at_finish_to_the_streamed_text(tok: PreTrainedTokenizerFast,
                                                             skip_special: bool) -> None:
    """A final-only request's tokens are decoded once, at the end: the same text as streaming."""
    rng = random.Random(1)
    base = enc(tok, SAMPLE + " " + SAMPLE[::-1])
    prompt = enc(tok, "the quick brown fox ")
    for _ in range(200):
        ids = _random_sequence(rng, tok, base) + ([tok.eos_token_id] if rng.random() < 0.3 else [])
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special)
        step = rng.choice([1, 2, 5])
        for i in range(0, len(ids), step):
            detok.add_tokens_unread(ids[i:i + step])
        assert detok.output_text == ""
        assert detok.finish() is None
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip_special), ids


def test_output_ending_mid_character_is_flushed(tok: PreTrainedTokenizerFast, window: str) -> None:
    ids = enc(tok, "ok 😀")
    cut = ids[:-1]  # the emoji's last byte(s) never arrive
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens(cut)
    # The token holding the emoji's first bytes also holds the space before it. A window waits
    # with the whole token for a completion that never comes; the byte table holds back only
    # the incomplete character...
    held = "ok " if window == "byte-table" else "ok"
    assert detok.output_text == held
    assert detok.stream_delta(finished=False) == held
    # ...until the end, when it is flushed the way a full decode shows it.
    assert detok.stream_delta(finished=True) == tok.decode(cut)[len(held):]
    assert detok.output_text == tok.decode(cut)
    assert detok.output_text.endswith("\ufffd")
    assert detok.finish() is None  # idempotent


def test_eos_is_skipped(tok: PreTrainedTokenizerFast) -> None:
    ids = enc(tok, "hello world") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id] + enc(tok, "say "))
    text, _ = stream_all(detok, ids)
    assert text == "hello world"
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert stream_all(kept, ids)[0] == "hello world<|eos|>"


def test_prompt_window_keeps_boundary_text(tok: PreTrainedTokenizerFast) -> None:
    prompt = enc(tok, "héllo")
    out = enc(tok, " wörld 日本語")
    detok = IncrementalDetokenizer(tok, prompt)
    assert stream_all(detok, out)[0] == " wörld 日本語"


def test_prompt_window_gives_sentencepiece_style_leading_space() -> None:
    # Metaspace ("▁") decoding drops the leading space of the first token decoded, so
    # the first output token only gets its space back when decoded after prompt tokens.
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"])
    raw.train_from_iterator(["hello world foo bar"] * 10, trainer=trainer)
    sp = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    prompt = enc(sp, "hello")
    out = enc(sp, "hello world foo")[len(prompt) :]
    assert sp.decode(out) == "world foo"  # what decoding the output alone gives
    assert stream_all(IncrementalDetokenizer(sp, prompt), out)[0] == " world foo"


def test_stop_string_truncates(tok: PreTrainedTokenizerFast) -> None:
    ids = enc(tok, "hello world, this is a plain English sentence.")
    detok = IncrementalDetokenizer(tok, [], stop=["this"])
    found = None
    for i in ids:
        found = detok.add_tokens([i])
        if found:
            break
    assert found == "this"
    assert detok.output_text == "hello world, "
    assert detok.stream_delta(finished=True) == "hello world, "

    detok = IncrementalDetokenizer(tok, [], stop=["this"], include_stop_str_in_output=True)
    assert detok.add_tokens(ids) == "this"
    assert detok.output_text == "hello world, this"


def test_stop_string_spanning_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = enc(tok, "héllo wörld 日本語")
    stop = "lo wö"
    # Premise: no single token contains the whole stop string.
    assert all(stop not in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    num = next(n for n in range(len(ids) + 1) if stop in tok.decode(ids[:n]))
    results = [detok.add_tokens([i]) for i in ids[:num]]
    assert results[-1] == stop and all(r is None for r in results[:-1])
    assert detok.output_text == "hél"


def test_stop_inside_multibyte_output(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["語"])
    ids = enc(tok, "日本語のテキスト")
    found = None
    for i in ids:
        found = detok.add_tokens([i])
        if found:
            break
    assert found == "語" and detok.output_text == "日本"


def test_earliest_stop_wins(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["world", "llo"])
    assert detok.add_tokens(enc(tok, "hello world")) == "llo"
    assert detok.output_text == "he"


def test_min_tokens_delays_stop(tok: PreTrainedTokenizerFast) -> None:
    ids = enc(tok, "the quick brown fox jumps over the lazy dog")
    assert len(ids) > 6
    detok = IncrementalDetokenizer(tok, [], stop=["the"], min_tokens=3)
    results = []
    for i in ids:
        results.append(detok.add_tokens([i]))
        if results[-1]:
            break
    # The leading "the" arrives before min_tokens output tokens exist and is kept; the
    # second one stops the request.
    assert results[-1] == "the" and len(results) > 3
    assert detok.output_text == "the quick brown fox jumps over "


def test_stream_delta_holds_back_partial_stop(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    detok.add_tokens(enc(tok, "hello S"))
    assert detok.stream_delta(finished=False) == "hello "  # "S" could start "STOP"
    detok.add_tokens(enc(tok, "T"))
    assert detok.stream_delta(finished=False) == ""  # "ST" still could
    detok.add_tokens(enc(tok, "ay"))
    assert detok.stream_delta(finished=False) == "STay"  # it was not a stop string
    detok.add_tokens(enc(tok, " ST"))
    assert detok.stream_delta(finished=False) == " "
    assert detok.stream_delta(finished=True) == "ST"  # finished: release everything
    assert detok.output_text == "hello STay ST"


def test_stream_delta_never_shows_partial_stop(tok: PreTrainedTokenizerFast) -> None:
    ids = enc(tok, "STOP here and stop there")
    for stop in (["here"], ["stop there"], ["and s", "xyz"], ["e"]):
        detok = IncrementalDetokenizer(tok, [], stop=stop)
        deltas = []
        for i in ids:
            found = detok.add_tokens([i])
            deltas.append(detok.stream_delta(finished=found is not None))
            if found:
                break
        streamed = "".join(deltas)
        assert streamed == detok.output_text
        assert not any(s in streamed for s in stop)
        # Every intermediate prefix the client saw is a prefix of the final text.
        seen = ""
        for d in deltas:
            seen += d
            assert detok.output_text.startswith(seen)


def test_include_stop_streams_without_holdback(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    detok.add_tokens(enc(tok, "ab ST"))
    assert detok.stream_delta(finished=False) == "ab ST"
    assert detok.add_tokens(enc(tok, "OP more")) == "STOP"
    assert detok.stream_delta(finished=True) == "OP"


def test_add_after_stop_raises(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["o"])
    assert detok.add_tokens(enc(tok, "hello")) == "o"
    with pytest.raises(RuntimeError):
        detok.add_tokens([5])


def test_decode_token(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [])
    assert detok.decode_token(tok.eos_token_id) == "<|eos|>"
    ids = enc(tok, "hello world")
    assert "".join(detok.decode_token(i) for i in ids) == "hello world"


def test_find_stop() -> None:
    assert find_stop("hello world", 0, ["world", "lo"]) == ("lo", 3)
    assert find_stop("hello world", 0, ["xyz"]) is None
    # Only occurrences that end after `start` count: "lo" ends at 5, so start=5 skips it.
    assert find_stop("hello world", 5, ["lo"]) is None
    assert find_stop("hello world", 4, ["lo"]) == ("lo", 3)
    # A long stop string that began well before `start` is still found.
    assert find_stop("hello world", 10, ["lo world"]) == ("lo world", 3)
    assert find_stop("aaa", 0, ["", "a"]) == ("a", 0)  # empty stop strings are ignored
    assert find_stop("abab", 0, ["ab", "a"]) == ("ab", 0)  # tie: first listed wins


def _random_stop_cases(tok: PreTrainedTokenizerFast, seed: int, count: int, max_stop_len: int):
    """(ids, their full decode, a stop string cut from it, include_stop_str_in_output), random."""
    rng = random.Random(seed)
    base = enc(tok, SAMPLE + " " + SAMPLE[::-1])
    for _ in range(count):
        ids = _random_sequence(rng, tok, base)
        full = tok.decode(ids, skip_special_tokens=True)
        if len(full) < 2:
            continue
        a = rng.randrange(len(full) - 1)
        yield ids, full, full[a : a + rng.randrange(1, max_stop_len)], rng.random() < 0.5


def test_stop_random_property(tok: PreTrainedTokenizerFast) -> None:
    """With one stop string, the result is the full decode cut at its first occurrence,
    and the streamed text is exactly that with no partial stop string ever shown."""
    for ids, full, stop, include in _random_stop_cases(tok, seed=0, count=200, max_stop_len=5):
        detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
        streamed, found = "", None
        for i in ids:
            found = detok.add_tokens([i])
            streamed += detok.stream_delta(finished=found is not None)
            if found:
                break
        if not found:
            found = detok.finish()
            streamed += detok.stream_delta(finished=True)
        assert found == stop, (ids, stop)
        cut = full.index(stop) + (len(stop) if include else 0)
        assert detok.output_text == full[:cut] == streamed, (ids, stop)


@pytest.mark.parametrize("read", ["stream", "cumulative", "at_the_end", "stream_late"])
def test_the_text_committed_as_it_grows_says_the_same(tok: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch,
                                                      read: str) -> None:
    """The text lives as committed pieces and a tail (appending to one string is quadratic in
    its length). With the tail committed after every token, each way of reading the text (a
    stream's deltas, the whole text each step, the text at the end, a stream that starts late)
    gives the full decode cut at the first stop string, never showing part of one."""
    monkeypatch.setattr(detokenizer, "_TAIL_CHARS", 0)
    # One stop string (of two, the one completed first wins, not the first in the full text);
    # every fifth case none.
    cases = _random_stop_cases(tok, seed=5, count=150, max_stop_len=6)
    for n, (ids, full, stop, include) in enumerate(cases):
        stops = [stop] if n % 5 else []
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        streamed, found = "", None
        for k, i in enumerate(ids):
            found = detok.add_tokens([i])
            if read == "stream" or (read == "stream_late" and k >= len(ids) // 2):
                streamed += detok.stream_delta(finished=found is not None)
            elif read == "cumulative":
                streamed = detok.output_text
            if found:
                break
        if not found:
            found = detok.finish()
        if read in ("stream", "stream_late"):
            streamed += detok.stream_delta(finished=True)
        else:
            streamed = detok.output_text
        if stops:
            assert found == stops[0], (ids, stops)
            expected = full[:full.index(stops[0]) + (len(stops[0]) if include else 0)]
        else:
            expected = full
        assert detok.output_text == expected == streamed, (ids, stops, read)
        if read == "stream" and not include:
            assert not any(s in streamed for s in stops)


@pytest.mark.parametrize("every", [1, 3, 7])
def test_a_stream_read_every_few_steps_says_what_one_read_every_step_says(tok: PreTrainedTokenizerFast, window: str,
                                                                          every: int) -> None:
    """A paced stream reads its text once per several steps. Without stop strings a byte-level
    vocabulary's ids wait undecoded until then; the text read, whenever it is read, is the one
    read step by step (which holds a split character back), and nothing is lost at the end."""
    rng = random.Random(every)
    for _ in range(60):
        ids = enc(tok, SAMPLE)[rng.randrange(8):]
        each, paced = IncrementalDetokenizer(tok, enc(tok, "prompt:")), IncrementalDetokenizer(tok, enc(tok, "prompt:"))
        deltas = []
        for k, tid in enumerate(ids):
            assert each.add_tokens([tid]) is None and paced.add_tokens([tid]) is None
            each.stream_delta(finished=False)
            if k % every == every - 1:
                deltas.append(paced.stream_delta(finished=False))
                assert "".join(deltas) == each.output_text
        assert bool(paced._held) == (window == "byte-table" and len(ids) % every != 0)
        assert paced.output_text == each.output_text  # the text read between outputs says the same
        assert paced.num_output_tokens == len(ids)
        deltas.append(paced.stream_delta(finished=True))
        assert "".join(deltas) == tok.decode(ids) == paced.output_text
