"""What each `tandem bench` command runs: its parsed arguments to the benchmark's call, then
the figures, with the machine's, printed as a table and written where the arguments say.

bench/cli.py registers the commands and their arguments; each benchmark's module is
imported when its command runs.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.bench.cli import RouterHooks

Figures = dict[str, Any]


def _measured(run: Callable[[], Figures], device: str = "auto", in_process: bool = False) -> Figures:
    """run()'s figures, with the machine's, the load average at the end and the wall time.

    `in_process` (the work runs in this process): also `process_cpu_share`, the CPU seconds
    this process got per wall second per torch thread; well below 1 means other processes
    took the cores (or the run waited on something else)."""
    from tandem.bench.hardware import machine_figures
    from tandem.bench.systems import resolve_device

    before = machine_figures(resolve_device(device))
    wall, cpu = time.perf_counter(), time.process_time()
    figures = {**before, **run()}
    figures["load_average_1m_end"] = os.getloadavg()[0]
    figures["wall_s"] = time.perf_counter() - wall
    if in_process:
        figures["process_cpu_share"] = (time.process_time() - cpu) / figures["wall_s"] / before["torch_num_threads"]
    return figures


def _finish(args: argparse.Namespace, figures: Figures, plot: Callable[[str, Figures], None] | None,
            warn: bool = True) -> int:
    from tandem.bench import report

    if warn:
        report.warn_if_busy(figures)
    report.write_outputs(figures, args.output_json, args.plot, plot)
    return 0


def _bench_options(hooks: RouterHooks, args: argparse.Namespace) -> Any:
    from tandem.bench.systems import BenchOptions

    options = hooks.engine_options(args)
    return BenchOptions(model=options.pop("model", None), bench_model=args.bench_model, dtype=options.pop("dtype"),
                        device=options.pop("device", "auto"), quick=args.quick, repeats=args.repeats,
                        engine_options=options,
                        idle_wait_s=args.idle_wait, temperature=args.temperature)


def bench_offline(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import offline, report
    from tandem.bench.workload import OFFLINE_FULL, OFFLINE_QUICK

    opts = _bench_options(hooks, args)
    spec = OFFLINE_QUICK if args.quick else OFFLINE_FULL
    if args.num_requests is not None:
        spec = replace(spec, num_requests=args.num_requests)
    figures = _measured(lambda: offline.run_offline(opts, spec, hf_sequential=args.hf_sequential, hf=args.hf),
                        args.device, in_process=True)
    report.print_table(offline.title(figures), offline.table_rows(figures))
    return _finish(args, figures, report.plot_offline)


def bench_latency(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import latency, report
    from tandem.bench.systems import resolve_device

    opts = _bench_options(hooks, args)
    shape = None
    if args.sweep_batches:
        batches = tuple(int(b) for b in args.sweep_batches.split(","))
        shape = replace(latency.default_shape(args.quick, resolve_device(args.device)), sweep_batches=batches)
    figures = _measured(lambda: latency.run_latency(opts, shape, hf_compiled=args.hf_compiled,
                                                               hf=args.hf), args.device,
                        in_process=True)
    report.print_table(latency.title(figures), latency.table_rows(figures))
    return _finish(args, figures, report.plot_latency)


def bench_overlap(args: argparse.Namespace) -> int:
    from tandem.bench import report
    from tandem.bench.overlap import run_overlap_bench
    from tandem.bench.systems import pick_model_dir

    model_dir = pick_model_dir(args.model, args.bench_model)
    figures = _measured(lambda: run_overlap_bench(args.quick, num_tokens=args.num_tokens, repeats=args.repeats,
                                                  model_dir=model_dir), "cpu")
    report.print_table("tandem bench overlap", [(k, v, "") for k, v in figures.items()])
    return _finish(args, figures, None)


def bench_serve(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench.serve import SERVE_FULL, SERVE_QUICK, run_serve_bench
    from tandem.bench.serve_report import plot_serve, print_serve_table
    from tandem.bench.systems import pick_model_dir

    options = hooks.engine_options(args)
    model = options.pop("model", None)
    if args.url is not None and args.bench_model is not None:
        raise ValueError("--bench-model is a model to serve here: not with --url")
    model_dir = pick_model_dir(model, args.bench_model) if args.url is None else model
    spec = SERVE_QUICK if args.quick else SERVE_FULL
    if args.num_requests:
        spec = replace(spec, num_requests=args.num_requests)
    if args.prompt_len:
        spec = replace(spec, prompt_len=(args.prompt_len, args.prompt_len))
    if args.output_len:
        spec = replace(spec, output_len=(args.output_len, args.output_len))
    figures = _measured(lambda: run_serve_bench(
        args.url, args.quick, model=model_dir, served_model=args.served_model, engine_options=options,
        local_app=hooks.local_app, spec=spec, serving_options=_serve_bench_serving(args),
        request_rates=[float(r) for r in args.request_rates.split(",")] if args.request_rates else None,
        concurrencies=[int(c) for c in args.concurrency.split(",")] if args.concurrency else None,
        compare_concurrency=args.compare_concurrency, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        api_key=args.api_key, vocab_size=args.vocab_size, stream=not args.no_stream, stall_check=args.stall_check,
        proxy=args.proxy))
    if args.url is None:
        figures.update({f"serving_{k}": v for k, v in _serve_bench_serving(args).items()})
    print_serve_table(figures)
    return _finish(args, figures, plot_serve, warn=args.url is None)  # with --url the server is elsewhere


def _serve_bench_serving(args: argparse.Namespace) -> dict[str, Any]:
    serving: dict[str, Any] = {"stream_channels": args.stream_channels,
                               "requests_on_channel": args.requests_on_channel,
                               "ingress_on_main_loop": args.ingress_on_main_loop}
    if args.channel_transport is not None:
        serving["channel_transport"] = args.channel_transport
    if args.ingress_max_chunks_per_s is not None:
        serving["ingress_max_chunks_per_s"] = args.ingress_max_chunks_per_s
    if args.ingress_replicas is not None:
        serving["ingress_num_replicas"] = args.ingress_replicas
    return serving


def bench_spec(args: argparse.Namespace) -> int:
    from tandem.bench import report, spec
    from tandem.bench.systems import check_model_choice, pick_model_dir

    check_model_choice(args.model, args.bench_model)
    if args.draft_model is not None and args.model is None and args.bench_model is None:
        raise ValueError("--draft-model needs --model or --bench-model (the built-in target comes with its own draft)")
    model = pick_model_dir(args.model, args.bench_model) if args.model or args.bench_model else None
    figures = _measured(lambda: spec.run_spec_bench(
        model, args.quick, args.num_speculative_tokens, args.repeats, draft=args.draft_model,
        idle_wait_s=args.idle_wait, draft_dtype=args.draft_dtype), in_process=True)
    report.print_table("tandem bench spec", spec.table_rows(figures))
    return _finish(args, figures, None)


def bench_structured(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import report, structured
    from tandem.bench.systems import check_model_choice, pick_model_dir

    options = hooks.engine_options(args)
    model = options.pop("model", None)
    check_model_choice(model, args.bench_model)
    model = pick_model_dir(model, args.bench_model) if model or args.bench_model else None
    figures = _measured(lambda: structured.run_structured_bench(
        model, args.quick, args.repeats, engine_options=options, idle_wait_s=args.idle_wait), in_process=True)
    report.print_table("tandem bench structured", structured.table_rows(figures))
    return _finish(args, figures, None)


def bench_quantization(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import quantization, report

    opts = _bench_options(hooks, args)
    figures = _measured(lambda: quantization.run_quantization_bench(opts, args.offline_requests, args.gemm_sweep),
                        args.device, in_process=True)
    rows = [(k, v, "us") for k, v in figures.items() if k.startswith("gemm_us_")] if args.gemm_sweep else \
        quantization.table_rows(figures)
    report.print_table("tandem bench quantization", rows)
    return _finish(args, figures, None)


def bench_quality(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import quality, report
    from tandem.bench.quality_model import quality_model_path
    from tandem.bench.systems import pick_model_dir

    options = hooks.engine_options(args)
    quantization, kv_cache_dtype = options.pop("quantization", None), options.pop("kv_cache_dtype", None)
    if quantization is None and kv_cache_dtype is None:
        raise ValueError("bench quality compares a quantized run with the reference: give --quantization and/or "
                         "--kv-cache-dtype (--quantization none: the reference against itself)")
    model = options.pop("model", None)
    # Default: the trained model, whose distributions are peaked as a real model's are (quality.py).
    model = pick_model_dir(model, args.bench_model) if model or args.bench_model else quality_model_path()
    overrides = {k: v for k, v in (("num_prompts", args.num_prompts), ("prompt_len", args.prompt_len))
                 if v is not None}
    qset = replace(quality.QUALITY_QUICK if args.quick else quality.QUALITY_FULL, **overrides)
    figures = _measured(lambda: quality.run_quality_bench(
        model, qset, None if quantization == "none" else quantization, kv_cache_dtype or "auto",
        engine_options=options), options.get("device", "auto"), in_process=True)
    figures["quick"] = args.quick
    report.print_table("tandem bench quality", quality.table_rows(figures))
    return _finish(args, figures, None, warn=False)  # the models' numbers: CPU contention cannot change them


def bench_prefix(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import report
    from tandem.bench.prefix import run_prefix_bench
    from tandem.bench.prefix_report import plot_prefix, table_rows, title
    from tandem.bench.prefix_workload import PREFIX_FULL, PREFIX_QUICK
    from tandem.bench.systems import pick_model_dir

    options = hooks.engine_options(args)
    if options.pop("address", None):
        raise ValueError("bench prefix starts its own local Ray (it runs two apps side by side): drop --address")
    model_dir = pick_model_dir(options.pop("model", None), args.bench_model)
    overrides = {name: getattr(args, name) for name in (
        "repeats", "num_requests", "num_prefixes", "prefix_len", "suffix_len", "num_no_share", "num_hit_pairs",
        "request_rate", "cache_requests")}
    cfg = replace(PREFIX_QUICK if args.quick else PREFIX_FULL, **{k: v for k, v in overrides.items() if v is not None})
    figures = _measured(lambda: run_prefix_bench(cfg, hooks.local_app, model=model_dir, engine_options=options,
                                                 idle_wait_s=args.idle_wait), "cpu")
    figures["quick"] = args.quick
    report.print_table(title(figures), table_rows(figures))
    return _finish(args, figures, plot_prefix)


def bench_soak(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import report
    from tandem.bench.soak import SOAK_FULL, SOAK_QUICK, run_soak

    options = hooks.engine_options(args)
    model = options.pop("model", None)
    tp = options.pop("tensor_parallel_size", None) or 2
    if args.bench_model is not None:
        raise ValueError("bench soak serves the demo model or --model: not --bench-model")
    cfg = SOAK_QUICK if args.quick else SOAK_FULL
    changes: dict[str, Any] = {}
    if args.num_requests:
        changes.update(overload_requests=args.num_requests, fault_requests=args.num_requests)
    if args.overload is not None:
        changes["overload"] = args.overload
    if args.duration is not None:
        changes["max_duration_s"] = args.duration
    faults = args.faults if args.faults is not None else ("none" if args.url else None)
    if faults is not None:
        changes["faults"] = () if faults == "none" else tuple(f for f in faults.split(",") if f)
    if args.timeout is not None:
        changes["mix"] = replace(cfg.mix, timeout_s=args.timeout)
    cfg = replace(cfg, **changes)
    figures = _measured(lambda: run_soak(
        cfg, url=args.url, grpc_address=args.grpc_address, served_model=args.served_model, api_key=args.api_key,
        model=model, engine_options=options, local_app=hooks.local_app, kv_holdings=hooks.kv_holdings,
        grpc_servicer=hooks.grpc_servicer, grpc_messages=hooks.grpc_messages, num_groups=args.num_groups,
        tensor_parallel_size=tp))
    figures["quick"] = args.quick
    report.print_table("tandem bench soak", [(k, v, "") for k, v in figures.items() if k in report.SOAK_ROWS])
    return _finish(args, figures, None, warn=False)


def bench_observability(hooks: RouterHooks, args: argparse.Namespace) -> int:
    from tandem.bench import report
    from tandem.bench.observability_cost import OBS_QUICK, ObservabilityCostConfig, run_observability_cost, table_rows
    from tandem.bench.systems import pick_model_dir, vocab_size_of

    options = hooks.engine_options(args)
    if options.pop("address", None):
        raise ValueError("bench observability starts its own local Ray (it counts the CPU of its processes): "
                         "drop --address")
    model_dir = pick_model_dir(options.pop("model", None), args.bench_model)
    cfg = OBS_QUICK if args.quick else ObservabilityCostConfig()
    changes: dict[str, Any] = {k: v for k, v in (("rounds", args.rounds), ("concurrency", args.concurrency))
                               if v is not None}
    if args.num_requests:
        changes["spec"] = replace(cfg.spec, num_requests=args.num_requests)
    cfg = replace(cfg, **changes)
    figures = _measured(lambda: run_observability_cost(cfg, hooks.local_app, model=model_dir, engine_options=options,
                                                       vocab_size=vocab_size_of(model_dir),
                                                       telemetry_cost=hooks.telemetry_cost), "cpu")
    figures["quick"] = args.quick
    report.print_table("tandem bench observability", table_rows(figures))
    return _finish(args, figures, None)
