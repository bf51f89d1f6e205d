"""Scheduler: the token-level stop conditions (EOS, stop ids, max_tokens, max_model_len, min_tokens)."""

from __future__ import annotations

from tandem.workers.core.request import Request, RequestStatus
from tandem.workers.core.scheduler import Scheduler
from tests.unit.core.scheduler_harness import EOS, FakeWorkers, make_req, make_scheduler, prompt, step


# --- stop conditions --------------------------------------------------------------------------
def run_to_end(s: Scheduler, w: FakeWorkers, req: Request, tokens: list[int]) -> list[int]:
    s.add_request(req)
    emitted: list[int] = []
    for token in tokens:
        _, updates = step(s, w, tokens={req.request_id: token})
        emitted += [t for u in updates for t in u.new_token_ids]
        if req.status.is_finished:
            break
    return emitted


def test_eos_stops() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0)
    assert run_to_end(s, w, req, [5, EOS, 6]) == [5, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [5, EOS]
    assert s.num_unfinished == 0
    s.kv.pool.check_all_free()


def test_ignore_eos() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=3, ignore_eos=True)
    assert run_to_end(s, w, req, [EOS, EOS, EOS, EOS]) == [EOS, EOS, EOS]
    assert req.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_stop_token_ids() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, stop_token_ids=[9])
    assert run_to_end(s, w, req, [5, 6, 9, 7]) == [5, 6, 9]
    assert req.status == RequestStatus.FINISHED_STOPPED
    s.kv.pool.check_all_free()


def test_max_tokens() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=3)
    assert run_to_end(s, w, req, [5, 6, 7, 8]) == [5, 6, 7]
    assert req.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_max_model_len() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=None, max_model_len=5)
    assert run_to_end(s, w, req, [5, 6, 7]) == [5, 6]
    assert req.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, min_tokens=3, stop_token_ids=[9])
    assert run_to_end(s, w, req, [EOS, 9, EOS, 7]) == [EOS, 9, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    s.kv.pool.check_all_free()


def test_length_ends_even_before_min_tokens_would_allow_a_stop() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=2, min_tokens=2)
    assert run_to_end(s, w, req, [EOS, EOS]) == [EOS, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED  # the stop check comes first
    s.kv.pool.check_all_free()
