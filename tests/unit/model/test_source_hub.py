"""Models named by Hugging Face repo id, fetched from a Hub on localhost (fake_hub.py) through
huggingface_hub: the revision chosen, only the files the engine reads, HF_TOKEN sent, and the
early check build_app makes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import pytest
from safetensors.torch import load_file, save

from tandem.router.app import build_app
from tandem.workers.llm import LLM
from tandem.workers.model.source import check_model_source, resolve_model, tokenizer_dir
from tandem.workers.text.tokenizer import load_tokenizer
from tests.unit.model.fake_hub import FakeHub, files_of
from tests.unit.model.served_tokens import greedy_tokens

METADATA = ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
# What a repo holds beside the model, which the engine never reads: never fetched.
EXTRAS = {"pytorch_model.bin": b"pickled weights", "original/consolidated.00.pth": b"other weights",
          "README.md": b"# tiny"}


@dataclass(frozen=True)
class Hub:
    server: FakeHub
    commits: dict[str, str]  # acme/tiny's revisions -> commits
    v2_dir: str  # acme/tiny at v2, as a local directory


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Hub:
    from tests.conftest import tiny_model

    files = files_of(tiny_model("llama"))
    # v2: the same model with other weights (every tensor halved), so its greedy tokens differ.
    tensors = {name: t * 0.5 for name, t in load_file(f"{tiny_model('llama')}/model.safetensors").items()}
    v2 = {**files, "model.safetensors": save(tensors, metadata={"format": "pt"})}
    v2_dir = tmp_path_factory.mktemp("v2")
    for name, data in v2.items():
        (v2_dir / name).write_bytes(data)
    server = FakeHub()
    commits = server.add("acme/tiny", {"main": {**files, **EXTRAS}, "v2": {**v2, **EXTRAS}})
    server.add("acme/tok", {"main": {name: files[name] for name in ("tokenizer.json", "tokenizer_config.json")}})
    server.add("acme/empty", {"main": {"README.md": b"no model here"}})
    server.start()
    yield Hub(server, commits, str(v2_dir))
    server.stop()


@pytest.fixture
def online(hub: Hub, tmp_path, monkeypatch) -> Hub:
    """The Hub at HF_ENDPOINT, a cache of this test's own, no token (nor one saved by a login), and
    online (tests/conftest.py sets HF_HUB_OFFLINE, which huggingface_hub reads once, at import)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub.server.requests.clear()
    return hub


def test_a_repo_is_fetched_at_its_revision_with_only_the_files_the_engine_reads(online: Hub, tmp_path) -> None:
    snapshots = tmp_path / "hf" / "models--acme--tiny" / "snapshots"
    config_only = resolve_model("acme/tiny", weights=False)  # what the ingress reads: no weights
    assert config_only == str(snapshots / online.commits["main"])
    assert sorted(os.listdir(config_only)) == METADATA
    assert resolve_model("acme/tiny") == config_only
    assert sorted(os.listdir(config_only)) == sorted(METADATA + ["model.safetensors"])
    v2 = resolve_model("acme/tiny", "v2")
    assert v2 == str(snapshots / online.commits["v2"])
    assert Path(v2, "model.safetensors").read_bytes() == Path(online.v2_dir, "model.safetensors").read_bytes()
    assert Path(config_only, "model.safetensors").read_bytes() != Path(v2, "model.safetensors").read_bytes()
    # A commit names its revision too.
    assert resolve_model("acme/tiny", online.commits["v2"]) == v2


def test_hf_token_goes_to_the_hub_as_a_bearer_token(online: Hub, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_tandem_test")
    resolve_model("acme/tiny", weights=False)
    check_model_source("acme/tiny", "v2")
    requests = online.server.requests
    assert requests[0] == ("GET", "/api/models/acme/tiny/revision/main", "Bearer hf_tandem_test")
    assert ("HEAD", f"/acme/tiny/resolve/{online.commits['v2']}/config.json", "Bearer hf_tandem_test") in requests
    assert {auth for _, _, auth in requests} == {"Bearer hf_tandem_test"}


def test_the_tokenizer_loads_from_its_own_repo_or_the_models(online: Hub, llama_dir: str) -> None:
    text = "The quick brown fox, 12345"
    expected = load_tokenizer(llama_dir)(text).input_ids
    own = tokenizer_dir("acme/tiny", "acme/tok")
    assert sorted(os.listdir(own)) == ["tokenizer.json", "tokenizer_config.json"]
    assert load_tokenizer(own)(text).input_ids == expected
    assert load_tokenizer(tokenizer_dir("acme/tiny", revision="v2"))(text).input_ids == expected


def test_llm_serves_the_revision_it_is_given(online: Hub, llama_dir: str) -> None:
    v2 = greedy_tokens(LLM("acme/tiny", revision="v2", kv_cache_memory=8 << 20))
    assert v2 == greedy_tokens(LLM(online.v2_dir, kv_cache_memory=8 << 20))
    assert v2 != greedy_tokens(LLM(llama_dir, kv_cache_memory=8 << 20))


def test_build_app_refuses_what_the_hub_does_not_have_and_fetches_nothing(online: Hub, tmp_path) -> None:
    url = online.server.url
    with pytest.raises(ValueError, match=rf"^model: cannot find 'acme/missing' at main on {url}: no such repo "):
        build_app({"model": "acme/missing"})
    with pytest.raises(ValueError, match=rf"^model: cannot find 'acme/tiny' at v9 on {url}: the repo has no "
                                         r"revision 'v9'$"):
        build_app({"model": "acme/tiny", "revision": "v9"})
    with pytest.raises(ValueError, match=r"^model: the Hub repo 'acme/empty' at main has no config.json$"):
        build_app({"model": "acme/empty"})
    with pytest.raises(ValueError, match=r"^tokenizer: the Hub repo 'acme/empty' at main has no "
                                         r"tokenizer_config.json or tokenizer.json$"):
        build_app({"model": "acme/tiny", "tokenizer": "acme/empty"})
    online.server.requests.clear()
    build_app({"model": "acme/tiny", "revision": "v2"})
    assert online.server.requests == [("GET", "/api/models/acme/tiny/revision/v2", None),
                                      ("HEAD", f"/acme/tiny/resolve/{online.commits['v2']}/config.json", None)]
    assert not (tmp_path / "hf").exists()


def test_offline_the_check_looks_in_the_cache(online: Hub, monkeypatch) -> None:
    resolve_model("acme/tiny", weights=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    online.server.requests.clear()
    check_model_source("acme/tiny")
    with pytest.raises(ValueError, match=r"^model: HF_HUB_OFFLINE is set and 'acme/tiny' at v2 is not in the "
                                         r"Hugging Face cache"):
        check_model_source("acme/tiny", "v2")
    assert online.server.requests == []

