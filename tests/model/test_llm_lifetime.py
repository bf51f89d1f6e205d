"""What an `LLM` holds goes back when it is shut down, or as soon as nothing refers to it."""

from __future__ import annotations

import gc
import weakref

from tandem.workers.llm import LLM


def test_a_dropped_llm_gives_its_model_back_at_once(llama_dir: str) -> None:
    llm = LLM(llama_dir, num_kv_blocks=16)
    model = weakref.ref(llm.engine.executor.runner.model)
    cache = weakref.ref(llm.engine.executor.runner.model.attention_layers[0].key_cache)
    gc.disable()  # no collection may come to the rescue: the last reference going must do it
    try:
        del llm
        assert model() is None and cache() is None
    finally:
        gc.enable()


def test_shutdown_releases_and_may_be_called_again(llama_dir: str) -> None:
    llm = LLM(llama_dir, num_kv_blocks=16)
    runner = llm.engine.executor.runner
    llm.shutdown()
    assert runner.model is None and llm.engine.executor.runner is None
    llm.shutdown()
