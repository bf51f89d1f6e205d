"""`tandem bench ...`: the benchmarks' command line, registered into `tandem` by cli/main.py.

cli/main.py hands in what the bench needs from the router (`RouterHooks`): the bench never
imports the router. Here are each command's arguments; what a command runs with them is in
bench/commands.py, and each benchmark's module is imported when its command runs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tandem.bench import commands
from tandem.bench.bench_models import BENCH_SHAPES
from tandem.bench.server import AppBuilder
from tandem.cluster.direct_ingress import PROXIES

DTYPES = ("auto", "float32", "bfloat16", "float16")
HELP = {
    "offline": "throughput of one request set: tandem vs transformers (static batches, one at a time)",
    "latency": "batch-1 time per output token, bandwidth use, engine overhead, batch-size sweep",
    "overlap": "tensor-parallel compute/communication overlap (two ranks on this machine)",
    "serve": "load test an OpenAI-compatible server (TTFT, TPOT, goodput)",
    "spec": "speculative decoding: per-token speedup, cost at saturation",
    "structured": "structured outputs: time per output token with a JSON schema enforced vs without",
    "quantization": "quantized weights / FP8 KV cache vs unquantized: batch-1 TPOT, batch decode, KV capacity",
    "quality": "quantization's accuracy: top-1 agreement and KL of next-token distributions vs unquantized",
    "prefix": "prefix-aware vs load-only routing: TTFT, cache hits, overhead",
    "soak": "overload and faults while serving: nothing lost, nothing leaked, goodput and recovery",
    "observability": "what metrics and tracing cost a server: throughput and CPU per token, both on vs both off",
}


@dataclass(frozen=True)
class RouterHooks:
    """What the bench takes from the router's command line and Serve application."""

    add_engine_args: Callable[[argparse.ArgumentParser], None]
    engine_options: Callable[[argparse.Namespace], dict[str, Any]]
    local_app: AppBuilder  # engine and serving options -> the application, its groups on this machine
    # application name -> the KV blocks it holds now (router/kv_report.py; blocking)
    kv_holdings: Callable[[str], dict[str, Any]] | None = None
    grpc_servicer: str | None = None  # Serve's gRPCOptions servicer function (import path)
    grpc_messages: Callable[[], Any] | None = None  # -> the gRPC API's message module (tandem_pb2)
    # () -> CPU seconds of the metrics and tracing code per request and per reporter interval
    # (router/telemetry_cost.py; in a process connected to Ray)
    telemetry_cost: Callable[[], dict[str, float]] | None = None


def override_help(parser: argparse.ArgumentParser, **helps: str) -> None:
    """Replace the help text of existing arguments, by destination name."""
    for action in parser._actions:
        if action.dest in helps:
            action.help = helps[action.dest]


