from __future__ import annotations

import pytest

from tandem.workers.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

# Each case: (config class, bad keyword options, the field the message must start with).
BAD = [
    (ModelConfig, dict(dtype="float64"), "dtype"),
    (ModelConfig, dict(device="tpu"), "device"),
    (ModelConfig, dict(max_model_len=0), "max_model_len"),
    (ModelConfig, dict(max_mixed_graph_tokens=15), "max_mixed_graph_tokens"),
    (ParallelConfig, dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (ParallelConfig, dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
    (ParallelConfig, dict(num_overlap_chunks=0), "num_overlap_chunks"),
    (ParallelConfig, dict(park_workers_after_s=0.0), "park_workers_after_s"),
    (CacheConfig, dict(block_size=3), "block_size"),
    (CacheConfig, dict(block_size=256), "block_size"),
    (CacheConfig, dict(kv_cache_memory=0), "kv_cache_memory"),
    (CacheConfig, dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (CacheConfig, dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (CacheConfig, dict(num_kv_blocks=0), "num_kv_blocks"),
    (SchedulerConfig, dict(max_num_seqs=0), "max_num_seqs"),
    (SchedulerConfig, dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (SchedulerConfig, dict(num_lookahead_slots=-1), "num_lookahead_slots"),
    (SchedulerConfig, dict(num_scheduler_steps=0), "num_scheduler_steps"),
    # Every running request must fit its decode (+ lookahead) in one step.
    (SchedulerConfig, dict(max_num_seqs=8, max_num_batched_tokens=7), "max_num_batched_tokens"),
    (SchedulerConfig, dict(max_num_seqs=4, max_num_batched_tokens=15, num_lookahead_slots=3),
     "max_num_batched_tokens"),
    (SpeculativeConfig, dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (SpeculativeConfig, dict(ngram_prompt_lookup_min=0), "ngram_prompt_lookup_min"),
    (SpeculativeConfig, dict(ngram_prompt_lookup_min=5, ngram_prompt_lookup_max=4), "ngram_prompt_lookup_min"),
    (SpeculativeConfig, dict(speculative_model="ngram"), "num_speculative_tokens"),
    (ModelConfig, dict(simulated_step_ms="5.9"), "simulated_step_ms"),
    (ModelConfig, dict(simulated_step_ms="5.9,fast"), "simulated_step_ms"),
    (ModelConfig, dict(simulated_step_ms=(1.0, -0.1)), "simulated_step_ms"),
    (ModelConfig, dict(simulated_step_ms=[float("nan"), 0.0]), "simulated_step_ms"),
    (ModelConfig, dict(simulated_step_ms=(float("inf"), 0.0)), "simulated_step_ms"),
    (ModelConfig, dict(simulated_step_ms=(1, 2, 3)), "simulated_step_ms"),
    (ModelConfig, dict(simulated_step_ms=5.9), "simulated_step_ms"),
    (ModelConfig, dict(simulated_step_ms=(True, 0)), "simulated_step_ms"),
]


@pytest.mark.parametrize(("cls", "options", "field_name"), BAD,
                         ids=[f"{c.__name__}-{'-'.join(o)}" for c, o, _ in BAD])
def test_validation_error_names_the_field(cls: type, options: dict, field_name: str) -> None:
    with pytest.raises(ValueError) as info:
        cls(**options)
    assert str(info.value).startswith(f"{field_name}: ")


@pytest.mark.parametrize(("cls", "options", "field_name"), BAD,
                         ids=[f"{c.__name__}-{'-'.join(o)}" for c, o, _ in BAD])
def test_from_options_reports_the_same_errors(cls: type, options: dict, field_name: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options(**options)
    assert str(info.value).startswith(f"{field_name}: ")


def test_boundary_values_are_accepted() -> None:
    assert SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, num_lookahead_slots=3).num_lookahead_slots == 3
    assert SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1).max_num_batched_tokens == 1
    assert CacheConfig(block_size=1, gpu_memory_utilization=1.0).block_size == 1
    assert CacheConfig(block_size=128).block_size == 128
    assert ModelConfig(max_model_len=1).max_model_len == 1
    assert ModelConfig(max_mixed_graph_tokens=16).max_mixed_graph_tokens == 16
    assert SpeculativeConfig(ngram_prompt_lookup_min=4, ngram_prompt_lookup_max=4).ngram_prompt_lookup_max == 4


def test_configs_are_frozen() -> None:
    config = SchedulerConfig()
    with pytest.raises(AttributeError):
        config.max_num_seqs = 3  # type: ignore[misc]


def test_defaults() -> None:
    config = EngineConfig()
    assert config.model.dtype == "auto"
    assert config.parallel.world_size == 1
    assert config.cache.block_size == 16
    assert config.cache.enable_prefix_caching is True
    assert config.scheduler.max_num_seqs == 128
    assert config.scheduler.max_num_batched_tokens == 2048
    assert config.scheduler.enable_chunked_prefill is True
    assert config.scheduler.num_lookahead_slots == 0
    assert config.speculative.enabled is False


def test_world_size() -> None:
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


def test_from_options_splits_flat_options() -> None:
    config = EngineConfig.from_options(
        model="/models/x", dtype="float32", max_model_len=512, tensor_parallel_size=2,
        pipeline_parallel_size=2, block_size=8, num_kv_blocks=64, enable_prefix_caching=False,
        max_num_seqs=4, max_num_batched_tokens=256, enable_chunked_prefill=False)
    assert config.model == ModelConfig(model="/models/x", dtype="float32", max_model_len=512)
    assert config.parallel == ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert config.cache == CacheConfig(block_size=8, num_kv_blocks=64, enable_prefix_caching=False)
    assert config.scheduler == SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                               enable_chunked_prefill=False)
    assert config.speculative == SpeculativeConfig()


def test_from_options_with_no_options_is_the_default() -> None:
    assert EngineConfig.from_options() == EngineConfig()


def test_from_options_refuses_unknown_names() -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options(max_num_seqs=4, max_batch_size=8)
    message = str(info.value)
    assert message.startswith("max_batch_size: unknown engine option")
    assert "max_num_seqs" in message  # the known names are listed


def test_speculative_config_sets_lookahead_slots() -> None:
    config = EngineConfig.from_options(speculative_model="ngram", num_speculative_tokens=3)
    assert config.speculative.enabled is True
    assert config.speculative.num_speculative_tokens == 3
    assert config.scheduler.num_lookahead_slots == 3


def test_explicit_lookahead_slots_win_over_speculation() -> None:
    config = EngineConfig.from_options(speculative_model="ngram", num_speculative_tokens=3,
                                       num_lookahead_slots=5)
    assert config.scheduler.num_lookahead_slots == 5


def test_speculative_tokens_without_a_model_reserve_nothing() -> None:
    config = EngineConfig.from_options(num_speculative_tokens=3)
    assert config.speculative.enabled is False
    assert config.scheduler.num_lookahead_slots == 0


def test_speculation_lookahead_is_checked_against_the_token_budget() -> None:
    # 128 seqs * (1 + 16) = 2176 > 2048 default budget.
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options(speculative_model="ngram", num_speculative_tokens=16)
    assert str(info.value).startswith("max_num_batched_tokens: ")
    config = EngineConfig.from_options(speculative_model="ngram", num_speculative_tokens=16, max_num_seqs=64)
    assert config.scheduler.num_lookahead_slots == 16


def test_draft_dtype_defaults_to_the_targets_and_is_validated():
    from tandem.workers.config import draft_dtype

    assert draft_dtype(EngineConfig.from_options(dtype="float32")) == "float32"
    assert draft_dtype(EngineConfig.from_options(dtype="float32", speculative_draft_dtype="bfloat16")) == "bfloat16"
    with pytest.raises(ValueError, match="^speculative_draft_dtype:"):
        EngineConfig.from_options(speculative_draft_dtype="int4")


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                     dict(speculative_model="ngram", num_speculative_tokens=2)])
def test_multi_step_decoding_needs_one_process_and_no_speculation(options: dict) -> None:
    with pytest.raises(ValueError, match="^num_scheduler_steps: multi-step decoding needs"):
        EngineConfig.from_options(num_scheduler_steps=4, **options)
    assert EngineConfig.from_options(num_scheduler_steps=1, **options).scheduler.num_scheduler_steps == 1
    assert EngineConfig.from_options(num_scheduler_steps=4).scheduler.num_scheduler_steps == 4


@pytest.mark.parametrize("value", ["5.9,0.01", " 5.9, 0.01", [5.9, 0.01], (5.9, 0.01), ["5.9", "0.01"]])
def test_simulated_step_ms_is_two_floats_whatever_form_it_comes_in(value) -> None:
    step_ms = EngineConfig.from_options(simulated_step_ms=value).model.simulated_step_ms
    assert step_ms == (5.9, 0.01) and type(step_ms) is tuple
    assert ModelConfig(simulated_step_ms=(0, 0)).simulated_step_ms == (0.0, 0.0)
    assert ModelConfig().simulated_step_ms is None


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                     dict(speculative_model="ngram", num_speculative_tokens=2)])
def test_a_simulated_device_is_one_device_without_drafts(options: dict) -> None:
    with pytest.raises(ValueError, match="^simulated_step_ms: a simulated device runs"):
        EngineConfig.from_options(simulated_step_ms="1,0", **options)
    # Multi-step decoding runs on it, as on the one GPU it stands for.
    assert EngineConfig.from_options(simulated_step_ms="1,0", num_scheduler_steps=4).scheduler.num_scheduler_steps == 4


def test_a_simulated_device_overlaps_steps_and_freezes_the_heap_as_a_gpu() -> None:
    model = ModelConfig()
    assert [model.overlaps_steps(d) for d in ("cuda", "sim", "cpu")] == [True, True, False]
    assert [model.freezes_startup_heap(d) for d in ("cuda", "sim", "cpu")] == [True, True, False]
    assert ModelConfig(overlap_steps=False).overlaps_steps("sim") is False
