"""`tandem bench spec`: what speculative decoding buys per token, and what it costs at saturation.

- tpot_speedup: batch-1 time per output token without speculation divided by with it
  (n-gram proposer, copy-heavy prompts: each prompt is a random passage repeated), runs
  interleaved, median of repeats. TPOT excludes the prefill: (t_last - t_first) / (n - 1).
- saturation_throughput_ratio: output tokens/s of a batch large enough to be
  compute-bound, speculation on vs off (the switch-off should make this ~1.0).
- acceptance_rate: accepted / drafted tokens in the batch-1 runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm


def _copy_heavy_prompts(num: int, passage_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(passage_len)] * 3 for _ in range(num)]


def _tpot(llm: Any, prompt: list[int], max_tokens: int) -> float:
    """Seconds per output token after the first, for one request alone."""
    from tandem.workers.request import SamplingParams

    engine = llm.engine
    engine.add_request("tpot", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    first = last = None
    produced = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if outs:
            now = time.perf_counter()
            produced = len(outs[0].outputs[0].token_ids)
            first = first if first is not None else (now, produced)
            last = (now, produced)
    return (last[0] - first[0]) / max(1, last[1] - first[1])


def _throughput(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from tandem.workers.request import SamplingParams

    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def run_spec_bench(model: str | None, quick: bool, k: int = 4, repeats: int | None = None,
                   progress: bool = True) -> dict[str, Any]:
    from tandem.workers.demo_model import bench_model_path
    from tandem.workers.llm import LLM

    model_dir = model or bench_model_path()
    repeats = repeats or (3 if quick else 5)
    max_tokens = 32 if quick else 96
    base = LLM(model_dir)
    spec = LLM(model_dir, speculative_model="ngram", num_speculative_tokens=k)
    vocab = base.engine.hf_config.vocab_size
    prompts = _copy_heavy_prompts(repeats, 48 if quick else 128, vocab, seed=0)
    plain_tpot: list[float] = []
    spec_tpot: list[float] = []
    _tpot(base, prompts[0], 4), _tpot(spec, prompts[0], 4)  # warm-up
    bar = tqdm(total=2 * repeats + 2, desc="bench spec", disable=not progress)
    for prompt in prompts:  # interleaved: each prompt runs plain then speculative
        plain_tpot.append(_tpot(base, prompt, max_tokens))
        spec_tpot.append(_tpot(spec, prompt, max_tokens))
        bar.update(2)
    stats = spec.engine.stats()
    batch = _copy_heavy_prompts(24 if quick else 48, 32, vocab, seed=1)
    sat_plain = _throughput(base, batch, max_tokens // 2)
    sat_spec = _throughput(spec, batch, max_tokens // 2)
    bar.update(2)
    bar.close()
    base.shutdown()
    spec.shutdown()
    tpot_plain, tpot_spec = statistics.median(plain_tpot), statistics.median(spec_tpot)
    return {
        "benchmark": "spec",
        "model": model_dir,
        "quick": quick,
        "num_speculative_tokens": k,
        "proposer": "ngram",
        "repeats": repeats,
        "tpot_plain_ms": tpot_plain * 1e3,
        "tpot_spec_ms": tpot_spec * 1e3,
        "tpot_speedup": tpot_plain / tpot_spec,
        "acceptance_rate": stats["spec_acceptance_rate"],
        "mean_accepted_length": stats["spec_mean_accepted_length"],
        "saturation_batch": len(batch),
        "saturation_tok_s_plain": sat_plain,
        "saturation_tok_s_spec": sat_spec,
        "saturation_throughput_ratio": sat_spec / sat_plain,
    }


def register_spec(bench_subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = bench_subparsers.add_parser("spec", help="speculative decoding: per-token speedup, cost at saturation")
    p.add_argument("--model", default=None, help="model directory (default: built-in benchmark model)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--output-json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="(no plot for this benchmark yet)")
    p.set_defaults(func=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    from tandem.bench import report

    figures = run_spec_bench(args.model, args.quick, args.num_speculative_tokens, args.repeats)
    units = {"tpot_plain_ms": "ms", "tpot_spec_ms": "ms", "saturation_tok_s_plain": "tok/s",
             "saturation_tok_s_spec": "tok/s"}
    report.print_table("tandem bench spec", [(k, v, units.get(k, "")) for k, v in figures.items()])
    if args.output_json:
        report.write_json(args.output_json, figures)
        print(f"wrote {args.output_json}")
    return 0
