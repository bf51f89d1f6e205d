"""DeploymentPlan: what a model needs on a cluster, worked out before anything is deployed.

`tandem plan` (cli/plan.py) prints it. It is arithmetic on the checkpoint's config with the
engine's own cost model (each rank's shard: `ModelCost.shard`) and a device's figures
(workers/device_specs.py):

    KV memory of a rank    = memory x gpu_memory_utilization - the rank's weights - RESERVE_BYTES
    KV capacity of a group = min over its stages of KV memory / the stage's KV bytes per token,
                             in whole blocks of BLOCK_SIZE tokens (every token has KV in every stage)
    fits                   = the capacity holds one sequence of max_model_len (the least the
                             engine needs to serve a request that long)

RESERVE_BYTES stands for what the engine's start-up profiling (workers/runner/gpu_memory.py)
finds on a card besides weights and KV: the CUDA context (~0.5 GiB), NCCL buffers, the peak
activations of a 2048-token prefill step and the CUDA graph pool (hundreds of MB up to 70B
shapes at TP >= 2). It is one fixed figure, not profiled, so a plan near the edge is a guess.
On a CPU the engine also keeps MKL-packed copies of float32 linear weights (cpu_packed_weights),
which this count leaves out: there the KV cache is sized by kv_cache_memory, not by this plan.

Time is a roofline per pipeline stage: a decode step of batch B at context c takes

    max(bytes read / bandwidth, FLOPs / peak FLOP/s) + the device's step_overhead_s

with the rank's bytes and FLOPs (`ModelCost.decode_step_bytes` / `decode_step_flops`, what the
engine's live MBU / MFU count). Batch-1 time per token sums the stages; with PP the batch is
split into micro-batches that keep the stages busy together. TP all-reduces and the PP
hand-off are not counted (microseconds on NVLink, not on PCIe or across nodes).

A layout is TP within a node (a power of two that divides num_attention_heads and divides or
is divided by num_key_value_heads: workers/model/layers.py replicates KV heads), and PP only
once TP is as wide as a node allows: stages of that TP across nodes, PP <= num_hidden_layers.
PP beside a narrower TP would split the same GPUs into a slower pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tandem.workers.config import CacheConfig, SchedulerConfig
from tandem.workers.device_specs import DeviceSpec
from tandem.workers.model.cost import ModelCost
from tandem.workers.model.hf_config import HFModelConfig

RESERVE_BYTES = 3 << 29  # 1.5 GiB per GPU: see the module docstring
BLOCK_SIZE = CacheConfig.block_size  # the engine's default KV block
DEFAULT_MAX_NUM_SEQS = SchedulerConfig.max_num_seqs


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: the model in the dtypes it will run in, the cluster and the workload."""

    cfg: HFModelConfig
    device: DeviceSpec
    itemsize: int  # the model's dtype
    weight_itemsize: int | None  # quantized linear weights (1); None: the model's dtype
    kv_itemsize: int | None  # an FP8 KV cache (1); None: the model's dtype
    fp8_matmuls: bool  # W8A8: the GEMMs run at the device's FP8 peak
    gpus_per_node: int
    num_nodes: int
    max_model_len: int
    context_len: int  # keys a decode step attends to, for the time and throughput figures
    concurrency: int  # sequences one replica group keeps decoding
    gpu_memory_utilization: float

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "num_nodes", "max_model_len", "context_len", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.context_len > self.max_model_len:
            raise ValueError(f"context_len {self.context_len} is longer than max_model_len {self.max_model_len}")

    def shard(self, tp: int = 1, pp_rank: int = 0, pp: int = 1) -> ModelCost:
        return ModelCost.shard(self.cfg, self.itemsize, self.weight_itemsize, self.kv_itemsize, tp, pp_rank, pp)


@dataclass(frozen=True)
class LayoutFit:
    """One TP x PP layout's figures for a request."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_nodes: int  # nodes one group spans
    weight_bytes_per_gpu: int  # the fullest rank's
    kv_bytes_per_token_per_gpu: int  # the stage with the most layers'
    kv_capacity_tokens: int  # tokens the group's KV cache holds
    num_max_len_seqs: int  # sequences of max_model_len the cache holds at once
    batch: int  # the decode batch: the concurrency, as far as the KV at context_len holds it
    tpot_s: float  # batch 1
    decode_tok_s: float  # at `batch`
    fits: bool

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def tensor_parallel_sizes(cfg: HFModelConfig, gpus_per_node: int) -> list[int]:
    """The TP sizes one node can run the model at, smallest first."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    sizes = [1 << i for i in range(gpus_per_node.bit_length()) if (1 << i) <= gpus_per_node]
    return [tp for tp in sizes if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)]


