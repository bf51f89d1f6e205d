"""The host's share of a decode step: the engine's step with the model's work taken away.

`python -m tandem.bench.host_step MODEL_DIR [--batches 1,32,128,256] [--device cpu]`

The model's forward returns a zero hidden state and its logits make one plain text token
the greedy choice (a short row: no vocabulary-wide argmax), so what is left of a step is
what the host does for it: scheduling, the scheduler's diff, the runner's input building
and its one copy, sampling's bookkeeping, the scheduler's update and the outputs. With
steps overlapped (as on CUDA), a device step can hide at most its own duration of this:
host ms per step is the floor of the step time, and `1000 * batch / host ms` the most
output tokens a second the engine can give at that batch, whatever the device. Medians
over the decode steps of one `LLM.generate` per batch (prompts of 256 tokens, 129 output
tokens each), best of `--repeats`; beside the median, the mean (which counts the garbage
collector's pauses) and the pauses' share of it. With
`--num-scheduler-steps K` (multi-step decoding) a step runs K forward passes, and the figure
is per pass: the host's work per token of every request. With `--temperature T` every request
samples instead of decoding greedily (unseeded; `--seeded`: each request seeded by its index,
which costs every seeded row its own generator and noise draw a step).

The engine is set up as on CUDA on every device (the Triton backend's kernel tables, decode
steps padded to graph buckets in the graph buffer, steps scheduled ahead of their tokens), so
on CPU the host work measured is the work a CUDA step costs, on this machine's cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.bench.gc_pauses import GcPauses
from tandem.workers import LLM, SamplingParams
from tandem.workers.config import CacheConfig
from tandem.workers.kernels import gpu_kernels
from tandem.workers.runner.model_runner import ModelRunner


def null_model(llm: LLM) -> int:
    """Replace the model's work with zeros of the right shapes (in place, on this process's runner);
    returns the token every greedy row then picks."""
    runner = llm.engine.executor.runner
    model = runner.model
    hidden = torch.zeros(runner.config.scheduler.max_num_batched_tokens + 1024, runner.hf_config.hidden_size,
                         dtype=runner.dtype, device=runner.device)
    # Logits up to one plain text token, which is their largest: greedy picks it at once, so
    # sampling costs only its host part (on CPU an argmax over the whole vocabulary is the
    # device's work done by the host). A text token, not a special one (token 0 is often BOS):
    # a skipped special token adds no text, so streaming's detokenizer window would grow by it
    # every step, a cost no real output has.
    token = llm.tokenizer.encode(" the", add_special_tokens=False)[-1]
    logits = torch.zeros(hidden.shape[0], token + 1, dtype=runner.dtype, device=runner.device)
    logits[:, token] = 1.0
    model.forward = lambda input_ids, positions, meta, hidden_in=None: hidden[:positions.shape[0]]
    model.compute_logits = lambda h: logits[:h.shape[0]]
    if runner.device.type == "cpu":
        # The step's own Triton launches (the pending-token copy) would run through the
        # interpreter, milliseconds of device work in Python; torch's index ops stand in, a
        # few microseconds of host time as a CUDA launch is.
        gpu_kernels.configure(False, runner.device)
    return token


@dataclass(frozen=True)
class HostStep:
    """One batch's host time per decode token of every request, from the repeat with the lowest
    median: `median_s`; `mean_s` counts the collector's pauses, which a median steps over;
    `gc_s` the collections' time over the run's forward passes; `oldest_collections` in the run."""

    median_s: float
    mean_s: float
    gc_s: float
    oldest_collections: int


def measure(llm: LLM, batch: int, repeats: int, output_kind: str, prompt_len: int = 256,
            max_tokens: int = 129, temperature: float = 0.0, seeded: bool = False) -> HostStep:
    """Host seconds per decode token of every request at this batch (best of `repeats` runs):
    a step's time over its forward passes (several with multi-step decoding)."""
    engine = llm.engine
    times: list[float] = []
    passes: list[int] = []
    step = engine.step
    schedule = engine.scheduler.schedule

    def timed() -> Any:
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
        return out

    def scheduled(*args: Any) -> Any:
        out = schedule(*args)
        if out.num_scheduled_tokens:
            passes.append(out.num_steps)
        return out

    engine.step = timed
    engine.scheduler.schedule = scheduled
    prompts = [{"prompt_token_ids": list(range(10 + i % 7, 10 + prompt_len))} for i in range(batch)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if seeded else None,
                             ignore_eos=True, output_kind=output_kind) for i in range(batch)]
    best: HostStep | None = None
    try:
        for _ in range(repeats):
            times.clear()
            passes.clear()
            with GcPauses() as pauses:
                if output_kind == "final":
                    llm.generate(prompts, params, use_tqdm=False)
                else:
                    _run_streaming(llm, prompts, params)
            # Every call launches one step (the first the prefill, left out with the one after).
            per_pass = [t / n for t, n in zip(times[2:], passes[2:])]
            run = HostStep(statistics.median(per_pass), statistics.fmean(per_pass),
                           pauses.total_s / sum(passes), pauses.oldest_collections)
            if best is None or run.median_s < best.median_s:
                best = run
    finally:
        engine.step = step
        engine.scheduler.schedule = schedule
    assert best is not None
    return best


