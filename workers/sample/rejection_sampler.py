"""Verify draft tokens against the target so the output distribution is the target's.

For draft tokens d_1..d_k proposed from distributions q_1..q_k, and target
distributions p_0..p_k (p_j = the target's next-token distribution after d_1..d_j):

    accept d_{j+1} with probability min(1, p_j(d) / q_j(d));
    on the first rejection, sample from normalise(max(0, p_j - q_j)) and stop;
    if all k are accepted, sample a bonus token from p_k.

(Leviathan et al. 2023; Chen et al. 2023.) A point-mass draft (n-gram) has q_j(d) = 1,
so acceptance is p_j(d) and the residual is p_j with d removed. Greedy requests have a
point-mass target, which makes this "accept while the draft equals the argmax".
The random numbers come from the caller's generator, seeded per request and output
position, so a seeded request is reproducible.
"""

from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """target_probs: [k + 1, vocab]; draft_probs: [k, vocab] or None (point masses).

    Returns the accepted drafts plus one more token (the correction or the bonus).
    """
    k = len(draft_tokens)
    assert target_probs.shape[0] == k + 1
    device = target_probs.device
    uniforms = torch.rand(k + 1, generator=generator, device=device).tolist()
    out: list[int] = []
    for j, token in enumerate(draft_tokens):
        p = target_probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        p_token = float(p[token])
        if q_token > 0 and uniforms[j] < min(1.0, p_token / q_token):
            out.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min_(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q: any sample from p is right
            residual, total = p, float(p.sum())
        out.append(_sample(residual / total, generator))
        return out
    out.append(_sample(target_probs[k], generator))
    return out


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
