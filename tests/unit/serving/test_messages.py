"""The messages between the ingress and the groups: they survive Ray's pickling whole, and the
routing stats Serve carries as a dict come back as they went."""

from __future__ import annotations

import pickle

from ray import cloudpickle

from tandem.workers.core.request import CompletionOutput, Logprob, SamplingParams
from tandem.workers.serving import messages as m


def test_every_message_survives_pickling_whole() -> None:
    messages = [
        m.GroupRequest("cmpl-1-0", [1, 2, 3], SamplingParams(n=2, max_tokens=4, stop=["x"]), final_only=True,
                     trace_context={"traceparent": "00-ab-cd-01"}, avoid_group="g1"),
        m.GroupDelta("cmpl-1-0", "g0", [CompletionOutput(0, "hi", [7], [{7: Logprob(-0.5, 1, "hi")}], "stop", 7)],
                   True, num_prompt_tokens=3, num_cached_tokens=2, prompt_logprobs=[None, {2: Logprob(-1.0, 2, "b")}]),
        m.GroupDelta.failure("cmpl-2-0", "g0", "prompt: must not be empty", "invalid_request"),
        m.Accepted("g0"), m.ChannelOpen("g0", "ingress-1"),
        m.DeltaBatch([m.GroupDelta("cmpl-1-0", "g0", [CompletionOutput(0, "a", [5], None)], False)]),
        m.PrefixExportRequest("g2", [11, 12]), m.PrefixExport(2, ["ref-a", "ref-b"]), m.StatsRequest("g0"),
        m.GroupStats("g0", m.RoutingStats(num_running=1, kv_usage=0.5), kv_blocks_total=8, kv_blocks_free=3,
                   worker_pids=(41, 42)),
    ]
    for message in messages:
        assert pickle.loads(cloudpickle.dumps(message)) == message


def test_a_failure_is_a_finished_delta_with_no_outputs() -> None:
    delta = m.GroupDelta.failure("r", "g0", "the replica group has failed: worker died", "unavailable")
    assert (delta.finished, delta.outputs, delta.error_kind, delta.num_output_tokens) == (True, [], "unavailable", 0)


def test_output_tokens_count_every_sequence() -> None:
    outputs = [CompletionOutput(0, "ab", [5, 6], None), CompletionOutput(1, "c", [7], None)]
    assert m.GroupDelta("r", "g0", outputs, False).num_output_tokens == 3


def test_routing_stats_come_back_from_serves_dict_as_they_went() -> None:
    stats = m.RoutingStats(is_healthy=False, num_running=3, num_waiting=1, kv_usage=0.25, stats_time=12.5,
                         num_requests_total=9, num_aborted_total=2)
    assert stats.as_dict() == {"is_healthy": False, "num_running": 3, "num_waiting": 1, "kv_usage": 0.25,
                               "stats_time": 12.5, "num_requests_total": 9, "num_aborted_total": 2}
    assert m.RoutingStats.from_dict(stats.as_dict()) == stats
    assert m.RoutingStats.from_dict(None) == m.RoutingStats.from_dict({}) == m.RoutingStats()  # not polled yet
    assert m.RoutingStats.from_dict({"num_running": 2, "from_a_newer_group": 1}) == m.RoutingStats(num_running=2)


def test_group_stats_come_back_from_a_dict_as_they_went() -> None:
    stats = m.GroupStats(group_id="g1", routing=m.RoutingStats(is_healthy=False, num_running=3, stats_time=5.0),
                         kv_blocks_total=64, kv_blocks_free=10, worker_pids=(11, 12), num_rebuilds=1,
                         channel_deltas=7)
    assert m.GroupStats.from_dict(stats.as_dict()) == stats
    assert m.GroupStats.from_dict(cloudpickle.loads(cloudpickle.dumps(stats.as_dict()))) == stats
    assert m.GroupStats.from_dict({**stats.as_dict(), "from_a_newer_group": 1}) == stats


