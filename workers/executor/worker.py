"""Worker: one (pipeline rank, tensor rank) of a replica group, run as a Ray actor.

A worker loads only its shard (its stage's layers, its TP slice of each), sizes and
owns the KV tensors of those layers, and executes steps. Each step message reaches
every worker; a stage splits the step's requests into up to `pp` micro-batches so that
the stages work as a pipeline within the step:

    stage 0:  mb0 ──send──> mb1 ──send──> mb2
    stage 1:        recv mb0 ──────> recv mb1 ──────> recv mb2
                    (stage 1 runs mb i while stage 0 runs mb i+1)

Hidden states go stage to stage by torch.distributed point-to-point (each TP rank to
its peer on the next stage), never through the object store. Only TP rank 0 of the last
stage returns the step's RunnerOutput; the others return None.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import torch

from tandem.cluster.net import free_port
from tandem.workers.config import EngineConfig
from tandem.workers.core.scheduler_output import Park, RunnerOutput, SchedulerOutput
from tandem.workers.distributed.parallel import ParallelContext, init_groups
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.runner.kv_cache import ExportedKV
from tandem.workers.runner.model_runner import ModelRunner
from tandem.workers.startup_heap import StartupHeap

# Beyond this a step's activations go through gloo: the ring holds 2 x chunks slots per
# rank in /dev/shm, which containers often keep small.
MAX_SHM_SLOT_BYTES = 32 << 20


def shm_slot_bytes(config: EngineConfig, hf_config: HFModelConfig) -> int:
    """A shared-memory slot's size: the largest activation a step all-reduces (float32, the
    widest dtype used), capped; 0 when shared-memory collectives are off."""
    if not config.parallel.shm_collectives:
        return 0
    return min(config.scheduler.max_num_batched_tokens * hf_config.hidden_size * 4, MAX_SHM_SLOT_BYTES)


class Worker:
    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, model_dir: str, rank: int,
                 workers_on_node: int) -> None:
        from tandem.workers.executor.abstract import pick_device

        self.config = config
        self.hf_config = hf_config
        self.model_dir = model_dir
        self.rank = rank
        self.device = pick_device(config.model.device)
        if self.device.type == "cpu":
            # The node's cores, shared evenly by this group's workers on it: more threads
            # than that and the workers fight over cores (and every collective waits on the slowest).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers_on_node))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.ctx: ParallelContext | None = None
        self.runner: ModelRunner | None = None
        self.startup_heap: StartupHeap | None = None
        self._unparked = threading.Event()  # set by `unpark` (the actor's thread, beside the graph's)

    # ---- set-up (called once each, in this order, by RayExecutor) ---------------------------------
    def describe(self) -> dict[str, Any]:
        """Where this worker runs and (once loaded) what it holds; for set-up, tests and logs."""
        import ray

        info: dict[str, Any] = {
            "rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "device": str(self.device),
            "num_threads": torch.get_num_threads(), "gpu_ids": ray.get_gpu_ids(),
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "startup_heap_frozen": self.startup_heap is not None, "gc_frozen_objects": gc.get_freeze_count()}
        if self.ctx is not None and self.ctx.tp_size > 1:  # which transport the TP collectives take
            info["tp_comm"] = "nccl" if self.device.type == "cuda" else "shm" if self.ctx.shm else "gloo"
        if self.runner is not None and self.runner.model is not None:
            model = self.runner.model
            info.update(layers=(model.start_layer, model.end_layer), num_kv_blocks=self.runner.num_blocks,
                        num_kv_heads=model.attention_layers[0].num_kv_heads if model.layers else 0,
                        num_params=sum(p.numel() for p in model.parameters()))
        return info

    def free_port(self) -> int:
        """A port free on this node right now, for the group's rendezvous (rank 0 only)."""
        return free_port("")

    def init_distributed(self, init_method: str) -> None:
        par = self.config.parallel
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        overlap = par.overlap_comm if par.overlap_comm is not None else self.device.type == "cuda"
        self.ctx = init_groups(self.rank, par.tensor_parallel_size, par.pipeline_parallel_size, backend,
                               init_method, shm_slot_bytes=shm_slot_bytes(self.config, self.hf_config),
                               num_overlap_chunks=par.num_overlap_chunks if overlap else 1,
                               layer_partition=par.pipeline_layer_partition)

    def load_model(self) -> int:
        """Load this shard; returns how many KV blocks fit beside it on this worker."""
        self.runner = ModelRunner(self.config, self.hf_config, self.model_dir, self.ctx, self.device)
        self.runner.load_model(show_progress=False)
        return self.runner.num_blocks_fit()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)
        if self.config.model.freezes_startup_heap(self.device.type):
            # The last set-up step: what start-up left stays out of the collector's walks for
            # the worker's life (its process ends with the group, so nothing thaws it).
            self.startup_heap = StartupHeap()

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def init_host_cache(self, num_slots: int) -> None:
        self.runner.init_host_cache(num_slots)

    def export_blocks(self, block_ids: list[int]) -> ExportedKV:
        return self.runner.export_blocks(block_ids)

    def import_host_blocks(self, slots: list[int], blocks: ExportedKV) -> None:
        self.runner.import_host_blocks(slots, blocks)

    # ---- steps -----------------------------------------------------------------------------------
    def execute_step(self, step: SchedulerOutput | Park) -> RunnerOutput | None:
        if isinstance(step, Park):  # the group is idle: wait here, not in the graph's polling read
            self._unparked.wait()
            self._unparked.clear()
            return None
        runner, ctx = self.runner, self.ctx
        runner.update_states(step)
        is_output_rank = ctx.is_last_stage and ctx.tp_rank == 0
        if step.is_empty:  # only finished ids: nothing to run or send
            return RunnerOutput([], [], []) if is_output_rank else None
        # One step at a time: a micro-batch a stage, so the stages pipeline within the step.
        # With steps in flight together the stages are busy across steps already.
        batches = split_micro_batches(step, max(1, ctx.pp_size // self.config.parallel.inflight_batches))
        recvs: list[tuple[Any, torch.Tensor]] = []
        if not ctx.is_first_stage:  # post every receive now; they complete in the background
            for i, mb in enumerate(batches):
                buf = torch.empty(mb.total_num_scheduled_tokens, self.hf_config.hidden_size,
                                  dtype=runner.dtype, device=self.device)
                recvs.append((ctx.recv_prev(buf, tag=i), buf))
        sends: list[tuple[Any, torch.Tensor]] = []
        results: list[RunnerOutput] = []
        for i, mb in enumerate(batches):
            hidden = None
            if recvs:
                handle, hidden = recvs[i]
                handle.wait()
            out = runner.execute_batch(mb, hidden)
            if not ctx.is_last_stage:
                sends.append((ctx.send_next(out, tag=i), out))  # keep `out` alive until sent
            elif out is not None:
                results.append(out)
        for handle, _ in sends:
            handle.wait()
        return merge_outputs(results) if is_output_rank else None

    def unpark(self) -> None:
        """End a `Park` (an actor call, which runs beside the compiled graph's loop); one that
        comes before its park reaches the loop ends that park at once."""
        self._unparked.set()


def split_micro_batches(step: SchedulerOutput, num: int) -> list[SchedulerOutput]:
    """Split a step's requests into up to `num` contiguous micro-batches of similar token counts.

    Deterministic, so every worker derives the same split from the same message. Worker-side
    request state must already be updated (the micro-batches carry no finished ids).
    """
    req_ids = list(step.num_scheduled_tokens)
    num = min(num, len(req_ids))
    if num <= 1:
        return [step]
    total = step.total_num_scheduled_tokens
    groups: list[list[str]] = [[] for _ in range(num)]
    seen = 0
    for req_id in req_ids:
        n = step.num_scheduled_tokens[req_id]
        # A request goes to the micro-batch its token midpoint falls in.
        groups[min(num - 1, (2 * seen + n) * num // (2 * total))].append(req_id)
        seen += n
    batches = []
    for group in groups:
        if not group:
            continue
        ids = set(group)
        batches.append(SchedulerOutput(
            step_id=step.step_id,
            new_requests=[r for r in step.new_requests if r.req_id in ids],
            cached_requests=[r for r in step.cached_requests if r.req_id in ids],
            num_scheduled_tokens={r: step.num_scheduled_tokens[r] for r in group},
            spec_token_ids={r: d for r, d in step.spec_token_ids.items() if r in ids},
            token_masks={r: m for r, m in step.token_masks.items() if r in ids}))
    return batches


def merge_outputs(outputs: list[RunnerOutput]) -> RunnerOutput:
    if len(outputs) == 1:
        return outputs[0]
    merged = RunnerOutput([], [], [])
    for out in outputs:
        merged.req_ids.extend(out.req_ids)
        merged.sampled_token_ids.extend(out.sampled_token_ids)
        merged.logprobs.extend(out.logprobs)
        merged.num_draft_tokens += out.num_draft_tokens
        merged.num_accepted_draft_tokens += out.num_accepted_draft_tokens
        merged.prompt_logprobs.update(out.prompt_logprobs)
    return merged
