"""GroupMetrics' reporting, with recording fakes in place of ray.util.metrics."""

from __future__ import annotations

import sys
import types

import pytest


class _Recorder:
    def __init__(self, name: str, description: str = "", boundaries: list[float] | None = None,
                 tag_keys: tuple[str, ...] = ()) -> None:
        self.name = name
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
