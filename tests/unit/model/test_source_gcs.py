"""Models at gs:// URIs, fetched through google-cloud-storage from a Cloud Storage on localhost
(fake_gcs.py) at STORAGE_EMULATOR_HOST."""

from __future__ import annotations

import os

import pytest

from tandem.router.app import build_app
from tandem.workers.model.source import resolve_model
from tests.unit.model.fake_gcs import FakeGCS
from tests.unit.model.fake_hub import files_of

pytest.importorskip("google.cloud.storage")


@pytest.fixture
def gcs(llama_dir: str, tmp_path, monkeypatch):
    files = files_of(llama_dir)
    server = FakeGCS({"models": {**{f"tiny/{name}": data for name, data in files.items()},
                                 "tiny/pytorch_model.bin": b"pickled weights", "tiny/sub/config.json": b"{}",
                                 "weights-only/model.safetensors": files["model.safetensors"]}}).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    monkeypatch.setenv("TANDEM_MODEL_CACHE", str(tmp_path / "models"))
    yield tmp_path / "models"
    server.stop()


def test_a_gs_model_lands_in_the_cache_with_only_the_files_the_engine_reads(gcs, llama_dir: str) -> None:
    target = gcs / "gs" / "models" / "tiny"
    assert resolve_model("gs://models/tiny") == str(target)
    assert sorted(os.listdir(target)) == [".tandem-weights-complete", "chat_template.jinja", "config.json",
                                          "generation_config.json", "model.safetensors", "tokenizer.json",
                                          "tokenizer_config.json"]
    assert (target / "model.safetensors").read_bytes() == open(f"{llama_dir}/model.safetensors", "rb").read()


def test_build_app_refuses_a_gs_prefix_without_a_model(gcs) -> None:
    with pytest.raises(ValueError, match=r"^model: no config.json under gs://models/weights-only$"):
        build_app({"model": "gs://models/weights-only"})
    with pytest.raises(ValueError, match=r"^model: cannot list gs://elsewhere/tiny: 404 GET "):
        build_app({"model": "gs://elsewhere/tiny"})
    build_app({"model": "gs://models/tiny"})
    assert not gcs.exists()
