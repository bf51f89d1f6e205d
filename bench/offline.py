"""`tandem bench offline`: one seeded request set through tandem and two transformers baselines.

Systems: (a) tandem's engine, all requests submitted at once; (b) `transformers` static
batching (batch 16, left padding); (c) `transformers` one request at a time. Each repeat runs
all three, in an order rotated per repeat, plus the matmul probe; every figure is the median
over repeats, and each ratio is the median of the per-repeat (paired) ratios. A transformers
run's time is the sum of its `generate` calls' times (each call guarded against CPU
contention on its own); tandem's is one continuous run.

MFU = model FLOPs of the request set (see `workers/model/cost.py`) / elapsed seconds / the probe's
matmul FLOP/s. tandem's MFU is the headline `mfu`; all requests are in flight together, so
apart from the last requests' tail the engine runs saturated.

On CUDA, `gpu_busy` = the fraction of a tandem run's wall time the GPU spent executing
kernels, from one more tandem pass of the same request set under the profiler
(`gpu_busy.py`), after the timed ones, with where the GPU idled (`gpu_idle_edges_ms`, the
gaps between kernels by size, the largest gaps) and which kernels took its time
(`gpu_kernel_table`); `gpu_busy_unprofiled` sets that pass's kernel time against the fastest
timed (unprofiled) run, since the profiler adds host time per launch. The same pass records
the engine's host work (`host_timeline.py`) and sets each gap of 20 us or more against it:
`gpu_gap_ms_under_<part>` (launch, wait, update, emit, step, outside) and, for the largest
gaps, the part and the step it was on (`gpu_largest_gaps_host`); and it counts the caching
allocator's retries, cudaMallocs and cudaFrees (`gpu_alloc_retries`, `gpu_device_mallocs`,
`gpu_device_frees`: a retry frees every cached block, and cudaFree stalls the device), and
lists the host's CUDA API calls by the time they took (`gpu_runtime_calls`) and, for the
largest gaps, the call that overlapped each longest and the launch that ended it
(`gpu_largest_gaps_calls`). One more pass runs under torch's sync debug mode:
`gpu_host_syncs` counts the operations in the engine's code that made the host wait for the
device (beside its one event wait a step), and `gpu_host_sync_sites` names their lines
(`host_syncs.py`). Null on CPU.

On every device, `host_gc_ms` is how long the garbage collector stopped the host in a tandem
run (median over repeats), `host_gc_longest_ms` its longest pause and
`host_gc_oldest_collections` how many collections walked the oldest generation (`gc_pauses.py`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from tandem.bench import hf_baseline
from tandem.bench.gpu_busy import ALLOCATOR_FIGURES, GAP_BUCKETS_US, HOST_FIGURES, profiled_gpu_figures
from tandem.bench.host_syncs import FIGURES as HOST_SYNC_FIGURES
from tandem.bench.host_syncs import host_sync_figures
from tandem.bench.host_timeline import PARTS
from tandem.bench.report import Figures, sampled
from tandem.bench.systems import BenchOptions, Systems, load_systems, resolve_model_dir, tandem_options, vocab_size_of
from tandem.bench.tandem_runs import run_tandem
from tandem.bench.workload import (
    OFFLINE_FULL,
    OFFLINE_QUICK,
    BenchRequest,
    WorkloadSpec,
    make_workload,
    num_output_tokens,
    num_prompt_tokens,
)
from tandem.workers.device_peaks import matmul_flops

SYSTEMS = ("tandem", "hf_static", "hf_sequential")
_WARMUP = WorkloadSpec(num_requests=2, prompt_len=(16, 24), output_len=(4, 4), seed=99)


def run_offline(opts: BenchOptions, spec: WorkloadSpec | None = None, *,
                hf_sequential: bool = True, hf: bool = True) -> Figures:
    """`hf_sequential=False` leaves the one-request-at-a-time baseline out (its figures are
    null): on a GPU it takes minutes of the run for a figure nobody compares against. `hf=False`
    leaves transformers out entirely (not even loaded; every baseline figure null): tandem's
    figures alone, as a second run of one set under another engine option wants."""
    spec = spec or (OFFLINE_QUICK if opts.quick else OFFLINE_FULL)
    names = SYSTEMS[:1] if not hf else SYSTEMS[:2] if not hf_sequential else SYSTEMS
    repeats = opts.num_repeats(default_full=3, default_quick=2)
    model_dir = resolve_model_dir(opts)
    vocab = vocab_size_of(model_dir)
    requests = make_workload(spec, vocab)
    systems = load_systems(opts, [requests], with_hf=hf)
    warmup = make_workload(_WARMUP, vocab)
    for name in names:
        _run_system(name, systems, warmup, "warm-up", show_progress=False)

    results: dict[str, list] = {name: [] for name in SYSTEMS}
    peaks: list[float] = []
    log = opts.contention_log()
    tasks = tqdm(total=repeats * (len(names) + 1), desc="offline", unit="run", disable=not opts.show_progress)
    for rep in range(repeats):
        tasks.set_postfix_str(f"repeat {rep + 1}/{repeats}: matmul probe")
        peaks.append(log.run(lambda: matmul_flops(systems.device, systems.dtype), systems.device))
        tasks.update(1)
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate the order per repeat
            tasks.set_postfix_str(f"repeat {rep + 1}/{repeats}: {name}")
            results[name].append(_run_system(name, systems, requests, name, opts.show_progress,
                                             guard=lambda fn: log.run(fn, systems.device)))
            tasks.update(1)
    gpu = dict.fromkeys(GPU_FIGURES)  # null on CPU
    if systems.device.type == "cuda":
        tasks.set_postfix_str("tandem, profiled")
        gpu = profiled_gpu_figures(
            lambda: run_tandem(systems.llm, requests, desc="profiled", show_progress=False,
                               temperature=systems.temperature), systems.device, engine=systems.llm.engine)
        tasks.set_postfix_str("tandem, sync debug mode")
        gpu.update(host_sync_figures(lambda: run_tandem(systems.llm, requests, desc="sync debug", show_progress=False,
                                                        temperature=systems.temperature)))
    tasks.close()
    fig = _figures(spec, requests, systems, results, peaks, opts, repeats)
    if gpu["gpu_busy"] is not None:
        # The profiler adds host time per launch; set against the fastest (warm) timed run, the
        # profiled pass's kernel time says how busy an unprofiled run kept the GPU.
        fastest_ms = min(r.elapsed_s for r in results["tandem"]) * 1e3
        gpu["gpu_busy_unprofiled"] = min(1.0, gpu["gpu_busy"] * gpu["gpu_profiled_wall_ms"] / fastest_ms)
    fig.update(gpu)
    pp = opts.engine_options.get("pipeline_parallel_size", 1)
    if pp > 1 and "pipeline_inflight_batches" not in opts.engine_options:
        from tandem.bench.pipeline_inflight import pp_inflight_figures

        systems.llm.shutdown()  # its workers' cores go to the two runs' groups, one at a time
        fig.update(pp_inflight_figures(tandem_options(opts, [requests]), requests, warmup, repeats,
                                       guard=lambda fn: log.run(fn, systems.device)))
    fig.update(log.figures())
    return fig


GPU_FIGURES = ("gpu_busy", "gpu_busy_unprofiled", "gpu_kernels", "gpu_kernel_table", "gpu_runtime_calls",
               "gpu_largest_gaps_calls", "gpu_profiled_wall_ms",
               "gpu_idle_edges_ms", "gpu_largest_gaps",
               *(f"gpu_gaps_{label}_{unit}" for label, _ in GAP_BUCKETS_US for unit in ("count", "ms")),
               *HOST_FIGURES, "gpu_host_clock", *ALLOCATOR_FIGURES, *HOST_SYNC_FIGURES)


def _run_system(name: str, systems: Systems, requests: list[BenchRequest], desc: str, show_progress: bool,
                guard: Callable[[Callable[[], Any]], Any] | None = None) -> Any:
    """One run of `requests` on one system. `guard` (a ContentionLog's run) wraps the whole tandem
    run, but each transformers call separately: their runs are sums of independent calls."""
    guard = guard or (lambda fn: fn())
    if name == "tandem":
        return guard(lambda: run_tandem(systems.llm, requests, desc=desc, show_progress=show_progress,
                                        temperature=systems.temperature))
    if name == "hf_static":
        return hf_baseline.run_static(systems.hf_model, requests, systems.device, desc=desc,
                                      show_progress=show_progress, guard=guard)
    return hf_baseline.run_sequential(systems.hf_model, requests, systems.device, desc=desc,
                                      show_progress=show_progress, guard=guard)


def _figures(spec: WorkloadSpec, requests: list[BenchRequest], systems: Systems, results: dict[str, list],
             peaks: list[float], opts: BenchOptions, repeats: int) -> Figures:
    cost = systems.cost
    flops = sum(cost.request_flops(len(r.prompt_token_ids), r.output_len) for r in requests)
    flops_all_logits = sum(cost.request_flops(len(r.prompt_token_ids), r.output_len, lm_head_every_token=True)
                           for r in requests)
    median = statistics.median
    fig: Figures = {
        "benchmark": "offline", "model": systems.model_dir, "device": str(systems.device),
        "dtype": str(systems.dtype).removeprefix("torch."),
        "num_scheduler_steps": systems.llm.engine.config.scheduler.num_scheduler_steps,
        "max_mixed_graph_tokens": systems.llm.engine.config.model.max_mixed_graph_tokens, "quick": opts.quick,
        "temperature": opts.temperature,
        "repeats": repeats,
        "num_requests": len(requests), "num_prompt_tokens": num_prompt_tokens(requests),
        "num_output_tokens": num_output_tokens(requests),
        "prompt_len_min": spec.prompt_len[0], "prompt_len_max": spec.prompt_len[1],
        "output_len_min": spec.output_len[0], "output_len_max": spec.output_len[1], "workload_seed": spec.seed,
        "hf_static_batch_size": hf_baseline.STATIC_BATCH_SIZE,
        "model_flops": flops, "peak_matmul_flops": median(peaks),
        "non_embedding_params": cost.non_embedding_params, "lm_head_params": cost.lm_head_params,
    }
    for name in SYSTEMS:
        runs = results[name]
        if not runs:  # left out
            for key in ("output_tok_s", "output_tok_s_repeats", "elapsed_s", "mfu"):
                fig[f"{name}_{key}"] = None
            fig[f"throughput_ratio_vs_{name}"] = None
            continue
        fig[f"{name}_output_tok_s"] = median(r.tokens_per_s for r in runs)
        fig[f"{name}_output_tok_s_repeats"] = [r.tokens_per_s for r in runs]
        fig[f"{name}_elapsed_s"] = median(r.elapsed_s for r in runs)
        fig[f"{name}_mfu"] = median(flops / r.elapsed_s / p for r, p in zip(runs, peaks, strict=True))
    fig["mfu"] = fig["tandem_mfu"]
    # The host stops for each collection, and the device waits for the host's next launch.
    fig["host_gc_ms"] = median(r.gc.total_s for r in results["tandem"]) * 1e3
    fig["host_gc_longest_ms"] = max(r.gc.longest_s for r in results["tandem"]) * 1e3
    fig["host_gc_oldest_collections"] = max(r.gc.oldest_collections for r in results["tandem"])
    fig["mfu_lm_head_every_token"] = median(flops_all_logits / r.elapsed_s / p
                                            for r, p in zip(results["tandem"], peaks, strict=True))
    for name in ("hf_static", "hf_sequential"):
        if not results[name]:
            continue
        fig[f"throughput_ratio_vs_{name}"] = median(
            t.tokens_per_s / b.tokens_per_s for t, b in zip(results["tandem"], results[name], strict=True))
    generated = results["hf_static"][0].num_generated_tokens if results["hf_static"] else None
    fig["hf_static_generated_tokens"] = generated
    fig["hf_static_useful_fraction"] = num_output_tokens(requests) / generated if generated else None
    return fig


def table_rows(fig: Figures) -> list[tuple[str, object, str]]:
    return [
        ("tandem_output_tok_s", fig["tandem_output_tok_s"], "tok/s"),
        ("hf_static_output_tok_s", fig["hf_static_output_tok_s"], "tok/s"),
        ("hf_sequential_output_tok_s", fig["hf_sequential_output_tok_s"], "tok/s"),
        ("throughput_ratio_vs_hf_static", fig["throughput_ratio_vs_hf_static"], "x"),
        ("throughput_ratio_vs_hf_sequential", fig["throughput_ratio_vs_hf_sequential"], "x"),
        ("peak_matmul_flops", fig["peak_matmul_flops"] / 1e9, "GFLOP/s"),
        ("mfu", fig["mfu"], "tandem"),
        ("host_gc_ms", fig["host_gc_ms"],
         f"ms of collections in a tandem run (longest {fig['host_gc_longest_ms']:.1f}, "
         f"{fig['host_gc_oldest_collections']} of the oldest generation)"),
        ("gpu_busy", fig["gpu_busy"], "of tandem's wall time in kernels"),
        ("gpu_busy_unprofiled", fig["gpu_busy_unprofiled"], "the same kernel time over the fastest timed run"),
        ("gpu_idle_edges_ms", fig["gpu_idle_edges_ms"], "ms before the first kernel and after the last"),
        *((f"gpu_gaps_{label}", None if fig[f"gpu_gaps_{label}_ms"] is None else
           f"{fig[f'gpu_gaps_{label}_count']} gaps, {fig[f'gpu_gaps_{label}_ms']:.1f} ms", "between kernels")
          for label, _ in GAP_BUCKETS_US),
        ("gpu_gap_ms_under", None if fig["gpu_gap_ms_under_launch"] is None else
         ", ".join(f"{part} {fig[f'gpu_gap_ms_under_{part}']:.1f}" for part in PARTS),
         "ms of gaps over 20 us by the host's part"),
        ("gpu_alloc_retries", fig["gpu_alloc_retries"],
         f"cudaMalloc {fig['gpu_device_mallocs']}, cudaFree {fig['gpu_device_frees']} in the profiled pass"),
        ("gpu_host_syncs", fig["gpu_host_syncs"], "synchronising operations in the engine's code, one pass"),
        ("hf_static_mfu", fig["hf_static_mfu"], ""),
        ("hf_sequential_mfu", fig["hf_sequential_mfu"], ""),
        ("hf_static_useful_fraction", fig["hf_static_useful_fraction"], "of generated tokens"),
        *((name, fig[name], "tok/s" if "tok_s" in name else "x: P steps in flight over one")
          for name in fig if name.startswith("pp_inflight_") and name != "pp_inflight_repeats"),
    ]


def title(fig: Figures) -> str:
    return (f"tandem bench offline: {fig['num_requests']} requests, prompts {fig['prompt_len_min']}-"
            f"{fig['prompt_len_max']}, outputs {fig['output_len_min']}-{fig['output_len_max']} tokens; "
            f"{fig['device']} {fig['dtype']}; median of {fig['repeats']} repeats{sampled(fig)}")
