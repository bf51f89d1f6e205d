"""The systems a benchmark compares, loaded once per run: tandem's engine and transformers.

Both run the same checkpoint in the same dtype on the same device, in this process, with the
same torch thread count, so the ratios compare engines and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.bench.hardware import ContentionLog
from tandem.bench.workload import BenchRequest
from tandem.workers.model.cost import ModelCost


@dataclass(frozen=True)
class BenchOptions:
    model: str | None = None  # None = `bench_model`'s checkpoint, else the built-in benchmark model
    bench_model: str | None = None  # a BENCH_SHAPES name (bench_models.py); not with `model`
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    quick: bool = False
    repeats: int | None = None  # None = the subcommand's default
    engine_options: dict[str, Any] = field(default_factory=dict)  # extra tandem engine options
    show_progress: bool = True
    idle_wait_s: float = 60.0  # CPU: wait up to this for other processes to go quiet; 0 = never redo
    temperature: float = 0.0  # tandem's requests: 0 = greedy, else sampled (unseeded)

    def __post_init__(self) -> None:
        if self.repeats is not None and self.repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {self.repeats}")
        if self.idle_wait_s < 0:
            raise ValueError(f"idle_wait: must be >= 0 seconds, got {self.idle_wait_s}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        check_model_choice(self.model, self.bench_model)

    def contention_log(self) -> ContentionLog:
        return ContentionLog(max_wait_s=self.idle_wait_s, max_attempts=3 if self.idle_wait_s > 0 else 1)

    def num_repeats(self, default_full: int, default_quick: int) -> int:
        if self.repeats is not None:
            return self.repeats
        return default_quick if self.quick else default_full


@dataclass
class Systems:
    llm: Any  # tandem.workers.llm.LLM
    hf_model: Any  # transformers PreTrainedModel, eval mode; None where the benchmark leaves it out
    cost: ModelCost
    model_dir: str
    device: torch.device
    dtype: torch.dtype
    temperature: float = 0.0  # tandem's requests (BenchOptions.temperature)

    @property
    def runner(self) -> Any:
        return self.llm.engine.executor.runner

    @property
    def vocab_size(self) -> int:
        return self.llm.engine.hf_config.vocab_size


def resolve_device(option: str) -> torch.device:
    from tandem.workers.executor.abstract import pick_device
    return pick_device(option)


def resolve_dtype(option: str, device: torch.device) -> str:
    """The issue's convention: float32 on CPU, bfloat16 on a GPU, unless asked otherwise."""
    if option != "auto":
        return option
    return "bfloat16" if device.type == "cuda" else "float32"


def load_systems(opts: BenchOptions, request_sets: list[list[BenchRequest]], *, with_hf: bool = True) -> Systems:
    """Load tandem (KV cache sized for the largest of `request_sets`) and, `with_hf`, transformers.

    On CPU the KV cache gets room for every request of the largest set at once, so the
    benchmark measures batching, not preemption; `--kv-cache-memory` overrides that. On a GPU
    tandem takes half the memory (`--gpu-memory-utilization` overrides), leaving transformers
    the rest.
    """
    from tandem.workers.llm import LLM

    model_dir = resolve_model_dir(opts)
    llm = LLM(**tandem_options(opts, request_sets))
    engine = llm.engine
    if engine.model_in_process:
        runner = engine.executor.runner
        device, dtype = runner.device, runner.dtype
        cost = ModelCost.from_tandem_model(runner.model, dtype.itemsize)
    else:  # a Ray group (TP or PP > 1): the whole model's cost, from its config
        device = torch.device(engine.executor.device_type)
        dtype = engine.hf_config.resolve_dtype(engine.config.model.dtype, device)
        cost = ModelCost.from_hf_config(engine.hf_config, dtype.itemsize)
    hf_model = load_hf_model(model_dir, dtype, device) if with_hf else None
    return Systems(llm, hf_model, cost, model_dir, device, dtype, opts.temperature)


def tandem_options(opts: BenchOptions, request_sets: list[list[BenchRequest]]) -> dict[str, Any]:
    """The engine options tandem runs the benchmark with (load_systems' docstring: the KV sizing)."""
    from tandem.workers.model.hf_config import HFModelConfig

    model_dir = resolve_model_dir(opts)
    device = resolve_device(opts.device)
    dtype_name = resolve_dtype(opts.dtype, device)
    options = dict(opts.engine_options)
    options.update(model=model_dir, dtype=dtype_name, device=device.type)
    if device.type == "cpu" and "kv_cache_memory" not in options and "num_kv_blocks" not in options:
        hf_config = HFModelConfig.from_dir(model_dir)
        dtype = hf_config.resolve_dtype(dtype_name, device)
        options["kv_cache_memory"] = _kv_bytes_for(request_sets, hf_config, dtype,
                                                   options.get("block_size", 16))
    if device.type == "cuda":
        # transformers is loaded after tandem has sized its KV cache: leave it room.
        options.setdefault("gpu_memory_utilization", 0.5)
    return options


def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM
    if device.type == "cuda":
        # SDPA's cuDNN backend builds a plan for every new shape (~1 ms of CPU each): a static
        # batch's every new padded length paid it. Flash / memory-efficient SDPA is what a user
        # of transformers gets by turning it off; tandem's GPU path does not use SDPA at all.
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def _kv_bytes_for(request_sets: list[list[BenchRequest]], hf_config: Any, dtype: torch.dtype,
                  block_size: int) -> int:
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * hf_config.head_dim * dtype.itemsize
    tokens = max(sum(-(-(len(r.prompt_token_ids) + r.output_len) // block_size) + 1 for r in requests)
                 for requests in request_sets) * block_size
    return max(int(tokens * per_token * 1.1), 64 << 20)


def resolve_model_dir(opts: BenchOptions) -> str:
    return pick_model_dir(opts.model, opts.bench_model)


def check_model_choice(model: str | None, bench_model: str | None) -> None:
    from tandem.bench.bench_models import BENCH_SHAPES

    if model is not None and bench_model is not None:
        raise ValueError("--model and --bench-model: give one or the other")
    if bench_model is not None and bench_model not in BENCH_SHAPES:
        raise ValueError(f"bench_model: must be one of {', '.join(BENCH_SHAPES)}, got {bench_model!r}")


def pick_model_dir(model: str | None, bench_model: str | None) -> str:
    """`model`, else `bench_model`'s checkpoint (written on first use), else the built-in benchmark model."""
    from tandem.bench.bench_models import BENCH_SHAPES, bench_model_dir
    from tandem.workers.model.demo_model import bench_model_path

    check_model_choice(model, bench_model)
    if model is not None:
        return model
    return bench_model_dir(BENCH_SHAPES[bench_model]) if bench_model is not None else bench_model_path()


def vocab_size_of(model_dir: str) -> int:
    from tandem.workers.model.hf_config import HFModelConfig
    return HFModelConfig.from_dir(model_dir).vocab_size
