"""GroupMetrics' reporting, with recording fakes in place of ray.util.metrics."""

from __future__ import annotations

import sys
import types

import pytest


class _Recorder:
    def __init__(self, name: str, description: str = "", boundaries: list[float] | None = None,
                 tag_keys: tuple[str, ...] = ()) -> None:
        self.name = name
        self.boundaries = boundaries
        self.tag_keys = tag_keys
        self.events: list[tuple] = []

    def set_default_tags(self, tags: dict[str, str]) -> None:
        self.default_tags = tags

    def inc(self, value: float, tags: dict[str, str] | None = None) -> None:
        assert value > 0
        self.events.append(("inc", value, tags))

    def _record(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.events.append(("record", value, tags))

    def set(self, value: float) -> None:
        self.events.append(("set", value))

    def observe(self, value: float) -> None:
        self.events.append(("observe", value))


@pytest.fixture
def fake_ray_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("ray.util.metrics")
    module.Counter = module.Gauge = module.Histogram = _Recorder
    monkeypatch.setitem(sys.modules, "ray.util.metrics", module)


def _snapshot(**changes: float) -> dict[str, float]:
    base = {"num_running": 1, "num_waiting": 2, "num_preempted_waiting": 0, "kv_usage": 0.25, "host_kv_usage": 0.0,
            "num_prompt_tokens": 10, "num_prefix_hit_tokens": 4, "num_generated_tokens": 3, "num_preemptions": 0,
            "num_finished_stop": 1, "num_finished_length": 0, "num_finished_abort": 0, "num_finished_error": 0,
            "num_steps": 4, "step_seconds": 0.5, "bytes_read": 1e9, "flops": 2e9, "spec_num_draft_tokens": 0,
            "spec_num_accepted_tokens": 0, "spec_switched_off": 0.0}
    return {**base, **changes}


def test_group_metrics_reports_increases_and_utilization(fake_ray_metrics: None) -> None:
    from tandem.workers.device_peaks import DevicePeaks
    from tandem.workers.serving.group_metrics import GroupMetrics

    metrics = GroupMetrics({"application": "app", "model": "m", "replica_group": "g"})
    metrics.set_peaks(DevicePeaks(flops_per_s=1e10, bytes_per_s=4e9), num_devices=2)
    metrics.report(_snapshot(), [0.01, 0.02], kv_blocks_fetched=0)
    prompt = metrics.counters["tandem_prompt_tokens"]
    fetched = metrics.kv_fetched
    assert prompt.events == [("inc", 10, None)]
    assert fetched.events == [("record", 0.0, None)]  # exported at 0 from the start
    assert metrics.finished.events[:2] == [("inc", 1, {"finished_reason": "stop"}),
                                           ("record", 0.0, {"finished_reason": "length"})]
    assert metrics.itl.events == [("observe", 0.01), ("observe", 0.02)]
    # bytes / step seconds / (peak x devices): 1e9 / 0.5 / 8e9; FLOPs likewise over 2e10
    assert metrics.mbu.events == [("set", 0.25)]
    assert metrics.mfu.events == [("set", 0.2)]
    metrics.report(_snapshot(num_prompt_tokens=25, step_seconds=1.5, bytes_read=5e9, flops=4e9), [], 3)
    assert prompt.events[1:] == [("inc", 15, None)]
    assert fetched.events[1:] == [("inc", 3, None)]
    assert metrics.mbu.events[1:] == [("set", 0.5)]  # 4e9 bytes over 1 s of steps
    assert metrics.mfu.events[1:] == [("set", 0.1)]
    metrics.report(_snapshot(num_prompt_tokens=25, step_seconds=1.5, bytes_read=5e9, flops=4e9), [], 3)
    assert metrics.mbu.events[2:] == [("set", 0.0)]  # no step ended: no model work
    assert prompt.events[2:] == []
    gauge = metrics.gauges["tandem_kv_cache_usage_perc"]
    assert gauge.events == [("set", 0.25)] * 3


def test_the_engine_metrics_go_to_ray_under_vllms_names_and_labels_too(fake_ray_metrics: None) -> None:
    from tandem.workers.core.stats import RequestMetrics
    from tandem.workers.serving.group_metrics import GroupMetrics

    metrics = GroupMetrics({"application": "app", "model": "m", "replica_group": "g"}, max_model_len=300)
    vllm = metrics.vllm
    # Ray takes no ':' (it drops such a metric): vllm_<name>, renamed vllm:<name> by deploy/prometheus.yml.
    assert sorted(vllm.counters) == ["generation_tokens", "num_preemptions", "prefix_cache_hits",
                                     "prefix_cache_queries", "prompt_tokens", "spec_decode_num_accepted_tokens",
                                     "spec_decode_num_draft_tokens"]
    assert [h.name for h, _ in vllm.histograms] == [
        "vllm_time_to_first_token_seconds", "vllm_e2e_request_latency_seconds", "vllm_request_queue_time_seconds",
        "vllm_request_prefill_time_seconds", "vllm_request_decode_time_seconds",
        "vllm_request_inference_time_seconds", "vllm_request_time_per_output_token_seconds",
        "vllm_request_prompt_tokens", "vllm_request_generation_tokens"]
    assert [h.name for h in vllm.token_intervals] == ["vllm_inter_token_latency_seconds",
                                                      "vllm_time_per_output_token_seconds"]
    assert sorted(g.name for g in vllm.gauges.values()) == ["vllm_gpu_cache_usage_perc", "vllm_kv_cache_usage_perc",
                                                            "vllm_num_requests_running", "vllm_num_requests_waiting"]
    assert vllm.request_success.name == "vllm_request_success"
    assert vllm.request_success.tag_keys == ("model_name", "engine", "application", "finished_reason")
    assert vllm.gauges["num_requests_running"].default_tags == {"model_name": "m", "engine": "g", "application": "app"}
    assert vllm.histograms[-1][0].boundaries == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0]  # 1-2-5 to 300

    metrics.report(_snapshot(spec_num_draft_tokens=6, spec_num_accepted_tokens=3), [0.01, 0.02], 0)
    metrics.report(_snapshot(num_prompt_tokens=25, num_finished_stop=2, num_finished_length=1), [0.03], 0)
    assert vllm.counters["prompt_tokens"].events == [("inc", 10, None), ("inc", 15, None)]
    assert vllm.counters["prefix_cache_queries"].events == [("inc", 10, None), ("inc", 15, None)]
    assert vllm.counters["prefix_cache_hits"].events == [("inc", 4, None)]
    assert vllm.counters["num_preemptions"].events == [("record", 0.0, None)]  # exported at 0 from the start
    # 6 then 0: the group was rebuilt and counts from 0 again, so 0 is the increase (none).
    assert vllm.counters["spec_decode_num_draft_tokens"].events == [("inc", 6, None)]
    assert vllm.request_success.events == [
        ("inc", 1, {"finished_reason": "stop"}), ("record", 0.0, {"finished_reason": "length"}),
        ("record", 0.0, {"finished_reason": "abort"}), ("record", 0.0, {"finished_reason": "error"}),
        ("inc", 1, {"finished_reason": "stop"}), ("inc", 1, {"finished_reason": "length"})]
    assert vllm.gauges["num_requests_waiting"].events == [("set", 2.0)] * 2
    kv_usage = [("set", 0.25)] * 2
    assert vllm.gauges["kv_cache_usage_perc"].events == vllm.gauges["gpu_cache_usage_perc"].events == kv_usage
    for histogram in vllm.token_intervals:
        assert histogram.events == [("observe", 0.01), ("observe", 0.02), ("observe", 0.03)]

    finished = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                              last_token_time=13.0, finished_time=13.5, finish_reason="length", num_prompt_tokens=7,
                              num_generation_tokens=5, num_cached_tokens=0, num_prefill_chunks=1, num_preemptions=0)
    metrics.observe_request(finished)
    observed = {h.name.removeprefix("vllm_"): h.events for h, _ in vllm.histograms}
    assert observed == {"time_to_first_token_seconds": [("observe", 1.0)],
                        "e2e_request_latency_seconds": [("observe", 3.5)],
                        "request_queue_time_seconds": [("observe", 0.5)],
                        "request_prefill_time_seconds": [("observe", 0.5)],
                        "request_decode_time_seconds": [("observe", 2.0)],
                        "request_inference_time_seconds": [("observe", 2.5)],  # first scheduled to last token
                        "request_time_per_output_token_seconds": [("observe", 0.5)],  # 2 s over 4 tokens
                        "request_prompt_tokens": [("observe", 7)], "request_generation_tokens": [("observe", 5)]}
    tandem_ttft = metrics.histograms[0][0]
    assert (tandem_ttft.name, tandem_ttft.events) == ("tandem_time_to_first_token_seconds", [("observe", 1.0)])
