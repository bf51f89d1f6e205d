"""Tests for tandem.workers.model.demo_model: the locally generated tokenizer and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.workers.model import demo_model
from tandem.workers.model.demo_model import build_tokenizer, create_model_dir

MULTIBYTE_TEXT = "Héllo wörld, naïve café! 日本語 😀🚀 鬱 x . y\n\tz  12345 <|im_end|> done"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512, seed=0)


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_tokenizer_is_deterministic(tok) -> None:
    again = build_tokenizer(512, seed=0)
    assert again.get_vocab() == tok.get_vocab()
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert build_tokenizer(512, seed=1).get_vocab() != tok.get_vocab()


def test_tokenizer_size_and_special_tokens(tok) -> None:
    assert len(tok) == 512
    ids = {t: tok.convert_tokens_to_ids(t) for t in demo_model.SPECIAL_TOKENS}
    assert list(ids.values()) == [0, 1, 2, 3, 4]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert set(tok.all_special_ids) == {0, 1, 2, 3, 4}
    # Special tokens written in text are single tokens, not byte soup.
    assert tok("<|im_start|>", add_special_tokens=False).input_ids == [ids["<|im_start|>"]]


def test_bos_added_by_post_processor(tok) -> None:
    assert tok("hi").input_ids[0] == tok.bos_token_id
    assert tok.bos_token_id not in tok("hi", add_special_tokens=False).input_ids
    assert tok("hi").input_ids[1:] == tok("hi", add_special_tokens=False).input_ids


def test_chat_template(tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == expected + "<|im_start|>assistant\n"


@pytest.mark.parametrize("size", [512, 4096])
def test_round_trip_multibyte(size: int) -> None:
    tk = build_tokenizer(size, seed=0)
    ids = tk(MULTIBYTE_TEXT).input_ids
    assert tk.decode(ids, skip_special_tokens=True) == MULTIBYTE_TEXT.replace("<|im_end|>", "")
    assert tk.decode(ids) == "<|bos|>" + MULTIBYTE_TEXT
    # Some tokens must end inside a UTF-8 character: serving has to detokenise incrementally.
    assert any("\ufffd" in tk.decode([i]) for i in ids)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_create_model_dir_loads_back(tmp_path: Path, tok, arch: str) -> None:
    path = create_model_dir(tmp_path / arch, architecture=arch, tokenizer=tok, seed=3)
    assert path == str(tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    loaded_tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.architectures == [type(model).__name__]
    assert cfg.vocab_size == len(loaded_tok) == len(tok)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == [1, 4]
    # The reloaded tokenizer (Qwen2Tokenizer for qwen2) must encode exactly like the original.
    assert loaded_tok(MULTIBYTE_TEXT).input_ids == tok(MULTIBYTE_TEXT).input_ids
    assert loaded_tok.chat_template == tok.chat_template
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == (arch == "qwen2") == cfg.tie_word_embeddings
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    # The wide init makes greedy decoding decisive: top-1 clearly beats top-2.
    with torch.no_grad():
        logits = model(**loaded_tok("hello world", return_tensors="pt")).logits[0, -1]
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() > 1e-3


def test_defaults_build_their_own_tokenizer(tmp_path: Path) -> None:
    path = create_model_dir(tmp_path / "m", vocab_size=300)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["vocab_size"] == len(AutoTokenizer.from_pretrained(path)) == 300
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0


def test_same_seed_same_weights(tmp_path: Path, tok) -> None:
    a = _state_dict(Path(create_model_dir(tmp_path / "a", tokenizer=tok, seed=7)))
    b = _state_dict(Path(create_model_dir(tmp_path / "b", tokenizer=tok, seed=7)))
    c = _state_dict(Path(create_model_dir(tmp_path / "c", tokenizer=tok, seed=8)))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    # init_std is honoured (not the HF default 0.02) and norms sit around 1.
    assert 0.12 < a["model.embed_tokens.weight"].std().item() < 0.18
    assert abs(a["model.norm.weight"].mean().item() - 1.0) < 0.05


def test_sharded_save(tmp_path: Path, tok) -> None:
    path = Path(create_model_dir(tmp_path / "s", tokenizer=tok, max_shard_size="200KB"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards == {f.name for f in path.glob("*.safetensors")}
    model = AutoModelForCausalLM.from_pretrained(path)
    assert set(index["weight_map"]) == set(model.state_dict())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_saved_dtype(tmp_path: Path, tok, dtype: str) -> None:
    path = Path(create_model_dir(tmp_path / dtype, tokenizer=tok, dtype=dtype))
    tensors = _state_dict(path)
    assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype


def test_rope_scaling_and_sliding_window(tmp_path: Path, tok) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = create_model_dir(tmp_path / "r", tokenizer=tok, rope_scaling=scaling, rope_theta=5e5)
    rope = json.loads((Path(path) / "config.json").read_text())["rope_parameters"]
    assert rope == {**scaling, "rope_theta": 5e5}
    path = create_model_dir(tmp_path / "w", architecture="mistral", tokenizer=tok, sliding_window=16)
    assert AutoModelForCausalLM.from_pretrained(path).config.sliding_window == 16
    # Mistral's config defaults to a 4096 window; not asking for one must mean full attention.
    path = create_model_dir(tmp_path / "f", architecture="mistral", tokenizer=tok)
    assert AutoModelForCausalLM.from_pretrained(path).config.sliding_window is None


def test_bad_arguments(tmp_path: Path, tok) -> None:
    with pytest.raises(ValueError):
        create_model_dir(tmp_path / "x", architecture="gpt2", tokenizer=tok)
    with pytest.raises(ValueError):
        create_model_dir(tmp_path / "x", dtype="int8", tokenizer=tok)


def test_demo_model_path_created_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    first = demo_model.demo_model_path()
    assert first == str(tmp_path / "cache" / "demo-llama-v1")
    assert "creating" in capsys.readouterr().err
    mtime = Path(first, "config.json").stat().st_mtime_ns
    assert demo_model.demo_model_path() == first
    assert capsys.readouterr().err == ""  # second call reuses the directory
    assert Path(first, "config.json").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["demo-llama-v1"]  # no temp left
    cfg = json.loads(Path(first, "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (256, 4, 4)
    assert cfg["vocab_size"] == len(AutoTokenizer.from_pretrained(first)) == 4096


def test_lost_race_uses_existing_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tok) -> None:
    """If another process renames its copy into place first, ours is discarded, not an error."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    target = tmp_path / "race-v1"
    real_create = demo_model.create_model_dir

    def create_while_racing(path: Path, **spec: object) -> str:
        real_create(target, tokenizer=tok)  # the "other process" wins while we build
        (target / "winner").touch()
        return real_create(path, tokenizer=tok)

    monkeypatch.setattr(demo_model, "create_model_dir", create_while_racing)
    assert demo_model._cached_model("race-v1") == str(target)
    assert (target / "winner").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["race-v1"]


