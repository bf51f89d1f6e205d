"""Prompt-lookup drafting: propose what followed the last time the recent tokens appeared.

For n from ngram_max down to ngram_min, take the request's last n tokens and look for
their most recent earlier occurrence in the request's own tokens (prompt + output);
the k tokens that followed it are the draft. No extra model, so the draft
distribution is a point mass (q = one-hot), which the rejection sampler handles.
"""

from __future__ import annotations

from tandem.workers.core.request import Request


def find_ngram_continuation(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
    num = len(tokens)
    for n in range(min(ngram_max, num - 1), ngram_min - 1, -1):
        suffix = tokens[num - n:]
        # Scan right to left: the most recent match reflects the current context best.
        for start in range(num - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.k = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: list[Request]) -> None:
        for req in requests:
            req.spec_token_ids = find_ngram_continuation(req.all_token_ids, self.ngram_min, self.ngram_max, self.k)
