"""The draft model core: drafts are the draft's greedy tokens, and groups sharing it keep
their sequences apart (one group's batch never drops another's)."""

from __future__ import annotations

import pytest

from tandem.workers.spec import draft_model as draft_module
from tandem.workers.spec.draft_model import DraftModelCore, DraftSettings
from tests.conftest import hf_greedy, mixed_prompts


@pytest.fixture(scope="module")
def core(llama_dir: str) -> DraftModelCore:
    return DraftModelCore(DraftSettings(model=llama_dir, k=3, block_size=4, num_kv_blocks=64))


def test_drafts_are_the_drafts_greedy_continuation(core: DraftModelCore, llama_dir: str) -> None:
    [prompt] = mixed_prompts(seed=71, lengths=(13,))
    drafts = core.propose({"a/0": prompt}, "a/")
    assert drafts["a/0"] == hf_greedy(llama_dir, [prompt], 3)[0]
    core.detach("a/")


def test_namespaces_keep_their_sequences_apart(core: DraftModelCore, llama_dir: str) -> None:
    p1, p2 = mixed_prompts(seed=72, lengths=(9, 14))
    expected = hf_greedy(llama_dir, [p1, p2], 6)
    core.attach("a/"), core.attach("b/")
    first = core.propose({"a/1": p1}, "a/")["a/1"]
    core.propose({"b/1": p2}, "b/")
    assert set(core.seqs) == {"a/1", "b/1"}  # b's batch did not drop a's sequence
    computed = core.seqs["a/1"].num_computed
    # a's next step (all three drafts accepted) reuses its KV: only the new tokens are computed.
    second = core.propose({"a/1": p1 + first}, "a/")["a/1"]
    assert first + second == expected[0]
    assert core.seqs["a/1"].num_computed == computed + 3 and "b/1" in core.seqs
    core.propose({}, "a/")  # a's request finished: its blocks go back, b's stay
    assert set(core.seqs) == {"b/1"}
    assert core.detach("b/") == 1 and core.seqs == {}
    assert core.detach("a/") == 0
    assert core.num_free_blocks() == core.pool.num_blocks


def test_a_silent_namespace_has_its_sequences_dropped(core: DraftModelCore, monkeypatch) -> None:
    p1, p2 = mixed_prompts(seed=73, lengths=(8, 8))
    core.propose({"gone/1": p1}, "gone/")
    monkeypatch.setattr(draft_module, "IDLE_NAMESPACE_S", -1.0)  # everyone else counts as silent now
    core.propose({"live/1": p2}, "live/")
    assert set(core.seqs) == {"live/1"}
    core.detach("live/"), core.detach("gone/")
    assert core.num_free_blocks() == core.pool.num_blocks
