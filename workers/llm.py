"""The offline API: `LLM(model=PATH, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tqdm.auto import tqdm

from tandem.workers.config import EngineConfig
from tandem.workers.core.request import RequestOutput, SamplingParams
from tandem.workers.engine import GroupEngine, Prompt
from tandem.workers.startup_heap import StartupHeap
from tandem.workers.text.tokenizer import apply_chat_template


def build_engine(config: EngineConfig, *, show_progress: bool = True) -> GroupEngine:
    """Resolve the model, load tokenizer and weights, size the KV cache, and start a group."""
    from tandem.workers.model.demo_model import demo_model_path
    from tandem.workers.model.hf_config import HFModelConfig
    from tandem.workers.text.tokenizer import load_tokenizer

    model_dir = config.model.model or demo_model_path()
    hf_config = HFModelConfig.from_dir(model_dir)
    max_len = config.model.max_model_len
    if max_len is not None and max_len > hf_config.max_position_embeddings:
        raise ValueError(f"max_model_len: {max_len} exceeds the model's max_position_embeddings "
                         f"({hf_config.max_position_embeddings})")
    # The tokenizer (and transformers' import, ~2 s of CPU) loads on a thread while the model
    # loads: a group rebuilt after a fault serves that much sooner, most of all on a busy host.
    with ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer") as pool:
        tokenizer_loaded = pool.submit(load_tokenizer, model_dir)
        executor = _start_executor(config, hf_config, model_dir, show_progress)
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
    executor = _start_executor(failed.config, failed.hf_config, failed.model_dir, show_progress=False)
    return _assemble(failed.config, failed.hf_config, failed.tokenizer, executor, failed.model_dir)


def _start_executor(config: EngineConfig, hf_config, model_dir: str, show_progress: bool):
    if config.parallel.world_size > 1:
        from tandem.workers.distributed.ray_executor import RayExecutor  # Ray only when a group spans ranks

        return RayExecutor(config, hf_config, model_dir)
    from tandem.workers.executor import UniProcExecutor

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


class LLM:
    """Generate offline from a local Hugging Face model directory (the demo model by default)."""

    def __init__(self, model: str | None = None, **options) -> None:
        self.config = EngineConfig.from_options(model=model, **options)
        self.engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # The engine's insides hold reference cycles, which would keep its weights and KV cache
        # (device memory, workers) until some later garbage collection: the LLM's last
        # reference going away shuts the engine down at once, as shutdown() does.
        self._shutdown = weakref.finalize(self, self.engine.shutdown)
        self._shutdown.atexit = False  # at exit the process's end frees it all anyway

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params):
            # Only finished outputs are returned: the engine builds no output (and decodes no
            # text) for a request until it finishes.
            self.engine.add_request(request_id, prompt, replace(p, output_kind="final"))
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer(apply_chat_template(self.tokenizer, c),
                                                       add_special_tokens=False).input_ids}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, leave=False)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        """Give back the device memory and the workers now (idempotent)."""
        self._shutdown()