def register(subparsers: Any, hooks: RouterHooks) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(HELP))
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name in ("offline", "latency"):
        p = _parser(sub, name, hooks, model="local Hugging Face model directory (default: built-in benchmark model)",
                    dtype="auto = float32 on CPU, bfloat16 on CUDA")
        p.set_defaults(device="auto")  # the engine's --device, which the benchmark's own work follows too
        _add_repeats(p, "default 3; offline --quick: 2")
        _add_idle_wait(p, "CPU only: before each run wait up to this long for other processes to go quiet, and "
                       "redo a run they disturbed (up to twice); 0 = measure at once, never redo")
        p.add_argument("--temperature", type=float, default=0.0,
                       help="tandem's requests sample at this temperature, unseeded as most traffic is (default 0: "
                       "greedy); transformers stays greedy")
    offline, latency = sub.choices["offline"], sub.choices["latency"]
    offline.add_argument("--num-requests", type=int, default=None, help="requests in the set (default 64; --quick 32)")
    offline.add_argument("--no-hf-sequential", dest="hf_sequential", action="store_false",
                         help="leave out transformers one request at a time (minutes on a GPU); its figures are null")
    offline.add_argument("--no-hf", dest="hf", action="store_false",
                         help="leave transformers out (not loaded; its figures are null): tandem's figures alone")
    latency.add_argument("--hf-compiled", action="store_true", help="CPU: also time transformers with a static "
                         "cache and torch.compile (a minute or more of compiling; always on CUDA)")
    latency.add_argument("--no-hf", dest="hf", action="store_false",
                         help="leave transformers out (not loaded; its figures are null): tandem's figures alone")
    latency.add_argument("--sweep-batches", default=None, metavar="B,B,...",
                         help="batch sizes of the sweep (default 1,2,...,64; to 128 on CUDA)")
    offline.set_defaults(func=partial(commands.bench_offline, hooks))
    latency.set_defaults(func=partial(commands.bench_latency, hooks))

    p = _parser(sub, "overlap", None)
    p.add_argument("--model", default=None, help="local model directory (default: built-in benchmark model)")
    p.add_argument("--num-tokens", type=int, default=None, help="tokens of the prefill step (default 512; --quick 256)")
    _add_repeats(p, "default 21; --quick 7")
    p.set_defaults(func=commands.bench_overlap)

    p = _parser(sub, "serve", hooks, model="without --url: the local model directory to serve "
                "(default: built-in benchmark model)")
    _add_serve_args(p)
    p.set_defaults(func=partial(commands.bench_serve, hooks))

    from tandem.bench import spec

    p = _parser(sub, "spec", None)
    p.add_argument("--model", default=None, help="target model directory (default: the built-in agreeing "
                   "target/draft pair)")
    p.add_argument("--draft-model", default=None, help="draft model directory for --model (default with --model "
                   "or --bench-model: n-gram only)")
    p.add_argument("--num-speculative-tokens", type=int, default=spec.DEFAULT_K, help="drafts per step")
    p.add_argument("--draft-dtype", default="auto", choices=DTYPES, help="the draft model's dtype (auto: the "
                   "target's)")
    _add_repeats(p, "batch-1 prompts to take the median over; default 9, --quick 5")
    _add_idle_wait(p)
    p.set_defaults(func=commands.bench_spec)

    p = _parser(sub, "structured", hooks, model="local model directory (default: built-in benchmark model)")
    _add_repeats(p, "default 5; --quick 3")
    _add_idle_wait(p)
    p.set_defaults(func=partial(commands.bench_structured, hooks))

    p = _parser(sub, "quantization", hooks, model="local model directory (default: built-in benchmark model)",
                dtype="auto = float32 on CPU, bfloat16 on CUDA")
    p.set_defaults(device="auto")
    _add_repeats(p, "default 5; --quick 3")
    _add_idle_wait(p)
    p.add_argument("--offline-requests", type=int, default=0,
                   help="also run an offline set of this many requests (the offline bench's lengths) on each")
    p.add_argument("--gemm-sweep", action="store_true",
                   help="only the 8-bit linear kernels against the dense one per row count, on Llama-3-8B's layer "
                        "shapes (CPU: a quarter of each side): what decides W8A8 against the weight-only kernel")
    p.set_defaults(temperature=0.0, func=partial(commands.bench_quantization, hooks))

    p = _parser(sub, "quality", hooks, model="local model directory (default: a small model trained here on "
                                             "Python's own sources, bench/quality_model.py)",
                quantization="the quantized run's weights (the reference runs without); none: the reference "
                "again (a determinism check, unless --kv-cache-dtype is given)",
                kv_cache_dtype="the quantized run's KV cache (the reference's is auto)")
    _allow_choice(p, "quantization", "none")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts in the set (default 64; --quick 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 256; --quick 64)")
    p.set_defaults(func=partial(commands.bench_quality, hooks))

    p = _parser(sub, "prefix", hooks, model="local model directory to serve (default: built-in benchmark model)",
                kv_cache_memory="bytes of KV cache per group (default: --cache-requests whole requests)")
    _add_prefix_args(p)
    p.set_defaults(func=partial(commands.bench_prefix, hooks))

    p = _parser(sub, "soak", hooks, model="without --url: the local model directory to serve (default: the "
                "built-in demo model); with --url: the server's model here, to check outputs against")
    _add_soak_args(p)
    p.set_defaults(func=partial(commands.bench_soak, hooks))

    p = _parser(sub, "observability", hooks, model="local model directory to serve (default: built-in benchmark "
                "model)")
    p.add_argument("--rounds", type=int, default=None, help="passes through each application, off and on, the "
                   "order alternating (default 12; --quick 2)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 8)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per pass (default 32; --quick 8)")
    p.set_defaults(func=partial(commands.bench_observability, hooks))


def _allow_choice(parser: argparse.ArgumentParser, dest: str, choice: str) -> None:
    """One more value the argument `dest` takes on this parser (a value only this command knows)."""
    for action in parser._actions:
        if action.dest == dest:
            action.choices = [choice, *action.choices]


def _parser(sub: Any, name: str, hooks: RouterHooks | None, **helps: str) -> argparse.ArgumentParser:
    """A benchmark's parser: engine flags (with `hooks`; `helps` retell their defaults), --bench-model, outputs."""
    p = sub.add_parser(name, help=HELP[name], description=HELP[name])
    if hooks is not None:
        hooks.add_engine_args(p)
        override_help(p, **helps)
    p.add_argument("--bench-model", default=None, choices=sorted(BENCH_SHAPES),
                   help="a random-weight Llama of a real model's shape in bfloat16, built once into the model "
                   "cache: llama-1b = Llama-3.2-1B's, llama-8b = Llama-3-8B's (for GPUs; not with --model)")
    p.add_argument("--quick", action="store_true", help="a smaller run of the same shape")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write every figure as one flat JSON object")
    p.add_argument("--plot", default=None, metavar="PATH", help="write the plots to this PNG file")
    return p


