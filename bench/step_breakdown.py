"""Where a decode step's wall time goes: waiting for the device, host work on the critical
path (the collect after the wait, the launch of the next step) and host work that overlaps
the device (the emit). `python -m tandem.bench.step_breakdown MODEL_DIR [--batches 1,64]`.

Each phase of `GroupEngine.step()` is timed by wrapping it; medians over the decode steps
of one `LLM.generate` per batch size (prompt 256 tokens, 129 output tokens).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

from tandem.workers import LLM, SamplingParams
from tandem.workers.core.scheduler_output import PendingOutput


def _timed(times: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times[name].append(time.perf_counter() - start)
        return result
    return inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    llm = LLM(model=args.model, device=args.device, gpu_memory_utilization=0.6)
    engine = llm.engine
    times: dict[str, list[float]] = collections.defaultdict(list)
    result = PendingOutput.result
    PendingOutput.result = lambda self: _timed(times, "wait", result)(self)
    for phase in ("_collect", "_launch", "_emit"):
        setattr(engine, phase, _timed(times, phase[1:], getattr(engine, phase)))
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [{"prompt_token_ids": list(range(10 + i % 7, 266))} for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        times.clear()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - start
        ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        print(f"batch {batch}: {wall / 129 * 1e3:.3f} ms/step wall; medians (ms): wait {ms['wait']:.3f}, "
              f"collect after the wait {ms['collect'] - ms['wait']:.3f}, launch {ms['launch']:.3f}, "
              f"emit {ms['emit']:.3f}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
