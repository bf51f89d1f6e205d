"""How many pieces flash-decoding cuts each decode row's keys into.

Apart from the kernels (no Triton import): the runner asks it on the host for every eager
decode step and for each CUDA-graph bucket at capture.
"""

from __future__ import annotations


def default_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                       num_sms: int) -> int:
    """Enough (row, kv_head, split) programs for ~2 waves over the SMs, but no split shorter
    than ~256 keys (or one block) and at most 32 splits."""
    # Plain integer ceil-divisions: this runs on the host every step, where triton.cdiv (a
    # jitted function) costs tens of microseconds a call.
    programs = max(1, batch_size * num_kv_heads)
    wanted = -(-2 * max(1, num_sms) // programs)
    min_keys = max(256, block_size)
    by_length = max(1, -(-max(1, max_seq_len) // min_keys))
    return max(1, min(wanted, by_length, 32))
