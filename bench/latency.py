"""`tandem bench latency`: batch-1 decode latency, bandwidth use, engine overhead, batch sweep.

Per repeat (tandem and transformers in an order rotated per repeat, probes first):
- tandem TPOT: the wall time from the first token to the last of one request, over the tokens
  in between (`TandemRun.time_per_decode_token_s`);
  transformers TPOT: the mean gap between consecutive tokens of one `generate()` of the same
  request (timed by a logits processor that only reads the clock).
- MBU = bytes one decode step must read (all weights incl. lm_head, plus the KV cache at the
  mean decode context; see `model_cost`) / TPOT / the large-tensor copy bandwidth (read +
  write). MBU against the GEMV read bandwidth is reported too (`mbu_vs_gemv_read`).
- engine overhead = TPOT / median bare forward + logits on the same step inputs (see
  `tandem_runs`): what the engine adds to one forward pass a token.
- hf_compiled TPOT: transformers' fast path (static KV cache, torch.compile with CUDA graphs)
  on the same request, timed as (T(n tokens) - T(1 token)) / (n - 1) after an untimed
  warm-up that compiles; measured on CUDA always, on CPU with `hf_compiled` (`--hf-compiled`),
  else its figures are null. `tpot_ratio_vs_hf_compiled` = tandem TPOT / hf_compiled TPOT.
- `hf=False` (`--no-hf`) leaves transformers out entirely (not even loaded): its figures are
  null. For runs that need tandem's figures alone, such as a second `num_scheduler_steps` on a
  machine where transformers was measured already, or MBU on a model whose compile costs minutes.
Then a sweep over batch sizes (to 64; to 128 on CUDA, `decode_tok_s_at_128`): B identical
requests decoding together. Per batch: TPOT (as at batch 1: the decode
phase's time per token), tokens/s = B / TPOT, MFU and MBU of a decode step, and engine
overhead. Decoding counts as compute-bound from the first batch whose MFU >= its MBU (the
resource closer to its peak is the one that binds); the roofline ridge (matmul FLOP/s over
copy bandwidth) predicts the same crossover from the probes alone and is reported beside it.
Every figure is the median over repeats. On CUDA, `replay_b1_*` and `replay_b{largest}_*` say
how busy the GPU is inside the decode passes themselves (`replay_figures`): the ceiling that
kernel launch gaps leave for `gpu_busy`.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, replace
from functools import partial

import torch
from tqdm.auto import tqdm

from tandem.bench import hf_baseline
from tandem.bench.arrivals import arrival_figures
from tandem.bench.gpu_busy import GAP_BUCKETS_US, profiled_gpu_figures
from tandem.bench.report import Figures, sampled, sweep_batches
from tandem.bench.systems import BenchOptions, Systems, load_systems, resolve_device, resolve_model_dir, vocab_size_of
from tandem.bench.tandem_runs import median_or_nan, run_tandem, time_bare_forward
from tandem.bench.workload import BenchRequest, fixed_length_requests
from tandem.workers.device_peaks import copy_bandwidth, gemv_read_bandwidth, matmul_flops, sync


@dataclass(frozen=True)
class LatencyShape:
    prompt_len: int  # batch-1 request
    output_len: int
    sweep_prompt_len: int
    sweep_output_len: int
    sweep_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


LATENCY_FULL = LatencyShape(prompt_len=256, output_len=128, sweep_prompt_len=128, sweep_output_len=32)
LATENCY_QUICK = LatencyShape(prompt_len=128, output_len=32, sweep_prompt_len=32, sweep_output_len=12)
CUDA_SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def default_shape(quick: bool, device: torch.device) -> LatencyShape:
    shape = LATENCY_QUICK if quick else LATENCY_FULL
    return replace(shape, sweep_batches=CUDA_SWEEP_BATCHES) if device.type == "cuda" else shape


@dataclass
class _Repeat:
    copy_bw: float
    gemv_bw: float
    peak_flops: float
    tpot_tandem: float = 0.0
    tpot_hf: float | None = None
    tpot_hf_compiled: float | None = None
    bare_forward: float = 0.0
    sweep_step: dict[int, float] | None = None
    sweep_bare: dict[int, float] | None = None


def run_latency(opts: BenchOptions, shape: LatencyShape | None = None, *, hf_compiled: bool = False,
                hf: bool = True) -> Figures:
    """Every figure (see the module docstring); `hf_compiled`: measure transformers' fast path on CPU
    too; `hf=False`: leave transformers out (its figures null)."""
    shape = shape or default_shape(opts.quick, resolve_device(opts.device))
    repeats = opts.num_repeats(default_full=3, default_quick=3)
    vocab = vocab_size_of(resolve_model_dir(opts))
    single = fixed_length_requests(1, shape.prompt_len, shape.output_len, vocab, seed=1)
    sweep = {b: fixed_length_requests(b, shape.sweep_prompt_len, shape.sweep_output_len, vocab, seed=100 + b)
             for b in shape.sweep_batches}
    systems = load_systems(opts, [single, sweep[max(shape.sweep_batches)]], with_hf=hf)
    device = systems.device
    _warm_up(systems, vocab, single[0])
    measure_compiled = hf and (hf_compiled or device.type == "cuda")
    compiled_error = _warm_up_compiled(systems, single[0]) if measure_compiled else None
    names = ("tandem",) + (("hf",) if hf else ()) + (
        ("hf_compiled",) if measure_compiled and compiled_error is None else ())

    tasks = tqdm(total=repeats * (1 + len(names) + len(shape.sweep_batches)), desc="latency", unit="run",
                 disable=not opts.show_progress)
    runs = []
    log = opts.contention_log()
    for rep in range(repeats):
        tasks.set_postfix_str(f"repeat {rep + 1}/{repeats}: probes")
        run = log.run(lambda: _Repeat(copy_bandwidth(device), gemv_read_bandwidth(device, systems.dtype),
                                      matmul_flops(device, systems.dtype)), device)
        tasks.update(1)
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate the order per repeat
            tasks.set_postfix_str(f"repeat {rep + 1}/{repeats}: {name} batch 1")
            if name == "tandem":
                run.tpot_tandem, run.bare_forward = log.run(
                    lambda: _sweep_point(systems, single, "tandem batch 1", opts.show_progress), device)
            elif name == "hf":
                run.tpot_hf = log.run(lambda: hf_baseline.time_per_output_token(systems.hf_model, single[0], device),
                                      device)
            else:
                run.tpot_hf_compiled = log.run(
                    lambda: hf_baseline.compiled_time_per_output_token(systems.hf_model, single[0], device), device)
            tasks.update(1)
        run.sweep_step, run.sweep_bare = {}, {}
        for batch, requests in sweep.items():
            tasks.set_postfix_str(f"repeat {rep + 1}/{repeats}: sweep batch {batch}")
            run.sweep_step[batch], run.sweep_bare[batch] = log.run(
                partial(_sweep_point, systems, requests, f"batch {batch}", opts.show_progress), device)
            tasks.update(1)
        runs.append(run)
    tasks.close()
    fig = _figures(shape, systems, runs, opts)
    for batch in (1, max(shape.sweep_batches)):
        fig.update(replay_figures(systems, single if batch == 1 else sweep[batch], batch))
    fig.update(arrival_figures(systems.llm, vocab, repeats, systems.temperature))
    fig.update(hf_compiled_figures([r.tpot_tandem for r in runs], [r.tpot_hf_compiled for r in runs],
                                   compiled_error))
    fig.update(log.figures())
    return fig


def _warm_up_compiled(systems: Systems, req: BenchRequest) -> str | None:
    """Compile transformers' fast path for `req`'s shape; the error, if it cannot be compiled here."""
    try:
        hf_baseline.warm_up_compiled(systems.hf_model, req, systems.device)
    except Exception as exc:  # noqa: BLE001 - a missing or failing compiler costs this one figure, not the run
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"warning: transformers with a static cache and torch.compile failed, not measured: {error}",
              file=sys.stderr)
        return error
    return None


def hf_compiled_figures(tpot_tandem: list[float], tpot_compiled: list[float | None], error: str | None) -> Figures:
    """The hf_compiled figures over repeats; null where it was not measured (`error` says why, if it failed)."""
    measured = [(t, c) for t, c in zip(tpot_tandem, tpot_compiled, strict=True) if c is not None]
    if not measured:
        return {"tpot_hf_compiled_ms": None, "tpot_ratio_vs_hf_compiled": None, "hf_compiled_error": error}
    return {"tpot_hf_compiled_ms": statistics.median(c for _, c in measured) * 1e3,
            "tpot_ratio_vs_hf_compiled": statistics.median(t / c for t, c in measured),
            "hf_compiled_error": error}


def _warm_up(systems: Systems, vocab: int, single: BenchRequest) -> None:
    warm = fixed_length_requests(2, 16, 4, vocab, seed=99)
    result = run_tandem(systems.llm, warm, record_inputs=True, show_progress=False, temperature=systems.temperature)
    time_bare_forward(systems.runner, result.decode_inputs, systems.device)
    # At the timed request's shapes too: on a GPU transformers' first call at new attention
    # shapes builds kernel plans step by step (~4x its steady TPOT).
    if systems.hf_model is not None:
        hf_baseline.time_per_output_token(systems.hf_model, single, systems.device)


def replay_figures(systems: Systems, requests: list[BenchRequest], batch: int) -> Figures:
    """On CUDA, where the GPU idles inside the forward passes themselves: the decode steps of one
    run of `requests` replayed back to back under the profiler (no host sync between them, so
    the device never waits for the host), as `replay_b{batch}_gpu_busy`, kernels per pass
    (`replay_b{batch}_kernels_per_pass`), the mean gap between kernels in microseconds
    (`replay_b{batch}_mean_gap_us`) and the kernels a pass is made of
    (`replay_b{batch}_kernel_table`: name, launches a pass, mean us, share of kernel time).
    Inside a CUDA graph each gap is the launch of the next kernel, so this is the ceiling of
    `gpu_busy` for decode steps at this batch. The same replay timed without the profiler gives
    `replay_b{batch}_profiler_slowdown` (profiled wall / unprofiled) and
    `replay_b{batch}_gpu_busy_unprofiled` (the profiled kernel time over the unprofiled wall:
    the busy fraction if the profiler lengthens the gaps, not the kernels). Null elsewhere."""
    if systems.device.type != "cuda":
        return replay_summary(None, 0, batch)
    result = run_tandem(systems.llm, requests, record_inputs=True, show_progress=False,
                        temperature=systems.temperature)
    steps = result.decode_inputs
    runner = systems.runner

    def replay() -> None:
        for step in steps:
            if step.graph_batch is not None:
                runner.graphs.buffer[:step.staged.numel()].copy_(step.staged)
            runner.forward(step)

    replay()  # anything a first pass compiles or allocates, outside the profile
    walls = []
    for _ in range(3):
        sync(systems.device)
        start = time.perf_counter()
        replay()
        sync(systems.device)
        walls.append(time.perf_counter() - start)
    gpu = profiled_gpu_figures(replay, systems.device, num_passes=len(steps))
    return replay_summary(gpu, len(steps), batch, unprofiled_ms=statistics.median(walls) * 1e3)


REPLAY_FIGURES = ("gpu_busy", "kernels_per_pass", "mean_gap_us", "kernel_table", "profiler_slowdown",
                  "gpu_busy_unprofiled")


def replay_summary(gpu: Figures | None, num_passes: int, batch: int, unprofiled_ms: float | None = None) -> Figures:
    """`replay_figures`' figures from a profile of `num_passes` passes and the same passes'
    unprofiled wall time (all null without a profile)."""
    names = [f"replay_b{batch}_{name}" for name in REPLAY_FIGURES]
    if gpu is None or not num_passes:
        return dict.fromkeys(names)
    num_gaps = sum(gpu[f"gpu_gaps_{label}_count"] for label, _ in GAP_BUCKETS_US)
    gap_ms = sum(gpu[f"gpu_gaps_{label}_ms"] for label, _ in GAP_BUCKETS_US)
    slowdown = busy_unprofiled = None
    if unprofiled_ms:
        slowdown = gpu["gpu_profiled_wall_ms"] / unprofiled_ms
        busy_unprofiled = min(1.0, gpu["gpu_busy"] * slowdown)
    return dict(zip(names, (gpu["gpu_busy"], gpu["gpu_kernels"] / num_passes,
                            gap_ms * 1e3 / num_gaps if num_gaps else None, gpu["gpu_kernel_table"], slowdown,
                            busy_unprofiled), strict=True))


def _sweep_point(systems: Systems, requests: list[BenchRequest], desc: str, show_progress: bool) -> tuple[float, float]:
    """(time per decode token, median bare forward on the decode steps' inputs), in seconds."""
    result = run_tandem(systems.llm, requests, desc=desc, record_inputs=True, show_progress=show_progress,
                        temperature=systems.temperature)
    bare = time_bare_forward(systems.runner, result.decode_inputs, systems.device)
    return result.time_per_decode_token_s, median_or_nan(bare)


def _figures(shape: LatencyShape, systems: Systems, runs: list[_Repeat], opts: BenchOptions) -> Figures:
    cost = systems.cost
    median = statistics.median
    ctx = shape.prompt_len + shape.output_len / 2  # mean keys attended over the decode steps
    step_bytes = cost.decode_step_bytes(1, ctx)
    fig: Figures = {
        "benchmark": "latency", "model": systems.model_dir, "device": str(systems.device),
        "dtype": str(systems.dtype).removeprefix("torch."),
        "num_scheduler_steps": systems.llm.engine.config.scheduler.num_scheduler_steps, "quick": opts.quick,
        "temperature": opts.temperature,
        "repeats": len(runs),
        "prompt_len": shape.prompt_len, "output_len": shape.output_len,
        "sweep_prompt_len": shape.sweep_prompt_len, "sweep_output_len": shape.sweep_output_len,
        "copy_bandwidth_bytes_s": median(r.copy_bw for r in runs),
        "gemv_read_bandwidth_bytes_s": median(r.gemv_bw for r in runs),
        "peak_matmul_flops": median(r.peak_flops for r in runs),
        "weight_bytes": cost.weight_bytes, "kv_bytes_per_token": cost.kv_bytes_per_token,
        "decode_step_bytes_b1": step_bytes,
        "tpot_tandem_ms": median(r.tpot_tandem for r in runs) * 1e3,
        "tpot_tandem_ms_repeats": [r.tpot_tandem * 1e3 for r in runs],
        "mbu": median(step_bytes / r.tpot_tandem / r.copy_bw for r in runs),
        "mbu_vs_gemv_read": median(step_bytes / r.tpot_tandem / r.gemv_bw for r in runs),
        "bare_forward_ms": median(r.bare_forward for r in runs) * 1e3,
        "engine_overhead": median(r.tpot_tandem / r.bare_forward for r in runs),
    }
    fig.update(_hf_figures(runs, step_bytes))
    sweep_ctx = shape.sweep_prompt_len + shape.sweep_output_len / 2
    compute_bound_from = None
    for b in shape.sweep_batches:
        step = median(r.sweep_step[b] for r in runs)
        fig[f"sweep_b{b}_tpot_ms"] = step * 1e3
        fig[f"sweep_b{b}_tok_s"] = b / step
        fig[f"sweep_b{b}_mfu"] = median(cost.decode_step_flops(b, sweep_ctx) / r.sweep_step[b] / r.peak_flops
                                        for r in runs)
        fig[f"sweep_b{b}_mbu"] = median(cost.decode_step_bytes(b, sweep_ctx) / r.sweep_step[b] / r.copy_bw
                                        for r in runs)
        fig[f"sweep_b{b}_engine_overhead"] = median(r.sweep_step[b] / r.sweep_bare[b] for r in runs)
        if compute_bound_from is None and fig[f"sweep_b{b}_mfu"] >= fig[f"sweep_b{b}_mbu"]:
            compute_bound_from = b
    fig["compute_bound_from_batch"] = compute_bound_from
    fig["decode_tok_s_at_128"] = fig.get("sweep_b128_tok_s")
    fig["roofline_crossover_batch"] = cost.roofline_crossover_batch(
        sweep_ctx, fig["peak_matmul_flops"], fig["copy_bandwidth_bytes_s"])
    return fig


def _hf_figures(runs: list[_Repeat], step_bytes: float) -> Figures:
    """transformers' eager figures; null where it was left out."""
    if any(r.tpot_hf is None for r in runs):
        return {"tpot_hf_ms": None, "tpot_ratio_vs_hf": None, "tpot_hf_ms_repeats": None, "hf_mbu": None}
    median = statistics.median
    return {"tpot_hf_ms": median(r.tpot_hf for r in runs) * 1e3,
            "tpot_ratio_vs_hf": median(r.tpot_tandem / r.tpot_hf for r in runs),
            "tpot_hf_ms_repeats": [r.tpot_hf * 1e3 for r in runs],
            "hf_mbu": median(step_bytes / r.tpot_hf / r.copy_bw for r in runs)}


def table_rows(fig: Figures) -> list[tuple[str, object, str]]:
    rows = [
        ("tpot_tandem_ms", fig["tpot_tandem_ms"], "ms"),
        ("tpot_hf_ms", fig["tpot_hf_ms"], "ms"),
        ("tpot_ratio_vs_hf", fig["tpot_ratio_vs_hf"], "x"),
        ("tpot_hf_compiled_ms", fig["tpot_hf_compiled_ms"], "ms (static cache + torch.compile)"),
        ("tpot_ratio_vs_hf_compiled", fig["tpot_ratio_vs_hf_compiled"], "x"),
        ("copy_bandwidth_bytes_s", fig["copy_bandwidth_bytes_s"] / 1e9, "GB/s (read+write)"),
        ("gemv_read_bandwidth_bytes_s", fig["gemv_read_bandwidth_bytes_s"] / 1e9, "GB/s"),
        ("mbu", fig["mbu"], "vs copy"),
        ("mbu_vs_gemv_read", fig["mbu_vs_gemv_read"], "vs GEMV read"),
        ("hf_mbu", fig["hf_mbu"], "vs copy"),
        ("bare_forward_ms", fig["bare_forward_ms"], "ms"),
        ("engine_overhead", fig["engine_overhead"], "x"),
        ("peak_matmul_flops", fig["peak_matmul_flops"] / 1e9, "GFLOP/s"),
    ]
    for b in sweep_batches(fig):
        rows.append((f"sweep_b{b}", f"{fig[f'sweep_b{b}_tpot_ms']:.2f} ms  {fig[f'sweep_b{b}_tok_s']:.0f} tok/s",
                     f"MFU {fig[f'sweep_b{b}_mfu']:.2f} MBU {fig[f'sweep_b{b}_mbu']:.2f} "
                     f"overhead {fig[f'sweep_b{b}_engine_overhead']:.2f}"))
    rows.append(("decode_tok_s_at_128", fig["decode_tok_s_at_128"], "tok/s"))
    for name, value in fig.items():
        if name.startswith("replay_b") and name.endswith("_gpu_busy") and value is not None:
            prefix = name.removesuffix("_gpu_busy")
            detail = (f"{fig[f'{prefix}_kernels_per_pass']:.0f} kernels a pass, mean gap "
                      f"{fig[f'{prefix}_mean_gap_us']:.2f} us, "
                      f"profiler slowdown {fig[f'{prefix}_profiler_slowdown']:.3f}")
            rows.append((prefix, f"GPU busy {value:.3f}", detail))
    if fig.get("arrivals_step_ms") is not None:
        rows.append(("arrivals_step_ms", f"{fig['arrivals_step_ms']:.3f} ms",
                     f"eager mixed steps {fig['arrivals_step_ms_eager_mixed']:.3f} ms: "
                     f"{fig['arrivals_mixed_graph_speedup']:.2f}x with mixed-step graphs"))
    rows.append(("compute_bound_from_batch", fig["compute_bound_from_batch"], "measured (MFU >= MBU)"))
    rows.append(("roofline_crossover_batch", fig["roofline_crossover_batch"], "predicted by the probes"))
    return rows


def title(fig: Figures) -> str:
    return (f"tandem bench latency: batch 1, prompt {fig['prompt_len']}, {fig['output_len']} output tokens; "
            f"sweep prompt {fig['sweep_prompt_len']}, {fig['sweep_output_len']} tokens; {fig['device']} "
            f"{fig['dtype']}; median of {fig['repeats']} repeats{sampled(fig)}")
