"""`tandem bench quality`: how far a quantized engine's next-token distributions are from the
unquantized engine's, teacher-forced over a fixed prompt set.

The same prompts go through the reference engine (the engine options as given, without
`quantization` or `kv_cache_dtype`: the checkpoint as it is) and then through the quantized
one (the same options plus those), one engine after the other, each shut down after its run.
At every prompt position past the first, each side's next-token distribution comes from
`SamplingParams.prompt_logprobs`, its top TOP_K = 20 tokens (the cap in workers/core/request.py)
plus the prompt's own next token. Figures:

- `top1_agreement`: the share of positions where both sides' most likely next token is the same;
- `mean_kl`, `max_kl`: KL(reference || quantized) in nats, over positions. Only the top-k is
  known, so each position's distributions are coarsened onto one partition of the vocabulary:
  a bin for each token whose probability both sides report (the tokens in both top-k sets, and
  the prompt's next token, which both always report), and one "rest" bin holding the remaining
  mass of each side (1 - the sum of its reported probabilities over those tokens). A token in
  one side's top-k only goes to the rest bin: the other side's probability of it is unknown. By
  the data-processing inequality the coarsened KL is a lower bound of the full KL. A side's rest
  mass below REST_FLOOR counts as REST_FLOOR (float32 logprobs sum to 1 only to about 1e-6),
  which can only lower the figure further.

The engine has no cheaper way to the full distributions: `ModelRunner.forward` gives the
logits of the rows a step samples (each sequence's last token), not every prompt position's,
and keeping two engines' full [positions, vocab] distributions side by side costs gigabytes at
a real vocabulary.

The prompts (--quick: 8 of 64 tokens; else 64 of 256) are the same on both sides and on every
run, and come from one of two sources (the figures' `prompts`):

- "held-out text", on the default model, bench/quality_model.py's small Llama trained on Python's
  own sources (or its directory given as --model): windows of its held-out files. Random ids
  are input unlike anything a trained model saw, so its activations on them are not those of a
  model in use (on this model they give about the same top-1 agreement and up to 1.6x the KL:
  bench/RESULTS.md). The figures also carry the model's held-out loss.
- "random ids", on any other model (--model, --bench-model): seeded random token ids below the
  tokenizer's vocabulary, special tokens left out. Those models have random weights and no text
  they are trained on, so no text suits them better; their distributions are nearly flat, so
  their top-1 agreement measures near-ties more than the quantization.

With `quantization` and `kv_cache_dtype` both unset ("none"), the quantized run is the reference
again: a determinism check, whose figures are exactly 1.0 and 0.0.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from tandem.bench.quality_model import quality_text_prompts, training_record
from tandem.workers.core.request import PositionLogprobs

TOP_K = 20  # SamplingParams.prompt_logprobs's cap
REST_FLOOR = 1e-6


@dataclass(frozen=True)
class QualitySet:
    """The fixed prompt set: `num_prompts` prompts of `prompt_len` tokens (the module docstring's
    held-out text or seeded random ids)."""

    num_prompts: int
    prompt_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.prompt_len < 2:
            raise ValueError(f"a quality set needs >= 1 prompt of >= 2 tokens, got {self.num_prompts} of "
                             f"{self.prompt_len}")


QUALITY_QUICK = QualitySet(num_prompts=8, prompt_len=64)
QUALITY_FULL = QualitySet(num_prompts=64, prompt_len=256)


def quality_prompts(qset: QualitySet, vocab_size: int, excluded: Sequence[int] = ()) -> list[list[int]]:
    """The set's prompts: token ids below `vocab_size`, none of `excluded` (special tokens)."""
    skip = set(excluded)
    ids = [t for t in range(vocab_size) if t not in skip]
    rng = random.Random(qset.seed)
    return [[rng.choice(ids) for _ in range(qset.prompt_len)] for _ in range(qset.num_prompts)]


def top1(entry: PositionLogprobs) -> int:
    """The most likely token of a position (the smallest id among equals)."""
    return max(entry, key=lambda t: (entry[t].logprob, -t))


def position_kl(reference: PositionLogprobs, quantized: PositionLogprobs) -> float:
    """KL(reference || quantized) in nats, coarsened to the tokens both report plus one rest bin
    (the module docstring): a lower bound of the full KL."""
    shared = sorted(reference.keys() & quantized.keys())
    kl = 0.0
    for t in shared:
        p_log = reference[t].logprob
        if p_log > -math.inf:
            kl += math.exp(p_log) * (p_log - quantized[t].logprob)
    p_rest = _rest(reference, shared)
    if p_rest > 0.0:
        kl += p_rest * (math.log(p_rest) - math.log(max(_rest(quantized, shared), REST_FLOOR)))
    return max(kl, 0.0)


