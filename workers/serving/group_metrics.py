"""Prometheus metrics of a replica group, through Ray's metrics pipeline (`ray.util.metrics`).

Every Ray node serves the metrics of its processes on its metrics export port, so one scrape
gets Serve's own `ray_serve_*` metrics and these together. Ray prefixes each name with
`ray_` and a counter's with `_total` as well: `tandem_prompt_tokens` scrapes as
`ray_tandem_prompt_tokens_total`, a histogram as `ray_tandem_..._bucket` / `_count` / `_sum`.
Names use underscores only (Ray drops a metric whose name has a dot, with only a warning).
Labels: `application`, `model`, `replica_group`.

Two sources, neither on the engine's step path:
- a finished request's `RequestMetrics` (on its last output): the per-request histograms,
  observed on the group's event loop as the request ends;
- `GroupEngine.metrics_snapshot()` (cumulative counters, current gauges), read by a
  reporter thread every `interval_s`: counters get the increase since the last read.

Live MBU / MFU: the model bytes (weights + KV) and FLOPs of the steps that ended in the
interval, over those steps' own time, divided by the device peaks that `DevicePeaks.probe`
(the probes of `tandem bench`) measured once at start-up; a group whose model runs on Ray
workers has no probe in its process and exports bytes and FLOPs without the ratios.

The engine metrics vLLM also has are exported under vLLM's names and labels too
(vllm_metrics.py: `vllm:num_requests_running{model_name=...}` and so on, after
deploy/prometheus.yml's relabel rule), fed from the same figures: a vLLM dashboard and
tandem's read the same series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.workers.core.stats import RequestMetrics
from tandem.workers.serving.vllm_metrics import COUNTERS as VLLM_COUNTERS
from tandem.workers.serving.vllm_metrics import REQUEST_LATENCY_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, VLLMMetrics

if TYPE_CHECKING:
    from tandem.workers.device_peaks import DevicePeaks
    from tandem.workers.engine.async_engine import AsyncEngine
    from tandem.workers.serving.kv_fetch import KVFetcher

logger = logging.getLogger(__name__)

TAG_KEYS = ("application", "model", "replica_group")

# Histograms observed per finished request, on vLLM's buckets: (name, description, buckets, RequestMetrics property).
REQUEST_HISTOGRAMS = (
    ("tandem_time_to_first_token_seconds", "Arrival at the group to first token", TTFT_BUCKETS, "ttft_s"),
    ("tandem_request_time_per_output_token_seconds", "Mean time per output token after the first, per request",
     TPOT_BUCKETS, "tpot_s"),
    ("tandem_e2e_request_latency_seconds", "Arrival at the group to finish", REQUEST_LATENCY_BUCKETS, "e2e_s"),
    ("tandem_request_queue_time_seconds", "Arrival to first scheduled", REQUEST_LATENCY_BUCKETS, "queue_s"),
    ("tandem_request_prefill_time_seconds", "First scheduled to first token", REQUEST_LATENCY_BUCKETS, "prefill_s"),
    ("tandem_request_decode_time_seconds", "First token to last token", REQUEST_LATENCY_BUCKETS, "decode_s"),
)
# Counters fed from the snapshot: name -> (description, snapshot key).
SNAPSHOT_COUNTERS = {
    "tandem_prompt_tokens": ("Prompt tokens of admitted requests (cached ones included)", "num_prompt_tokens"),
    "tandem_generation_tokens": ("Generated tokens", "num_generated_tokens"),
    "tandem_num_preemptions": ("Requests preempted (to be recomputed)", "num_preemptions"),
    "tandem_requests_aborted": ("Requests aborted (the client went away)", "num_finished_abort"),
    "tandem_prefix_cache_queries": ("Prompt tokens looked up in the group's prefix cache", "num_prompt_tokens"),
    "tandem_prefix_cache_hits": ("Prompt tokens found in the group's prefix cache (device or host)",
                                 "num_prefix_hit_tokens"),
    "tandem_spec_decode_num_draft_tokens": ("Draft tokens proposed", "spec_num_draft_tokens"),
    "tandem_spec_decode_num_accepted_tokens": ("Draft tokens accepted", "spec_num_accepted_tokens"),
    "tandem_model_bytes_read": ("Model bytes (weights + KV) the steps read", "bytes_read"),
    "tandem_model_flops": ("Model FLOPs of the steps", "flops"),
    "tandem_step_seconds": ("Seconds of model steps (launch to collect)", "step_seconds"),
}
FINISH_REASONS = ("stop", "length", "abort", "error")
# Where the engine is not at hand (tests, the telemetry cost bench): the context length the
# vLLM-named token-count histograms' buckets reach.
DEFAULT_MAX_MODEL_LEN = 8192
# Gauges set from the snapshot: name -> (description, snapshot key).
SNAPSHOT_GAUGES = {
    "tandem_num_requests_running": ("Requests in the running batch", "num_running"),
    "tandem_num_requests_waiting": ("Requests waiting to be scheduled", "num_waiting"),
    "tandem_num_requests_swapped": ("Preempted requests waiting to be recomputed", "num_preempted_waiting"),
    "tandem_kv_cache_usage_perc": ("Fraction of the device KV blocks in use (0-1)", "kv_usage"),
    "tandem_host_kv_cache_usage_perc": ("Fraction of the host KV tier in use (0-1)", "host_kv_usage"),
    "tandem_spec_decode_switched_off": ("1 while the batch is too large to draft for", "spec_switched_off"),
}


def scrape_name(name: str, kind: str) -> str:
    """The name Prometheus sees for one of ours (`kind`: counter, gauge, histogram)."""
    return f"ray_{name}_total" if kind == "counter" else f"ray_{name}"


class GroupMetrics:
    """One group's metrics; `observe_request` on each finished request, `report` every interval."""

    def __init__(self, tags: dict[str, str], max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        def made(metric: Any) -> Any:
            metric.set_default_tags(tags)
            return metric

        self.histograms = [(made(Histogram(name, desc, boundaries=buckets, tag_keys=TAG_KEYS)), prop)
                           for name, desc, buckets, prop in REQUEST_HISTOGRAMS]
        self.itl = made(Histogram("tandem_inter_token_latency_seconds",
                                  "Time between consecutive tokens of the running requests (one observation per step)",
                                  boundaries=TPOT_BUCKETS, tag_keys=TAG_KEYS))
        self.counters = {name: made(Counter(name, desc, tag_keys=TAG_KEYS)) for name, (desc, _) in
                         SNAPSHOT_COUNTERS.items()}
        self.finished = made(Counter("tandem_requests_finished", "Requests finished, by reason",
                                     tag_keys=(*TAG_KEYS, "finished_reason")))
        self.kv_fetched = made(Counter("tandem_kv_blocks_fetched", "Prefix KV blocks fetched from other groups",
                                       tag_keys=TAG_KEYS))
        self.gauges = {name: made(Gauge(name, desc, tag_keys=TAG_KEYS)) for name, (desc, _) in
                       SNAPSHOT_GAUGES.items()}
        self.acceptance = made(Gauge("tandem_spec_decode_acceptance_rate", "Accepted over proposed draft tokens",
                                     tag_keys=TAG_KEYS))
        self.mbu = made(Gauge("tandem_model_bandwidth_utilization",
                              "Model bytes read per second of steps over the device's probed copy bandwidth",
                              tag_keys=TAG_KEYS))
        self.mfu = made(Gauge("tandem_model_flops_utilization",
                              "Model FLOPs per second of steps over the device's probed matmul FLOP/s",
                              tag_keys=TAG_KEYS))
        self.peak_flops = made(Gauge("tandem_device_peak_flops", "Probed matmul FLOP/s of the group's devices",
                                     tag_keys=TAG_KEYS))
        self.peak_bytes = made(Gauge("tandem_device_peak_bytes_per_second",
                                     "Probed copy bandwidth of the group's devices", tag_keys=TAG_KEYS))
        self.vllm = VLLMMetrics(tags, max_model_len)
        # Every counter fed from the snapshot, tandem's and vLLM's: (counter, snapshot key, tags).
        self._feeds: list[tuple[Any, str, dict[str, str] | None]] = [
            *((self.counters[name], key, None) for name, (_, key) in SNAPSHOT_COUNTERS.items()),
            *((self.vllm.counters[name], key, None) for name, (_, key) in VLLM_COUNTERS.items()),
            (self.kv_fetched, "kv_blocks_fetched", None)]
        for reason in FINISH_REASONS:
            self._feeds += [(counter, f"num_finished_{reason}", {"finished_reason": reason})
                            for counter in (self.finished, self.vllm.request_success)]
        self.peaks: DevicePeaks | None = None
        self.num_devices = 1
        self._last: dict[str, float] = {}

    def observe_request(self, metrics: RequestMetrics) -> None:
        for histogram, prop in self.histograms:
            value = getattr(metrics, prop)
            if value is not None:
                histogram.observe(max(0.0, value))
        self.vllm.observe_request(metrics)

    def set_peaks(self, peaks: DevicePeaks, num_devices: int) -> None:
        self.peaks, self.num_devices = peaks, num_devices
        self.peak_flops.set(peaks.flops_per_s * num_devices)
        self.peak_bytes.set(peaks.bytes_per_s * num_devices)

    def report(self, snapshot: dict[str, float], token_intervals: list[float], kv_blocks_fetched: int) -> None:
        """Counters by their increase since the last report; gauges as they are."""
        values = {**snapshot, "kv_blocks_fetched": kv_blocks_fetched}
        first = not self._last
        for counter, key, tags in self._feeds:
            last, value = self._last.get(key, 0.0), values.get(key, 0.0)
            # Below the last figure: the group was rebuilt (workers/serving/group_healer.py) and counts from 0 again.
            delta = value - last if value >= last else value
            if delta > 0:
                counter.inc(delta, tags=tags)
            elif first:
                start_at_zero(counter, tags)
        for name, (_, key) in SNAPSHOT_GAUGES.items():
            self.gauges[name].set(float(values[key]))
        self.vllm.set_gauges(values)
        drafted = values["spec_num_draft_tokens"]
        self.acceptance.set(values["spec_num_accepted_tokens"] / drafted if drafted else 0.0)
        for interval in token_intervals:
            self.itl.observe(interval)
        self.vllm.observe_token_intervals(token_intervals)
        self._report_utilization(values)
        self._last.update(values)

    def _report_utilization(self, values: dict[str, float]) -> None:
        if self.peaks is None:
            return
        seconds = values["step_seconds"] - self._last.get("step_seconds", 0.0)
        if seconds <= 0:  # no step ended: the devices did no model work
            self.mbu.set(0.0)
            self.mfu.set(0.0)
            return
        num_bytes = values["bytes_read"] - self._last.get("bytes_read", 0.0)
        flops = values["flops"] - self._last.get("flops", 0.0)
        self.mbu.set(num_bytes / seconds / (self.peaks.bytes_per_s * self.num_devices))
        self.mfu.set(flops / seconds / (self.peaks.flops_per_s * self.num_devices))


def start_at_zero(counter: Any, tags: dict[str, str] | None = None) -> None:
    """Export a counter at 0 before its first increase, so its series (and rate()) exist from the
    start: `Counter.inc` refuses 0, the underlying record does not."""
    counter._record(0.0, tags=tags)


class MetricsReporter:
    """A daemon thread calling `metrics.report(*read())` every `interval_s`."""

    def __init__(self, metrics: GroupMetrics, read: Callable[[], tuple[dict[str, float], list[float], int]],
                 interval_s: float = 1.0) -> None:
        self.metrics = metrics
        self._read = read
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.metrics.report(*self._read())
            except Exception:  # noqa: BLE001 - metrics never stop serving
                logger.exception("metrics report failed")

    def close(self) -> None:
        self._stop.set()


def start_group_metrics(engine: AsyncEngine, fetcher: KVFetcher | None, tags: dict[str, str], *,
                        interval_s: float = 1.0, probe_peaks: bool = True) -> MetricsReporter:
    """The group's metrics and their reporter; the device peaks are probed first (start-up,
    before any request, so nothing else runs on the device meanwhile)."""
    metrics = GroupMetrics(tags, engine.engine.max_model_len)
    if probe_peaks:
        try:
            probed = engine.probe_device_peaks()
        except Exception:  # noqa: BLE001 - metrics never stop serving
            logger.exception("device peak probe failed: no MBU / MFU gauges")
            probed = None
        if probed is not None:
            metrics.set_peaks(*probed)
            logger.info("device peaks: %.3g FLOP/s, %.3g B/s (x%d devices)", probed[0].flops_per_s,
                        probed[0].bytes_per_s, probed[1])

    def read() -> tuple[dict[str, float], list[float], int]:
        fetched = fetcher.num_blocks_fetched if fetcher is not None else 0
        return engine.metrics_snapshot(), engine.drain_token_intervals(), fetched

    return MetricsReporter(metrics, read, interval_s)
