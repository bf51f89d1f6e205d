"""Frozen configuration of one replica group's engine.

Every option a user can set lands in one of these dataclasses, validated in
``__post_init__`` so that a bad value fails at construction with a message that
names the field. ``EngineConfig.from_options`` is the one place where the flat
keyword options users pass (vLLM-style names) are split into the parts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
# Executors' device types whose steps run beside the host: a GPU, or the simulated device
# (workers/executor/simulated.py) that stands for one. The host's work overlaps their steps,
# and a garbage collection's pause leaves them idle.
ASYNC_DEVICE_TYPES = ("cuda", "sim")


def require_field(ok: bool, field_name: str, message: str) -> None:
    """Raise ValueError("field: message") unless ok: every validation error names its field."""
    if not ok:
        raise ValueError(f"{field_name}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how."""

    # A local HF directory, a Hub repo id (org/name), or s3://bucket/prefix or gs://bucket/prefix
    # (workers/model/source.py); None = the built-in demo model.
    model: str | None = None
    # The Hub revision of `model` (a branch, tag or commit; None: main). Bucket and local models
    # have none: a new version of one goes under a new prefix or directory.
    revision: str | None = None
    # The tokenizer's own reference, resolved as `model` is (at the Hub's main revision, not
    # `revision`); None = the model's.
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = config's dtype on GPU, float32 on CPU
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # CPU float32: linear weights packed once into MKL's GEMM layout (workers/kernels/cpu_gemm.py),
    # faster decode steps for a few MB more per weight.
    cpu_packed_weights: bool = True
    # CUDA: no CUDA graphs; every decode step launches its kernels one by one (vLLM's name).
    enforce_eager: bool = False
    # Decode steps whose longest sequence is longer run eagerly: a graph's block-table buffer
    # is this wide, and every step copies it whole (vLLM's name and default).
    max_seq_len_to_capture: int = 8192
    # CUDA: steps that carry prompt chunks beside decodes replay graphs too, per token bucket;
    # False: only pure decode steps do (vLLM's FULL_DECODE_ONLY).
    mixed_step_graphs: bool = True
    # The largest such step a graph holds (its last bucket; never past max_num_batched_tokens):
    # larger ones launch their kernels from Python, one by one. 2048 covers the default budget.
    max_mixed_graph_tokens: int = 2048
    # auto: the Triton kernels on CUDA, torch elsewhere; triton on CPU needs TRITON_INTERPRET=1.
    attention_backend: str = "auto"
    # Prepare and launch step N+1 before turning step N's tokens into text, so the host's work
    # overlaps the device's; None = on CUDA (on CPU both compete for the same cores).
    overlap_steps: bool | None = None
    # Freeze what start-up left out of the garbage collector's walks while the engine serves
    # (workers/startup_heap.py); None = on CUDA, where a collection's pause idles the GPU (on
    # CPU every start would pay a full collection for pauses its slower steps barely notice).
    freeze_startup_heap: bool | None = None
    # (BASE, PER_SEQ) in ms: no weights are loaded and each step's forward pass is a wait of
    # BASE + PER_SEQ x its requests (workers/executor/simulated.py); the scheduler, KV blocks,
    # detokenizer and outputs stay real, so the serving path runs anywhere at a GPU's step
    # rate. Options may give "5.9,0.01" or a list; it is kept as a tuple of two floats.
    simulated_step_ms: tuple[float, float] | None = None
    # Quantized linear weights (workers/quant/): "fp8" (W8A8 e4m3 where the device multiplies
    # FP8, weights only elsewhere), "fp8_weight_only", "int8" (W8A16); a bf16/fp16/fp32
    # checkpoint is quantized at load. A pre-quantized checkpoint's `quantization_config` is
    # read without this option; given, it must name that checkpoint's method (vLLM's rule).
    quantization: str | None = None

    def freezes_startup_heap(self, device_type: str) -> bool:
        if self.freeze_startup_heap is not None:
            return self.freeze_startup_heap
        return device_type in ASYNC_DEVICE_TYPES

    def overlaps_steps(self, device_type: str) -> bool:
        return self.overlap_steps if self.overlap_steps is not None else device_type in ASYNC_DEVICE_TYPES

    def __post_init__(self) -> None:
        if self.simulated_step_ms is not None:
            object.__setattr__(self, "simulated_step_ms", parse_step_ms(self.simulated_step_ms))
        require_field(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        require_field(self.max_seq_len_to_capture >= 1, "max_seq_len_to_capture",
                      f"must be >= 1, got {self.max_seq_len_to_capture}")
        require_field(self.max_mixed_graph_tokens >= 16, "max_mixed_graph_tokens",
                      f"must be >= 16 (the smallest bucket), got {self.max_mixed_graph_tokens}")
        require_field(self.attention_backend in ("auto", "torch", "triton"), "attention_backend",
                      f"must be auto, torch or triton, got {self.attention_backend!r}")
        require_field(self.quantization is None or self.quantization in QUANTIZATION_METHODS, "quantization",
                      f"must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        require_field(self.device in ("auto", "cpu", "cuda"), "device",
                 f"must be auto, cpu or cuda, got {self.device!r}")
        if self.max_model_len is not None:
            require_field(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        for name in ("model", "tokenizer"):
            if getattr(self, name) is not None:
                check_model_reference(name, getattr(self, name))
        if self.revision is not None:
            require_field(isinstance(self.revision, str) and self.revision.strip() == self.revision != "",
                          "revision", f"must be a branch, tag or commit of the model's Hub repo, got {self.revision!r}")
            require_field(self.model is not None, "revision", "names a version of `model`, and no model is given")
            require_field(self.model.partition("://")[0] not in MODEL_URI_SCHEMES, "revision",
                          f"{self.model.partition(':')[0]}:// models have no revisions (a new version goes under "
                          "a new prefix)")


# `quantization` values: online methods, then the pre-quantized formats' own names.
QUANTIZATION_METHODS = ("fp8", "fp8_weight_only", "int8", "compressed-tensors", "fbgemm_fp8")
# `kv_cache_dtype` values (vLLM's names; "fp8" is e4m3).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


# The bucket URIs a model reference may be (workers/model/source.py downloads them).
MODEL_URI_SCHEMES = ("s3", "gs")


def check_model_reference(field_name: str, reference: Any) -> None:
    """A model reference's syntax: a non-empty path or repo id, or s3:// or gs:// with a bucket.
    Whether it exists is asked where it is read (workers/model/source.py), not here."""
    require_field(isinstance(reference, str) and reference.strip() == reference != "", field_name,
                  f"must be a directory, a Hugging Face repo id or an s3:// or gs:// URI, got {reference!r}")
    scheme, sep, rest = reference.partition("://")
    if sep:
        require_field(scheme in MODEL_URI_SCHEMES, field_name,
                      f"{scheme}:// is not a model source; name a directory, a Hugging Face repo id (org/name), "
                      f"s3://bucket/prefix or gs://bucket/prefix, got {reference!r}")
        require_field(rest.split("/")[0] != "", field_name, f"names no bucket: {reference!r}")


def parse_step_ms(value: Any) -> tuple[float, float]:
    """simulated_step_ms from "BASE,PER_SEQ", a list or a tuple: two finite floats >= 0."""
    parts = value.split(",") if isinstance(value, str) else value
    try:
        numbers = tuple(float(p) for p in parts if not isinstance(p, bool))
        count = len(parts)
    except (TypeError, ValueError):
        numbers, count = (), 0
    require_field(count == len(numbers) == 2 and all(math.isfinite(n) and n >= 0 for n in numbers),
                  "simulated_step_ms", f"must be BASE,PER_SEQ: two finite numbers of milliseconds >= 0, got {value!r}")
    return numbers[0], numbers[1]


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Overlap each row-parallel all-reduce with the next chunk's GEMMs. None = where it pays:
    # on CUDA (NCCL has its own stream and SMs), not on CPU, where the communication is work
    # on the computing cores and chunking costs more than it hides (bench/RESULTS.md).
    overlap_comm: bool | None = None
    num_overlap_chunks: int = 2
    # CPU only: a stage's TP all-reduces and all-gathers go through shared memory instead of
    # gloo's loopback TCP (its ranks are on one node by placement). False: gloo for all.
    shm_collectives: bool = True
    address: str | None = None  # Ray address to join; None = local / in-process
    # A Ray group's workers wait for steps in a compiled graph's channel, which keeps a core
    # busy per worker; after this many seconds without a step they wait on an event instead
    # (workers/executor/parking.py), and the next step wakes them (a few ms). None: never.
    park_workers_after_s: float | None = 1.0
    # Steps reach a Ray group's workers through a compiled graph's shared-memory channels (a
    # third of plain actor calls' cost a step) or plain actor calls. None: the graph on GPUs
    # only. Ray 2.60 reads the graph's output by polling, so while a step runs the engine's
    # process holds a core: on a CPU group, one the workers need (bench/RESULTS.md).
    compiled_graph: bool | None = None
    # Steps in flight at once with pipeline stages, each of other requests, so stage k runs one
    # while stage k + 1 runs the one before (vLLM's virtual engines). None = one a stage; 1 =
    # one step at a time, each split into a micro-batch a stage.
    pipeline_inflight_batches: int | None = None
    # Decoder layers per stage, first to last (vLLM's VLLM_PP_LAYER_PARTITION; "6,2" or a list);
    # None: balanced by what a decode step reads, the LM head counted on the last stage
    # (workers/model/stages.py).
    pipeline_layer_partition: tuple[int, ...] | None = None

    @property
    def inflight_batches(self) -> int:
        return self.pipeline_inflight_batches or self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.pipeline_layer_partition is not None:
            parts = self.pipeline_layer_partition
            parts = parts.split(",") if isinstance(parts, str) else parts
            try:
                counts = tuple(int(p) for p in parts)
            except (TypeError, ValueError):
                counts = ()
            require_field(len(counts) == self.pipeline_parallel_size and all(c >= 1 for c in counts),
                          "pipeline_layer_partition",
                          f"must give each of the {self.pipeline_parallel_size} stages >= 1 layers (e.g. \"6,2\"), "
                          f"got {self.pipeline_layer_partition!r}")
            object.__setattr__(self, "pipeline_layer_partition", counts)
        if self.pipeline_inflight_batches is not None:
            require_field(1 <= self.pipeline_inflight_batches <= self.pipeline_parallel_size,
                          "pipeline_inflight_batches",
                          f"must be in [1, pipeline_parallel_size = {self.pipeline_parallel_size}], got "
                          f"{self.pipeline_inflight_batches}")
        if self.park_workers_after_s is not None:
            require_field(self.park_workers_after_s > 0, "park_workers_after_s",
                          f"must be > 0 (or None: never park), got {self.park_workers_after_s}")
        require_field(self.tensor_parallel_size >= 1, "tensor_parallel_size",
                 f"must be >= 1, got {self.tensor_parallel_size}")
        require_field(self.pipeline_parallel_size >= 1, "pipeline_parallel_size",
                 f"must be >= 1, got {self.pipeline_parallel_size}")
        require_field(self.num_overlap_chunks >= 1, "num_overlap_chunks",
                 f"must be >= 1, got {self.num_overlap_chunks}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for KV on CPU (default 256 MiB)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory on CUDA
    num_kv_blocks: int | None = None  # exact override (tests, benchmarks)
    enable_prefix_caching: bool = True
    # Host memory for evicted prefix blocks (bytes, the whole group); 0 = no host tier.
    host_kv_cache_memory: int = 0
    # "auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 blocks with per-layer K and V scales
    # (1.0, or the checkpoint's k_scale / v_scale), half a bf16 cache's bytes.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        require_field(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                      f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                      + (" (e5m2 is not supported: its scales are not in the checkpoints people ship)"
                         if self.kv_cache_dtype == "fp8_e5m2" else ""))
        require_field(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
                 f"must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_memory is not None:
            require_field(self.kv_cache_memory > 0, "kv_cache_memory",
                     f"must be > 0 bytes, got {self.kv_cache_memory}")
        require_field(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None:
            require_field(self.num_kv_blocks >= 1, "num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        require_field(self.host_kv_cache_memory >= 0, "host_kv_cache_memory",
                      f"must be >= 0 bytes, got {self.host_kv_cache_memory}")
        require_field(self.host_kv_cache_memory == 0 or self.enable_prefix_caching, "host_kv_cache_memory",
                      "the host tier keeps prefix-cache blocks: it needs enable_prefix_caching")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    num_lookahead_slots: int = 0  # extra KV slots reserved per decode for speculative tokens
    # Multi-step decoding (vLLM's name): a step of decodes only runs up to this many forward
    # passes back to back, each fed the previous one's tokens on the device (sampling,
    # penalties, logprobs and min_tokens included), before the host schedules again. The host's
    # per-step work (scheduling, stop checks, outputs) is paid once for that many tokens; a stop
    # token is seen only at the end of the step (the tokens computed past it are dropped). A
    # step runs no longer than the shortest pace of the paced streams in flight
    # (GroupEngine.max_passes): a served stream alone still gets its tokens one at a time. 1 = off.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        require_field(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        require_field(self.num_scheduler_steps >= 1, "num_scheduler_steps",
                      f"must be >= 1, got {self.num_scheduler_steps}")
        require_field(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        require_field(self.num_lookahead_slots >= 0, "num_lookahead_slots",
                 f"must be >= 0, got {self.num_lookahead_slots}")
        # Every running request must be able to take its decode token (plus lookahead)
        # in one step, or decodes could starve behind each other.
        require_field(self.max_num_batched_tokens >= self.max_num_seqs * (1 + self.num_lookahead_slots),
                 "max_num_batched_tokens",
                 f"must be >= max_num_seqs * (1 + num_lookahead_slots) = "
                 f"{self.max_num_seqs * (1 + self.num_lookahead_slots)}, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_model: str | None = None  # a model reference (as ModelConfig.model's), or "ngram"
    num_speculative_tokens: int = 0
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    disable_batch_size: int = 16  # no drafts while more requests than this run (compute-bound)
    # The draft model's dtype ("auto": the target's). A lower precision draft reads half the
    # bytes per draft token; outputs stay exactly the target's (every draft is verified).
    speculative_draft_dtype: str = "auto"
    # The draft's own tensor-parallel size (vLLM's name): its ranks go to spare GPUs when
    # enough sit on one node, else they share the group's first devices.
    speculative_draft_tensor_parallel_size: int = 1
    # Engines naming the same Ray actor share one draft (a Serve application names one for
    # all its groups); None: the draft is this engine's own.
    speculative_draft_actor_name: str | None = None

    def __post_init__(self) -> None:
        require_field(self.speculative_draft_tensor_parallel_size >= 1, "speculative_draft_tensor_parallel_size",
                      f"must be >= 1, got {self.speculative_draft_tensor_parallel_size}")
        require_field(self.speculative_draft_dtype in ("auto", "float32", "bfloat16", "float16"),
                      "speculative_draft_dtype",
                      f"must be auto, float32, bfloat16 or float16, got {self.speculative_draft_dtype!r}")
        require_field(self.num_speculative_tokens >= 0, "num_speculative_tokens",
                 f"must be >= 0, got {self.num_speculative_tokens}")
        require_field(1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max,
                 "ngram_prompt_lookup_min",
                 "must satisfy 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max")
        if self.speculative_model is not None:
            require_field(self.num_speculative_tokens >= 1, "num_speculative_tokens",
                     "must be >= 1 when speculative_model is set")
            if self.speculative_model != "ngram":
                check_model_reference("speculative_model", self.speculative_model)

    @property
    def enabled(self) -> bool:
        return self.speculative_model is not None and self.num_speculative_tokens > 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        # A multi-step step's passes feed each other on one device without the host; ranks in
        # other processes would need every pass's tokens, and drafts need the host between them.
        require_field(self.scheduler.num_scheduler_steps == 1 or (
            self.parallel.world_size == 1 and not self.speculative.enabled), "num_scheduler_steps",
            "multi-step decoding needs tensor_parallel_size = pipeline_parallel_size = 1 and no speculative model")
        # The simulated device is one device in this process: it has no ranks to spread over and
        # no draft model to run.
        if self.model.simulated_step_ms is not None:
            require_field(self.parallel.world_size == 1, "simulated_step_ms",
                          "a simulated device runs with tensor_parallel_size = pipeline_parallel_size = 1")
            require_field(not self.speculative.enabled, "simulated_step_ms",
                          "a simulated device runs no speculative decoding")

    @staticmethod
    def from_options(**options: Any) -> EngineConfig:
        """Build from flat vLLM-style keyword options; unknown names are a ValueError."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        if options.get("speculative_config") is not None:
            from tandem.workers.speculative_config import speculative_options

            expanded = speculative_options(options["speculative_config"])
            both = sorted(key for key in expanded if options.get(key) is not None)
            if both:
                raise ValueError(f"speculative_config: give it or {', '.join(both)}, not both")
            options = {**options, **expanded}
        options.pop("speculative_config", None)
        for key, value in options.items():
            owner = _FIELD_OWNER.get(key)
            if owner is None:
                raise ValueError(f"{key}: unknown engine option (known: {', '.join(sorted(_FIELD_OWNER))})")
            parts[owner][key] = value
        # Speculation reserves lookahead slots in the scheduler.
        spec = SpeculativeConfig(**parts["speculative"])
        if spec.enabled and "num_lookahead_slots" not in parts["scheduler"]:
            parts["scheduler"]["num_lookahead_slots"] = spec.num_speculative_tokens
        return EngineConfig(
            model=ModelConfig(**parts["model"]),
            parallel=ParallelConfig(**parts["parallel"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            speculative=spec,
        )


_PARTS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
}
_FIELD_OWNER: dict[str, str] = {
    f.name: part for part, cls in _PARTS.items() for f in dataclasses.fields(cls)
}


def draft_dtype(config: EngineConfig) -> str:
    """The speculative draft model's dtype option."""
    spec = config.speculative.speculative_draft_dtype
    return config.model.dtype if spec == "auto" else spec
