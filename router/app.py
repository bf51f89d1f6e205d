"""build_app(args) -> the Serve application (used by `tandem serve` and deploy/serve_config.yaml).

    HTTP / gRPC proxy ──> OpenAIIngress ──LoadAwareRouter──> GroupServer x num_replicas
                          (tokenize, validate)               (one replica = one replica group)

`args` holds engine options under their vLLM names (model, tensor_parallel_size,
max_model_len, ...) plus the serving options below. A group with more than one worker
gets its own placement group through the deployment's placement-group options:
bundle 0 holds the GroupServer replica (the engine), bundles 1..tp*pp its workers
(bundle 1 + pp_rank * tp + tp_rank), so Serve starts a group only where all of it fits.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from tandem.router.admission import AdmissionLimits
from tandem.router.api_key import check_digest, key_digest, read_key_file
from tandem.router.chat_tools import tool_call_options
from tandem.router.ingress import OpenAIIngress
from tandem.router.limits import RequestLimits
from tandem.workers.config import EngineConfig
from tandem.workers.serving.group_healer import HealPolicy
from tandem.workers.serving.group_server import DEFAULT_STEP_TIMEOUT_S, GroupServer
from tandem.workers.serving.kv_fetch import FETCH_MODES

DEMO_MODEL_NAME = "tandem-demo"

logger = logging.getLogger(__name__)

# Serving options and their defaults; every other key is an engine option.
SERVING_DEFAULTS: dict[str, Any] = {
    "served_model_name": None,  # default: the model path, or "tandem-demo"
    "num_replicas": 1,  # replica groups (ignored when autoscaling_config is set)
    "autoscaling_config": None,  # Serve autoscaling for the groups (min_replicas, max_replicas, ...)
    # The API key clients must send (Authorization: Bearer KEY): `api_key` (turned into its
    # digest here, before anything is deployed), `api_key_file` (a file holding it, read
    # here), or `api_key_sha256` (the digest alone, for a config file; router/api_key.py).
    "api_key": None,
    "api_key_file": None,
    "api_key_sha256": None,
    "group_num_cpus": 1,  # CPUs of a GroupServer replica (the engine; the model too when tp*pp == 1)
    "max_ongoing_requests": None,  # per group; default 2 * max_num_seqs (the engine queues the rest)
    "max_queued_requests": 1024,  # waiting for a group (per ingress replica); beyond: 503; -1 = no limit
    "routing_stats_period_s": 1.0,  # how often each group reports its load to the router
    # Serve marks a group unhealthy after 3 failed checks in a row, so a group whose engine died
    # is replaced ~3 periods later; a check only reads a flag.
    "health_check_period_s": 1.0,
    # When a worker of a TP or PP group dies, the group starts new workers in place (no new
    # replica): at most this many times in 10 minutes, each within the timeout; beyond, or
    # with 0, Serve replaces the whole replica (workers/serving/group_healer.py).
    "max_group_rebuilds": 3,
    "group_rebuild_timeout_s": 120.0,
    # A group whose step has run this long is stalled (a hung device, a SIGSTOPped worker):
    # its health check fails and Serve replaces it (workers/serving/group_server.py).
    "step_timeout_s": DEFAULT_STEP_TIMEOUT_S,
    # Ingress replicas (each carries its share of the streams, on its own event loop, and
    # admits its share of the bounds below); None: one per 8 cores of the node that builds
    # the application, at least 1 and at most 8 (default_ingress_replicas).
    "ingress_num_replicas": None,
    "ingress_num_cpus": 0,  # tokenizing is light; a laptop's CPUs go to the groups
    # Streams one ingress replica carries at once. The ingress only awaits, so it can carry
    # thousands; Serve's default (5) would hold the rest at the proxy for whole requests.
    "ingress_max_ongoing_requests": 4096,
    "routing": "prefix",  # "prefix": prefix-cache-aware (router/policy.py); "load": load only
    "routing_tokens_per_request": 256.0,  # prefix routing: cached tokens worth one queued request
    "routing_max_imbalance": 4.0,  # prefix routing: queued requests above the least loaded group
    "host_kv_memory_per_node": None,  # bytes of host KV tier the groups of one node may lease
    "kv_fetch": "auto",  # fetch a missed prefix from another group: "auto" (when cheaper), "always", "never"
    # A streamed request's tokens are sent at most this often (first token at once): fewer,
    # larger messages. 0 = no floor: the ingress's chunk budget alone paces its streams (every
    # step's tokens while few streams run; workers/core/output_pace.py).
    "stream_interval_ms": 0,
    # Streamed requests' deltas travel over one channel per ingress replica and group, one
    # message per flush for all of its streams (workers/serving/outbox.py); False: each
    # request's deltas over its own call, one Ray message per delta.
    "stream_channels": True,
    # What a channel is: "socket", a TCP connection from the ingress replica to the group's
    # channel socket (a free port on the group's node; workers/serving/channel_server.py), or
    # "serve", a streaming Serve call (where ingress and groups cannot connect directly).
    "channel_transport": "socket",
    # With socket channels: while an ingress replica's router knows one group only (nothing to
    # choose), its streamed requests go on its channel to that group, not as a Serve call each
    # (router/group_channels.py). Off under autoscaling: Serve counts only its own calls as a
    # group's load.
    "requests_on_channel": True,
    # Serve runs the ingress's code on the replica's own event loop, the one that writes to
    # the clients' sockets, instead of a second loop on a thread of its own (Serve's default,
    # RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD): no hand-over between the two loops (a
    # wake-up, a queue and a turn of each loop) for every SSE chunk. The ingress never blocks
    # its loop (tokenizing and Serve's status run on threads). False: Serve's default.
    "ingress_on_main_loop": True,
    # Messages per second one ingress replica sends its clients, all streams together (with
    # stream_channels; 0 = no bound): each costs the ingress and Serve's proxy the same
    # whatever it holds, so past this a stream's tokens gather into fewer, larger messages
    # (router/group_channels.py). Near what Serve's streaming path carries on a small host;
    # a stream waits for nothing while fewer than (this x step time) streams run.
    "ingress_max_chunks_per_s": 2000.0,
    # With a draft model: the application's groups share one draft actor (placed by the
    # first group to start); False: a draft per group.
    "share_draft": True,
    # Admission at the ingress (router/admission.py): requests in flight per group that is
    # up (default: max_ongoing_requests + max_num_seqs, one batch queued beyond what the
    # group takes), and for the whole application (None: the groups' sum); beyond, 429 with
    # Retry-After (503 when no group is up). False: no admission control (Serve's queue only).
    "admission_control": True,
    "max_requests_per_group": None,
    "max_requests": None,
    "retry_after_s": 1,
    "max_request_body_bytes": 8 * 1024 * 1024,  # larger bodies: 413
    # Bytes of bodies one ingress replica reads and parses at once (a body is read whole before
    # admission can price it); past them, 429 (router/body_budget.py). None: 32 of the largest.
    "max_request_body_bytes_in_flight": None,
    # The deadline of a request that sets no `timeout` of its own (seconds; past it, 408 and
    # its KV freed): no request, however its client behaves, holds a group for ever. None: none.
    "request_timeout_s": 3600.0,
    # The work one request may ask for, HTTP and gRPC alike (router/limits.py; beyond: 400 /
    # INVALID_ARGUMENT naming the field): samples per prompt, alternatives per position, and
    # prompts x n, the sequences admission charges.
    "max_n": 128,
    "max_logprobs": 20,
    "max_sequences_per_request": 256,
    # Metrics (workers/serving/group_metrics.py): how often a group hands its figures to Ray's pipeline (which
    # exports every metrics_report_interval_ms, 10 s by default), and whether it probes its
    # device's peaks at start-up for the live MBU / MFU gauges.
    "metrics": True,  # False: the groups and the router export no metrics (the engine still counts)
    "metrics_interval_s": 1.0,
    "probe_device_peaks": True,
    # Environment variables of this application's processes (its ingress and groups, and the
    # groups' workers), e.g. OTEL_* to trace one application of a shared cluster (Ray's
    # runtime_env; they override what the processes inherit from the cluster).
    "env_vars": None,
    # The GPU model the groups need (a Ray accelerator type: "H100", "A100", "L4", ...): they
    # reserve GPUs of that type whatever `device` says, and wait for a node that has them.
    "accelerator_type": None,
    # Tool calls with tool_choice "auto" (vLLM's --tool-call-parser and --enable-auto-tool-choice):
    # the family whose call syntax is read out of the model's text (hermes, llama3_json, mistral;
    # router/tool_parsers/), and whether "auto" is served at all (without it, a 400 says how to
    # turn it on). Forced calls (required, a named function) need neither: the engine holds the
    # output to the tools' schema (router/chat_tools.py).
    "tool_call_parser": None,
    "enable_auto_tool_choice": False,
}

ROUTING_POLICIES = ("prefix", "load")
CHANNEL_TRANSPORTS = ("socket", "serve")


def build_app(args: dict[str, Any] | None = None) -> Application:
    serving = dict(SERVING_DEFAULTS)
    engine_options: dict[str, Any] = {}
    for key, value in (args or {}).items():
        if key in serving:
            serving[key] = value
        elif key != "address" and value is not None:  # where to join Ray: the caller's business
            engine_options[key] = value
    # Parsed here only: unknown or bad options fail before anything starts, and every group
    # gets this EngineConfig.
    config = EngineConfig.from_options(**engine_options)
    # A missing or unreadable model, tokenizer or draft is refused here with the reason, before
    # anything starts: its source is asked (workers/model/source.py), nothing is fetched.
    from tandem.workers.model.source import check_model_sources

    check_model_sources(config)
    if serving["routing"] not in ROUTING_POLICIES:
        raise ValueError(f"routing: must be one of {', '.join(ROUTING_POLICIES)}, got {serving['routing']!r}")
    served_model_name = serving["served_model_name"] or config.model.model or DEMO_MODEL_NAME
    api_key_sha256 = api_key_digest(serving)

    serving["ingress_num_replicas"] = num_ingress_replicas(serving)
    if not isinstance(serving["ingress_num_replicas"], int) or serving["ingress_num_replicas"] < 1:
        raise ValueError(f"ingress_num_replicas: must be an integer >= 1, got {serving['ingress_num_replicas']!r}")
    chunks = serving["ingress_max_chunks_per_s"]
    if isinstance(chunks, bool) or not isinstance(chunks, (int, float)) or not 0 <= chunks < math.inf:
        raise ValueError(f"ingress_max_chunks_per_s: must be a number >= 0 (0: no bound), got {chunks!r}")
    if serving["channel_transport"] not in CHANNEL_TRANSPORTS:
        raise ValueError(f"channel_transport: must be one of {', '.join(CHANNEL_TRANSPORTS)}, "
                         f"got {serving['channel_transport']!r}")
    for name in ("requests_on_channel", "ingress_on_main_loop"):
        if not isinstance(serving[name], bool):
            raise ValueError(f"{name}: must be true or false, got {serving[name]!r}")
    if serving["kv_fetch"] not in FETCH_MODES:
        raise ValueError(f"kv_fetch: must be one of {', '.join(FETCH_MODES)}, got {serving['kv_fetch']!r}")
    group_options = {"kv_allocator": config.cache.enable_prefix_caching,
                     "host_kv_memory_per_node": serving["host_kv_memory_per_node"], "kv_fetch": serving["kv_fetch"],
                     "stream_interval_ms": serving["stream_interval_ms"], "share_draft": serving["share_draft"],
                     "served_model_name": served_model_name, "metrics": serving["metrics"],
                     "metrics_interval_s": serving["metrics_interval_s"],
                     "probe_device_peaks": serving["probe_device_peaks"],
                     "max_group_rebuilds": serving["max_group_rebuilds"],
                     "group_rebuild_timeout_s": serving["group_rebuild_timeout_s"],
                     "step_timeout_s": serving["step_timeout_s"], "channel_transport": serving["channel_transport"]}
    for name in ("step_timeout_s", "request_timeout_s"):
        timeout = serving[name]
        if name == "request_timeout_s" and timeout is None:
            continue
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"{name}: must be a number of seconds > 0, got {timeout!r}")
    HealPolicy(max_rebuilds=serving["max_group_rebuilds"], timeout_s=serving["group_rebuild_timeout_s"])  # fails here
    admission = admission_options(config, serving)
    if admission is not None:
        AdmissionLimits.from_dict(admission)  # bad bounds fail here, not in every ingress replica
    limits = {"max_body_bytes": serving["max_request_body_bytes"],
              "max_body_bytes_in_flight": serving["max_request_body_bytes_in_flight"], "max_n": serving["max_n"],
              "max_logprobs": serving["max_logprobs"],
              "max_sequences_per_request": serving["max_sequences_per_request"]}
    RequestLimits(**limits)  # bad bounds fail here
    group = GroupServer.options(**_group_options(config, serving)).bind(config, group_options)
    ingress_config = {"model": config.model.model, "revision": config.model.revision,
                      "tokenizer": config.model.tokenizer, "served_model_name": served_model_name,
                      "max_model_len": config.model.max_model_len, "api_key_sha256": api_key_sha256,
                      "limits": limits,
                      "admission": admission, "stream_channels": serving["stream_channels"],
                      "max_chunks_per_s": serving["ingress_max_chunks_per_s"],
                      "max_sent_on_channel": max_sent_on_channel(config, serving), "metrics": serving["metrics"],
                      "request_timeout_s": serving["request_timeout_s"], **tool_call_options(serving)}
    ingress = OpenAIIngress.options(num_replicas=serving["ingress_num_replicas"],
                                    max_ongoing_requests=serving["ingress_max_ongoing_requests"],
                                    ray_actor_options={"num_cpus": serving["ingress_num_cpus"],
                                                       **_runtime_env(serving, _ingress_env(serving))})
    return ingress.bind(group, ingress_config)


def api_key_digest(serving: dict[str, Any]) -> str | None:
    """The digest of the one API key the options give (None: no key); ValueError for two."""
    given = [name for name in ("api_key", "api_key_file", "api_key_sha256") if serving[name]]
    if len(given) > 1:
        raise ValueError(f"{given[1]}: give one of api_key, api_key_file and api_key_sha256, not {' and '.join(given)}")
    if serving["api_key_sha256"]:
        return check_digest(serving["api_key_sha256"])
    if serving["api_key_file"]:
        return key_digest(read_key_file(serving["api_key_file"]))
    return key_digest(serving["api_key"]) if serving["api_key"] else None


def default_ingress_replicas(cores: int) -> int:
    """Ingress replicas for a node of `cores`: a replica's event loop carries a few thousand
    stream messages a second (bench/RESULTS.md), so a GPU host's streams want more than one;
    a small host's cores go to the groups."""
    return max(1, min(8, cores // 8))


def num_ingress_replicas(serving: dict[str, Any]) -> int:
    """The option, or its default for this node when it is None."""
    given = serving["ingress_num_replicas"]
    return default_ingress_replicas(os.cpu_count() or 1) if given is None else given


def max_sent_on_channel(config: EngineConfig, serving: dict[str, Any]) -> int:
    """Streamed requests one ingress replica may have in flight on its channel to a sole group:
    its share of the group's `max_ongoing_requests` (0: none, all through Serve calls)."""
    if not (serving["requests_on_channel"] and serving["stream_channels"]
            and serving["channel_transport"] == "socket" and serving["autoscaling_config"] is None):
        return 0
    max_ongoing = serving["max_ongoing_requests"] or 2 * config.scheduler.max_num_seqs
    return math.ceil(max_ongoing / num_ingress_replicas(serving))


def admission_options(config: EngineConfig, serving: dict[str, Any]) -> dict[str, Any] | None:
    """One ingress replica's AdmissionLimits fields: the application's bounds, split evenly
    among the ingress replicas (each counts only the requests it carries)."""
    if not serving["admission_control"]:
        return None
    num_ingress = num_ingress_replicas(serving)
    per_group = serving["max_requests_per_group"]
    if per_group is None:
        max_ongoing = serving["max_ongoing_requests"] or 2 * config.scheduler.max_num_seqs
        per_group = max_ongoing + config.scheduler.max_num_seqs
    total = serving["max_requests"]
    return {"max_requests_per_group": math.ceil(per_group / num_ingress),
            "max_requests": None if total is None else math.ceil(total / num_ingress),
            "retry_after_s": serving["retry_after_s"]}


def local_group_num_cpus(num_replicas: int, cores: int) -> int:
    """CPUs (and so torch threads: Ray sets OMP_NUM_THREADS from them) for each TP=1 group
    when the whole application runs on this machine: its cores but one, shared by the groups.

    The spare core is for Serve's proxy, the ingress and the groups' event loops, which
    stream every token. Were the model's OpenMP threads on every core, each burst of Serve
    work would stall one of them, and the others would wait for it at each GEMM's end
    (bench/RESULTS.md compares the two).
    """
    return max(1, (cores - 1) // max(1, num_replicas))


def group_world_size(args: dict[str, Any]) -> int:
    """Workers per replica group, from build_app's arguments."""
    return (args.get("tensor_parallel_size") or 1) * (args.get("pipeline_parallel_size") or 1)


def num_cpus_needed(args: dict[str, Any]) -> int:
    """Logical CPUs the application's groups take on a CPU-only cluster."""
    world = group_world_size(args)
    group_cpus = args.get("group_num_cpus", SERVING_DEFAULTS["group_num_cpus"])
    per_group = group_cpus + (world if world > 1 else 0)
    return math.ceil(per_group * (args.get("num_replicas") or 1))


def _group_options(config: EngineConfig, serving: dict[str, Any]) -> dict[str, Any]:
    par = config.parallel
    use_gpu = groups_use_gpus(config, serving["accelerator_type"])
    max_ongoing = serving["max_ongoing_requests"] or 2 * config.scheduler.max_num_seqs
    options: dict[str, Any] = {
        # Each ingress replica's channel (stream_channels) may be one more call a group carries.
        "max_ongoing_requests": max_ongoing + num_ingress_replicas(serving),
        "max_queued_requests": serving["max_queued_requests"],
        "health_check_period_s": serving["health_check_period_s"],
        "request_router_config": RequestRouterConfig(
            request_router_class="tandem.router.request_router:LoadAwareRouter",
            request_router_kwargs=_router_kwargs(config, serving),
            request_routing_stats_period_s=serving["routing_stats_period_s"]),
    }
    if serving["autoscaling_config"] is not None:
        options["autoscaling_config"] = AutoscalingConfig.model_validate(serving["autoscaling_config"])
    else:
        options["num_replicas"] = serving["num_replicas"]
    num_cpus = serving["group_num_cpus"]
    if par.world_size == 1:
        options["ray_actor_options"] = {"num_cpus": num_cpus, "num_gpus": 1 if use_gpu else 0, **_runtime_env(serving)}
        if serving["accelerator_type"]:
            options["ray_actor_options"]["accelerator_type"] = serving["accelerator_type"]
    else:
        worker = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
        if serving["accelerator_type"]:  # what Ray's accelerator_type option asks of a node
            worker[f"accelerator_type:{serving['accelerator_type']}"] = 0.001
        options["ray_actor_options"] = {"num_cpus": num_cpus, **_runtime_env(serving)}
        options["placement_group_bundles"] = [{"CPU": float(num_cpus)}] + [dict(worker) for _ in range(par.world_size)]
        # A stage's TP ranks talk every layer: one node. Stages may span nodes.
        options["placement_group_strategy"] = "STRICT_PACK" if par.pipeline_parallel_size == 1 else "PACK"
    return options


def _runtime_env(serving: dict[str, Any], defaults: dict[str, str] | None = None) -> dict[str, Any]:
    """The `runtime_env` actor option that sets `env_vars` over `defaults` (nothing when there
    are none)."""
    env = serving["env_vars"]
    if env and (not isinstance(env, dict)
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError(f"env_vars: must map names to string values, got {env!r}")
    env_vars = {**(defaults or {}), **(env or {})}
    return {"runtime_env": {"env_vars": env_vars}} if env_vars else {}


def _ingress_env(serving: dict[str, Any]) -> dict[str, str]:
    """What the ingress's processes are given besides `env_vars` (which win)."""
    return {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"} if serving["ingress_on_main_loop"] else {}


def _router_kwargs(config: EngineConfig, serving: dict[str, Any]) -> dict[str, Any]:
    prefix = serving["routing"] == "prefix" and config.cache.enable_prefix_caching
    return {"routing": "prefix" if prefix else "load", "block_size": config.cache.block_size,
            "tokens_per_request": serving["routing_tokens_per_request"],
            "max_imbalance": serving["routing_max_imbalance"], "metrics": serving["metrics"]}


def groups_use_gpus(config: EngineConfig, accelerator_type: str | None = None) -> bool:
    """Whether the replica groups reserve GPUs, decided by the configuration when the
    application is built, never by which nodes have joined by then.

    `device: cuda` or an `accelerator_type` reserves them: Serve then holds the groups until
    GPU nodes join (a cluster's GPU workers often start after its head deploys the
    application). `device: auto` reserves them where GPUs are visible now (the Ray cluster
    joined, else this machine, where `tandem serve` starts Ray) and otherwise runs the groups
    on CPU, saying so: a deployment meant for GPUs names them. A simulated device stands for a
    GPU but uses none: it reserves one only for an `accelerator_type` (placement tests).
    """
    device = config.model.device
    if accelerator_type is not None:
        if not isinstance(accelerator_type, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", accelerator_type):
            raise ValueError(f"accelerator_type: must be a Ray accelerator type such as H100, got {accelerator_type!r}")
        if device == "cpu":
            raise ValueError(f"accelerator_type: {accelerator_type} asks for GPUs but device is cpu")
        return True
    if config.model.simulated_step_ms is not None:
        return False
    if device != "auto":
        return device == "cuda"
    if gpus_visible():
        return True
    logger.warning("device: auto and no GPU is visible as the application is built: its replica groups run on "
                   "CPU. A deployment meant for GPU nodes that have not joined yet sets device: cuda (or "
                   "accelerator_type), and its groups wait for them.")
    return False


def gpus_visible() -> bool:
    """GPUs in the Ray cluster this process has joined, else the GPUs a Ray started on this
    machine would count: Ray's own probe (NVML, within CUDA_VISIBLE_DEVICES), which loads no
    torch into the process that builds the application (`tandem serve`, Serve's builder)."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    from ray._private.accelerators import NvidiaGPUAcceleratorManager as nvidia  # ray is pinned (pyproject)

    count = nvidia.get_current_node_num_accelerators()
    visible = nvidia.get_current_process_visible_accelerator_ids()
    return (count if visible is None else min(count, len(visible))) > 0
