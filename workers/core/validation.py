"""The one check of a prompt against a model, used by the ingress and by the engine alike.

Sampling options are checked where they are made: `SamplingParams.__post_init__`. This adds
what needs the prompt and the model: the ingress checks with the model's figures before a
request leaves it (so a bad one never reaches a group), and the engine checks again with its
KV cache's size, which only it knows. Every message names its field (`ValueError("field:
...")`), which the ingress turns into a 400 / INVALID_ARGUMENT with that `param`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.workers.core.request import SamplingParams


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    # The longest prompt the group's KV cache can hold in blocks (the engine knows it; None:
    # not checked).
    max_cached_tokens: int | None = None
    # OpenAI's rule at an API server: prompt + max_tokens must fit the context, or 400.
    # Offline, a max_tokens past the context is capped there instead (finish reason "length").
    max_tokens_must_fit: bool = False


def validate_prompt(token_ids: list[int], params: SamplingParams, limits: PromptLimits,
                    field: str = "prompt") -> None:
    """ValueError naming `field` (or max_tokens) when the prompt cannot be served as asked."""
    if not token_ids:
        raise ValueError(f"{field}: must not be empty")
    vocab = limits.vocab_size
    bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad!r} is outside the vocabulary [0, {vocab})")
    num_prompt, max_len = len(token_ids), limits.max_model_len
    if num_prompt >= max_len:
        raise ValueError(f"{field}: this model's maximum context length is {max_len} tokens, but the prompt "
                         f"has {num_prompt} (at least one must be left to generate)")
    if limits.max_tokens_must_fit and params.max_tokens is not None and num_prompt + params.max_tokens > max_len:
        raise ValueError(f"max_tokens: this model's maximum context length is {max_len} tokens; the prompt has "
                         f"{num_prompt} and max_tokens asks for {params.max_tokens} more")
    if limits.max_cached_tokens is not None and num_prompt + 1 > limits.max_cached_tokens:
        raise ValueError(f"{field}: {num_prompt} tokens and one to generate need more KV blocks than the cache "
                         f"holds ({limits.max_cached_tokens} tokens); raise kv_cache_memory")