def nodes_spanned(tp: int, pp: int, gpus_per_node: int) -> int:
    return math.ceil(pp / (gpus_per_node // tp))  # a stage's TP ranks share a node


def step_seconds(cost: ModelCost, device: DeviceSpec, fp8_matmuls: bool, batch: int, context_len: int) -> float:
    """One stage's decode step on a roofline (see the module docstring)."""
    memory_s = cost.decode_step_bytes(batch, context_len) / device.bytes_per_s
    compute_s = cost.decode_step_flops(batch, context_len) / device.matmul_flops_per_s(fp8_matmuls)
    return max(memory_s, compute_s) + device.step_overhead_s


def decode_tokens_per_s(req: PlanRequest, stages: list[ModelCost], batch: int) -> float:
    """Tokens a second at `batch`: PP splits it into micro-batches of ceil(batch / pp) in flight together."""
    micro = math.ceil(batch / len(stages))
    times = [step_seconds(s, req.device, req.fp8_matmuls, micro, req.context_len) for s in stages]
    round_s = max(math.ceil(batch / micro) * max(times), sum(times))
    return batch / round_s


def evaluate(req: PlanRequest, tp: int, pp: int) -> LayoutFit:
    stages = [req.shard(tp, rank, pp) for rank in range(pp)]
    budget = int(req.device.memory_bytes * req.gpu_memory_utilization) - RESERVE_BYTES
    capacity = min(max(0, budget - s.memory_bytes) // (s.kv_bytes_per_token * BLOCK_SIZE) * BLOCK_SIZE
                   for s in stages)
    batch = min(req.concurrency, capacity // req.context_len)
    tpot = sum(step_seconds(s, req.device, req.fp8_matmuls, 1, req.context_len) for s in stages)
    return LayoutFit(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, num_nodes=nodes_spanned(tp, pp, req.gpus_per_node),
        weight_bytes_per_gpu=max(s.memory_bytes for s in stages),
        kv_bytes_per_token_per_gpu=max(s.kv_bytes_per_token for s in stages), kv_capacity_tokens=capacity,
        num_max_len_seqs=capacity // req.max_model_len, batch=batch, tpot_s=tpot,
        decode_tok_s=decode_tokens_per_s(req, stages, batch) if batch else 0.0,
        fits=capacity >= req.max_model_len)


def layout_sizes(req: PlanRequest, max_nodes: int) -> list[tuple[int, int]]:
    """(TP, PP) of the layouts of at most `max_nodes` nodes, fewest GPUs first: TP alone within a
    node, or pipeline stages of the widest TP (PP only where TP has no room left to grow)."""
    sizes = tensor_parallel_sizes(req.cfg, req.gpus_per_node)
    found = [(tp, 1) for tp in sizes]
    for pp in range(2, req.cfg.num_hidden_layers + 1):
        if nodes_spanned(sizes[-1], pp, req.gpus_per_node) > max_nodes:
            break
        found.append((sizes[-1], pp))
    return sorted(found, key=lambda size: size[0] * size[1])


def layouts(req: PlanRequest, max_nodes: int) -> list[LayoutFit]:
    return [evaluate(req, tp, pp) for tp, pp in layout_sizes(req, max_nodes)]


def smallest_fit(req: PlanRequest, max_nodes: int) -> LayoutFit | None:
    fits = (evaluate(req, tp, pp) for tp, pp in layout_sizes(req, max_nodes))
    return next((fit for fit in fits if fit.fits), None)


def recommend(req: PlanRequest) -> tuple[LayoutFit | None, str]:
    """The layout for the workload on the cluster, and why."""
    fitting = [fit for fit in layouts(req, req.num_nodes) if fit.fits]
    if not fitting:
        return None, (f"does not fit {req.num_nodes} node(s) of {req.gpus_per_node} x {req.device.name} "
                      f"with one {req.max_model_len}-token sequence")
    one_stage = [fit for fit in fitting if fit.pipeline_parallel_size == 1]
    want = f"{req.concurrency} sequences at context {req.context_len}"
    if one_stage:
        smallest = one_stage[0]
        holding = [fit for fit in one_stage if fit.batch >= req.concurrency]
        if holding and holding[0] is smallest:
            return smallest, (f"TP={smallest.tensor_parallel_size} in one node is the smallest layout that fits "
                              f"the weights, and its KV cache holds {want}")
        if holding:
            return holding[0], (f"TP={smallest.tensor_parallel_size} fits the weights but its KV cache holds "
                                f"{smallest.batch} of {want}; TP={holding[0].tensor_parallel_size} in one node "
                                f"holds them all (and cuts the time per token)")
        best = one_stage[-1]
        return best, (f"no TP in one node holds {want}: TP={best.tensor_parallel_size}, the most KV and the "
                      f"lowest latency in one node, holds {best.batch} (more replicas or an FP8 KV cache hold more)")
    widest = max(fit.tensor_parallel_size for fit in fitting)
    staged = [fit for fit in fitting if fit.tensor_parallel_size == widest]
    best = next((fit for fit in staged if fit.batch >= req.concurrency), staged[0])
    return best, (f"the weights do not fit one node's {req.gpus_per_node} GPUs: TP={widest} within each node, "
                  f"PP={best.pipeline_parallel_size} stages across {best.num_nodes} nodes; its KV cache holds "
                  f"{best.batch} of {want}")


def suggestions(req: PlanRequest) -> list[str]:
    """What would make a request that does not fit the cluster fit."""
    found = []
    more = smallest_fit(req, max_nodes=req.cfg.num_hidden_layers)
    if more is not None:
        found.append(f"{more.num_nodes} nodes of {req.gpus_per_node} GPUs fit it (--nodes {more.num_nodes}): "
                     f"TP={more.tensor_parallel_size} x PP={more.pipeline_parallel_size}")
    if req.weight_itemsize is None and req.itemsize > 1:
        fp8 = smallest_fit(replace(req, weight_itemsize=1), req.num_nodes)
        if fp8 is not None:
            found.append(f"FP8 weights fit this cluster (--quantization fp8): TP={fp8.tensor_parallel_size} x "
                         f"PP={fp8.pipeline_parallel_size}")
    if req.kv_itemsize is None and req.itemsize > 1:
        kv8 = smallest_fit(replace(req, kv_itemsize=1), req.num_nodes)
        if kv8 is not None:
            found.append(f"an FP8 KV cache fits this cluster (--kv-cache-dtype fp8): TP={kv8.tensor_parallel_size}"
                         f" x PP={kv8.pipeline_parallel_size}")
    longest = max(layouts(req, req.num_nodes), key=lambda fit: fit.kv_capacity_tokens, default=None)
    if longest is not None and longest.kv_capacity_tokens >= BLOCK_SIZE:
        found.append(f"a shorter context fits this cluster: --max-model-len {longest.kv_capacity_tokens} at "
                     f"TP={longest.tensor_parallel_size} x PP={longest.pipeline_parallel_size}")
    if not found:
        found.append(f"the weights alone outgrow {req.num_nodes} node(s) of {req.gpus_per_node} x "
                     f"{req.device.name}: a card with more memory, or more nodes")
    return found


@dataclass(frozen=True)
class DeploymentPlan:
    request: PlanRequest
    model: ModelCost  # the whole checkpoint
    min_layout: LayoutFit | None  # the fewest GPUs that fit, with as many nodes as it takes
    layout: LayoutFit | None  # the recommendation on the cluster; None: it does not fit
    num_replicas: int  # groups of `layout` the cluster holds
    reason: str
    suggestions: tuple[str, ...]

    @staticmethod
    def make(req: PlanRequest) -> DeploymentPlan:
        layout, reason = recommend(req)
        min_layout = smallest_fit(req, max_nodes=req.cfg.num_hidden_layers)
        replicas = 0 if layout is None else (
            req.num_nodes * (req.gpus_per_node // layout.tensor_parallel_size) // layout.pipeline_parallel_size)
        model = ModelCost.from_hf_config(req.cfg, req.itemsize, req.weight_itemsize, req.kv_itemsize)
        return DeploymentPlan(req, model, min_layout, layout, replicas, reason,
                              () if layout is not None else tuple(suggestions(req)))

    @property
    def fits(self) -> bool:
        return self.layout is not None

    @property
    def shown(self) -> LayoutFit | None:
        """The layout the figures are of: the recommendation, else the smallest that would fit."""
        return self.layout or self.min_layout

    def figures(self) -> dict[str, Any]:
        """The plan as plain JSON values (bytes, tokens, seconds as ms)."""
        req, shown = self.request, self.shown
        fit = {} if shown is None else {
            "tensor_parallel_size": shown.tensor_parallel_size, "pipeline_parallel_size": shown.pipeline_parallel_size,
            "num_nodes": shown.num_nodes, "weight_bytes_per_gpu": shown.weight_bytes_per_gpu,
            "kv_bytes_per_token_per_gpu": shown.kv_bytes_per_token_per_gpu,
            "kv_capacity_tokens": shown.kv_capacity_tokens, "max_model_len_sequences": shown.num_max_len_seqs,
            "decode_batch": shown.batch, "predicted_tpot_ms": shown.tpot_s * 1e3,
            "predicted_decode_tokens_per_s": shown.decode_tok_s}
        return {
            "device": req.device.name, "gpus_per_node": req.gpus_per_node, "num_nodes_available": req.num_nodes,
            "num_params": self.model.num_params, "weight_bytes": self.model.memory_bytes,
            "kv_bytes_per_token": self.model.kv_bytes_per_token, "max_model_len": req.max_model_len,
            "context_len": req.context_len, "concurrency": req.concurrency, "fits": self.fits,
            "tensor_parallel_size": None, "pipeline_parallel_size": None, "kv_capacity_tokens": 0,
            "predicted_tpot_ms": None, **fit, "num_replicas": self.num_replicas,
            "min_layout": None if self.min_layout is None else {
                "tensor_parallel_size": self.min_layout.tensor_parallel_size,
                "pipeline_parallel_size": self.min_layout.pipeline_parallel_size,
                "num_nodes": self.min_layout.num_nodes},
            "reason": self.reason, "suggestions": list(self.suggestions),
            "reserve_bytes_per_gpu": RESERVE_BYTES, "step_overhead_ms": req.device.step_overhead_s * 1e3,
        }
