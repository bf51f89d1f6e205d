"""A served group's engine thread: its CPU a streamed token at a device's step time, the
device's wait slept or spun.

`python -m tandem.bench.step_wait [--simulated-step-ms 5.9,0.01] [--num-requests 512]
[--concurrency 128] [--output-len 256] [--chunks-per-s 2000] [--num-scheduler-steps 1] [--repeats 3]
[--output-json FILE]`

The work of a group's engine thread on the served path, in this one process and nothing
else: the engine on the simulated device (`simulated_step_ms`), every request streamed
(delta outputs, paced as one ingress channel of `--chunks-per-s` paces its streams), each
step's outputs made into GroupDeltas and encoded as one DeltaBatch, as
`GroupServer._take_step` sends them. Two ways to wait for the device alternate, run after
run: `sleep`, the simulated device's own (the served group's thread sleeps so), and `spin`,
the thread holding its core until the step would end, as a host thread in a spinning GPU
synchronize does (the spin's own time is measured and left out).

`{sleep,spin}_host_us_per_token`: the process's CPU (user + system) a streamed output token,
the wait left out; `sleep_over_spin` their ratio; medians of `--repeats` pairs. Set against
`server_cpu_us_per_token_GroupServer` of `tandem bench serve` at the same step time, it says
how much of the served group's CPU is the engine's own work; run at several step times, how
that work's cost depends on the time between steps (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tandem.bench.report import log_progress
from tandem.bench.serve import SERVE_FULL
from tandem.bench.workload import BenchRequest, WorkloadSpec, make_workload
from tandem.workers.core.output_pace import OutputPace
from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tandem.workers.serving.messages import DeltaBatch, GroupDelta, encode_batch

WAITS = ("sleep", "spin")


class SpinWait:
    """A wait that holds the core until its end; `spun_s` sums the time it held it."""

    def __init__(self) -> None:
        self.spun_s = 0.0

    def __call__(self, seconds: float) -> None:
        start = time.perf_counter()
        end = start + seconds
        while time.perf_counter() < end:
            pass
        self.spun_s += time.perf_counter() - start


def stream_all(engine: Any, requests: list[BenchRequest], concurrency: int, pace: OutputPace) -> int:
    """Stream every request through `engine` with `concurrency` in flight, each step's outputs
    encoded as a channel's DeltaBatch; returns the output tokens streamed."""
    pending = deque(enumerate(requests))
    in_flight: set[str] = set()
    num_tokens = 0
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i, req = pending.popleft()
            request_id = f"step-wait-{len(requests)}-{i}"
            engine.add_request(request_id, {"prompt_token_ids": req.prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True,
                                              output_kind="delta"), pace)
            in_flight.add(request_id)
        deltas = []
        for out in engine.step():
            deltas.append(GroupDelta.from_output(out, "group"))
            num_tokens += sum(len(o.token_ids) for o in out.outputs)
            if out.finished:
                in_flight.discard(out.request_id)
        if deltas:
            encode_batch(DeltaBatch(deltas))
    return num_tokens


def measure(llm: LLM, requests: list[BenchRequest], concurrency: int, chunks_per_s: float,
            wait: str) -> dict[str, float]:
    """One run with the device's wait slept or spun: the thread's CPU a token, the wait left out."""
    executor = llm.engine.executor
    spin = SpinWait()
    sleep: Callable[[float], None] = executor.wait
    executor.wait = spin if wait == "spin" else sleep
    llm.engine.pool.reset_prefix_cache()  # every run computes every prompt
    pace = OutputPace(concurrency / chunks_per_s if chunks_per_s > 0 else 0.0)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        num_tokens = stream_all(llm.engine, requests, concurrency, pace)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        executor.wait = sleep
    return {"host_us_per_token": 1e6 * (cpu - spin.spun_s) / num_tokens, "output_tok_s": num_tokens / wall,
            "spun_s": spin.spun_s}


def run(model: str | None, step_ms: tuple[float, float], num_requests: int, concurrency: int, output_len: int,
        chunks_per_s: float, repeats: int, seed: int = 0, show_progress: bool = True,
        num_scheduler_steps: int = 1) -> dict[str, Any]:
    from tandem.workers.model.demo_model import bench_model_path

    llm = LLM(model=model or bench_model_path(), simulated_step_ms=step_ms, num_scheduler_steps=num_scheduler_steps)
    try:
        # `bench serve`'s request shape: prompts of 32-256 tokens, every output `output_len` long.
        spec = WorkloadSpec(num_requests, SERVE_FULL.prompt_len, (output_len, output_len), seed)
        requests = make_workload(spec, llm.engine.hf_config.vocab_size)
        stream_all(llm.engine, [BenchRequest(r.prompt_token_ids, 8) for r in requests[:4]], 4, OutputPace())  # warm-up
        runs: dict[str, list[dict[str, float]]] = {wait: [] for wait in WAITS}
        for i in range(repeats):
            for wait in WAITS:  # interleaved: a drift of the machine reaches both alike
                log_progress("step_wait", show_progress, f"repeat {i + 1}/{repeats}, {wait}")
                runs[wait].append(measure(llm, requests, concurrency, chunks_per_s, wait))
    finally:
        llm.shutdown()
    figures: dict[str, Any] = {"simulated_step_ms": ",".join(map(str, step_ms)), "num_requests": num_requests,
                               "concurrency": concurrency, "output_len": output_len, "chunks_per_s": chunks_per_s,
                               "num_scheduler_steps": num_scheduler_steps, "repeats": repeats}
    for wait in WAITS:
        figures[f"{wait}_host_us_per_token"] = statistics.median(r["host_us_per_token"] for r in runs[wait])
        figures[f"{wait}_output_tok_s"] = statistics.median(r["output_tok_s"] for r in runs[wait])
    figures["sleep_over_spin"] = statistics.median(
        s["host_us_per_token"] / p["host_us_per_token"] for s, p in zip(runs["sleep"], runs["spin"]))
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bench model)")
    parser.add_argument("--simulated-step-ms", default="5.9,0.01", help="BASE,PER_SEQ (the device's step)")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--chunks-per-s", type=float, default=2000.0,
                        help="the channel's message budget its streams share (the ingress's default)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="passes a step may run (multi-step decoding, bounded by the streams' pace)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    base, per_seq = (float(x) for x in args.simulated_step_ms.split(","))
    figures = run(args.model, (base, per_seq), args.num_requests, args.concurrency, args.output_len,
                  args.chunks_per_s, args.repeats, num_scheduler_steps=args.num_scheduler_steps)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