def joined(deltas: list[m.GroupDelta]) -> m.GroupDelta:
    joiner = m.DeltaJoiner(deltas[0])
    for delta in deltas[1:]:
        joiner.add(delta)
    return joiner.result()


def test_a_delta_joined_with_a_later_one_says_both() -> None:
    lp = {5: Logprob(-0.5, 1, "a")}
    first = m.GroupDelta("r", "g0", [CompletionOutput(0, "a", [5], [lp]), CompletionOutput(1, "x", [9], [lp])],
                         False, num_prompt_tokens=3, prompt_logprobs=[None, lp])
    later = m.GroupDelta("r", "g0", [CompletionOutput(0, "b", [6], [lp], "stop", "b")], True, num_prompt_tokens=3,
                         num_cached_tokens=2)
    both = joined([first, later])
    assert both.outputs == [CompletionOutput(0, "ab", [5, 6], [lp, lp], "stop", "b"),
                            CompletionOutput(1, "x", [9], [lp])]
    assert (both.finished, both.num_prompt_tokens, both.num_cached_tokens, both.prompt_logprobs) == (
        True, 3, 2, [None, lp])


def test_a_joined_delta_keeps_every_field_of_the_last_one() -> None:
    """The joiner builds its result field by field: a field added to GroupDelta or
    CompletionOutput must be added there too, or it would be dropped here."""
    import dataclasses

    lp = {5: Logprob(-0.5, 1, "a")}
    last_output = {"index": 1, "text": "y", "token_ids": [6], "logprobs": [lp], "finish_reason": "stop",
                   "stop_reason": "y", "cumulative_logprob": -1.0}
    last = {"request_id": "r", "group_id": "g1", "outputs": [CompletionOutput(**last_output)], "finished": True,
            "num_prompt_tokens": 3, "num_cached_tokens": 2, "prompt_logprobs": [None, lp], "error": "worker died",
            "error_kind": "unavailable"}
    assert set(last) == {f.name for f in dataclasses.fields(m.GroupDelta)}
    assert set(last_output) == {f.name for f in dataclasses.fields(CompletionOutput)}
    first = m.GroupDelta("r", "g1", [CompletionOutput(1, "x", [5], [lp])], False)
    both = joined([first, m.GroupDelta(**last)])
    assert both == m.GroupDelta(**{**last, "outputs": [CompletionOutput(
        **{**last_output, "text": "xy", "token_ids": [5, 6], "logprobs": [lp, lp]})]})


def test_a_delta_batch_crosses_as_rows_and_comes_back_whole() -> None:
    lp = {5: Logprob(-0.5, 1, "a")}
    every_field = m.GroupDelta("r", "g1", [CompletionOutput(1, "x", [5], [lp], "stop", "x", -0.5)], True,
                               num_prompt_tokens=3, num_cached_tokens=2, prompt_logprobs=[None, lp],
                               error="worker died", error_kind="unavailable")
    batch = m.DeltaBatch([every_field, m.GroupDelta("s", "g1", [], False)])
    assert pickle.loads(cloudpickle.dumps(batch)) == batch


def test_joining_many_deltas_keeps_every_sequences_order_and_the_last_finish() -> None:
    lp = {5: Logprob(-0.5, 1, "a")}
    deltas = [m.GroupDelta("r", "g0", [CompletionOutput(0, "a", [1], None)], False, num_prompt_tokens=3),
              m.GroupDelta("r", "g0", [CompletionOutput(1, "x", [7], [lp]), CompletionOutput(0, "b", [2], [lp])],
                           False),
              m.GroupDelta("r", "g0", [CompletionOutput(0, "c", [3], None, "length")], True, num_cached_tokens=16)]
    result = joined(deltas)
    assert result.outputs == [CompletionOutput(0, "abc", [1, 2, 3], [lp], "length"),
                              CompletionOutput(1, "x", [7], [lp])]
    assert (result.finished, result.num_prompt_tokens, result.num_cached_tokens) == (True, 3, 16)
    assert deltas[0].outputs[0].token_ids == [1]  # the parts are not changed
