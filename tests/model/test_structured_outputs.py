"""Structured outputs in the engine: the output matches its grammar, and greedy output equals
transformers' greedy generation under the same grammar's masks, at every step layout."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tandem.workers.structured.grammar_cache import GrammarCompiler
from tandem.workers.structured.spec import StructuredSpec
from tests.conftest import mixed_prompts

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tag"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green"]}}}
SPECS = {
    "json": StructuredSpec.json_schema(SCHEMA),
    "regex": StructuredSpec("regex", "[a-z]{2,6}@(x|yz)\\.com"),
    "choice": StructuredSpec.choice(["alpha", "beta", "gamma delta"]),
    "grammar": StructuredSpec("grammar", 'root ::= "(" [0-9] [0-9]? ")" (" or " [a-c])?'),
}
PROMPTS = mixed_prompts(seed=41, lengths=(5, 19, 33))
MAX_TOKENS = 48


def matches(spec: StructuredSpec, text: str) -> bool:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "choice":
        return text in spec.choices()
    return re.fullmatch(r"\(\d\d?\)( or [a-c])?", text) is not None


class _GrammarProcessor:
    """transformers' side of the comparison: the same grammar's mask on each step's scores."""

    def __init__(self, compiler: GrammarCompiler, spec: StructuredSpec, prompt_len: int) -> None:
        import xgrammar as xgr

        self.matcher = compiler.matcher(compiler.compile(spec))
        self.bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from tandem.workers.structured.bitmask import apply_token_masks

        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bitmask)
        apply_token_masks(scores, [0], self.bitmask)
        return scores


def hf_constrained(model, compiler: GrammarCompiler, eos: list[int], prompt: list[int],
                   spec: StructuredSpec) -> list[int]:
    from transformers import LogitsProcessorList

    processor = _GrammarProcessor(compiler, spec, len(prompt))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, logits_processor=LogitsProcessorList([processor]))
    return out[0, len(prompt):].tolist()


