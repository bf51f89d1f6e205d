"""Processes that never run the model import no torch (~230 MB and seconds of CPU each): an
ingress replica, to start and for its text work (xgrammar, for a structured output's grammar
check, is the one thing there that imports it), and whatever builds the application
(`tandem serve`'s driver, Serve's builder task)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tandem.workers.text.tokenizer import load_tokenizer
from tests.conftest import tiny_model


def _probe(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=dict(os.environ), capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("remembered", [True, False])
def test_an_ingress_start_and_its_text_work_import_no_torch(tmp_path, monkeypatch, remembered):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    model_dir = tiny_model("llama")
    if remembered:
        load_tokenizer(model_dir)  # what the node's group does: AutoTokenizer picks, and the pick is remembered
    # What OpenAIIngress.__init__ reads and the text modules it uses, then a chat prompt encoded
    # and decoded.
    out = _probe(f"""
        import sys
        import tandem.router.ingress
        from tandem.router.text_work import TextWork
        from tandem.workers.model.hf_config import HFModelConfig
        from tandem.workers.model.source import tokenizer_dir
        from tandem.workers.text.detokenizer import IncrementalDetokenizer
        from tandem.workers.text.tokenizer import apply_chat_template, load_tokenizer

        config = HFModelConfig.from_dir({model_dir!r})
        tokenizer = load_tokenizer(tokenizer_dir({model_dir!r}), pick_in_child=True)
        prompt = apply_chat_template(tokenizer, [{{"role": "user", "content": "hi"}}])
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        print(config.vocab_size, tokenizer.decode(ids) == prompt, "torch" in sys.modules)
    """)
    assert out.split() == ["512", "True", "False"]
    assert len(list((tmp_path / "tokenizer-classes").iterdir())) == 1  # remembered either way


def test_building_the_application_imports_no_torch() -> None:
    model_dir = tiny_model("llama")
    assert _probe(f"""
        import sys
        from tandem.router.app import build_app
        build_app({{"model": {model_dir!r}}})
        print("torch" in sys.modules)
    """) == "False"


@pytest.mark.parametrize("count,visible,expected", [
    (0, None, False), (2, None, True), (2, ["1"], True), (2, [], False), (0, ["0"], False)])
def test_gpus_visible_counts_as_a_ray_started_here_would(monkeypatch, count, visible, expected) -> None:
    import ray
    from ray._private.accelerators import NvidiaGPUAcceleratorManager

    from tandem.router.app import gpus_visible

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # no cluster joined: this machine's GPUs
    monkeypatch.setattr(NvidiaGPUAcceleratorManager, "get_current_node_num_accelerators", staticmethod(lambda: count))
    monkeypatch.setattr(NvidiaGPUAcceleratorManager, "get_current_process_visible_accelerator_ids",
                        staticmethod(lambda: visible))
    assert gpus_visible() is expected
