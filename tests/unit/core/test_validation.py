"""validate_prompt: the one check of a prompt, at the ingress and in the engine, with one set of
messages, each naming its field."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.core.validation import PromptLimits, validate_prompt

SERVER = PromptLimits(vocab_size=512, max_model_len=64, max_tokens_must_fit=True)
ENGINE = PromptLimits(vocab_size=512, max_model_len=64, max_cached_tokens=40)


@pytest.mark.parametrize("token_ids, params, limits, field, message", [
    ([], SamplingParams(), SERVER, "prompt", "prompt: must not be empty"),
    ([], SamplingParams(), ENGINE, "messages", "messages: must not be empty"),
    ([1, 512], SamplingParams(), SERVER, "prompt", "prompt: token id 512 is outside the vocabulary [0, 512)"),
    ([1, -1], SamplingParams(), ENGINE, "prompt", "prompt: token id -1 is outside the vocabulary [0, 512)"),
    ([1, "a"], SamplingParams(), SERVER, "prompt", "prompt: token id 'a' is outside the vocabulary [0, 512)"),
    ([5] * 64, SamplingParams(), SERVER, "prompt", "prompt: this model's maximum context length is 64 tokens, "
                                                    "but the prompt has 64 (at least one must be left to generate)"),
    ([5] * 60, SamplingParams(max_tokens=5), SERVER, "prompt",
     "max_tokens: this model's maximum context length is 64 tokens; the prompt has 60 and max_tokens asks "
     "for 5 more"),
    ([5] * 40, SamplingParams(), ENGINE, "prompt",
     "prompt: 40 tokens and one to generate need more KV blocks than the cache holds (40 tokens); "
     "raise kv_cache_memory"),
])
def test_each_rule_names_its_field(token_ids, params, limits, field, message) -> None:
    with pytest.raises(ValueError) as info:
        validate_prompt(token_ids, params, limits, field)
    assert str(info.value) == message


def test_what_passes() -> None:
    validate_prompt([5] * 60, SamplingParams(max_tokens=4), SERVER)  # 64 tokens in all: fits exactly
    validate_prompt([5] * 60, SamplingParams(max_tokens=None), SERVER)  # up to the context
    validate_prompt([5] * 60, SamplingParams(max_tokens=100), PromptLimits(512, 64))  # offline: capped
    validate_prompt([5] * 39, SamplingParams(), ENGINE)  # 39 + 1 fill the cache's 40 tokens


def test_sampling_numbers_must_be_finite() -> None:
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ValueError) as info:
                SamplingParams(**{name: value})
            assert str(info.value) == f"{name}: must be a finite number, got {value!r}"
