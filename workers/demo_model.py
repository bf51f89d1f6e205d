"""Tiny, locally generated Llama/Mistral/Qwen2 checkpoints for tests, demos and benchmarks.

There is no model hub here, so every model tandem serves in tests is made by this module:
a byte-level BPE tokenizer trained on a synthetic corpus, plus randomly initialised
weights saved in the ordinary Hugging Face layout (config.json, safetensors, tokenizer).
The outputs are meaningless text, but they are deterministic and exercise the same code
paths (multi-byte detokenisation, GQA, RoPE scaling, tied embeddings, sharded loading)
as a real checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. A serving system accepts requests, "
    "schedules them in batches, and streams tokens back to the client as soon as they are "
    "generated. Each worker holds a slice of the model and a paged cache of keys and values; "
    "when memory runs short, the scheduler preempts the youngest request and resumes it later.\n"
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness. Numbers like 3.14159, 2024 and 1,000,000 appear too, as do quotes "
    "(\"hello\", 'world') and symbols: #, $, %, &, *, +, -, /, <, =, >, @, [, ], ^, _, {, |, }, ~.\n"
)
# Frequent multi-byte strings get merged into whole-character tokens; the rare random CJK
# characters and emoji below stay split across byte tokens, which is what makes
# incremental detokenisation non-trivial (a token may end in the middle of a character).
_MULTIBYTE = ["é", "ü", "ñ", "ß", "ø", "日本", "東京", "中文", "😀", "🚀", "naïve", "café", "Ω", "€", "→"]
# Same as transformers' Qwen2Tokenizer (GPT-4 style: digits split one by one).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_ARCHS: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _corpus(vocab_size: int, seed: int) -> list[str]:
    """Synthetic text whose size scales with the target vocab, so BPE can always reach it.

    Pseudo-words come from a lexicon of about `vocab_size` random words; half the draws are
    Zipf-like (a few very common words, as in real text) and half uniform (so there are enough
    distinct pairs left for the last merges). Measured: 32000 is reached in about 1 s.
    """
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(max(vocab_size, 1000))]
    lines = [_ENGLISH] * 20
    for _ in range(max(vocab_size // 100, 40)):
        words = []
        for _ in range(500):
            r = rng.random()
            if r < 0.80:
                if rng.random() < 0.5:
                    word = lexicon[min(int(rng.paretovariate(1.0)) - 1, len(lexicon) - 1)]
                else:
                    word = rng.choice(lexicon)
            elif r < 0.88:
                word = str(rng.randint(0, 99999))
            elif r < 0.95:
                word = rng.choice(_MULTIBYTE) + rng.choice(lexicon)
            else:
                word = chr(rng.randint(0x4E00, 0x9FFF)) + chr(rng.randint(0x1F300, 0x1F5FF))
            if rng.random() < 0.1:
                word += rng.choice(".,;:!?")
            words.append(word)
        lines.append(" ".join(words) + "\n")
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer with `vocab_size` entries (specials included)."""
    tok = Tokenizer(models.BPE())
    # The Qwen2 pipeline (NFC + split regex + byte-level), used for every architecture: in
    # transformers 5, AutoTokenizer ignores tokenizer.json's pipeline for model_type "qwen2" and
    # rebuilds it as Qwen2Tokenizer, so any other pipeline would encode differently there.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, even unseen ones, so any input text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(vocab_size, seed), trainer)
    bos_id = tok.token_to_id(BOS)
    # BOS via the post-processor (not the chat template or the caller), so that
    # tokenizer(text) matches what Llama-style tokenizers do; trim_offsets=False keeps
    # offsets byte-exact.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # Saved as "unk_token": null, which stops Qwen2Tokenizer (see above) from adding its
        # default unk "<|endoftext|>" as an extra token beyond the model's vocab.
        unk_token=None,
        # Registered so all_special_ids and skip_special_tokens cover the chat markers too
        # (transformers 5 name; `additional_special_tokens` is the v4 spelling).
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        # Must be off: the default clean-up rewrites " ." to "." and breaks round-trips.
        clean_up_tokenization_spaces=False,
    )


def create_model_dir(
    path: str | os.PathLike[str],
    *,
    architecture: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool | None = None,
    attention_bias: bool | None = None,
    sliding_window: int | None = None,
    init_std: float = 0.15,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> str:
    """Write a randomly initialised HF checkpoint (config, safetensors, tokenizer) to `path`."""
    if architecture not in _ARCHS:
        raise ValueError(f"architecture must be one of {sorted(_ARCHS)}, got {architecture!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if tokenizer is None:
        tokenizer = build_tokenizer(vocab_size, seed)
    config_cls, model_cls = _ARCHS[architecture]

    # transformers 5 replaced `rope_scaling` with `rope_parameters`, which also carries rope_theta.
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        extra = dict(rope_scaling)
        if "type" in extra:  # legacy spelling used by older configs
            extra.setdefault("rope_type", extra.pop("type"))
        rope.update(extra)

    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),  # len() counts added tokens; vocab_size alone may not
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope,
        tie_word_embeddings=(architecture == "qwen2") if tie_word_embeddings is None else tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[model_cls.__name__],
    )
    if architecture == "llama":
        kwargs["attention_bias"] = bool(attention_bias)
        if sliding_window is not None:
            raise ValueError("llama has no sliding window; use architecture='mistral' or 'qwen2'")
    elif architecture == "mistral":
        if attention_bias:
            raise ValueError("mistral has no attention bias")
        # MistralConfig defaults to a 4096 window; None here must mean "full attention".
        kwargs["sliding_window"] = sliding_window
    else:
        if attention_bias is False:
            raise ValueError("qwen2 always has q/k/v bias")
        # max_window_layers=0 makes every layer use the window, matching mistral's behaviour.
        kwargs.update(use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                      max_window_layers=0)
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config)
    # Re-initialise with a wide spread: the HF default (std 0.02) makes logits nearly flat,
    # so greedy argmax would flip on float noise; tests compare greedy outputs across
    # implementations and need decisive winners. named_parameters() skips tied duplicates.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1).add_(1.0)
            else:
                param.normal_(0.0, init_std)
    model = model.to(_DTYPES[dtype])
    # Chat turns end with <|im_end|>, plain completions with <|eos|>: both must stop generation.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)  # safetensors is the only format in transformers 5
    tokenizer.save_pretrained(path)
    return str(path)


def cache_dir() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "tandem"
    return Path.home() / ".cache" / "tandem"


def _cached_model(name: str, **spec: Any) -> str:
    """Create `name` under the cache dir once; safe when several processes race to do it.

    Each process builds into its own temp dir beside the target and renames it into place;
    rename is atomic, so a visible target is always complete, and a loser just discards its copy.
    """
    target = cache_dir() / name
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"tandem: creating built-in model {name} in {target.parent} (one-time, a few seconds)",
          file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model itself is not secret
    try:
        create_model_dir(tmp, **spec)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # a genuine failure, not a lost race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def demo_model_path() -> str:
    """Small Llama (about 4M params, vocab 4096) for tests and the quick-start demo."""
    return _cached_model(
        "demo-llama-v1", architecture="llama", hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
        max_position_embeddings=2048, seed=1234, init_std=0.15,
    )


def bench_model_path() -> str:
    """Larger Llama (about 70M params, vocab 32000) for benchmarks, where compute must show."""
    return _cached_model(
        "bench-llama-v1", architecture="llama", hidden_size=512, intermediate_size=1408,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=4096, seed=4321, init_std=0.1,
    )
