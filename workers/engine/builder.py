"""Building a group's engine: the model resolved, tokenizer and weights loaded, the KV cache
sized, the executor and the speculative proposer started. The offline API (`LLM`) and the
server's group (`GroupServer`) build their engines here, and a failed group is rebuilt here."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tandem.workers.config import EngineConfig
from tandem.workers.engine.group_engine import GroupEngine
from tandem.workers.startup_heap import StartupHeap
from tandem.workers.young_generation import widen_young_generation


def build_engine(config: EngineConfig, *, show_progress: bool = True) -> GroupEngine:
    """Resolve the model, load tokenizer and weights, size the KV cache, and start a group."""
    from tandem.workers.model.demo_model import demo_model_path
    from tandem.workers.model.hf_config import HFModelConfig
    from tandem.workers.model.source import tokenizer_dir
    from tandem.workers.text.tokenizer import load_tokenizer

    model_dir = config.model.model or demo_model_path()
    hf_config = HFModelConfig.from_dir(model_dir, config.model.revision)
    max_len = config.model.max_model_len
    if max_len is not None and max_len > hf_config.max_position_embeddings:
        raise ValueError(f"max_model_len: {max_len} exceeds the model's max_position_embeddings "
                         f"({hf_config.max_position_embeddings})")
    # The tokenizer (and transformers' import, ~2 s of CPU) loads on a thread while the model
    # loads: a group rebuilt after a fault serves that much sooner, most of all on a busy host.
    with ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer") as pool:
        tokenizer_loaded = pool.submit(
            lambda: load_tokenizer(tokenizer_dir(model_dir, config.model.tokenizer, config.model.revision)))
        executor = _start_executor(config, hf_config, model_dir, show_progress, tokenizer_loaded.result)
        try:
            tokenizer = tokenizer_loaded.result()
        except BaseException:
            executor.shutdown()  # a Ray group's workers would outlive the failed start
            raise
    return _assemble(config, hf_config, tokenizer, executor, model_dir)


def rebuild_engine(failed: GroupEngine) -> GroupEngine:
    """A group in place of a failed one: new workers for the same model and options (in the
    same placement group when the group runs in one), the tokenizer kept, the cache empty."""
    failed.shutdown()  # what is left of the old workers, and its draft's attachment
    executor = _start_executor(failed.config, failed.hf_config, failed.model_dir, False, lambda: failed.tokenizer)
    return _assemble(failed.config, failed.hf_config, failed.tokenizer, executor, failed.model_dir)


def _start_executor(config: EngineConfig, hf_config, model_dir: str, show_progress: bool,
                    tokenizer: Callable[[], Any]):
    if config.model.simulated_step_ms is not None:
        from tandem.workers.executor.simulated import SimulatedExecutor, tokenizer_special_ids

        # No weights to load meanwhile: it waits for the tokenizer, whose special ids its tokens avoid.
        return SimulatedExecutor(config, hf_config, special_token_ids=tokenizer_special_ids(tokenizer()))
    if config.parallel.world_size > 1:
        from tandem.workers.executor.ray_executor import RayExecutor  # Ray only when a group spans ranks
        from tandem.workers.model.stages import stage_layers

        stage_layers(hf_config, 0, config.parallel.pipeline_parallel_size,  # a partition that is not the
                     config.parallel.pipeline_layer_partition)  # model's is refused before workers start

        return RayExecutor(config, hf_config, model_dir)
    from tandem.workers.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, hf_config, model_dir, show_progress=show_progress)


def _assemble(config: EngineConfig, hf_config, tokenizer, executor, model_dir: str) -> GroupEngine:
    engine = GroupEngine(config, hf_config, tokenizer, executor, model_dir=model_dir)
    try:
        engine.proposer = build_proposer(config, hf_config, executor)
    except BaseException:
        executor.shutdown()  # a Ray group's workers would outlive the failed start
        raise
    if config.cache.host_kv_cache_memory:
        engine.enable_host_tier(config.cache.host_kv_cache_memory)
    if config.model.freezes_startup_heap(getattr(executor, "device_type", "cpu")):
        engine.startup_heap = StartupHeap()  # start-up is over: its objects leave the collector's walks
    widen_young_generation()  # a step's objects die before a collection walks them
    return engine


def build_proposer(config: EngineConfig, hf_config, executor):
    """The speculative proposer the options ask for, or None."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.speculative_model == "ngram":
        from tandem.workers.spec.ngram_proposer import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.ngram_prompt_lookup_min,
                             spec.ngram_prompt_lookup_max)
    from tandem.workers.model.hf_config import HFModelConfig
    from tandem.workers.spec.draft_proposer import start_draft

    draft_config = HFModelConfig.from_dir(spec.speculative_model)
    if draft_config.vocab_size != hf_config.vocab_size:
        raise ValueError(f"speculative_model: its vocabulary ({draft_config.vocab_size}) differs from the "
                         f"target's ({hf_config.vocab_size}); a draft must share the target's tokenizer")
    return start_draft(config, executor)
