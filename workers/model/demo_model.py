"""Locally generated Llama/Mistral/Qwen2 checkpoints for tests, demos and benchmarks.

There is no model hub, so every model tandem serves is made here: a byte-level BPE tokenizer
trained on synthetic text plus random weights, in the ordinary HF layout. Gibberish, but deterministic.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.workers.cache_dir import cache_dir

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedConfig, PreTrainedTokenizerFast

# torch, tokenizers and transformers' model classes (~4 s of CPU to import) are imported by
# the functions that build a model: a group serving the demo model, once it is built, only
# asks `demo_model_path()` where it is.

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
# These frequent strings become whole-character tokens; the rare random CJK/emoji in _corpus stay
# split into byte pieces, so a token can end mid-character, as in real models (streaming must cope).
_MULTIBYTE = ["é", "ü", "ñ", "ß", "ø", "日本", "東京", "中文", "😀", "🚀", "naïve", "café", "Ω", "€", "→"]
# Same as transformers' Qwen2Tokenizer (GPT-4 style: digits split one by one).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_ARCHS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}  # transformers' class name prefixes
_DTYPES = ("float32", "bfloat16", "float16")


def _classes(architecture: str) -> tuple[type, type]:
    """(config class, model class) of an architecture."""
    import transformers

    prefix = _ARCHS[architecture]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def _corpus(vocab_size: int, seed: int) -> list[str]:
    """Synthetic text whose size scales with the target vocab, so BPE can always reach it.

    Words come from a lexicon of ~vocab_size random words, half drawn Zipf-like (common words, as
    in real text), half uniformly (enough distinct pairs for the last merges). 32000 takes ~1.5 s."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lex = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(max(vocab_size, 1000))]
    lines = [_ENGLISH] * 20
    for _ in range(max(vocab_size // 100, 40)):
        words = []
        for _ in range(500):
            r = rng.random()
            if r < 0.80:
                zipf = rng.random() < 0.5
                word = lex[min(int(rng.paretovariate(1.0)), len(lex)) - 1] if zipf else rng.choice(lex)
            elif r < 0.88:
                word = str(rng.randint(0, 99999))
            elif r < 0.95:
                word = rng.choice(_MULTIBYTE) + rng.choice(lex)
            else:
                word = chr(rng.randint(0x4E00, 0x9FFF)) + chr(rng.randint(0x1F300, 0x1F5FF))
            if rng.random() < 0.1:
                word += rng.choice(".,;:!?")
            words.append(word)
        lines.append(" ".join(words) + "\n")
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer with `vocab_size` entries (specials included),
    on `texts` (default: the synthetic corpus of `seed`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's pipeline for every architecture: for model_type "qwen2", transformers 5 AutoTokenizer
    # rebuilds it as Qwen2Tokenizer whatever tokenizer.json says, so any other would diverge there.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # initial_alphabet: all 256 byte symbols, even unseen ones, so any text can be encoded.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts if texts is not None else _corpus(vocab_size, seed), trainer)
    # BOS from the post-processor, as in Llama: tokenizer(text) starts with it, while
    # add_special_tokens=False (what apply_chat_template uses) leaves it out.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))]),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        # Saved as "unk_token": null, stopping Qwen2Tokenizer (see above) from adding its default
        # unk "<|endoftext|>" as an extra token beyond the model's vocab.
        unk_token=None,
        # So all_special_ids / skip_special_tokens cover the chat markers (v4: additional_special_tokens).
        extra_special_tokens=[IM_START, IM_END], chat_template=CHAT_TEMPLATE,
        # Must be off: the default clean-up rewrites " ." to "." and breaks round-trips.
        clean_up_tokenization_spaces=False,
    )


def create_model_dir(
    path: str | os.PathLike[str], *, architecture: str = "llama", hidden_size: int = 64,
    intermediate_size: int = 128, num_hidden_layers: int = 2, num_attention_heads: int = 4,
    num_key_value_heads: int = 2, vocab_size: int = 512, max_position_embeddings: int = 512,
    rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool | None = None, attention_bias: bool | None = None,
    sliding_window: int | None = None, init_std: float = 0.15, seed: int = 0, dtype: str = "float32",
    max_shard_size: str | None = None, tokenizer: PreTrainedTokenizerFast | None = None,
) -> str:
    """Write a randomly initialised HF checkpoint (config, safetensors, tokenizer) to `path`."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if tokenizer is None:
        tokenizer = build_tokenizer(vocab_size, seed)
    config = model_config(
        tokenizer, architecture=architecture, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=tie_word_embeddings,
        attention_bias=attention_bias, sliding_window=sliding_window, init_std=init_std)

    import torch

    torch.manual_seed(seed)
    model = _classes(architecture)[1](config)
    # Re-initialise with a wide spread: the HF default (std 0.02) makes logits nearly flat,
    # so greedy argmax would flip on float noise; tests compare greedy outputs across
    # implementations and need decisive winners. named_parameters() skips tied duplicates.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1).add_(1.0)
            else:
                param.normal_(0.0, init_std)
    model = model.to(getattr(torch, dtype))
    model.generation_config = generation_config(tokenizer)
    with _quiet_hf_progress():  # no "Writing model shards" bars on stderr
        # No safe_serialization argument: safetensors is the only format in transformers 5.
        model.save_pretrained(path, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    tokenizer.save_pretrained(path)
    return str(path)


def model_config(
    tokenizer: PreTrainedTokenizerFast, *, architecture: str = "llama", hidden_size: int = 64,
    intermediate_size: int = 128, num_hidden_layers: int = 2, num_attention_heads: int = 4,
    num_key_value_heads: int = 2, head_dim: int | None = None, max_position_embeddings: int = 512,
    rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool | None = None, attention_bias: bool | None = None,
    sliding_window: int | None = None, init_std: float = 0.15, dtype: str | None = None,
) -> PreTrainedConfig:
    """The HF config of a model of this shape whose vocabulary is `tokenizer`'s."""
    if architecture not in _ARCHS:
        raise ValueError(f"architecture must be one of {sorted(_ARCHS)}, got {architecture!r}")
    # transformers 5 replaced `rope_scaling` with `rope_parameters`, which also carries rope_theta.
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        extra = dict(rope_scaling)
        if "type" in extra:  # legacy spelling used by older configs
            extra.setdefault("rope_type", extra.pop("type"))
        rope.update(extra)

    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),  # len() counts added tokens; tokenizer.vocab_size does not
        hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        rope_parameters=rope, initializer_range=init_std, architectures=[f"{_ARCHS[architecture]}ForCausalLM"],
        tie_word_embeddings=(architecture == "qwen2") if tie_word_embeddings is None else tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if dtype is not None:
        kwargs["dtype"] = dtype
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
    return _classes(architecture)[0](**kwargs)


def generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Chat turns end with <|im_end|>, plain completions with <|eos|>: both must stop generation."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)])


def _cached_model(name: str, **spec: Any) -> str:
    """Create `name` under the cache dir once (see `cached_dir`) with `create_model_dir(**spec)`."""
    return cached_dir(name, lambda tmp: create_model_dir(tmp, **spec))


def cached_dir(name: str, build: Callable[[Path], object], what: str = "a few seconds") -> str:
    """Create `name` under the cache dir once; safe when several processes race to do it.

    Each builds in its own temp dir beside the target and renames it into place: rename is
    atomic, so a visible target is always complete, and a loser just discards its copy."""
    target = cache_dir() / name
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"tandem: creating built-in model {target} (one-time, {what})", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model itself is not secret
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # a genuine failure, not a lost race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def demo_model_path() -> str:
    """Small Llama (5.0M params, vocab 4096) for tests and the quick-start demo."""
    return _cached_model(
        "demo-llama-v1", architecture="llama", hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
        max_position_embeddings=2048, seed=1234, init_std=0.15,
    )


def bench_model_path() -> str:
    """Larger Llama for benchmarks: 66.9M params (34.1M outside the embeddings), vocab 32000."""
    return _cached_model(
        "bench-llama-v2", architecture="llama", hidden_size=512, intermediate_size=2048,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=4096, seed=4321, init_std=0.1,
    )


def create_spec_pair(path: str | os.PathLike[str], *, num_draft_layers: int = 1, tail_scale: float = 1e-4,
                     **model_kwargs: Any) -> tuple[str, str]:
    """Write a target and a draft that agree, as `path`/target and `path`/draft; return both paths.

    The target is `create_model_dir(**model_kwargs)` with every layer past the first
    `num_draft_layers` muted: its o_proj and down_proj are scaled by `tail_scale`, so it still
    costs its full compute and bytes but adds ~nothing to the residual stream. The draft is the
    target's embedding, first `num_draft_layers` layers, final norm and LM head, so its greedy
    tokens are the target's almost always. Both share one tokenizer."""
    path = Path(path)
    layers = model_kwargs.get("num_hidden_layers", 2)
    if not 1 <= num_draft_layers < layers:
        raise ValueError(f"num_draft_layers must be in [1, {layers}), got {num_draft_layers}")
    if model_kwargs.get("tokenizer") is None:
        model_kwargs["tokenizer"] = build_tokenizer(model_kwargs.get("vocab_size", 512), model_kwargs.get("seed", 0))
    import torch

    target_dir, draft_dir = path / "target", path / "draft"
    create_model_dir(target_dir, **model_kwargs)
    with _quiet_hf_progress():
        target = _classes(model_kwargs.get("architecture", "llama"))[1].from_pretrained(target_dir, dtype="auto")
        with torch.no_grad():
            for layer in target.model.layers[num_draft_layers:]:
                layer.self_attn.o_proj.weight.mul_(tail_scale)
                layer.mlp.down_proj.weight.mul_(tail_scale)
        draft_config = target.config.to_dict()
        draft_config["num_hidden_layers"] = num_draft_layers
        if isinstance(draft_config.get("layer_types"), list):
            draft_config["layer_types"] = draft_config["layer_types"][:num_draft_layers]
        draft = type(target)(type(target.config).from_dict(draft_config)).to(target.dtype)
        kept = {name: w for name, w in target.state_dict().items()
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_draft_layers}
        draft.load_state_dict(kept, strict=True)
        draft.generation_config = target.generation_config
        shard_size = model_kwargs.get("max_shard_size")
        shards = {} if shard_size is None else {"max_shard_size": shard_size}
        target.save_pretrained(target_dir, **shards)
        draft.save_pretrained(draft_dir, **shards)
    model_kwargs["tokenizer"].save_pretrained(draft_dir)
    return str(target_dir), str(draft_dir)


@contextlib.contextmanager
def _quiet_hf_progress() -> Iterator[None]:
    """No "Loading weights" / "Writing model shards" bars on stderr."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def spec_model_paths() -> tuple[str, str]:
    """(target, draft) for `tandem bench spec`: the bench model with layers 2-8 muted, and its layer 1.

    Same shapes and base weights as `bench_model_path()` (so the target costs what the bench
    model costs per token); the draft is one layer plus the LM head, which dominates its bytes."""
    root = Path(cached_dir("spec-llama-v1", lambda tmp: create_spec_pair(
        tmp, num_draft_layers=1, architecture="llama", hidden_size=512, intermediate_size=2048,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=4096, seed=4321, init_std=0.1)))
    return str(root / "target"), str(root / "draft")
