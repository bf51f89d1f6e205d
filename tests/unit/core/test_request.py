from __future__ import annotations

import pytest

from tandem.workers.core.request import CompletionOutput, Request, RequestStatus, SamplingParams

BAD = [
    (dict(n=0), "n"),
    (dict(n=1.5), "n"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(presence_penalty=2.1), "presence_penalty"),
    (dict(presence_penalty=-2.1), "presence_penalty"),
    (dict(frequency_penalty=2.1), "frequency_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(output_kind="streaming"), "output_kind"),
]


@pytest.mark.parametrize(("options", "field_name"), BAD, ids=[f"{f}={o[f]!r}" for o, f in BAD])
def test_validation_error_names_the_field(options: dict, field_name: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**options)
    assert str(info.value).startswith(f"{field_name}: ")


def test_boundary_values_are_accepted() -> None:
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=2.0,
                            frequency_penalty=-2.0, max_tokens=1, min_tokens=1, logprobs=20)
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (1, 1, 20)
    assert SamplingParams(logprobs=0, max_tokens=None, min_tokens=1000).logprobs == 0


def test_normalisation() -> None:
    params = SamplingParams(stop="END", top_k=0)
    assert params.stop == ["END"]
    assert params.top_k == -1
    assert params.stop_token_ids == []
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_is_greedy_and_needs_penalties() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties


def test_status_is_finished() -> None:
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
    assert [s.value for s in sorted(finished, key=lambda s: s.value)] == ["abort", "error", "length", "stop"]


def test_request_token_views() -> None:
    req = Request("r", [10, 11, 12], SamplingParams(max_tokens=4), arrival_seq=0)
    assert req.status == RequestStatus.WAITING
    req.output_token_ids += [20, 21]
    assert req.all_token_ids == [10, 11, 12, 20, 21]
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 2, 5)
    assert [req.token_at(p) for p in range(5)] == [10, 11, 12, 20, 21]


def test_request_is_prefill_until_only_the_last_token_is_left() -> None:
    req = Request("r", [1, 2, 3, 4], SamplingParams(), arrival_seq=0)
    assert req.is_prefill
    req.num_computed_tokens = 2
    assert req.is_prefill
    req.num_computed_tokens = 3  # only the last prompt token left: a decode-sized step
    assert not req.is_prefill
    req.num_computed_tokens = 4
    req.output_token_ids.append(9)
    assert not req.is_prefill


def test_max_total_tokens() -> None:
    assert Request("r", [1, 2, 3], SamplingParams(max_tokens=4), 0).max_total_tokens == 7
    assert Request("r", [1, 2, 3], SamplingParams(max_tokens=4), 0, max_model_len=5).max_total_tokens == 5
    assert Request("r", [1, 2, 3], SamplingParams(max_tokens=None), 0, max_model_len=64).max_total_tokens == 64


def test_completion_output_finished() -> None:
    assert not CompletionOutput(0, "", [], None).finished
    assert CompletionOutput(0, "x", [1], None, finish_reason="stop").finished
