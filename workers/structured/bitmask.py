"""Token bitmasks (xgrammar's layout: int32 words, bit j of word w allows token 32 w + j) applied
to logits on their device, with torch alone: the workers need no grammar engine."""

from __future__ import annotations

import torch

BITS = 32


def num_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab_size] bool from [rows, words] int32 bitmasks."""
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(BITS, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1  # arithmetic shift: the sign bit's word still reads right
    return bits.view(words.shape[0], -1)[:, :vocab_size].bool()


def apply_token_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Disallowed tokens of `logits[rows[i]]` become -inf, in place (`bitmask[i]` says which)."""
    if not rows:
        return
    vocab = logits.shape[-1]
    refused = ~allowed_tokens(bitmask, vocab, logits.device)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(refused, float("-inf"))  # every row (one launch)
        return
    for i, row in enumerate(rows):  # in place row by row: no gather and scatter of the whole batch
        logits[row].masked_fill_(refused[i], float("-inf"))
