"""One replica group: engine, scheduler, KV blocks, model runner and model code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.workers.core.request import CompletionOutput, Logprob, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from tandem.workers.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from tandem.workers.llm import LLM

        return LLM
    raise AttributeError(name)
