"""The remembered tokenizer class (workers/text/tokenizer_class.py): a load through it is the
tokenizer AutoTokenizer loads, and it imports no torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tandem.workers.text.tokenizer import apply_chat_template, load_tokenizer
from tandem.workers.text.tokenizer_class import entry_key, picked_in_child, remember_class, remembered_class
from tests.conftest import ARCHITECTURES, tiny_model

TEXTS = ["Hello world", "  two  spaces, tabs\tand\nnew lines", "<|im_start|>user\nhi<|im_end|>", "日本語 ü ß 🙂"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer-classes"


def _tokenizer_copy(tmp_path, architecture: str, declared_class: str | None = None) -> str:
    """The tokenizer and config files of a test model (no weights), its declared class replaced."""
    source = tiny_model(architecture)
    target = tmp_path / f"{architecture}-{declared_class}"
    target.mkdir()
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            shutil.copy2(os.path.join(source, name), target / name)
    if declared_class is not None:
        config = json.loads((target / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = declared_class
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    return str(target)


def _behaviour(tokenizer) -> dict:
    return {
        "class": type(tokenizer),
        "backend": tokenizer.backend_tokenizer.to_str(),
        "encoded": [tokenizer(text)["input_ids"] for text in TEXTS],
        "plain": [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS],
        "decoded": [tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) for text in TEXTS],
        "special_ids": tokenizer.all_special_ids,
        "added": {i: str(token) for i, token in tokenizer.added_tokens_decoder.items()},
        "eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id, "pad": tokenizer.pad_token_id,
        "chat": apply_chat_template(tokenizer, MESSAGES),
    }


@pytest.mark.parametrize("architecture,declared_class", [
    *[(a, None) for a in ARCHITECTURES],
    # Declared Llama over a ByteLevel tokenizer.json: AutoTokenizer loads TokenizersBackend instead.
    ("llama", "LlamaTokenizerFast"),
    ("llama", "PreTrainedTokenizerFast"),
    ("mistral", "GPT2TokenizerFast"),
    # A model-specific class a declared one names: loaded as that class.
    ("llama", "GPT2TokenizerFast"),
    ("llama", "Qwen2TokenizerFast"),
])
def test_a_remembered_class_loads_what_autotokenizer_loads(tmp_path, cache, architecture, declared_class):
    from transformers import AutoTokenizer

    model_dir = _tokenizer_copy(tmp_path, architecture, declared_class)
    reference = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert remembered_class(model_dir) is None
    first = load_tokenizer(model_dir)  # picked by AutoTokenizer, and remembered
    assert remembered_class(model_dir) is type(reference)
    again = load_tokenizer(model_dir)  # through the remembered class
    assert _behaviour(first) == _behaviour(reference)
    assert _behaviour(again) == _behaviour(reference)
    assert len(list(cache.iterdir())) == 1


def test_qwen2_is_remembered_as_the_class_autotokenizer_rebuilds_it_as(tmp_path, cache):
    model_dir = _tokenizer_copy(tmp_path, "qwen2")
    assert json.loads(open(os.path.join(model_dir, "tokenizer_config.json")).read())["tokenizer_class"] \
        == "TokenizersBackend"
    load_tokenizer(model_dir)
    assert remembered_class(model_dir).__name__ == "Qwen2Tokenizer"


@pytest.mark.parametrize("architecture,name", [("llama", "TokenizersBackend"), ("qwen2", "Qwen2Tokenizer")])
def test_a_load_through_a_remembered_class_imports_no_torch(tmp_path, cache, architecture, name):
    model_dir = _tokenizer_copy(tmp_path, architecture)
    load_tokenizer(model_dir)
    probe = textwrap.dedent(f"""
        import sys
        from tandem.workers.text.tokenizer import load_tokenizer
        tokenizer = load_tokenizer({model_dir!r})
        print(type(tokenizer).__name__, "torch" in sys.modules, tokenizer.encode("Hello world"))
    """)
    env = dict(os.environ, TANDEM_CACHE_DIR=str(cache.parent))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    loaded, torch_loaded, ids = out.stdout.split(" ", 2)
    assert (loaded, torch_loaded) == (name, "False")
    assert ids.strip() == str(load_tokenizer(model_dir).encode("Hello world"))


def test_the_key_changes_with_the_tokenizer_files_not_with_the_weights(tmp_path, cache):
    model_dir = _tokenizer_copy(tmp_path, "llama")
    key = entry_key(model_dir)
    shutil.copy2(os.path.join(tiny_model("llama"), "model.safetensors"), os.path.join(model_dir, "model.safetensors"))
    open(os.path.join(model_dir, ".tandem-weights-complete"), "w").close()
    assert entry_key(model_dir) == key  # a group's fetch brings the weights; an ingress's does not
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config = json.loads(open(config_path).read())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        f.write(json.dumps(config))
    os.utime(config_path, ns=(1, 1))
    assert entry_key(model_dir) != key
    open(os.path.join(model_dir, "tekken.json"), "w").close()  # a new file AutoTokenizer might read
    assert entry_key(model_dir) != key
    assert entry_key(_tokenizer_copy(tmp_path, "mistral")) != entry_key(_tokenizer_copy(tmp_path, "qwen2"))


def test_remote_code_and_unreadable_entries_are_never_used(tmp_path, cache):
    model_dir = _tokenizer_copy(tmp_path, "llama")
    remember_class(model_dir, type("RemoteTokenizer", (), {"__module__": "transformers_modules.repo.tok"}))
    assert remembered_class(model_dir) is None and not cache.exists()
    cache.mkdir(parents=True)
    entry = cache / f"{entry_key(model_dir)}.json"
    for bad in ["not json", json.dumps({"module": "os", "name": "path"}),
                json.dumps({"module": "transformers", "name": "NoSuchTokenizer"}), json.dumps({"name": "x"})]:
        entry.write_text(bad)
        assert remembered_class(model_dir) is None
    entry.write_text("not json")
    assert type(load_tokenizer(model_dir)).__name__ == "TokenizersBackend"  # AutoTokenizer picks again
    assert remembered_class(model_dir).__name__ == "TokenizersBackend"


def test_a_pick_made_in_a_child_is_autotokenizers_and_is_remembered(tmp_path, cache):
    from transformers import AutoTokenizer

    model_dir = _tokenizer_copy(tmp_path, "qwen2")
    assert picked_in_child(model_dir) is type(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    assert remembered_class(model_dir).__name__ == "Qwen2Tokenizer"


def test_a_child_that_cannot_pick_leaves_the_reason_to_this_process(tmp_path, cache):
    missing = str(tmp_path / "no-such-model")
    os.mkdir(missing)
    assert picked_in_child(missing) is None
    with pytest.raises(ValueError, match="cannot load a tokenizer from"):
        load_tokenizer(missing, pick_in_child=True)
