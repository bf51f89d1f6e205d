"""Tokenizer loading and prompt handling shared by the engine and the server."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot load a tokenizer from {model_dir!r}: {exc}") from exc


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True) -> str:
    if not messages:
        raise ValueError("messages: must be a non-empty list")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
