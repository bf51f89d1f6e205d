"""Every sampling value the APIs accept, at its extremes, through every sampler: probabilities
stay finite and the drawn tokens are tokens. A value that broke this would fail a whole group
(`torch.multinomial` raises on NaN) for one request's choice."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.workers.core.request import GREEDY_BELOW_TEMPERATURE, REPETITION_PENALTY_RANGE, SamplingParams
from tandem.workers.sample.pass_sampler import PassSampler
from tandem.workers.sample.rejection_sampler import rejection_sample
from tandem.workers.sample.sampler import Sampler, SamplingRow

VOCAB = 48
CPU = torch.device("cpu")
# gRPC's temperature is a double with no upper bound; HTTP's stops at 2.
TEMPERATURES = st.one_of(st.sampled_from([0.0, 1e-300, 1e-40, 1e-6, GREEDY_BELOW_TEMPERATURE, 1e-4, 2.0, 1e300]),
                         st.floats(0.0, 1e6))
PENALTY = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2.0, 2.0))


@st.composite
def params(draw) -> SamplingParams:
    return SamplingParams(
        temperature=draw(TEMPERATURES),
        top_p=draw(st.one_of(st.sampled_from([1e-300, 1e-9, 1.0]), st.floats(1e-9, 1.0))),
        top_k=draw(st.sampled_from([-1, 1, 2, VOCAB - 1, VOCAB, VOCAB + 7, 2**31 - 1])),
        min_p=draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))),
        presence_penalty=draw(PENALTY), frequency_penalty=draw(PENALTY),
        repetition_penalty=draw(st.one_of(st.sampled_from(REPETITION_PENALTY_RANGE),
                                          st.floats(*REPETITION_PENALTY_RANGE))),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))))


@st.composite
def batches(draw) -> tuple[list[SamplingRow], torch.Tensor]:
    num_rows = draw(st.integers(1, 4))
    rows = [SamplingRow(draw(params()), draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
                        draw(st.lists(st.integers(0, VOCAB - 1), max_size=200)))
            for _ in range(num_rows)]
    # Logits as a model makes them, at scales from flat to very peaked (fp32 range to spare).
    scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e3, 1e4]))
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31)))) * scale
    return rows, logits


def test_tiny_temperatures_are_greedy_and_penalties_are_bounded():
    assert SamplingParams(temperature=1e-40).temperature == 0.0 and SamplingParams(temperature=1e-40).is_greedy
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).temperature == GREEDY_BELOW_TEMPERATURE
    for bad in (1e-30, 0.009, 100.5, 1e30):
        with pytest.raises(ValueError, match=r"^repetition_penalty: must be in \[0.01, 100\]"):
            SamplingParams(repetition_penalty=bad)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_every_accepted_extreme_samples_from_finite_probabilities(batch):
    rows, logits = batch
    sampler = Sampler(seed=3)
    probs = sampler.probs(logits, rows)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert all(math.isclose(total, 1.0, rel_tol=1e-4) for total in probs.sum(-1).tolist())
    out = sampler(logits, rows)
    assert all(0 <= t < VOCAB for t in out.token_ids)
    for position in out.logprobs:
        assert position is None or all(not math.isnan(lp.logprob) for lp in position.values())
    passes = PassSampler([r.params for r in rows], [r.prompt_token_ids for r in rows],
                         [r.output_token_ids for r in rows], CPU, sampler.shared_generator(CPU))
    assert all(0 <= t < VOCAB for t in passes(logits, 0).tolist())


@settings(max_examples=80, deadline=None)
@given(batches(), st.integers(1, 3))
def test_speculation_verifies_drafts_at_every_accepted_extreme(batch, num_drafts):
    rows, logits = batch
    row = rows[0]
    sampler = Sampler(seed=3)
    positions = [SamplingRow(row.params, row.prompt_token_ids, row.output_token_ids + [1] * j)
                 for j in range(num_drafts + 1)]
    target = sampler.probs(logits[:1].expand(num_drafts + 1, VOCAB), positions)
    draft = sampler.probs(torch.flip(logits[:1], [1]).expand(num_drafts, VOCAB), positions[:num_drafts])
    drafts = [int(t) for t in draft.argmax(-1).tolist()]
    for draft_probs in (draft, None):
        tokens = rejection_sample(target, drafts, draft_probs, torch.Generator().manual_seed(1))
        assert 1 <= len(tokens) <= num_drafts + 1 and all(0 <= t < VOCAB for t in tokens)
