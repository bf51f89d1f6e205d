from __future__ import annotations

import math

import pytest
import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.sample.sampler import Sampler, SamplingRow, compute_logprobs


def row(prompt: list[int] | None = None, output: list[int] | None = None,
        suppress: tuple[int, ...] = (), **kw: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt or []), list(output or []), suppress)


def greedy_one(logits: list[float], **kw: object) -> int:
    return Sampler()(torch.tensor([logits]), [row(temperature=0.0, **kw)]).token_ids[0]


# --- greedy -------------------------------------------------------------------------------

def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_top_k_1_and_temperature_0_equal_greedy() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    expect = logits.argmax(-1).tolist()
    assert Sampler()(logits, [row(top_k=1, temperature=1.0) for _ in range(4)]).token_ids == expect
    assert Sampler()(logits, [row(temperature=0.0, top_p=0.5, seed=3) for _ in range(4)]).token_ids == expect


def test_greedy_ties_pick_lowest_id() -> None:
    assert greedy_one([0.0, 2.0, 2.0, 1.0]) == 1


def test_input_logits_not_modified() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.5]])
    before = logits.clone()
    Sampler()(logits, [row(temperature=0.7, top_k=2, repetition_penalty=2.0, prompt=[0],
                           suppress=(1,))])
    assert torch.equal(logits, before)


# --- seeding and distribution ---------------------------------------------------------------

def test_seed_independent_of_batch_composition() -> None:
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(1000, generator=gen)
    seeded = row(output=[5, 6, 7], seed=42, temperature=1.0)
    alone = Sampler(seed=0)(target[None], [seeded]).token_ids[0]

    others = torch.randn(3, 1000, generator=gen)
    batch = torch.stack([others[0], target, others[1], others[2]])
    rows = [row(temperature=1.0), seeded, row(seed=7, output=[1], temperature=0.5), row(temperature=0.0)]
    assert Sampler(seed=123)(batch, rows).token_ids[1] == alone
    # Reordered, and with different neighbours: still the same token.
    batch2 = torch.stack([target, others[2]])
    assert Sampler(seed=9)(batch2, [seeded, row(temperature=2.0)]).token_ids[0] == alone
    # Same seed + position but a different output history (e.g. after preemption) -> same token.
    assert Sampler()(target[None], [row(output=[9, 9, 9], seed=42)]).token_ids[0] == alone


def test_seed_differs_across_positions() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any repetition would be a seeding bug
    tokens = [Sampler()(logits, [row(output=[0] * pos, seed=42)]).token_ids[0] for pos in range(20)]
    assert len(set(tokens)) >= 15


def test_unseeded_follows_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    logits = probs.log().expand(n, 4).contiguous()
    out = Sampler(seed=0)(logits, [row(temperature=1.0) for _ in range(n)]).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=4).float()
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # df=3, p=0.001
    # Same sampler seed -> same draws; the sampler's generator advances between calls.
    s1, s2 = Sampler(seed=5), Sampler(seed=5)
    a, b = s1(logits[:50], [row() for _ in range(50)]), s2(logits[:50], [row() for _ in range(50)])
    assert a.token_ids == b.token_ids
    assert s1(logits[:50], [row() for _ in range(50)]).token_ids != a.token_ids


# --- filters -------------------------------------------------------------------------------

def _sample_many(logits: list[float], n: int = 2000, **kw: object) -> set[int]:
    x = torch.tensor(logits).expand(n, len(logits)).contiguous()
    return set(Sampler(seed=1)(x, [row(**kw) for _ in range(n)]).token_ids)


def test_top_k() -> None:
    assert _sample_many([0.0, 1.0, 0.5, 0.9, 0.2], top_k=2, temperature=5.0) == {1, 3}


def test_top_p() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    assert _sample_many(logits, top_p=0.01) == {0}
    assert _sample_many(logits, top_p=0.75) == {0, 1}
    assert _sample_many(logits, top_p=0.85) == {0, 1, 2}
    assert _sample_many(logits, top_p=1.0) == {0, 1, 2, 3}
    # top-p applies after temperature: at T=5 the distribution is flatter, so 0.75 needs 3 tokens.
    assert _sample_many(logits, top_p=0.75, temperature=5.0) == {0, 1, 2}


def test_min_p() -> None:
    logits = [1.0, 3.0, 2.9, 0.0]
    assert _sample_many(logits, min_p=1.0, temperature=3.0) == {1}
    # exp(-0.1)≈0.905 >= 0.5 keeps token 2; exp(-2)≈0.135 and exp(-3) drop tokens 0 and 3.
    assert _sample_many(logits, min_p=0.5) == {1, 2}


