"""What an `LLM` holds goes back when it is shut down, or as soon as nothing refers to it; while
it serves, what its start-up left stays out of the garbage collector's walks."""

from __future__ import annotations

import gc
import weakref

from tandem.workers import startup_heap
from tandem.workers.config import ModelConfig
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


def _tracked(obj: object) -> bool:
    """Whether a collection of the oldest generation would walk `obj` (frozen objects are not
    among gc.get_objects())."""
    return any(o is obj for o in gc.get_objects())


def test_an_engine_serves_with_its_startup_heap_frozen(llama_dir: str) -> None:
    before = startup_heap.holders()
    llm = LLM(llama_dir, num_kv_blocks=16, freeze_startup_heap=True)  # the default on CUDA
    model = llm.engine.executor.runner.model
    assert startup_heap.holders() == before + 1 and gc.get_freeze_count() > 0
    assert not _tracked(model) and not _tracked(llm.engine.scheduler)
    llm.generate([[5, 6, 7]], use_tqdm=False)  # serving's own objects are walked as usual
    assert not _tracked(model)
    del model
    llm.shutdown()
    assert startup_heap.holders() == before
    if before == 0:
        assert gc.get_freeze_count() == 0


def test_an_engine_shut_down_beside_another_gives_back_what_its_cycles_held(llama_dir: str) -> None:
    first = LLM(llama_dir, num_kv_blocks=16, freeze_startup_heap=True)
    model = first.engine.executor.runner.model
    model.cycle = [model]  # only a collection frees it once the runner lets go
    ref = weakref.ref(model)
    del model
    # Its freeze takes the first's cycle along with its own start-up.
    second = LLM(llama_dir, num_kv_blocks=16, freeze_startup_heap=True)
    holders = startup_heap.holders()
    first.shutdown()
    # The heap thawed while the first let go, so its cycle was collected, and froze again for
    # the second, which still serves.
    assert ref() is None
    assert startup_heap.holders() == holders - 1 and gc.get_freeze_count() > 0
    assert not _tracked(second.engine.executor.runner.model)
    out = second.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    second.shutdown()


def test_on_cpu_the_heap_is_left_to_the_collector_unless_asked(llama_dir: str) -> None:
    before = startup_heap.holders()
    llm = LLM(llama_dir, num_kv_blocks=16)
    assert llm.engine.startup_heap is None and startup_heap.holders() == before
    assert _tracked(llm.engine.scheduler)
    llm.shutdown()
    assert ModelConfig().freezes_startup_heap("cuda") and not ModelConfig().freezes_startup_heap("cpu")
    assert not ModelConfig(freeze_startup_heap=False).freezes_startup_heap("cuda")
