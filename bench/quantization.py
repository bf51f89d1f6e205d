"""`tandem bench quantization`: what quantized weights and an FP8 KV cache buy, measured side by
side with the unquantized engine on the same requests, in one run.

Two engines are loaded at once, the baseline (the engine options without `quantization` and
`kv_cache_dtype`) and the quantized one (with them), each with the same KV memory (CPU: the
same bytes; GPU: the same `gpu_memory_utilization`, 0.45 each unless given, so both fit). Per
repeat, in an order rotated per repeat:

- batch-1 time per output token: one request's decode phase (`TandemRun.time_per_decode_token_s`);
- decode throughput at batch B (128 on CUDA, 32 on CPU): B requests decoding together, output
  tokens per second of the decode phase;
- the offline set (`--offline-requests`, default 0: left out): every request at once, output
  tokens per second end to end.

Then the KV capacity of each (pool blocks x block size: tokens) and the stored weight bytes.
Figures are medians over repeats; `*_ratio` = quantized / baseline (TPOT: lower is better;
the others: higher is better). The issue's targets, on an H100 with llama-8b and FP8: TPOT
ratio <= 0.6, batch-128 decode ratio >= 1.3, KV capacity ratio >= 1.9 (FP8 KV), offline
ratio >= 1.2; on CPU, INT8 weight-only batch-1 TPOT ratio <= 0.6.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.bench.report import Figures
from tandem.bench.systems import BenchOptions, resolve_device, resolve_dtype, resolve_model_dir, vocab_size_of
from tandem.bench.tandem_runs import run_tandem
from tandem.bench.workload import OFFLINE_FULL, BenchRequest, WorkloadSpec, fixed_length_requests, make_workload
from tandem.workers.quant.memory import weight_bytes

QUANT_OPTIONS = ("quantization", "kv_cache_dtype")


@dataclass(frozen=True)
class QuantShape:
    prompt_len: int
    output_len: int
    batch: int  # the decode-throughput batch
    batch_prompt_len: int
    batch_output_len: int


QUANT_FULL = QuantShape(prompt_len=128, output_len=64, batch=32, batch_prompt_len=64, batch_output_len=32)
QUANT_QUICK = QuantShape(prompt_len=64, output_len=24, batch=8, batch_prompt_len=32, batch_output_len=12)
CUDA_BATCH = 128


def run_quantization_bench(opts: BenchOptions, offline_requests: int = 0, gemm_sweep: bool = False) -> Figures:
    from tandem.workers.llm import LLM

    device = resolve_device(opts.device)
    if gemm_sweep:  # the kernels alone, on the 8B layer's shapes: no engines
        from tandem.bench.quant_gemm import gemm_sweep as sweep

        dtype = torch.bfloat16 if resolve_dtype(opts.dtype, device) == "bfloat16" else torch.float32
        return {"benchmark": "quantization_gemm", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                **sweep(device, dtype)}
    shape = QUANT_QUICK if opts.quick else QUANT_FULL
    if device.type == "cuda":
        shape = QuantShape(shape.prompt_len, shape.output_len, CUDA_BATCH, shape.batch_prompt_len,
                           shape.batch_output_len)
    model_dir = resolve_model_dir(opts)
    vocab = vocab_size_of(model_dir)
    single = fixed_length_requests(1, shape.prompt_len, shape.output_len, vocab, seed=1)
    batch = fixed_length_requests(shape.batch, shape.batch_prompt_len, shape.batch_output_len, vocab, seed=2)
    offline = make_workload(WorkloadSpec(offline_requests, OFFLINE_FULL.prompt_len, OFFLINE_FULL.output_len),
                            vocab) if offline_requests else []
    quantized = {k: opts.engine_options[k] for k in QUANT_OPTIONS if k in opts.engine_options}
    if not quantized:
        raise ValueError("bench quantization compares a quantized engine with the baseline: give --quantization "
                         "and/or --kv-cache-dtype")
    base = {k: v for k, v in opts.engine_options.items() if k not in QUANT_OPTIONS}
    base.update(model=model_dir, dtype=resolve_dtype(opts.dtype, device), device=device.type)
    if device.type == "cuda":
        base.setdefault("gpu_memory_utilization", 0.45)
    elif "kv_cache_memory" not in base and "num_kv_blocks" not in base:
        base["kv_cache_memory"] = 256 * 2**20
    engines = {"baseline": LLM(**base), "quantized": LLM(**base, **quantized)}
    try:
        return _measure(engines, opts, shape, single, batch, offline, quantized)
    finally:
        for llm in engines.values():
            llm.shutdown()


def _measure(engines: dict[str, Any], opts: BenchOptions, shape: QuantShape, single: list[BenchRequest],
             batch: list[BenchRequest], offline: list[BenchRequest], quantized: dict[str, Any]) -> Figures:
    device = resolve_device(opts.device)
    repeats = opts.num_repeats(default_full=5, default_quick=3)
    for llm in engines.values():  # warm-up: kernels compiled, graphs captured, caches touched
        run_tandem(llm, single, desc="warm-up", show_progress=False)
    tpot: dict[str, list[float]] = {name: [] for name in engines}
    decode: dict[str, list[float]] = {name: [] for name in engines}
    whole: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    bar = tqdm(total=repeats * len(names), desc="bench quantization", unit="run", disable=not opts.show_progress)
    log = opts.contention_log()
    for rep in range(repeats):
        for name in names[rep % 2:] + names[:rep % 2]:
            llm = engines[name]
            tpot[name].append(log.run(partial(_tpot, llm, single), device))
            decode[name].append(log.run(partial(_decode_tok_s, llm, batch), device))
            if offline:
                whole[name].append(log.run(partial(_tok_s, llm, offline), device))
            bar.update(1)
    bar.close()
    median = statistics.median
    fig: Figures = {"benchmark": "quantization", "model": resolve_model_dir(opts), "device": str(device),
                    "quick": opts.quick, "repeats": repeats, "quantization": quantized.get("quantization", "none"),
                    "kv_cache_dtype": quantized.get("kv_cache_dtype", "auto"), "batch": shape.batch,
                    "prompt_len": shape.prompt_len, "output_len": shape.output_len,
                    "offline_requests": len(offline)}
    for name, llm in engines.items():
        engine = llm.engine
        fig[f"{name}_tpot_b1_ms"] = median(tpot[name]) * 1e3
        fig[f"{name}_decode_tok_s_b{shape.batch}"] = median(decode[name])
        fig[f"{name}_kv_capacity_tokens"] = engine.pool.num_blocks * engine.config.cache.block_size
        fig[f"{name}_weight_bytes"] = weight_bytes(engine.executor.runner.model)
        if offline:
            fig[f"{name}_offline_tok_s"] = median(whole[name])
    fig["tpot_b1_ratio"] = fig["quantized_tpot_b1_ms"] / fig["baseline_tpot_b1_ms"]
    fig[f"decode_b{shape.batch}_ratio"] = fig[f"quantized_decode_tok_s_b{shape.batch}"] / \
        fig[f"baseline_decode_tok_s_b{shape.batch}"]
    fig["kv_capacity_ratio"] = fig["quantized_kv_capacity_tokens"] / fig["baseline_kv_capacity_tokens"]
    fig["weight_bytes_ratio"] = fig["quantized_weight_bytes"] / fig["baseline_weight_bytes"]
    if offline:
        fig["offline_ratio"] = fig["quantized_offline_tok_s"] / fig["baseline_offline_tok_s"]
    fig.update(log.figures())
    return fig


def _tpot(llm: Any, requests: list[BenchRequest]) -> float:
    return run_tandem(llm, requests, show_progress=False).time_per_decode_token_s


def _decode_tok_s(llm: Any, requests: list[BenchRequest]) -> float:
    """Output tokens per second of the decode phase (every request decoding together)."""
    run = run_tandem(llm, requests, show_progress=False)
    return len(requests) * run.decode_tokens / run.decode_s if run.decode_s else float("nan")


def _tok_s(llm: Any, requests: list[BenchRequest]) -> float:
    return run_tandem(llm, requests, show_progress=False).tokens_per_s


def table_rows(fig: Figures) -> list[tuple[str, Any, str]]:
    """Both engines' figures and the ratios, as (name, value, unit)."""
    units = {"_ms": "ms", "_tok_s": "tok/s", "_tokens": "tokens", "_bytes": "B"}
    names = [name for name in fig if name.startswith(("baseline_", "quantized_")) or name.endswith("_ratio")]
    return [("quantization", fig["quantization"], ""), ("kv_cache_dtype", fig["kv_cache_dtype"], ""),
            *((name, fig[name], "" if name.endswith("_ratio") else
               next((u for suffix, u in units.items() if suffix in name), ""))
              for name in names)]