def transformers_references(model_dir: str, kinds: tuple[str, ...] = tuple(SPECS)) -> dict[str, list[list[int]]]:
    """transformers' greedy output for PROMPTS under each of SPECS' grammars."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(model_dir), model.config.vocab_size, tuple(eos))
    return {kind: [hf_constrained(model, compiler, eos, p, SPECS[kind]) for p in PROMPTS] for kind in kinds}


@pytest.fixture(scope="module")
def references(llama_dir: str) -> dict[str, list[list[int]]]:
    return transformers_references(llama_dir)


def _generate(llm: LLM, spec: StructuredSpec, **params) -> list:
    return _generate_with(llm, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=spec, **params))


LAYOUTS = {
    "plain": {},
    "chunked, overlapped": {"max_num_batched_tokens": 16, "max_num_seqs": 2, "overlap_steps": True},
    "multi-step": {"num_scheduler_steps": 4, "overlap_steps": True},
    "preempt": {"block_size": 4, "num_kv_blocks": 24},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_output_is_transformers_under_the_same_grammar(llama_dir, references, layout, monkeypatch) -> None:
    from tandem.workers.structured.request_grammars import RequestGrammars

    early: list[str] = []  # sequences whose step was scheduled ahead of their last token
    accept_early = RequestGrammars.accept_early
    monkeypatch.setattr(RequestGrammars, "accept_early",
                        lambda self, seq, tokens: (early.append(seq), accept_early(self, seq, tokens)))
    llm = LLM(llama_dir, **LAYOUTS[layout])
    for kind, spec in SPECS.items():
        outs = _generate(llm, spec)
        assert [list(o.token_ids) for o in outs] == references[kind], kind
        eos = llm.engine.hf_config.eos_token_ids
        for o in outs:
            assert o.finish_reason == "stop" and o.token_ids[-1] in eos, (kind, o)
            assert matches(spec, o.text), (kind, o.text)
    assert len(llm.engine.grammars) == 0
    # Overlapped, grammar rows keep the overlap: their masks wait for the step in flight.
    assert bool(early) == bool(LAYOUTS[layout].get("overlap_steps")), len(early)
    llm.engine.pool.check_all_free()
    llm.shutdown()


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_with_a_grammar_changes_no_greedy_token(llama_dir, references, proposer) -> None:
    draft = "ngram" if proposer == "ngram" else llama_dir  # a self-draft proposes the unconstrained argmax
    llm = LLM(llama_dir, speculative_model=draft, num_speculative_tokens=3)
    for kind, spec in SPECS.items():
        assert [list(o.token_ids) for o in _generate(llm, spec)] == references[kind], kind
    assert llm.engine.num_draft_tokens > 0
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_sampled_outputs_match_their_grammar_for_every_sample(llama_dir) -> None:
    llm = LLM(llama_dir)
    for kind, spec in SPECS.items():
        params = SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=MAX_TOKENS, structured=spec)
        for request in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
            assert len(request.outputs) == 2
            for o in request.outputs:
                assert o.finish_reason == "stop" and matches(spec, o.text), (kind, o.text)
    llm.shutdown()


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos_and_min_tokens(llama_dir) -> None:
    llm = LLM(llama_dir)
    spec = SPECS["choice"]
    out = _generate(llm, spec, ignore_eos=True, min_tokens=20)
    assert all(o.finish_reason == "stop" and o.text in spec.choices() for o in out)
    llm.shutdown()


def test_an_uncompilable_spec_is_refused_and_an_abort_frees_the_matcher_and_the_kv(llama_dir) -> None:
    llm = LLM(llama_dir)
    engine = llm.engine
    with pytest.raises(ValueError, match="^the regex cannot be compiled: Regex parsing error at position 2"):
        engine.add_request("bad", {"prompt_token_ids": [11, 12]},
                           SamplingParams(structured=StructuredSpec("regex", "(")))
    assert "bad" not in engine.states and len(engine.grammars) == 0
    engine.add_request("r", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(n=2, max_tokens=MAX_TOKENS, structured=SPECS["grammar"]))
    engine.step()
    assert len(engine.grammars) == 2
    engine.abort_request("r")
    assert len(engine.grammars) == 0
    engine.pool.check_all_free()
    llm.shutdown()


def test_logit_bias_moves_the_logits_it_names(llama_dir) -> None:
    llm = LLM(llama_dir)
    [forced] = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={77: 100}),
                            use_tqdm=False)
    assert forced.outputs[0].token_ids == [77, 77, 77, 77]
    plain = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=1),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    [banned] = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                            SamplingParams(temperature=0.0, max_tokens=1, logit_bias={plain: -100}), use_tqdm=False)
    assert banned.outputs[0].token_ids[0] != plain
    llm.shutdown()


def test_sampled_grammar_rows_keep_the_overlap_and_sample_as_the_host_does(llama_dir, monkeypatch) -> None:
    """Overlapped, a step of sampled decodes is sampled on the device (PassSampler) with the
    grammar's masks, so the next step is scheduled ahead of it; seeded, its tokens are the host
    sampler's."""
    from tandem.workers.structured.request_grammars import RequestGrammars
    from tests.conftest import host_sampler

    early: list[str] = []
    accept_early = RequestGrammars.accept_early
    monkeypatch.setattr(RequestGrammars, "accept_early",
                        lambda self, seq, tokens: (early.append(seq), accept_early(self, seq, tokens)))

    def run() -> list[list[int]]:
        llm = LLM(llama_dir, overlap_steps=True)
        outs = []
        for kind, spec in SPECS.items():
            params = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS, structured=spec, min_tokens=2)
            for o in _generate_with(llm, params):
                assert o.finish_reason == "stop" and matches(spec, o.text), (kind, o.text)
                outs.append(list(o.token_ids))
        llm.shutdown()
        return outs

    on_device = run()
    assert early  # sampled grammar rows were scheduled ahead of
    with host_sampler():
        assert run() == on_device


def _generate_with(llm: LLM, params: SamplingParams) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
