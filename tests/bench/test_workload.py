"""The seeded request set every system runs."""

from __future__ import annotations

from tandem.bench.workload import WorkloadSpec, fixed_length_requests, make_workload

TINY_OFFLINE = WorkloadSpec(num_requests=5, prompt_len=(6, 20), output_len=(3, 7), seed=3)


def test_workload_is_seeded_and_in_range() -> None:
    a = make_workload(TINY_OFFLINE, vocab_size=100)
    assert a == make_workload(TINY_OFFLINE, vocab_size=100)
    assert a != make_workload(WorkloadSpec(5, (6, 20), (3, 7), seed=4), vocab_size=100)
    assert len(a) == 5
    for r in a:
        assert 6 <= len(r.prompt_token_ids) <= 20 and 3 <= r.output_len <= 7
        assert all(5 <= t < 100 for t in r.prompt_token_ids)  # no special tokens
    same = fixed_length_requests(3, 4, 2, vocab_size=100)
    assert [(len(r.prompt_token_ids), r.output_len) for r in same] == [(4, 2)] * 3
