"""Prompts: what the engine takes as one, its token ids, and the sequences a request runs as.

A request with `n` completions becomes `n` scheduler requests over the same prompt, named
`<id>#0` .. `<id>#<n-1>` (just `<id>` when n is 1); the first leads, and its siblings wait
to share its prompt KV. The engine adds, aborts and fails them by these names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from tandem.workers.core.request import Request, SamplingParams

Prompt = str | list[int] | dict[str, Any]


def tokenize_prompt(tokenizer: Any, prompt: Prompt) -> tuple[str | None, list[int]]:
    """(the prompt's text where it has one, its token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError("prompt: must be a string, a list of token ids or a dict")


def sequence_id(request_id: str, n: int, index: int) -> str:
    """The scheduler's name for completion `index` of a request with `n` of them."""
    return request_id if n == 1 else f"{request_id}#{index}"


def sequences(request_id: str, token_ids: list[int], params: SamplingParams, arrival_seq: Iterator[int], *,
              eos_token_ids: tuple[int, ...], max_model_len: int, arrival_time: float) -> Iterator[Request]:
    """The request's `n` scheduler requests, in order (each takes its arrival number when made)."""
    leader = sequence_id(request_id, params.n, 0)
    for i in range(params.n):
        child_params = params
        if params.n > 1 and params.seed is not None:
            child_params = replace(params, seed=params.seed + i)  # vLLM: siblings differ
        yield Request(
            request_id=sequence_id(request_id, params.n, i), prompt_token_ids=token_ids,
            sampling_params=child_params, arrival_seq=next(arrival_seq), eos_token_ids=eos_token_ids,
            max_model_len=max_model_len, parent_id=request_id, index=i,
            leader_id=None if i == 0 else leader, arrival_time=arrival_time)
