"""`tandem bench spec`: what speculative decoding buys per token, and what it costs at saturation.

- tpot_speedup: batch-1 time per output token without speculation divided by with it, runs
  interleaved (plain, draft, n-gram, the order rotating per prompt), median of repeats. TPOT
  excludes the prefill: (t_last - t_first) / (n - 1). The proposer is a draft model that
  agrees with its target (`spec_model_paths`: the bench model with layers 2-8 muted, and a
  draft made of its layer 1 and LM head); with `--model` and no `--draft-model`, n-gram.
- acceptance_rate: accepted / drafted tokens in those batch-1 runs.
- saturation_throughput_ratio: output tokens/s of a batch larger than `disable_batch_size`,
  speculation on vs off, same pair (the policy stops drafting there, so ~1.0). The timed runs
  find their prompts in the prefix cache (a warm-up left them there), so decode dominates.
- ngram_*: the n-gram proposer on the same copy-heavy prompts (a random-weight target never
  continues its prompt's n-grams, so it drafts ~nothing: a check that a proposer with no
  guesses costs nothing).

Cost model, at full acceptance and batch 1, per verify step of k drafts:

    speedup = (k + 1) / (v + k * d)

d = draft step / target step. Decoding at batch 1 reads every weight once, so by bytes a draft
step reads its own layers plus the whole LM head (vocab x hidden) against the target's
weights: d ~= 0.41 for the built-in pair. v = target step over k + 1 tokens / target step over
1 token: ~1 while a step is memory-bound, more where small-row GEMMs run below peak (CPUs).
The default k is where the bound clears 2x with d and v as measured (bench/RESULTS.md).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any

from tqdm.auto import tqdm

DEFAULT_K = 12  # see the cost model above


def _copy_heavy_prompts(num: int, passage_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(passage_len)] * 3 for _ in range(num)]


def _tpot(llm: Any, prompt: list[int], max_tokens: int) -> float:
    """Seconds per output token after the first, for one request alone."""
    from tandem.workers.core.request import SamplingParams

    engine = llm.engine
    engine.add_request("tpot", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    first = last = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if outs:
            now = time.perf_counter()
            produced = len(outs[0].outputs[0].token_ids)
            first = first if first is not None else (now, produced)
            last = (now, produced)
    return (last[0] - first[0]) / max(1, last[1] - first[1])


def _throughput(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from tandem.workers.core.request import SamplingParams

    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def _interleaved_tpot(engines: dict[str, Any], prompts: list[list[int]], max_tokens: int,
                      bar: Any) -> dict[str, float]:
    """Median TPOT per engine; each prompt runs on every engine, the order rotating per prompt."""
    names = list(engines)
    for name in names:  # warm-up
        _tpot(engines[name], prompts[0], 4)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(_tpot(engines[name], prompt, max_tokens))
        bar.update(1)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_spec_bench(model: str | None, quick: bool, k: int = DEFAULT_K, repeats: int | None = None,
                   progress: bool = True, draft: str | None = None, idle_wait_s: float = 0.0,
                   draft_dtype: str = "auto") -> dict[str, Any]:
    from tandem.bench.hardware import wait_for_idle
    from tandem.workers.llm import LLM
    from tandem.workers.model.demo_model import spec_model_paths

    if model is None:
        model, draft = spec_model_paths()
    repeats = repeats or (5 if quick else 9)
    sat_repeats = 3 if quick else 5
    max_tokens = 64 if quick else 96
    engines = {"plain": LLM(model), "ngram": LLM(model, speculative_model="ngram", num_speculative_tokens=k)}
    if draft is not None:
        engines["draft"] = LLM(model, speculative_model=draft, num_speculative_tokens=k,
                               speculative_draft_dtype=draft_dtype)
    primary = "draft" if draft is not None else "ngram"
    vocab = engines["plain"].engine.hf_config.vocab_size
    prompts = _copy_heavy_prompts(repeats, 48 if quick else 128, vocab, seed=0)
    batch = _copy_heavy_prompts(24 if quick else 48, 32, vocab, seed=1)
    assert len(batch) > engines[primary].config.speculative.disable_batch_size, "saturation batch would draft"
    waited = wait_for_idle(idle_wait_s) if idle_wait_s > 0 else 0.0
    load_start = os.getloadavg()[0]
    bar = tqdm(total=repeats + sat_repeats, desc="bench spec", disable=not progress)
    tpot = _interleaved_tpot(engines, prompts, max_tokens, bar)
    stats = {name: engines[name].engine.stats() for name in engines if name != "plain"}
    sat: dict[str, list[float]] = {"plain": [], primary: []}
    for name in sat:  # warm-up: first big batch allocates, and leaves the prompts in the prefix cache
        _throughput(engines[name], batch, 2)
    for r in range(sat_repeats):  # interleaved, order alternating
        for name in (["plain", primary] if r % 2 == 0 else [primary, "plain"]):
            sat[name].append(_throughput(engines[name], batch, max_tokens // 2))
        bar.update(1)
    bar.close()
    for llm in engines.values():
        llm.shutdown()
    sat_plain, sat_spec = statistics.median(sat["plain"]), statistics.median(sat[primary])
    return {
        "benchmark": "spec",
        "model": model,
        "draft_model": draft or "",
        "quick": quick,
        "num_speculative_tokens": k,
        "draft_dtype": draft_dtype,
        "proposer": primary,
        "repeats": repeats,
        "max_tokens": max_tokens,
        "tpot_plain_ms": tpot["plain"] * 1e3,
        "tpot_spec_ms": tpot[primary] * 1e3,
        "tpot_speedup": tpot["plain"] / tpot[primary],
        "acceptance_rate": float(stats[primary]["spec_acceptance_rate"]),
        "mean_accepted_length": float(stats[primary]["spec_mean_accepted_length"]),
        "ngram_tpot_ms": tpot["ngram"] * 1e3,
        "ngram_tpot_speedup": tpot["plain"] / tpot["ngram"],
        "ngram_acceptance_rate": float(stats["ngram"]["spec_acceptance_rate"]),
        "ngram_num_draft_tokens": stats["ngram"]["spec_num_draft_tokens"],
        "saturation_batch": len(batch),
        "saturation_tok_s_plain": sat_plain,
        "saturation_tok_s_spec": sat_spec,
        "saturation_throughput_ratio": sat_spec / sat_plain,
        "idle_waited_s": waited,
        "load_average_1m_start": load_start,
        "load_average_1m_end": os.getloadavg()[0],
    }


_UNITS = {"tpot_plain_ms": "ms", "tpot_spec_ms": "ms", "ngram_tpot_ms": "ms", "saturation_tok_s_plain": "tok/s",
          "saturation_tok_s_spec": "tok/s", "idle_waited_s": "s"}


def table_rows(figures: dict[str, Any]) -> list[tuple[str, Any, str]]:
    return [(name, value, _UNITS.get(name, "")) for name, value in figures.items()]