def _rest(entry: PositionLogprobs, shared: list[int]) -> float:
    return min(max(1.0 - math.fsum(math.exp(entry[t].logprob) for t in shared), 0.0), 1.0)


def compare(reference: Sequence[Sequence[PositionLogprobs | None]],
            quantized: Sequence[Sequence[PositionLogprobs | None]]) -> dict[str, Any]:
    """Per prompt, its positions' logprobs on each side (None where nothing is predicted: the
    first token) -> `positions`, `top1_agreement`, `mean_kl`, `max_kl`."""
    assert len(reference) == len(quantized), (len(reference), len(quantized))
    agree, kls = 0, []
    for ref_prompt, quant_prompt in zip(reference, quantized):
        assert len(ref_prompt) == len(quant_prompt), (len(ref_prompt), len(quant_prompt))
        for ref, quant in zip(ref_prompt, quant_prompt):
            assert (ref is None) == (quant is None)
            if ref is None or quant is None:
                continue
            agree += top1(ref) == top1(quant)
            kls.append(position_kl(ref, quant))
    assert kls, "no position was scored"
    return {"positions": len(kls), "top1_agreement": agree / len(kls), "mean_kl": math.fsum(kls) / len(kls),
            "max_kl": max(kls)}


def score_prompts(model: str, options: dict[str, Any], qset: QualitySet, progress: bool
                  ) -> tuple[list[list[int]], list[list[PositionLogprobs | None]], float]:
    """One engine with `options`: the prompts, each one's position logprobs, and the seconds
    they took (loading left out). The engine is shut down before this returns."""
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM

    llm = LLM(model, **options)
    try:
        tokenizer = llm.tokenizer
        if training_record(model) is not None:
            prompts = quality_text_prompts(tokenizer, qset.num_prompts, qset.prompt_len)
        else:
            vocab = min(len(tokenizer), llm.engine.hf_config.vocab_size)
            prompts = quality_prompts(qset, vocab, tokenizer.all_special_ids)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_K, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    assert all(out.prompt_logprobs is not None for out in outputs)
    return prompts, [out.prompt_logprobs for out in outputs], seconds


def run_quality_bench(model: str, qset: QualitySet, quantization: str | None, kv_cache_dtype: str = "auto",
                      engine_options: dict[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """The reference engine, then the quantized one, over `qset`; the figures (module docstring)."""
    reference_options = {k: v for k, v in (engine_options or {}).items()
                         if k not in ("quantization", "kv_cache_dtype")}
    quantized_options = dict(reference_options)
    if quantization is not None:
        quantized_options["quantization"] = quantization
    if kv_cache_dtype != "auto":
        quantized_options["kv_cache_dtype"] = kv_cache_dtype
    bar = tqdm(total=2, desc="bench quality", unit="run", disable=not progress)
    prompts, reference, reference_s = score_prompts(model, reference_options, qset, progress)
    bar.update(1)
    quantized_prompts, quantized, quantized_s = score_prompts(model, quantized_options, qset, progress)
    bar.update(1)
    bar.close()
    assert quantized_prompts == prompts, "both runs must score the same prompts"
    record = training_record(model)
    trained = {} if record is None else {"heldout_loss": record["heldout_loss"],
                                         "unigram_heldout_loss": record["unigram_heldout_loss"]}
    return {"benchmark": "quality", "model": model, "quantization": quantization or "none",
            "kv_cache_dtype": kv_cache_dtype, "num_prompts": qset.num_prompts, "prompt_len": qset.prompt_len,
            "prompts": "random ids" if record is None else "held-out text", **trained,
            "top_k": TOP_K, **compare(reference, quantized), "reference_s": reference_s,
            "quantized_s": quantized_s, "reference_options": json.dumps(reference_options, sort_keys=True),
            "quantized_options": json.dumps(quantized_options, sort_keys=True)}


def table_rows(fig: dict[str, Any]) -> list[tuple[str, Any, str]]:
    # KLs of a good quantization are ~1e-3 nats: three significant digits, not three decimals.
    return [("quantization", fig["quantization"], ""), ("kv_cache_dtype", fig["kv_cache_dtype"], ""),
            ("prompts", fig["prompts"], ""), ("positions", fig["positions"], ""),
            ("top1_agreement", f"{fig['top1_agreement']:.4f}", ""),
            ("mean_kl", f"{fig['mean_kl']:.3g}", "nats"), ("max_kl", f"{fig['max_kl']:.3g}", "nats"),
            *([("heldout_loss", f"{fig['heldout_loss']:.3f}", "nats")] if "heldout_loss" in fig else []),
            ("reference_s", fig["reference_s"], "s"), ("quantized_s", fig["quantized_s"], "s")]