def test_spec_pair_draft_is_the_targets_first_layers(tmp_path: Path, tok) -> None:
    target, draft = demo_model.create_spec_pair(tmp_path, num_draft_layers=1, tail_scale=1e-4, tokenizer=tok,
                                                num_hidden_layers=3, seed=3)
    assert (target, draft) == (str(tmp_path / "target"), str(tmp_path / "draft"))
    base = _state_dict(Path(create_model_dir(tmp_path / "base", tokenizer=tok, num_hidden_layers=3, seed=3)))
    t, d = _state_dict(Path(target)), _state_dict(Path(draft))
    muted = {f"model.layers.{i}.{w}.weight" for i in (1, 2) for w in ("self_attn.o_proj", "mlp.down_proj")}
    assert t.keys() == base.keys()
    assert all(torch.equal(t[k], base[k] * 1e-4 if k in muted else base[k]) for k in t)
    assert d.keys() == {k for k in t if not k.startswith(("model.layers.1.", "model.layers.2."))}
    assert all(torch.equal(d[k], t[k]) for k in d)
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["num_hidden_layers"] == 1
    assert AutoTokenizer.from_pretrained(draft).get_vocab() == tok.get_vocab()


def test_spec_pair_greedy_agrees_in_transformers(tmp_path: Path, tok) -> None:
    target, draft = demo_model.create_spec_pair(tmp_path, num_draft_layers=2, tokenizer=tok, num_hidden_layers=6,
                                                hidden_size=64, intermediate_size=128, seed=4)
    prompt = torch.tensor([[5, 17, 300, 42, 9, 77, 120, 3]])
    outs = [AutoModelForCausalLM.from_pretrained(p).generate(prompt, max_new_tokens=32, do_sample=False,
                                                             pad_token_id=2, eos_token_id=None)
            for p in (target, draft)]
    assert torch.equal(outs[0], outs[1])


def test_spec_pair_needs_layers_to_mute(tmp_path: Path, tok) -> None:
    with pytest.raises(ValueError, match="num_draft_layers"):
        demo_model.create_spec_pair(tmp_path, num_draft_layers=2, tokenizer=tok, num_hidden_layers=2)


def test_finding_the_built_demo_model_imports_neither_torch_nor_transformers() -> None:
    """A group serving the demo model asks where it is at every start: that costs no imports."""
    import subprocess
    import sys

    demo_model.demo_model_path()  # built (once per cache dir) here, not in the child
    script = ("import sys\n"
              "from tandem.workers.model.demo_model import demo_model_path\n"
              "demo_model_path()\n"
              "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
