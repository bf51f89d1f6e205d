"""`tandem bench {offline,latency,overlap}`: registered into the `tandem` command by router/cli.py."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_BENCHMARKS = {
    "offline": "throughput of one request set: tandem vs transformers (static batches, one at a time)",
    "latency": "batch-1 time per output token, bandwidth use, engine overhead, batch-size sweep",
}
_OPTIONAL = ("overlap", "serve", "spec", "prefix")


def override_help(parser: argparse.ArgumentParser, **helps: str) -> None:
    """Replace the help text of existing arguments, by destination name."""
    for action in parser._actions:
        if action.dest in helps:
            action.help = helps[action.dest]


def register(subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (offline throughput, latency, overlap)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text in _BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_engine_args(p)
        # The engine args document the generate defaults; ours differ.
        override_help(p, model="local Hugging Face model directory (default: built-in benchmark model)",
                      dtype="auto = float32 on CPU, bfloat16 on CUDA")
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        p.add_argument("--repeats", type=int, default=None,
                       help="repeats to take the median of (default 3; offline --quick: 2)")
        p.add_argument("--idle-wait", type=float, default=60.0, metavar="SECONDS",
                       help="CPU only: before each run wait up to this long for other processes to go quiet, "
                       "and redo a run they disturbed (up to twice); 0 = measure at once, never redo")
        _add_output_args(p)
        p.set_defaults(func=_run_benchmark, benchmark=name)
    registered = _register_optional(sub, add_engine_args)
    if "overlap" not in registered:
        overlap = sub.add_parser("overlap", help="tensor-parallel compute/communication overlap")
        _add_output_args(overlap)
        overlap.set_defaults(func=_run_overlap)


def _register_optional(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """Benchmarks of later issues live in `tandem.bench.<name>` and add themselves through
    `register_<name>(bench_subparsers, add_engine_args)`; a module not written yet is skipped."""
    registered = []
    for name in _OPTIONAL:
        module_name = f"tandem.bench.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue
            raise
        hook = getattr(module, f"register_{name}", None)
        if hook is not None:
            hook(sub, add_engine_args)
            registered.append(name)
    return registered


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a smaller run of the same shape (< 2 min on 2 CPU cores)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write every figure as one flat JSON object")
    p.add_argument("--plot", default=None, metavar="PATH", help="write the plots to this PNG file")


def _run_benchmark(args: argparse.Namespace) -> int:
    from tandem.bench import latency, offline, report
    from tandem.bench.hardware import machine_figures
    from tandem.bench.systems import BenchOptions, resolve_device
    from tandem.router.cli import engine_options

    extra = {k: v for k, v in engine_options(args).items() if k not in ("model", "dtype")}
    opts = BenchOptions(model=args.model, dtype=args.dtype, device=args.device, quick=args.quick,
                        repeats=args.repeats, engine_options=extra, idle_wait_s=args.idle_wait)
    module = offline if args.benchmark == "offline" else latency
    before = machine_figures(resolve_device(args.device))
    wall, cpu = time.perf_counter(), time.process_time()
    figures = offline.run_offline(opts) if args.benchmark == "offline" else latency.run_latency(opts)
    figures.update(before)
    figures["load_average_1m_end"] = os.getloadavg()[0]
    figures["wall_s"] = time.perf_counter() - wall
    # CPU seconds this process got per wall second per torch thread: well below 1 means
    # other processes took the cores (or the run waited on something else).
    figures["process_cpu_share"] = (time.process_time() - cpu) / figures["wall_s"] / before["torch_num_threads"]
    report.print_table(module.title(figures), module.table_rows(figures))
    _warn_if_busy(figures)
    _write_outputs(args, figures, report.plot_offline if args.benchmark == "offline" else report.plot_latency)
    return 0


def _run_overlap(args: argparse.Namespace) -> int:
    try:
        from tandem.bench.overlap import run_overlap_bench
    except ModuleNotFoundError as exc:
        if exc.name and "tandem.bench.overlap".startswith(exc.name):
            print("tandem bench overlap: not available yet (tandem.bench.overlap is not built)", file=sys.stderr)
            return 1
        raise
    from tandem.bench import report

    figures = run_overlap_bench(args.quick)
    if isinstance(figures, dict):
        report.print_table("tandem bench overlap", [(k, v, "") for k, v in figures.items()])
        _write_outputs(args, figures, None)
    return 0


def _warn_if_busy(figures: dict[str, Any]) -> None:
    if figures.get("device") != "cpu":
        return
    cores = figures.get("cpu_count") or 1
    load = max(figures.get("load_average_1m", 0.0), figures.get("load_average_1m_end", 0.0))
    share = figures["process_cpu_share"]
    if load > cores + 1 or share < 0.7:  # + 1: this run itself
        print(f"warning: load average {load:.1f} on {cores} cores, this process got {share:.0%} of its "
              "threads' CPU time: other processes shared the CPU, so these figures are unreliable",
              file=sys.stderr)


def _write_outputs(args: argparse.Namespace, figures: dict[str, Any], plot: Callable | None) -> None:
    from tandem.bench import report

    if args.output_json:
        report.write_json(args.output_json, figures)
        print(f"wrote {args.output_json}", file=sys.stderr)
    if args.plot:
        if plot is None:
            print("no plot for this benchmark", file=sys.stderr)
        else:
            plot(args.plot, figures)
            print(f"wrote {args.plot}", file=sys.stderr)
