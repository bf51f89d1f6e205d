"""The `transformers` baselines: one request at a time, and static batches with padding.

Every call is `generate(max_new_tokens=n, min_new_tokens=n, do_sample=False)`: greedy, and
EOS is suppressed until n tokens exist, so exactly n come out (the HF way to ignore EOS).

Static batching takes the request set in order, 16 at a time, left-padded to the longest
prompt of the batch, and generates for the longest output of the batch. Only each request's
own requested output tokens count as useful output: tokens generated past a request's
length (because a batch-mate wanted more) are waste, as in any static batcher, and are
reported separately as `num_generated_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.bench.workload import BenchRequest
from tandem.workers.device_peaks import sync

STATIC_BATCH_SIZE = 16
# Runs a measurement (returning its seconds) and returns what it returned, possibly after
# redoing it (hardware.ContentionLog.run); the default runs it once.
Guard = Callable[[Callable[[], float]], float]


def _once(fn: Callable[[], float]) -> float:
    return fn()


@dataclass
class HFRun:
    elapsed_s: float
    num_output_tokens: int  # useful: what the requests asked for
    num_generated_tokens: int  # including static-batch overrun

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


@torch.inference_mode()
def _generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_new: int,
              **kwargs: Any) -> torch.Tensor:
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_new,
                         min_new_tokens=num_new, do_sample=False, pad_token_id=_pad_id(model), **kwargs)
    return out[:, input_ids.shape[1]:]


def _pad_id(model: Any) -> int:
    pad = model.generation_config.pad_token_id
    return pad if pad is not None else 0


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def _timed_generate(model: Any, prompts: list[list[int]], num_new: int, device: torch.device,
                    **kwargs: Any) -> float:
    """Seconds of one generate() of `num_new` tokens for each of `prompts` (left-padded to the longest)."""
    ids, mask = left_pad(prompts, _pad_id(model), device)

    def call() -> None:
        out = _generate(model, ids, mask, num_new, **kwargs)
        assert out.shape == (len(prompts), num_new), f"generated {tuple(out.shape)}, asked for {num_new}"

    return _timed(call, device)


def run_sequential(model: Any, requests: list[BenchRequest], device: torch.device, *, desc: str = "hf sequential",
                   show_progress: bool = True, guard: Guard = _once) -> HFRun:
    """One `generate` call per request, batch 1, no padding; elapsed = the sum of the calls' times.

    Each call is timed on its own (through `guard`), so a call disturbed by another process can
    be redone without redoing the whole run.
    """
    bar = tqdm(total=sum(r.output_len for r in requests), desc=desc, unit="tok", leave=False,
               disable=not show_progress)
    elapsed = 0.0
    for req in requests:
        elapsed += guard(partial(_timed_generate, model, [req.prompt_token_ids], req.output_len, device))
        bar.update(req.output_len)
    bar.close()
    num = sum(r.output_len for r in requests)
    return HFRun(elapsed, num, num)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, max_len] ids, [B, max_len] attention mask) with padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def run_static(model: Any, requests: list[BenchRequest], device: torch.device, *,
               batch_size: int = STATIC_BATCH_SIZE, desc: str = "hf static", show_progress: bool = True,
               guard: Guard = _once) -> HFRun:
    """Batches of `batch_size` in request order; each runs to its longest output.

    elapsed = the sum of the batches' times (each timed on its own, through `guard`).
    """
    bar = tqdm(total=sum(r.output_len for r in requests), desc=desc, unit="tok", leave=False,
               disable=not show_progress)
    generated = 0
    elapsed = 0.0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        num_new = max(r.output_len for r in batch)
        elapsed += guard(partial(_timed_generate, model, [r.prompt_token_ids for r in batch], num_new, device))
        generated += len(batch) * num_new
        bar.update(sum(r.output_len for r in batch))
    bar.close()
    return HFRun(elapsed, sum(r.output_len for r in requests), generated)


class _StepClock:
    """A logits processor that only notes the time: generate() calls it once per new token."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def time_per_output_token(model: Any, req: BenchRequest, device: torch.device) -> float:
    """Batch-1 decode seconds per token: the mean gap between consecutive tokens of one generate().

    The gaps are generate()'s decode steps (forward, logits, its own sampling and bookkeeping),
    the same span as a tandem engine step; prefill and set-up fall before the first token.
    """
    from transformers import LogitsProcessorList

    assert req.output_len >= 2, "need at least two output tokens"
    ids = torch.tensor([req.prompt_token_ids], device=device)
    clock = _StepClock(device)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.output_len,
                       min_new_tokens=req.output_len, do_sample=False, pad_token_id=_pad_id(model),
                       logits_processor=LogitsProcessorList([clock]))
    assert len(clock.times) == req.output_len, f"{len(clock.times)} steps for {req.output_len} tokens"
    return (clock.times[-1] - clock.times[0]) / (req.output_len - 1)


# ---- transformers' fast path: a static KV cache and torch.compile -------------------------------
def compiled_generate_kwargs(req: BenchRequest, device: torch.device) -> dict[str, Any]:
    """generate() arguments for transformers' own fast path: a static KV cache, its decode steps
    compiled by torch.compile (mode "reduce-overhead": CUDA graphs on a GPU), as transformers
    recommends. `max_cache_len` fixes the cache at the longest call's size, so calls of any
    length up to `req`'s reuse one cache and one compiled graph."""
    from transformers import CompileConfig

    config = CompileConfig()
    if device.type != "cuda":
        # transformers compiles on accelerators only, unless told to anywhere.
        config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config,
            "max_cache_len": len(req.prompt_token_ids) + req.output_len}


def warm_up_compiled(model: Any, req: BenchRequest, device: torch.device, calls: int = 3) -> None:
    """Compile, and capture the CUDA graphs (recorded on a later call than the first), before anything is timed."""
    kwargs = compiled_generate_kwargs(req, device)
    for _ in range(calls):
        _timed_generate(model, [req.prompt_token_ids], req.output_len, device, **kwargs)
        _timed_generate(model, [req.prompt_token_ids], 1, device, **kwargs)


def compiled_time_per_output_token(model: Any, req: BenchRequest, device: torch.device) -> float:
    """Batch-1 decode seconds per token on transformers' fast path: (T(n) - T(1)) / (n - 1), where
    T(k) is one generate() of k tokens for `req`'s prompt.

    The prefill (uncompiled) and the first token are in both calls and cancel. No per-token
    clock: a host sync per token would stop generate() from queueing a step's CUDA graph while
    the previous one runs, which is half of what this path buys."""
    assert req.output_len >= 2, "need at least two output tokens"
    kwargs = compiled_generate_kwargs(req, device)
    full = _timed_generate(model, [req.prompt_token_ids], req.output_len, device, **kwargs)
    first = _timed_generate(model, [req.prompt_token_ids], 1, device, **kwargs)
    return (full - first) / (req.output_len - 1)
