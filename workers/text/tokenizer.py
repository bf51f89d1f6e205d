"""Tokenizer loading and prompt handling shared by the engine and the server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    # transformers is imported here, not with the module: ~2 s of CPU that a group's start-up
    # spends on a thread of its own while its workers load the model (workers/engine/builder.py).
    from transformers import AutoTokenizer

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
