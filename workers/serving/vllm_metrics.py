"""A replica group's engine metrics under vLLM's names and labels, so that a dashboard or
alert written for vLLM reads tandem's series as they are (group_metrics.py feeds them).

Names: vLLM's (vllm/v1/metrics/loggers.py, spec_decode/metrics.py), `vllm:<name>`. Ray's
pipeline cannot carry the ':': Ray 2.60's `ray.util.metrics` accepts the name with a
FutureWarning, then the metric never reaches the metrics endpoint (OpenTelemetry's
instrument names, which Ray's exporter makes, have no ':'); and every name gets Ray's
`ray_` prefix. So each goes through Ray as `vllm_<name>` (as vLLM's own Ray logger,
vllm/v1/metrics/ray_wrappers.py, does), scrapes as `ray_vllm_<name>` (`_total` added to a
counter, `_bucket` / `_sum` / `_count` to a histogram) - the series Ray's Serve LLM
dashboard reads - and deploy/prometheus.yml's `metric_relabel_configs` rule renames
`ray_vllm_<rest>` to `vllm:<rest>` as Prometheus scrapes: vLLM's names.

Labels: vLLM's `model_name` (the served model name) and `engine` (vLLM's engine index; here
the replica group, tandem's engine), and `application` (the Serve application). Buckets are
vLLM's. Only under tandem_* names (group_metrics.py), as vLLM has no such series: MBU / MFU,
the host KV tier, aborts, fetched KV blocks, the acceptance rate. Not exported: vLLM's
series of figures the engine does not keep (iteration_tokens_total, request_params_n /
max_tokens, request_max_num_generation_tokens, spec_decode_num_drafts and
num_accepted_tokens_per_pos, cache_config_info, engine_sleep_state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.workers.core.stats import RequestMetrics

TAG_KEYS = ("model_name", "engine", "application")
RAY_PREFIX = "vllm_"  # what Ray is given: `vllm_` + vLLM's name without `vllm:`

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


def _inference_s(m: RequestMetrics) -> float | None:
    """First scheduled to last token (vLLM's RUNNING phase: prefill and decode)."""
    return m.last_token_time - m.first_scheduled_time if m.first_scheduled_time and m.last_token_time else None


# Observed once per finished request: (name, description, buckets or None for the token
# buckets, the value from its RequestMetrics; None: not observed).
REQUEST_HISTOGRAMS: tuple[tuple[str, str, list[float] | None, Callable[[RequestMetrics], float | None]], ...] = (
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS,
     lambda m: m.ttft_s),
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS,
     lambda m: m.e2e_s),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     REQUEST_LATENCY_BUCKETS, lambda m: m.queue_s),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     REQUEST_LATENCY_BUCKETS, lambda m: m.prefill_s),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     REQUEST_LATENCY_BUCKETS, lambda m: m.decode_s),
    ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     REQUEST_LATENCY_BUCKETS, _inference_s),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     TPOT_BUCKETS, lambda m: m.tpot_s),
    ("request_prompt_tokens", "Number of prefill tokens processed.", None, lambda m: m.num_prompt_tokens),
    ("request_generation_tokens", "Number of generation tokens processed.", None,
     lambda m: m.num_generation_tokens),
)
# Observed once per token interval the engine drained (one per step that decoded): the
# current name, and the one vLLM had before 0.11, which older dashboards still read.
TOKEN_INTERVAL_HISTOGRAMS = (
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("time_per_output_token_seconds", "Histogram of time per output token in seconds (vLLM < 0.11's name for "
                                      "vllm:inter_token_latency_seconds)."),
)
# Counters fed from the engine's snapshot: name -> (description, snapshot key). Ray adds
# `_total` (vllm:prompt_tokens_total, ...), as prometheus_client does for vLLM.
COUNTERS = {
    "prompt_tokens": ("Number of prefill tokens processed.", "num_prompt_tokens"),
    "generation_tokens": ("Number of generation tokens processed.", "num_generated_tokens"),
    "num_preemptions": ("Cumulative number of preemption from the engine.", "num_preemptions"),
    "prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.", "num_prompt_tokens"),
    "prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.", "num_prefix_hit_tokens"),
    "spec_decode_num_draft_tokens": ("Number of draft tokens.", "spec_num_draft_tokens"),
    "spec_decode_num_accepted_tokens": ("Number of accepted tokens.", "spec_num_accepted_tokens"),
}
REQUEST_SUCCESS = ("request_success", "Count of successfully processed requests.")  # label finished_reason
# Gauges set from the snapshot: name -> (description, snapshot key); gpu_cache_usage_perc is
# vLLM's name for kv_cache_usage_perc before 0.10, which older dashboards still read.
GAUGES = {
    "num_requests_running": ("Number of requests in model execution batches.", "num_running"),
    "num_requests_waiting": ("Number of requests waiting to be processed.", "num_waiting"),
    "kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
    "gpu_cache_usage_perc": ("GPU KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
}


def vllm_name(name: str, kind: str) -> str:
    """The name Prometheus stores for one of these after the relabel rule (`kind`: counter,
    gauge, histogram), e.g. vllm:prompt_tokens_total."""
    return f"vllm:{name}_total" if kind == "counter" else f"vllm:{name}"


def vllm_tags(tags: dict[str, str]) -> dict[str, str]:
    """vLLM's labels from a group's tandem ones (application, model, replica_group)."""
    return {"model_name": tags["model"], "engine": tags["replica_group"], "application": tags["application"]}


class VLLMMetrics:
    """The vLLM-named metrics of one group; GroupMetrics observes and sets them beside its own."""

    def __init__(self, tags: dict[str, str], max_model_len: int) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        labels = vllm_tags(tags)

        def made(metric: Any) -> Any:
            metric.set_default_tags(labels)
            return metric

        self.histograms = [(made(Histogram(RAY_PREFIX + name, desc, boundaries=buckets or token_buckets(max_model_len),
                                           tag_keys=TAG_KEYS)), value)
                           for name, desc, buckets, value in REQUEST_HISTOGRAMS]
        self.token_intervals = [made(Histogram(RAY_PREFIX + name, desc, boundaries=TPOT_BUCKETS, tag_keys=TAG_KEYS))
                                for name, desc in TOKEN_INTERVAL_HISTOGRAMS]
        self.counters = {name: made(Counter(RAY_PREFIX + name, desc, tag_keys=TAG_KEYS))
                         for name, (desc, _) in COUNTERS.items()}
        self.request_success = made(Counter(RAY_PREFIX + REQUEST_SUCCESS[0], REQUEST_SUCCESS[1],
                                            tag_keys=(*TAG_KEYS, "finished_reason")))
        self.gauges = {name: made(Gauge(RAY_PREFIX + name, desc, tag_keys=TAG_KEYS))
                       for name, (desc, _) in GAUGES.items()}

    def observe_request(self, metrics: RequestMetrics) -> None:
        for histogram, value_of in self.histograms:
            value = value_of(metrics)
            if value is not None:
                histogram.observe(max(0.0, value))

    def observe_token_intervals(self, intervals: list[float]) -> None:
        for histogram in self.token_intervals:
            for interval in intervals:
                histogram.observe(interval)

    def set_gauges(self, values: dict[str, float]) -> None:
        for name, (_, key) in GAUGES.items():
            self.gauges[name].set(float(values[key]))
