"""Monitoring figures the engine keeps: the scheduler's counters and per-step cost inputs,
EngineStats and RequestMetrics."""

from __future__ import annotations

from tandem.workers.core.request import RequestStatus
from tandem.workers.core.stats import EngineStats, RequestMetrics
from tandem.workers.model.cost import ModelCost
from tests.unit.core.scheduler_harness import FakeWorkers, make_req, make_scheduler, prompt, step


def test_scheduler_counts_tokens_prefix_hits_and_step_cost_inputs() -> None:
    s, w = make_scheduler(max_num_batched_tokens=8, prefix=True), FakeWorkers()
    a = make_req("a", prompt(10), 0, max_tokens=2)
    s.add_request(a)
    out, _ = step(s, w)  # a: 8 of 10 prompt tokens
    assert (out.num_context_tokens, out.num_attention_pairs) == (8, 8 * 9 // 2)
    assert (s.num_prompt_tokens, s.num_prefix_hit_tokens, a.num_prefill_chunks) == (10, 0, 1)
    assert a.first_scheduled_time > 0
    out, _ = step(s, w)  # a: the last 2 prompt tokens after 8 cached -> first token
    assert (out.num_context_tokens, out.num_attention_pairs) == (10, 2 * 8 + 2 * 3 // 2)
    assert (a.num_prefill_chunks, s.num_generated_tokens) == (2, 1)
    out, _ = step(s, w)  # a decodes its last token: attends 11 keys
    assert (out.num_context_tokens, out.num_attention_pairs) == (11, 11)
    assert (s.num_generated_tokens, a.status) == (2, RequestStatus.FINISHED_LENGTH)
    # The same prompt again: its two full blocks (8 tokens) come from the prefix cache.
    b = make_req("b", prompt(10), 1, max_tokens=1)
    s.add_request(b)
    out, _ = step(s, w)
    assert (s.num_prompt_tokens, s.num_prefix_hit_tokens) == (20, 8)
    assert (out.num_context_tokens, out.num_attention_pairs) == (10, 2 * 8 + 3)


def test_preempted_waiting_is_counted_until_readmitted() -> None:
    s, w = make_scheduler(num_blocks=4, max_num_batched_tokens=64), FakeWorkers()
    a, b = make_req("a", prompt(7), 0, max_tokens=8), make_req("b", prompt(7, 50), 1, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step(s, w)  # both prefill: 2 blocks each, the pool is full
    step(s, w)  # both decode into their second block's last slot
    step(s, w)  # a needs a third block: b (the latest) is preempted
    assert (s.num_preemptions, s.num_preempted_waiting, b.status) == (1, 1, RequestStatus.PREEMPTED)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.num_preempted_waiting == 0


def test_engine_stats_step_cost_and_intervals() -> None:
    cost = ModelCost(num_layers=2, hidden_size=8, num_kv_heads=2, head_dim=4, non_embedding_params=1000,
                     lm_head_params=100, itemsize=4)
    stats = EngineStats(cost=cost)
    stats.record_step(num_tokens=3, num_context_tokens=10, num_attention_pairs=12, num_logit_rows=2, seconds=0.5)
    assert stats.bytes_read == 1100 * 4 + 10 * (2 * 2 * 2 * 4 * 4)
    assert stats.flops == 2 * 1000 * 3 + 2 * 2 * 2 * 8 * 12 + 2 * 100 * 2
    assert (stats.num_steps, stats.step_seconds) == (1, 0.5)
    # A multi-step step of 3 passes reads the weights three times.
    stats.record_step(num_tokens=3, num_context_tokens=6, num_attention_pairs=6, num_logit_rows=3, seconds=0.5,
                      num_passes=3)
    assert stats.bytes_read == 1100 * 4 + 10 * 128 + 3 * 1100 * 4 + 6 * 128
    assert stats.num_steps == 2
    stats.record_emit(10.0, had_decode=False)  # a first token: no interval
    stats.record_emit(10.25, had_decode=True)
    stats.record_emit(10.75, had_decode=True)
    assert stats.drain_token_intervals() == [0.25, 0.5]
    assert stats.drain_token_intervals() == []
    stats.record_finished("stop")
    stats.record_finished(None)
    assert stats.num_finished == {"stop": 1, "length": 0, "abort": 0, "error": 0}


def test_request_metrics_intervals() -> None:
    m = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, last_token_time=4.0,
                       finished_time=4.5, finish_reason="stop", num_prompt_tokens=5, num_generation_tokens=5,
                       num_cached_tokens=0, num_prefill_chunks=1, num_preemptions=0)
    assert (m.queue_s, m.prefill_s, m.ttft_s, m.decode_s, m.e2e_s, m.tpot_s) == (0.5, 0.5, 1.0, 2.0, 3.5, 0.5)
    never = RequestMetrics(1.0, 0.0, 0.0, 0.0, 2.0, "abort", 5, 0, 0, 0, 0)
    assert (never.queue_s, never.prefill_s, never.ttft_s, never.decode_s, never.tpot_s) == (None,) * 5