def _add_repeats(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--repeats", type=int, default=None, help=f"repeats to take the median of ({default})")


def _add_idle_wait(p: argparse.ArgumentParser, help_text: str | None = None) -> None:
    p.add_argument("--idle-wait", type=float, default=60.0, metavar="SECONDS", help=help_text or (
        "before starting, wait up to this long for other processes to go quiet; 0 = do not wait"))


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from tandem.bench import serve

    p.add_argument("--url", default=None, help="server base URL (default: serve tandem locally and compare offline)")
    p.add_argument("--served-model", default=None, help="with --url: the model name to send "
                   "(default: the first of the server's /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--request-rates", default=None, help="comma-separated req/s, 'inf' = all at once "
                   "(default 1,2,4,inf; 2,inf with --quick)")
    p.add_argument("--concurrency", default=None, help="comma-separated fixed in-flight counts (instead of rates)")
    p.add_argument("--compare-concurrency", type=int, default=None, help="in flight for the server/offline "
                   "comparison (default 16; 8 with --quick)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default 64; --quick 24)")
    p.add_argument("--prompt-len", type=int, default=None, metavar="N", help="every prompt N tokens (default: "
                   "uniform in 32..256; --quick 16..96)")
    p.add_argument("--output-len", type=int, default=None, metavar="N", help="every request N output tokens "
                   "(default: uniform in 32..128; --quick 16..48)")
    p.add_argument("--no-stall-check", dest="stall_check", action="store_false", help="without --url: leave out "
                   "the stall check (32 streams, without and with an 8 MiB text prompt arriving; "
                   "stall_itl_p99_ratio)")
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids are drawn below this "
                   f"(default: the model's; {serve.URL_MODE_VOCAB_SIZE} with --url)")
    p.add_argument("--slo-ttft-ms", type=float, default=serve.DEFAULT_SLO_TTFT_MS)
    p.add_argument("--slo-tpot-ms", type=float, default=serve.DEFAULT_SLO_TPOT_MS)
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests, each answered whole "
                   "(TTFT is then E2E): what batch clients that wait for the whole answer cost the server")
    p.add_argument("--no-stream-channels", dest="stream_channels", action="store_false", help="without --url: "
                   "each streamed request's deltas over its own group call, one Ray message per delta (the "
                   "path before channels; for comparison)")
    p.add_argument("--channel-transport", choices=("socket", "serve"), default=None, help="without --url: "
                   "what carries a group's deltas to an ingress replica: a TCP connection to the group's "
                   "channel socket, or a streaming Serve call (default: the server's, socket)")
    p.add_argument("--no-requests-on-channel", dest="requests_on_channel", action="store_false", help="without "
                   "--url: every streamed request through a Serve call of its own, even with one group (for "
                   "comparison)")
    p.add_argument("--no-ingress-on-main-loop", dest="ingress_on_main_loop", action="store_false", help="without "
                   "--url: the ingress's code on a second event loop, Serve's default (for comparison)")
    p.add_argument("--ingress-max-chunks-per-s", type=float, default=None, help="without --url: messages per "
                   "second one ingress replica sends its clients, all streams together (default: the server's)")
    p.add_argument("--ingress-replicas", type=int, default=None, help="without --url: ingress replicas "
                   "(default: the server's)")
    p.add_argument("--proxy", choices=PROXIES, default=None, help="without --url: in front of the ingress, "
                   "haproxy (direct ingress, as tandem serve; the default where installed) or serve (Serve's "
                   "Python proxy actor)")


def _add_prefix_args(p: argparse.ArgumentParser) -> None:
    _add_repeats(p, "default 3; --quick 2")
    p.add_argument("--num-requests", type=int, default=None, help="shared-workload requests per run")
    p.add_argument("--num-prefixes", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=None, help="tokens of a shared prefix (default 900)")
    p.add_argument("--suffix-len", type=int, default=None, help="tokens of a request's own after it (default 100)")
    p.add_argument("--num-no-share", type=int, default=None, help="no-share workload requests per run")
    p.add_argument("--num-hit-pairs", type=int, default=None, help="cold/hit request pairs")
    p.add_argument("--request-rate", type=float, default=None, help="shared workload, req/s (Poisson)")
    p.add_argument("--cache-requests", type=float, default=None,
                   help="each group's KV cache, in whole requests (default: num_prefixes / 2 + 0.5)")
    _add_idle_wait(p)


def _add_soak_args(p: argparse.ArgumentParser) -> None:
    from tandem.bench.soak_faults import FAULT_KINDS

    p.add_argument("--url", default=None, help="server base URL (default: serve tandem here: two TP=2 groups)")
    p.add_argument("--grpc-address", default=None, help="with --url: the server's gRPC host:port (default: HTTP only)")
    p.add_argument("--served-model", default=None, help="with --url: the model name to send (default: none)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests of the overload phase and of the fault phase, each (default 600; --quick 30)")
    p.add_argument("--overload", type=float, default=None, help="the overload rate, x the measured capacity "
                   "(default 4)")
    p.add_argument("--faults", default=None, help=f"comma-separated, in order, of {','.join(FAULT_KINDS)}; 'none' "
                   "(default: all; --quick: allocator,worker,stall; with --url: none)")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="no request is sent after this (default 1200; --quick 90)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="each request's server-side timeout (default 40; --quick 20); lost = no answer 20 s after it")
    p.add_argument("--num-groups", type=int, default=None, help="without --url: replica groups to serve (default 2; "
                   "--quick 1)")