def test_top_k_then_top_p_then_min_p_combined() -> None:
    logits = [math.log(p) for p in [0.4, 0.3, 0.2, 0.1]]
    # top-k=3 renormalises to [4/9, 3/9, 2/9]; top-p 0.7 then keeps {0, 1} (4/9 < 0.7 <= 7/9).
    assert _sample_many(logits, top_k=3, top_p=0.7) == {0, 1}


# --- penalties and suppression --------------------------------------------------------------

def test_repetition_penalty_positive_logit_divided() -> None:
    # 3.0 / 2 = 1.5: a 1.49 competitor still loses, a 1.51 one wins.
    assert greedy_one([3.0, 1.49], prompt=[0], repetition_penalty=2.0) == 0
    assert greedy_one([3.0, 1.51], prompt=[0], repetition_penalty=2.0) == 1
    assert greedy_one([3.0, 1.51], output=[0], repetition_penalty=2.0) == 1  # output counts too
    assert greedy_one([3.0, 1.51], output=[0, 0, 0], repetition_penalty=2.0) == 1  # once, not per count
    assert greedy_one([3.0, 1.49], output=[0, 0, 0], repetition_penalty=2.0) == 0


def test_repetition_penalty_negative_logit_multiplied() -> None:
    # -0.4 * 2 = -0.8
    assert greedy_one([-0.4, -0.79], output=[0], repetition_penalty=2.0) == 1
    assert greedy_one([-0.4, -0.81], output=[0], repetition_penalty=2.0) == 0


def test_frequency_and_presence_penalties() -> None:
    # 2.0 - 0.5 * 3 - 0.25 = 0.25
    kw = dict(output=[0, 0, 0], frequency_penalty=0.5, presence_penalty=0.25)
    assert greedy_one([2.0, 0.26], **kw) == 1
    assert greedy_one([2.0, 0.24], **kw) == 0
    # presence alone: 2.0 - 1.0 = 1.0, independent of count
    assert greedy_one([2.0, 1.01], output=[0, 0, 0, 0], presence_penalty=1.0) == 1
    assert greedy_one([2.0, 0.99], output=[0, 0, 0, 0], presence_penalty=1.0) == 0
    # prompt tokens are not penalised by presence/frequency
    assert greedy_one([2.0, 0.26], prompt=[0, 0, 0], frequency_penalty=2.0, presence_penalty=2.0) == 0


def test_repetition_then_frequency_order() -> None:
    # (4.0 / 2) - 1.0 * 1 = 1.0 ; frequency-first would give (4 - 1) / 2 = 1.5
    kw = dict(output=[0], repetition_penalty=2.0, frequency_penalty=1.0)
    assert greedy_one([4.0, 1.01], **kw) == 1
    assert greedy_one([4.0, 0.99], **kw) == 0


def test_suppress_token_ids() -> None:
    assert greedy_one([5.0, 1.0, 2.0], suppress=(0,)) == 2
    assert _sample_many([5.0, 1.0, 2.0], n=500, suppress=(0, 2)) == {1}


# --- logprobs ------------------------------------------------------------------------------

def test_logprobs_match_log_softmax() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    rows = [row(temperature=0.0, logprobs=5), row(temperature=0.8, logprobs=0, seed=1),
            row(temperature=1.0, logprobs=None)]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0)]:
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.token_ids[i]
        top = ref[i].topk(n).indices.tolist() if n else []
        assert set(lp) == {tok, *top}
        for t, entry in lp.items():
            assert abs(entry.logprob - ref[i, t].item()) <= 1e-6
            assert entry.rank == int((ref[i] > ref[i, t]).sum()) + 1
            assert entry.decoded_token is None
        if n:
            assert [lp[t].rank for t in top] == list(range(1, n + 1))


def test_logprobs_raw_and_chosen_outside_top_n() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    # Suppress the top 3 so greedy picks token 3; logprobs still come from the raw logits.
    out = Sampler()(logits, [row(temperature=0.0, logprobs=2, suppress=(0, 1, 2))])
    ref = torch.log_softmax(logits, -1)[0]
    assert out.token_ids == [3]
    lp = out.logprobs[0]
    assert lp is not None and list(lp) == [3, 0, 1]  # chosen first, then top-N
    assert lp[3].rank == 4 and lp[0].rank == 1 and lp[1].rank == 2
    for t in (3, 0, 1):
        assert abs(lp[t].logprob - ref[t].item()) <= 1e-6


def test_logprob_ranks_with_ties() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    (lp,) = compute_logprobs(logits, [3], [3])
    assert lp is not None
    assert {t: e.rank for t, e in lp.items()} == {3: 4, 1: 1, 2: 1, 0: 3}


def test_compute_logprobs_none_rows() -> None:
    assert compute_logprobs(torch.zeros(2, 5), [0, 1], [None, None]) == [None, None]


def test_bad_shape_rejected() -> None:
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(2, 5), [row()])
