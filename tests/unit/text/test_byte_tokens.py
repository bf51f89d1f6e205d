"""The byte table of a byte-level BPE vocabulary decodes exactly as the tokenizer does."""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tandem.workers.model.demo_model import bench_model_path
from tandem.workers.text.byte_tokens import byte_tokens
from tandem.workers.text.detokenizer import IncrementalDetokenizer

TEXT = ["héllo wörld", "日本語のテキスト", "emoji 😀🎉", "the quick brown fox", "tabs\tand\nlines  "] * 10


def _byte_level(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A trained byte-level BPE with added tokens of every kind: special and not, ASCII and not,
    with spaces (characters outside GPT-2's byte table) and without."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(TEXT, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.add_tokens(["<tool_call>", "ünï code", " spaced ", AddedToken("Ġraw", normalized=False)])
    raw.add_special_tokens(["<|im_end|>", "§ special §"])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|bos|>", eos_token="<|eos|>")


@pytest.fixture(scope="module", params=["trained", "demo"])
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return _byte_level() if request.param == "trained" else AutoTokenizer.from_pretrained(bench_model_path())


def test_every_token_decodes_alone_as_the_tokenizer_decodes_it(tok: PreTrainedTokenizerFast) -> None:
    tables = byte_tokens(tok)
    assert tables is not None
    assert len(tables.all) == len(tok)
    for token_id in range(len(tok)):
        assert tables.all[token_id].decode("utf-8", "replace") == tok.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False), token_id
        skipped = tok._tokenizer.decode([token_id], skip_special_tokens=True)
        assert tables.skipping[token_id].decode("utf-8", "replace") == skipped, token_id


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_sequences_decode_as_the_tokenizer_decodes_them(tok: PreTrainedTokenizerFast,
                                                               skip_special: bool) -> None:
    """Random ids (lone bytes of split and invalid characters, added and special tokens):
    the joined bytes read as UTF-8 with U+FFFD for what is invalid are the tokenizer's text,
    whole and streamed through the detokenizer one token or several at a time."""
    tables = byte_tokens(tok)
    assert tables is not None
    table = tables.table(skip_special)
    rng = random.Random(7)
    for _ in range(400):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 30))]
        expected = tok._tokenizer.decode(ids, skip_special_tokens=skip_special)
        assert b"".join(table[i] for i in ids).decode("utf-8", "replace") == expected, ids
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special)
        step = rng.choice([1, 1, 2, 5])
        streamed = []
        for i in range(0, len(ids), step):
            detok.add_tokens(ids[i:i + step])
            streamed.append(detok.stream_delta(False))
        streamed.append(detok.stream_delta(True))
        assert "".join(streamed) == expected == detok.output_text, ids
        assert detok._stream is None  # the table, not tokenizers' stream


def test_ids_past_the_vocabulary_decode_to_nothing() -> None:
    """A model's vocabulary may be padded past its tokenizer's: such an id adds no text, as in
    the tokenizer's own decode."""
    tok = _byte_level()
    hello = tok.encode("hello", add_special_tokens=False)
    past = len(tok) + 5
    assert tok._tokenizer.decode([*hello, past]) == "hello"
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens([hello[0]])
    detok.add_tokens([past])
    detok.add_tokens([*hello[1:], past])
    assert detok.stream_delta(True) == "hello" == detok.output_text


def test_other_decoders_have_no_table() -> None:
    """SentencePiece-style decoding (Metaspace) decides a token's leading space from its place:
    not a byte-level vocabulary, so the detokenizer keeps its window."""
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(TEXT, trainer=trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert byte_tokens(tok) is None
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens(tok.encode("the quick", add_special_tokens=False))
    assert detok._stream is not None and detok.stream_delta(True) == "the quick"
    assert byte_tokens(object()) is None
