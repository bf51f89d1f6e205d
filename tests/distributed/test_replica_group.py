"""Replica groups on Ray (CPU, gloo): greedy output equals transformers token for token at
TP=2, PP=2 and TP=2 x PP=2, for each model family, with the all-reduce overlap on and off,
with TP collectives through shared memory (the default) and through gloo, with chunked
prefill and preemption forced, with fewer KV heads than TP ranks, with the workers' start-up
heaps frozen, and with steps reaching the workers through a compiled graph or plain actor calls
(PP groups keep a step a stage in flight: tests/distributed/test_pipeline_inflight.py)."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts, tiny_model

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A 64-token budget splits the 90-token prompt over two steps (mixed with the others), and
# 64-token steps are long enough to run in two overlap chunks of 32; 30 blocks of 4 tokens
# cannot hold all four sequences, so someone is preempted.
STRESS = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "num_kv_blocks": 30, "block_size": 4}
ON = {"overlap_comm": True}  # on CPU the overlap is off unless asked for

CASES = {
    # name: (model options, tp, pp, engine options)
    "llama-tp2-overlap-stress": (dict(arch="llama"), 2, 1, dict(STRESS, **ON)),
    "llama-tp2-serial-stress": (dict(arch="llama"), 2, 1, dict(STRESS, overlap_comm=False)),
    "llama-tp2-gloo-overlap-stress": (dict(arch="llama"), 2, 1, dict(STRESS, shm_collectives=False, **ON)),
    "llama-tp2-default-stress": (dict(arch="llama"), 2, 1, dict(STRESS)),
    "llama-pp2-uneven-layers": (dict(arch="llama", num_hidden_layers=3), 1, 2, {}),
    # The compiled graph (GPU groups' default; CPU groups make plain actor calls) with two
    # steps in flight.
    "llama-tp2pp2-overlap": (dict(arch="llama"), 2, 2, dict(ON, freeze_startup_heap=True, compiled_graph=True)),
    "mistral-tp2pp2-overlap-stress": (dict(arch="mistral", sliding_window=8), 2, 2,
                                      dict(STRESS, compiled_graph=True, **ON)),
    "qwen2-tp2pp2-serial-stress": (dict(arch="qwen2"), 2, 2, dict(STRESS, overlap_comm=False)),
    "qwen2-tp2-overlap": (dict(arch="qwen2"), 2, 1, dict(ON)),
    "llama-kv1-tp2-overlap-stress": (dict(arch="llama", num_key_value_heads=1), 2, 1, dict(STRESS, **ON)),
}


def _model(spec: dict) -> str:
    spec = dict(spec)
    return tiny_model(spec.pop("arch"), **spec)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(ray_local, case: str) -> None:
    model_spec, tp, pp, options = CASES[case]
    model = _model(model_spec)
    prompts = mixed_prompts()
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)
    try:
        _count_overlapped_passes(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        num_overlapped = sum(w["num_overlapped"] for w in _describe(llm))
        if tp > 1 and options.get("overlap_comm"):
            assert num_overlapped > 0  # long steps ran in overlapped chunks
        else:
            assert num_overlapped == 0
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        engine = llm.engine
        if "stress" in case:
            assert engine.scheduler.num_preemptions > 0
        # Block accounting holds across the group: every worker sized the same cache, and
        # after all requests finish the engine's pool has all its blocks back.
        engine.pool.check_all_free()
        info = [w for w in _describe(llm)]
        assert {w["num_kv_blocks"] for w in info} == {engine.pool.num_blocks}
        _check_shards(info, model_spec, tp, pp)
        # Asked to, every worker froze what its start-up left (on CPU they do not by default).
        frozen = bool(options.get("freeze_startup_heap"))
        assert all(w["startup_heap_frozen"] is frozen and (w["gc_frozen_objects"] > 0) is frozen for w in info)
        # TP collectives go through shared memory unless turned off (one node here).
        expected_comm = "gloo" if options.get("shm_collectives") is False else "shm"
        assert [w.get("tp_comm") for w in info] == [expected_comm if tp > 1 else None] * (tp * pp)
        if case == "llama-tp2pp2-overlap":
            _check_seeded_sampling_and_overhead(llm, model)
            _check_structured_outputs(llm, model)
    finally:
        llm.shutdown()


def _describe(llm: LLM) -> list[dict]:
    import ray

    def describe(worker) -> dict:
        return worker.describe() | {"num_overlapped": len(getattr(worker, "overlapped", []))}

    return ray.get([w.__ray_call__.remote(describe) for w in llm.engine.executor.workers])


def _count_overlapped_passes(llm: LLM) -> None:
    """Record, in each worker, the forward passes that took the overlapped (chunked) path."""
    import ray

    def install(worker) -> None:
        model = worker.runner.model
        original = model._forward_overlapped
        worker.overlapped = []

        def spy(*args):
            worker.overlapped.append(args[-1])
            return original(*args)

        model._forward_overlapped = spy

    ray.get([w.__ray_call__.remote(install) for w in llm.engine.executor.workers])


def _check_shards(info: list[dict], model_spec: dict, tp: int, pp: int) -> None:
    """Each worker holds only its stage's layers and its share of the KV heads (the tiny
    models' LM head is under a layer's weight: the even split, earlier stages taking the extra)."""
    num_layers = model_spec.get("num_hidden_layers", 2)
    kv_heads = model_spec.get("num_key_value_heads", 2)
    expected = {(2, 1): [(0, 2)], (2, 2): [(0, 1), (1, 2)], (3, 2): [(0, 2), (2, 3)]}[num_layers, pp]
    for w in info:
        pp_rank = w["rank"] // tp
        assert tuple(w["layers"]) == expected[pp_rank]
        assert w["num_kv_heads"] == max(1, kv_heads // tp)  # replicated when kv_heads < tp
        assert w["num_threads"] == 1  # 2 cores shared by >= 2 workers


def _check_seeded_sampling_and_overhead(group: LLM, model: str) -> None:
    """Seeded sampling (done by the last stage's TP rank 0) gives the single-process result;
    and the per-step control cost of the group is measured against plain actor calls."""
    prompts = mixed_prompts(seed=4, lengths=(12, 30))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    single = LLM(model).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    outs = group.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in single]
    overhead = group.engine.executor.measure_control_overhead(num_steps=50)
    print("per-step control overhead:", overhead)
    assert overhead["compiled_graph"] and overhead["num_workers"] == 4 and overhead["step_ms"] > 0


def _check_structured_outputs(llm: LLM, model: str) -> None:
    """Grammar masks reach the sampling rank of the last stage (micro-batches split them):
    greedy output under a grammar equals transformers' under the same grammar."""
    from tests.model.test_structured_outputs import PROMPTS, SPECS, transformers_references

    references = transformers_references(model, ("json", "choice"))
    for kind in ("json", "choice"):
        params = SamplingParams(temperature=0.0, max_tokens=48, structured=SPECS[kind])
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == references[kind], kind
    llm.engine.pool.check_all_free()
