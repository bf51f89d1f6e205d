"""bench/quality_model.py: the trained model's build (at a tiny spec, through the cached path
`bench quality` takes), its held-out prompts, and `bench quality` defaulting to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench import quality_model
from tandem.bench.quality_model import (
    HELDOUT_MODULES,
    TRAINING_RECORD,
    QualityModelSpec,
    build_quality_model,
    module_sources,
    quality_model_path,
    quality_text_prompts,
    training_record,
)
from tests.bench.conftest import bench

TINY = QualityModelSpec(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, seq_len=32,
                        batch_size=8, num_steps=30, lr=1e-2, warmup_steps=3, num_eval_windows=8)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> str:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        path = quality_model_path(TINY)
        assert quality_model_path(TINY) == path  # built once, then found
    return path


def test_the_build_is_a_checkpoint_whose_held_out_loss_went_down(trained_dir) -> None:
    assert Path(trained_dir).name == TINY.cache_name
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", TRAINING_RECORD):
        assert (Path(trained_dir) / name).is_file(), name
    record = training_record(trained_dir)
    assert record is not None and record["spec"]["num_steps"] == 30
    assert record["heldout_loss"] < record["heldout_loss_initial"] - 0.5
    assert record["unigram_heldout_loss"] > 0
    assert json.loads((Path(trained_dir) / "config.json").read_text())["vocab_size"] == 320
    assert training_record(str(Path(trained_dir).parent)) is None


def test_prompts_are_windows_of_the_held_out_text(trained_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    prompts = quality_text_prompts(tokenizer, 6, 40)
    assert prompts == quality_text_prompts(tokenizer, 6, 40)
    assert [len(p) for p in prompts] == [40] * 6 and len({tuple(p) for p in prompts}) == 6
    special = set(tokenizer.all_special_ids)
    assert all(t not in special and t < len(tokenizer) for p in prompts for t in p)
    heldout = "".join(module_sources(HELDOUT_MODULES))
    assert all(tokenizer.decode(p) in heldout for p in prompts)
    with pytest.raises(ValueError, match="fewer than the 10000 prompts"):
        quality_text_prompts(tokenizer, 10_000, 40)


def test_bench_quality_defaults_to_the_trained_model_and_its_text(trained_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(quality_model, "quality_model_path", lambda: trained_dir)
    figures = bench(tmp_path, "quality", "--quantization", "none", "--quick", "--num-prompts", "3",
                    "--prompt-len", "20")
    assert figures["model"] == trained_dir and figures["prompts"] == "held-out text"
    assert figures["heldout_loss"] == training_record(trained_dir)["heldout_loss"]
    assert figures["positions"] == 3 * 19
    assert figures["top1_agreement"] == 1.0 and figures["mean_kl"] == 0.0


def test_the_same_spec_builds_the_same_weights(trained_dir, tmp_path) -> None:
    record = build_quality_model(tmp_path, TINY, progress=False)
    assert record["heldout_loss"] == training_record(trained_dir)["heldout_loss"]
    assert (tmp_path / "model.safetensors").read_bytes() == (Path(trained_dir) / "model.safetensors").read_bytes()
