"""Model references: what the options accept, what a local directory resolves to, and what
build_app refuses before anything starts."""

from __future__ import annotations

import shutil

import pytest

from tandem.router.app import build_app
from tandem.workers.config import EngineConfig
from tandem.workers.model.source import BucketURI, is_hub_repo, resolve_model, tokenizer_dir, wanted


@pytest.mark.parametrize(("options", "message"), [
    ({"model": ""}, "model: must be a directory, a Hugging Face repo id or an s3:// or gs:// URI, got ''"),
    ({"model": "http://host/model"}, "model: http:// is not a model source; name a directory, a Hugging Face repo "
                                     "id (org/name), s3://bucket/prefix or gs://bucket/prefix, got 'http://host/model'"),
    ({"model": "s3:///prefix"}, "model: names no bucket: 's3:///prefix'"),
    ({"tokenizer": " org/tok"}, "tokenizer: must be a directory, a Hugging Face repo id or an s3:// or gs:// URI, "
                                "got ' org/tok'"),
    ({"revision": "v1"}, "revision: names a version of `model`, and no model is given"),
    ({"model": "org/name", "revision": ""}, "revision: must be a branch, tag or commit of the model's Hub repo, "
                                            "got ''"),
    ({"model": "gs://bucket/m", "revision": "v1"}, "revision: gs:// models have no revisions (a new version goes "
                                                   "under a new prefix)"),
    ({"speculative_model": "ftp://draft", "num_speculative_tokens": 2},
     "speculative_model: ftp:// is not a model source; name a directory, a Hugging Face repo id (org/name), "
     "s3://bucket/prefix or gs://bucket/prefix, got 'ftp://draft'"),
])
def test_the_options_refuse_what_names_no_model(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        EngineConfig.from_options(**options)
    assert str(caught.value) == message


def test_references_are_told_apart(llama_dir: str, tmp_path, monkeypatch) -> None:
    assert BucketURI.parse("s3://models/llama/8b/") == BucketURI("s3", "models", "llama/8b")
    assert str(BucketURI.parse("gs://models")) == "gs://models/"
    assert BucketURI.parse("org/name") is None
    with pytest.raises(ValueError, match=r"^model: 's3://models/\.\./etc' is not a s3://bucket/prefix URI$"):
        BucketURI.parse("s3://models/../etc")
    assert [is_hub_repo(r) for r in ("org/name", "Org/name-v1.5", "org/name/sub", "./org/name", "/org/name",
                                     "name", "-org/name")] == [True, True, False, False, False, False, False]
    # A directory of a repo's name is that directory.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(llama_dir, tmp_path / "org" / "name")
    assert not is_hub_repo("org/name")
    assert resolve_model("org/name") == "org/name"
    assert tokenizer_dir(llama_dir) == llama_dir
    assert [wanted(n, weights) for n in ("model-00001-of-00002.safetensors", "pytorch_model.bin", "sub/config.json",
                                         "tokenizer.model") for weights in (False, True)] == \
        [False, True, False, False, False, False, True, True]


def test_build_app_refuses_a_missing_or_empty_directory(llama_dir: str, tmp_path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError) as caught:
        build_app({"model": str(missing)})
    assert str(caught.value) == (f"model: {str(missing)!r} is no directory here, nor a Hugging Face repo id "
                                 f"(org/name), nor an s3:// or gs:// URI")
    with pytest.raises(ValueError) as caught:
        build_app({"model": str(tmp_path)})
    assert str(caught.value) == f"model: no config.json in {str(tmp_path)!r}"
    with pytest.raises(ValueError) as caught:
        build_app({"model": llama_dir, "revision": "v2"})
    assert str(caught.value) == (f"revision: {llama_dir!r} is a local directory, which has no revisions (a revision "
                                 f"names a version of a Hub repo)")
    with pytest.raises(ValueError) as caught:
        build_app({"model": llama_dir, "tokenizer": str(tmp_path)})
    assert str(caught.value) == f"tokenizer: no tokenizer_config.json or tokenizer.json in {str(tmp_path)!r}"
    build_app({"model": llama_dir, "tokenizer": llama_dir})
