"""Tokenizer loading and prompt handling shared by the engine and the server."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: str, *, pick_in_child: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer AutoTokenizer loads from `model_dir`: through the class it picked before
    for this directory when one is remembered (workers/text/tokenizer_class.py: no torch
    imported), else through AutoTokenizer, whose pick is then remembered. `pick_in_child`: a
    process that must not load torch has a child process make a pick not yet remembered."""
    from tandem.workers.text.tokenizer_class import picked_in_child, remember_class, remembered_class

    try:
        cls = remembered_class(model_dir)
        if cls is None and pick_in_child and "torch" not in sys.modules:
            cls = picked_in_child(model_dir)
        if cls is not None:
            # What AutoTokenizer passes the class it picks, for a local directory.
            return cls.from_pretrained(model_dir, local_files_only=True, _from_auto=True)
        # transformers is imported here, not with the module: ~2 s of CPU that a group's
        # start-up spends on a thread of its own while its workers load the model
        # (workers/engine/builder.py).
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot load a tokenizer from {model_dir!r}: {exc}") from exc
    remember_class(model_dir, type(tokenizer))
    return tokenizer


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True) -> str:
    if not messages:
        raise ValueError("messages: must be a non-empty list")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
