"""`tandem bench overlap`: how much of the TP all-reduce time the micro-chunk overlap hides.

Two processes form a TP=2 group (one thread each, as RayExecutor would run them on a
2-core node), load the built-in bench model's shards, and time the model's forward pass
on one prefill step in three modes, interleaved (rotating order) and repeated:

    serial   all-reduce after each row-parallel linear, blocking (overlap_comm=False)
    overlap  the step's tokens in micro-chunks; chunk i's all-reduce runs while chunk i+1 computes
    compute  collectives skipped: the floor both of the others approach

    hidden_fraction = 1 - (T_overlap - T_compute) / (T_serial - T_compute)

The collectives go through shared memory, as a CPU group's do (workers/distributed/shm_comm.py);
`serial_gloo` and `overlap_gloo` repeat the two communicating modes over gloo's loopback
TCP, for `hidden_fraction_gloo`, `serial_step_speedup_shm_vs_gloo` and
`comm_time_removed_vs_gloo` (1 - exposed communication over shared memory / over gloo). Each trial's time is
the slower rank's (the step ends when both have finished); the reported times are medians
over the repeats. Diagnostics ride along: `t_compute_chunked_ms` (collectives skipped,
tokens chunked: what chunking itself costs) and the median CPU time per rank of each mode
(gloo's own threads count: on a machine with one core per rank, communication CPU cannot
hide behind compute, only its waiting can).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MODES = ("serial", "overlap", "compute")


def run_overlap_bench(quick: bool = False, *, num_tokens: int | None = None, num_chunks: int | None = None,
                      repeats: int | None = None, model_dir: str | None = None,
                      timeout_s: float = 900.0) -> dict[str, Any]:
    from tandem.cluster.net import free_port
    from tandem.workers.config import ParallelConfig
    from tandem.workers.model.demo_model import bench_model_path

    spec = {
        "model_dir": model_dir or bench_model_path(),
        "num_tokens": num_tokens or (256 if quick else 512),
        "num_chunks": num_chunks or ParallelConfig().num_overlap_chunks,
        "repeats": repeats or (7 if quick else 21),
        "warmup": 2,
        "init_method": f"tcp://127.0.0.1:{free_port()}",
    }
    # Plain subprocesses (not multiprocessing): nothing depends on how the caller's
    # __main__ is written, and a crashed rank cannot leave the other waiting forever.
    procs = [subprocess.Popen([sys.executable, "-m", "tandem.bench.overlap", str(rank), json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"overlap benchmark rank {rank} failed (exit {p.returncode}): {err.strip()[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _measure(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tandem.workers.config import EngineConfig
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.core.scheduler_output import NewRequestData, SchedulerOutput
    from tandem.workers.distributed.parallel import init_groups
    from tandem.workers.executor.worker import shm_slot_bytes
    from tandem.workers.model.hf_config import HFModelConfig
    from tandem.workers.runner.model_runner import ModelRunner

    torch.set_num_threads(1)  # two workers on a two-core machine: one core each
    n = spec["num_tokens"]
    block_size = 16
    num_blocks = -(-n // block_size) + 1
    config = EngineConfig.from_options(model=spec["model_dir"], tensor_parallel_size=2, num_kv_blocks=num_blocks,
                                       block_size=block_size, max_num_batched_tokens=max(2048, n))
    hf_config = HFModelConfig.from_dir(spec["model_dir"])
    ctx = init_groups(rank, 2, 1, "gloo", spec["init_method"], shm_slot_bytes=shm_slot_bytes(config, hf_config),
                      num_overlap_chunks=spec["num_chunks"])
    shm = ctx.shm
    assert shm is not None, "shared-memory collectives did not set up"
    runner = ModelRunner(config, hf_config, spec["model_dir"], ctx, torch.device("cpu"))
    runner.load_model(show_progress=False)
    runner.init_kv_cache(num_blocks)
    prompt = [(7 * i) % (hf_config.vocab_size - 10) + 5 for i in range(n)]
    new = NewRequestData("r", prompt, [], SamplingParams(), list(range(num_blocks)), 0)
    step = SchedulerOutput(0, new_requests=[new], num_scheduled_tokens={"r": n})
    runner.update_states(step)
    inputs = runner.prepare_inputs(step)

    def run(mode: str) -> tuple[float, float]:
        ctx.num_overlap_chunks = spec["num_chunks"] if mode.startswith(("overlap", "compute_chunked")) else 1
        ctx.skip_collectives = mode.startswith("compute")
        ctx.shm = None if mode.endswith("_gloo") else shm
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64)
        wall, cpu = elapsed.clone(), elapsed.clone()
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        return float(wall[0]), float(cpu[1]) / 2

    outputs = {}
    for mode in ("serial", "overlap"):  # same result either way (exactness is tested elsewhere)
        ctx.num_overlap_chunks = spec["num_chunks"] if mode == "overlap" else 1
        with torch.inference_mode():
            outputs[mode] = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
    max_diff = float((outputs["serial"] - outputs["overlap"]).abs().max())
    # For diagnosis: chunking's own cost, and both communicating modes over gloo's TCP.
    modes = MODES + ("compute_chunked", "serial_gloo", "overlap_gloo")
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(spec["warmup"] + spec["repeats"]):
        order = modes[i % len(modes):] + modes[:i % len(modes)]  # rotate so no mode always runs first
        for mode in order:
            wall, cpu_s = run(mode)
            if i >= spec["warmup"]:
                times[mode].append(wall)
                cpu[mode].append(cpu_s)
    dist.destroy_process_group()
    med = {m: statistics.median(ts) for m, ts in times.items()}

    def hidden(suffix: str) -> float | None:
        exposed_serial = med["serial" + suffix] - med["compute"]
        # None when the serial collectives cost nothing measurable (the ratio would be noise).
        if exposed_serial <= 0:
            return None
        return round(1.0 - (med["overlap" + suffix] - med["compute"]) / exposed_serial, 3)

    return {
        "hidden_fraction": hidden(""),
        "hidden_fraction_gloo": hidden("_gloo"),
        "t_serial_ms": round(med["serial"] * 1e3, 2),
        "t_overlap_ms": round(med["overlap"] * 1e3, 2),
        "t_compute_ms": round(med["compute"] * 1e3, 2),
        "num_tokens": n,
        "num_chunks": spec["num_chunks"],
        "repeats": spec["repeats"],
        "tp": 2,
        "threads_per_rank": 1,
        "max_abs_diff_serial_vs_overlap": max_diff,
        "t_compute_chunked_ms": round(med["compute_chunked"] * 1e3, 2),
        "t_serial_gloo_ms": round(med["serial_gloo"] * 1e3, 2),
        "t_overlap_gloo_ms": round(med["overlap_gloo"] * 1e3, 2),
        # What the shared-memory transport buys a TP=2 step over gloo's loopback TCP: the
        # speedup, and the share of gloo's exposed communication time that is gone.
        "serial_step_speedup_shm_vs_gloo": round(med["serial_gloo"] / med["serial"], 3),
        "comm_time_removed_vs_gloo": round(1.0 - (med["serial"] - med["compute"])
                                           / (med["serial_gloo"] - med["compute"]), 3),
        # Flat keys: --output-json writes one flat object of named figures.
        **{f"cpu_ms_per_rank_{m}": round(statistics.median(c) * 1e3, 2) for m, c in cpu.items()},
        "model": os.path.basename(spec["model_dir"].rstrip("/")),
    }


if __name__ == "__main__":  # one rank, started by run_overlap_bench
    print(json.dumps(_measure(int(sys.argv[1]), json.loads(sys.argv[2]))), flush=True)
