"""PassSampler (a multi-step step's passes) draws what Sampler draws for the same rows one
step at a time: the argmax for greedy rows, a seeded row's own token at each position."""

from __future__ import annotations

import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.sample.pass_sampler import PassSampler
from tandem.workers.sample.sampler import Sampler, SamplingRow, compute_logprobs
from tandem.workers.sample.step_sampler import StepSampler

VOCAB = 64
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.2, top_k=5, top_p=0.8, min_p=0.05, seed=12),
    SamplingParams(temperature=0.0, top_p=0.3),
    SamplingParams(temperature=0.7, top_k=VOCAB + 10, seed=13),  # a top-k past the vocabulary: no cut
]
NUM_OUTPUTS = [3, 0, 7, 1, 2]
CPU = torch.device("cpu")


def test_each_pass_draws_what_one_step_at_a_time_draws() -> None:
    sampler = Sampler(seed=5)
    passes = PassSampler(PARAMS, [[1, 2]] * len(PARAMS), [[0] * n for n in NUM_OUTPUTS], CPU,
                         sampler.shared_generator(CPU))
    for advance in range(4):
        logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(advance)) * 3
        rows = [SamplingRow(p, [1, 2], [0] * (n + advance)) for p, n in zip(PARAMS, NUM_OUTPUTS)]
        assert passes(logits, advance).tolist() == sampler(logits, rows).token_ids, advance


def test_an_unseeded_row_draws_within_its_filters() -> None:
    sampler = Sampler(seed=5)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=0.0)]
    passes = PassSampler(params, [[1], [1]], [[], []], CPU, sampler.shared_generator(CPU))
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0] + [-9.0] * (VOCAB - 4)] * 2)
    seen = {tuple(passes(logits, advance).tolist()) for advance in range(40)}
    assert {first for first, _ in seen} == {1, 2} and {second for _, second in seen} == {1}


def test_all_greedy_is_the_argmax() -> None:
    passes = PassSampler([SamplingParams(temperature=0.0)] * 3, [[1]] * 3, [[0] * 0, [0] * 4, [0] * 9], CPU,
                         Sampler().shared_generator(CPU))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    assert passes(logits, 2).tolist() == logits.argmax(-1).tolist()


def test_logprobs_of_every_pass_are_what_one_step_at_a_time_reports() -> None:
    sampler = Sampler(seed=5)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, seed=4, logprobs=0), SamplingParams(temperature=0.7, seed=8, logprobs=3)]
    passes = PassSampler(params, [[1]] * 4, [[]] * 4, CPU, sampler.shared_generator(CPU))
    sampled, expected = [], []
    for advance in range(3):
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(advance)) * 2
        sampled.append(passes(logits, advance))
        expected.append(compute_logprobs(logits, sampled[-1].tolist(), [p.logprobs for p in params]))
    found = passes.logprobs()
    assert (found.rows, found.num_top) == ([0, 2, 3], [2, 0, 3])
    # The step's output: each row's logprobs, pass by pass, from one copy of every pass's tensors.
    output = StepSampler(sampler, ()).collect_steps(list("abcd"), torch.stack(sampled, dim=1), found).result()
    assert output.logprobs[1] is None
    assert [output.logprobs[row] for row in (0, 2, 3)] == [[expected[a][row] for a in range(3)] for row in (0, 2, 3)]
    assert len(output.logprobs[3][0]) >= 3  # the chosen token and the top 3


def test_penalised_rows_draw_what_one_step_at_a_time_draws_as_their_tokens_grow() -> None:
    # Each pass adds its token to what the penalties count; Sampler is given the tokens so far.
    sampler = Sampler(seed=5)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
              SamplingParams(temperature=0.9, seed=6, repetition_penalty=0.8, frequency_penalty=-0.3),
              SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=1)]
    prompts = [[3, 4, 5], [6], [3, 3, VOCAB + 5], [7, 8], [9]]  # an id past the vocabulary counts for nothing
    outputs = [[4, 4], [], [5, 5, 6], [1], [2, 2, 2]]
    passes = PassSampler(params, prompts, outputs, CPU, sampler.shared_generator(CPU))
    grown = [list(out) for out in outputs]
    # Logits that favour the tokens seen so far: unpenalised, every row repeats them.
    base = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(2))
    for advance in range(5):
        logits = base.clone()
        for i, out in enumerate(grown):
            for t in set(prompts[i] + out):
                if t < VOCAB:
                    logits[i, t] += 3.0
        rows = [SamplingRow(p, prompts[i], list(grown[i])) for i, p in enumerate(params)]
        expected = sampler(logits, rows)
        chosen = passes(logits, advance).tolist()
        assert chosen == expected.token_ids, advance
        for out, token in zip(grown, chosen):
            out.append(token)
    assert grown[0][2:] != [4] * 5  # the penalty moved it off its favoured token
    found = passes.logprobs()  # from the raw logits, as Sampler reports them
    assert found.rows == [4] and found.tensors[0].shape == (1, 5)


def test_a_row_below_min_tokens_cannot_end_until_it_reaches_them() -> None:
    sampler = Sampler(seed=5)
    eos = (2,)
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, VOCAB + 1]),  # 1 output: 2 passes
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[9]),  # 0 outputs: 2
              SamplingParams(temperature=0.8, seed=3, min_tokens=5, frequency_penalty=0.5),  # 2 outputs: 3 passes
              SamplingParams(temperature=0.0, min_tokens=1)]  # reached already
    outputs = [[5], [], [6, 6], [4]]
    passes = PassSampler(params, [[1]] * 4, outputs, CPU, sampler.shared_generator(CPU), eos)
    grown = [list(out) for out in outputs]
    for advance in range(4):
        logits = torch.zeros(len(params), VOCAB)
        logits[:, [2, 7, 9]] = 10.0  # every row would end at once if it could
        rows = [SamplingRow(p, [1], list(out), () if len(out) >= p.min_tokens else
                            (() if p.ignore_eos else eos) + tuple(p.stop_token_ids)) for p, out in zip(params, grown)]
        chosen = passes(logits, advance).tolist()
        assert chosen == sampler(logits, rows).token_ids, advance
        for out, token in zip(grown, chosen):
            out.append(token)
    new = [out[len(first):] for out, first in zip(grown, outputs)]
    assert [new[0], new[1], new[3]] == [[9, 9, 2, 2], [2, 2, 2, 2], [2, 2, 2, 2]]
    assert 2 not in new[2][:3] and set(new[2][:3]) <= {7, 9}  # no EOS for three passes (5 - 2 outputs)