def _run_streaming(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> None:
    """As a server drives the engine: every step's outputs made (text included)."""
    engine = llm.engine
    for i, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"host-step-{i}", prompt, request_params)
    while engine.has_unfinished_requests():
        engine.step()


def _cuda_like_llm(model: str, device: str, max_num_seqs: int, num_scheduler_steps: int = 1,
                   max_context: int | None = None) -> LLM:
    """An engine that takes CUDA's host path on any device: the Triton backend's tables,
    decode steps padded to graph buckets and the start-up heap frozen, but nothing captured,
    so the null model's forward is what runs (on CUDA a captured graph would replay the real
    one). On CPU the cache holds `max_num_seqs` requests of `max_context` tokens at once, as
    half a GPU does: CPU's default 256 MiB would preempt, and a step would then hold fewer
    requests than the batch it is reported under."""
    options = dict(device=device, max_num_seqs=max_num_seqs, overlap_steps=True, attention_backend="triton",
                   gpu_memory_utilization=0.5, num_scheduler_steps=num_scheduler_steps, freeze_startup_heap=True)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # its kernels never run: it only passes the backend's check
        if max_context is not None:
            # A block more a request: lookahead slots and the block a step's new token may open.
            options["num_kv_blocks"] = max_num_seqs * (-(-max_context // CacheConfig.block_size) + 1)
    graph_mode = ModelRunner._graph_mode
    ModelRunner._graph_mode = lambda self: "eager"
    try:
        return LLM(model=model, **options)
    finally:
        ModelRunner._graph_mode = graph_mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-kind", default="final", choices=("final", "delta"),
                        help="final: LLM.generate (outputs when done); delta: a server's streaming outputs")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=129)
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="multi-step decoding: forward passes per step (the host time is per pass)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request samples at this temperature (default 0: greedy)")
    parser.add_argument("--seeded", action="store_true", help="with --temperature: request i has seed i")
    parser.add_argument("--thaw-startup-heap", action="store_true",
                        help="A/B: the collector walks the engine's start-up heap again (workers/startup_heap.py)")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = _cuda_like_llm(args.model, args.device, max(batches), args.num_scheduler_steps,
                         args.prompt_len + args.max_tokens)
    null_model(llm)
    if args.thaw_startup_heap:
        gc.unfreeze()
    results = []
    for batch in batches:
        host = measure(llm, batch, args.repeats, args.output_kind, args.prompt_len, args.max_tokens,
                       args.temperature, args.seeded)
        seconds = host.median_s
        results.append({"batch": batch, "host_ms_per_step": round(seconds * 1e3, 4),
                        "host_us_per_request": round(seconds * 1e6 / batch, 2),
                        "max_tok_s": round(batch / seconds),
                        "host_ms_per_step_mean": round(host.mean_s * 1e3, 4),
                        "gc_ms_per_step": round(host.gc_s * 1e3, 4), "gc_oldest_collections": host.oldest_collections})
        print(f"batch {batch:4d}: {seconds * 1e3:7.3f} ms/step on the host, {seconds * 1e6 / batch:6.2f} us a request, "
              f"at most {batch / seconds:9,.0f} tok/s; mean {host.mean_s * 1e3:.3f} ms/step with "
              f"{host.gc_s * 1e3:.3f} ms of collections ({host.oldest_collections} of the oldest generation)",
              flush=True)
    llm.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": args.device, "output_kind": args.output_kind,
                       "num_scheduler_steps": args.num_scheduler_steps, "temperature": args.temperature,
                       "seeded": args.seeded, "startup_heap_frozen": not args.thaw_startup_heap,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
