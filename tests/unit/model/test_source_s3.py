"""Models at s3:// URIs, fetched from moto's S3 server on localhost through boto3: into the
cache once per node (one fetch however many ask at once), a fetch cut short finished, never
read as whole, and the early check build_app makes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tandem.cluster.net import free_port
from tandem.router.app import build_app
from tandem.workers.llm import LLM
from tandem.workers.model.source import check_model_source, resolve_model
from tests.unit.model.fake_hub import files_of
from tests.unit.model.served_tokens import greedy_tokens

MODEL_FILES = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"]
# What a prefix holds beside the model, which the engine never reads: never fetched.
EXTRAS = {"pytorch_model.bin": b"pickled weights", "original/model.safetensors": b"another model", "README.md": b"#"}


@pytest.fixture(scope="module")
def s3(llama_dir: str):
    """moto's S3 at AWS_ENDPOINT_URL (dummy credentials): bucket `models` holds the tiny llama
    under tiny/ beside files the engine never reads, and under weights-only/ its weights alone."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server._port}")
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        files = files_of(llama_dir)
        for name, data in {**files, **EXTRAS}.items():
            client.put_object(Bucket="models", Key=f"tiny/{name}", Body=data)
        client.put_object(Bucket="models", Key="weights-only/model.safetensors", Body=files["model.safetensors"])
        yield client
    server.stop()


@pytest.fixture
def cache(s3, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TANDEM_MODEL_CACHE", str(tmp_path / "models"))
    return tmp_path / "models"


def _fetches(caplog) -> list[str]:
    return [r.getMessage().split(" into ")[0] for r in caplog.records if r.name == "tandem.workers.model.source"]


def test_a_model_lands_in_the_cache_once(cache: Path, llama_dir: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem.workers.model.source")
    target = cache / "s3" / "models" / "tiny"
    assert resolve_model("s3://models/tiny", weights=False) == str(target)  # configs and tokenizer only
    assert sorted(os.listdir(target)) == [".tandem-metadata-complete"] + [f for f in MODEL_FILES
                                                                          if f != "model.safetensors"]
    assert resolve_model("s3://models/tiny/") == str(target)
    assert resolve_model("s3://models/tiny") == str(target)
    assert resolve_model("s3://models/tiny", weights=False) == str(target)
    assert sorted(os.listdir(target)) == [".tandem-metadata-complete", ".tandem-weights-complete"] + MODEL_FILES
    assert _fetches(caplog) == ["s3://models/tiny: fetching 5 of 5 files (0.0 MB)",
                                "s3://models/tiny: fetching 1 of 6 files (0.6 MB)"]
    for name in MODEL_FILES:
        assert (target / name).read_bytes() == Path(llama_dir, name).read_bytes()


def test_concurrent_resolves_fetch_once(cache: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem.workers.model.source")
    start = threading.Barrier(4)
    paths: list[str] = []

    def resolve() -> None:
        start.wait()
        paths.append(resolve_model("s3://models/tiny"))

    threads = [threading.Thread(target=resolve) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # flock's lock goes with each open file: threads wait for each other as processes do.
    assert paths == [str(cache / "s3" / "models" / "tiny")] * 4
    assert _fetches(caplog) == ["s3://models/tiny: fetching 6 of 6 files (0.6 MB)"]


def test_a_fetch_cut_short_is_finished_never_read_as_whole(cache: Path, llama_dir: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem.workers.model.source")
    target = cache / "s3" / "models" / "tiny"
    target.mkdir(parents=True)
    # What a fetch that died leaves: files renamed into place (whole), one still under its
    # temporary name, and no marker.
    for name in ("config.json", "tokenizer.json"):
        (target / name).write_bytes(Path(llama_dir, name).read_bytes())
    (target / ".model.safetensors.x1.part").write_bytes(b"half")
    assert resolve_model("s3://models/tiny") == str(target)
    assert _fetches(caplog) == ["s3://models/tiny: fetching 4 of 6 files (0.6 MB)"]
    assert sorted(os.listdir(target)) == [".model.safetensors.x1.part", ".tandem-weights-complete"] + MODEL_FILES
    assert (target / "model.safetensors").read_bytes() == Path(llama_dir, "model.safetensors").read_bytes()


def test_llm_serves_an_s3_model_and_draft_as_their_local_directory(cache: Path, llama_dir: str) -> None:
    local = greedy_tokens(LLM(llama_dir, kv_cache_memory=8 << 20))
    assert greedy_tokens(LLM("s3://models/tiny", kv_cache_memory=8 << 20)) == local
    # A draft from S3 too: the target's own weights, so every draft token is the target's.
    drafted = LLM(llama_dir, speculative_model="s3://models/tiny", num_speculative_tokens=2, kv_cache_memory=8 << 20)
    proposer = drafted.engine.proposer
    assert greedy_tokens(drafted) == local
    assert proposer.core is not None and proposer.core.num_batches[""] > 0  # it drafted, and never failed


def test_build_app_refuses_a_prefix_without_a_model_and_fetches_nothing(cache: Path) -> None:
    with pytest.raises(ValueError, match=r"^model: no config.json under s3://models/weights-only$"):
        build_app({"model": "s3://models/weights-only"})
    with pytest.raises(ValueError, match=r"^model: nothing under s3://models/nowhere \(or no access to it\)$"):
        build_app({"model": "s3://models/nowhere"})
    with pytest.raises(ValueError, match=r"^model: cannot list s3://no-such-bucket/tiny: .*NoSuchBucket"):
        build_app({"model": "s3://no-such-bucket/tiny"})
    with pytest.raises(ValueError, match=r"^speculative_model: no config.json under s3://models/weights-only$"):
        build_app({"speculative_model": "s3://models/weights-only", "num_speculative_tokens": 2})
    build_app({"model": "s3://models/tiny", "tokenizer": "s3://models/tiny"})
    assert not cache.exists()
    check_model_source("s3://models/tiny")


def test_gs_without_google_cloud_storage_names_the_package() -> None:
    # google.cloud.storage as if not installed: an import of it fails.
    script = ("import sys; sys.modules['google.cloud.storage'] = None\n"
              "from tandem.workers.model.source import resolve_model\n"
              "try:\n    resolve_model('gs://bucket/model')\n"
              "except ValueError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == "model: gs:// models need google-cloud-storage (pip install 'tandem[gcs]')\n"
