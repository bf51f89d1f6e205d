"""A small Llama trained on the CPU on Python's own sources: the default model of `tandem bench quality`.

Every other model here has random weights, whose next-token distributions are nearly flat: the
top-1 token is a near-tie that any rounding flips, so a quantization's top-1 agreement on them
measures noise. This one is trained (briefly) on real text, so its distributions are peaked
where the text is predictable, as a real model's are.

Corpus: the `.py` sources of a fixed list of standard-library modules, read from this Python's
installation (so fixed per Python version). TRAIN_MODULES train the tokenizer (a byte-level
BPE with demo_model's pre-tokenizer and special tokens) and the model; HELDOUT_MODULES, other
files, give the held-out loss and the bench's prompts (`quality_text_prompts`).

`quality_model_path()` builds the checkpoint once into tandem's model cache (beside the bench
models, under a name hashing the spec, the version and Python's) and returns its path every
time after. The directory is an ordinary HF one (config, safetensors, tokenizer, generation
config) plus TRAINING_RECORD, the build's losses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

QUALITY_MODEL_VERSION = 1  # part of the cache key: a change to the build means a new directory
TRAINING_RECORD = "tandem_quality_model.json"
TRAIN_MODULES = (
    "argparse", "ast", "calendar", "collections", "csv", "dataclasses", "difflib", "enum", "fractions",
    "functools", "gettext", "heapq", "http.client", "inspect", "ipaddress", "json.decoder", "json.encoder",
    "logging", "shutil", "statistics", "subprocess", "tempfile", "threading", "typing", "urllib.parse",
)
HELDOUT_MODULES = ("textwrap", "configparser", "pickle", "tarfile")


@dataclass(frozen=True)
class QualityModelSpec:
    vocab_size: int = 2048
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    seq_len: int = 128  # tokens per training sequence
    batch_size: int = 16
    num_steps: int = 500
    lr: float = 3e-3  # peak: linear warm-up over warmup_steps, then cosine to lr / 10
    warmup_steps: int = 20
    num_eval_windows: int = 32  # held-out windows of seq_len tokens the losses are taken on
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.hidden_size % self.num_attention_heads == 0, (self.hidden_size, self.num_attention_heads)
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert 2 <= self.seq_len <= self.max_position_embeddings and self.num_steps >= 1

    @property
    def cache_name(self) -> str:
        key = (QUALITY_MODEL_VERSION, dataclasses.astuple(self), tuple(sys.version_info[:3]), TRAIN_MODULES,
               HELDOUT_MODULES)
        return f"quality-llama-{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"


QUALITY_MODEL = QualityModelSpec()


def quality_model_path(spec: QualityModelSpec = QUALITY_MODEL) -> str:
    """The trained checkpoint of `spec`, built on first use."""
    from tandem.workers.model.demo_model import cached_dir

    return cached_dir(spec.cache_name, lambda tmp: build_quality_model(tmp, spec),
                      what=f"training {spec.num_steps} steps on the CPU, ~2 minutes")


def module_sources(modules: tuple[str, ...]) -> list[str]:
    """Each module's source file, as text (a package: its __init__.py)."""
    texts = []
    for name in modules:
        found = importlib.util.find_spec(name)
        if found is None or found.origin is None or not found.origin.endswith(".py"):
            raise ValueError(f"no Python source for standard-library module {name!r}")
        texts.append(Path(found.origin).read_text(encoding="utf-8"))
    return texts


def quality_text_prompts(tokenizer: Any, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` windows of `prompt_len` tokens of the held-out sources, evenly spread over
    all of the files' non-overlapping windows (none crosses a file's end); no special tokens."""
    windows = []
    for text in module_sources(HELDOUT_MODULES):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        windows += [ids[i:i + prompt_len] for i in range(0, len(ids) - prompt_len + 1, prompt_len)]
    if len(windows) < num_prompts:
        raise ValueError(f"the held-out text has {len(windows)} windows of {prompt_len} tokens, "
                         f"fewer than the {num_prompts} prompts asked for")
    return [windows[i * len(windows) // num_prompts] for i in range(num_prompts)]


def build_quality_model(path: str | Path, spec: QualityModelSpec = QUALITY_MODEL, progress: bool = True
                        ) -> dict[str, Any]:
    """Train the tokenizer and the model of `spec`; write the checkpoint and TRAINING_RECORD to
    `path`. Returns the record: the held-out loss before and after training, and a unigram model's."""
    import time

    import torch
    from transformers import LlamaForCausalLM

    from tandem.workers.model.demo_model import _quiet_hf_progress, build_tokenizer, generation_config, model_config

    start = time.perf_counter()
    train_texts = module_sources(TRAIN_MODULES)
    tokenizer = build_tokenizer(spec.vocab_size, texts=train_texts)
    # The train files' tokens, each file ended by EOS.
    encoded = tokenizer(train_texts, add_special_tokens=False)["input_ids"]
    train_ids = torch.tensor([t for ids in encoded for t in ids + [tokenizer.eos_token_id]])
    heldout = torch.tensor(quality_text_prompts(tokenizer, spec.num_eval_windows, spec.seq_len))
    config = model_config(
        tokenizer, architecture="llama", hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True, init_std=0.02, dtype="float32")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    initial_loss = heldout_loss(model, heldout)
    train_losses = _train(model, train_ids, spec, progress)
    record = {"version": QUALITY_MODEL_VERSION, "spec": dataclasses.asdict(spec),
              "python": ".".join(map(str, sys.version_info[:3])), "train_tokens": len(train_ids),
              "num_params": sum(p.numel() for p in model.parameters()),
              "heldout_loss_initial": initial_loss, "heldout_loss": heldout_loss(model, heldout),
              "unigram_heldout_loss": unigram_loss(train_ids, heldout, len(tokenizer)),
              "train_loss_last": train_losses[-1], "build_s": time.perf_counter() - start}
    model.generation_config = generation_config(tokenizer)
    with _quiet_hf_progress():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (Path(path) / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record


def _train(model: torch.nn.Module, train_ids: torch.Tensor, spec: QualityModelSpec, progress: bool) -> list[float]:
    """AdamW over `spec.num_steps` batches of random windows of `train_ids`; each step's loss."""
    import torch
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_scale(step, spec))
    offsets = torch.arange(spec.seq_len)
    losses = []
    model.train()
    # One thread: on a loaded machine two threads' barriers cost more than the second core gives
    # (0.6 s against 1.1 s a step here), and the sums' order then cannot depend on the core count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bar = tqdm(range(spec.num_steps), desc="training the quality model", unit="step", disable=not progress)
        for _ in bar:
            starts = torch.randint(0, len(train_ids) - spec.seq_len, (spec.batch_size,), generator=generator)
            batch = train_ids[starts[:, None] + offsets]  # [batch_size, seq_len]
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return losses


def _lr_scale(step: int, spec: QualityModelSpec) -> float:
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    done = (step - spec.warmup_steps) / max(spec.num_steps - spec.warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))


def heldout_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of `model` over `windows` [num_windows, seq_len]."""
    import torch

    with torch.no_grad():
        return float(model(input_ids=windows, labels=windows).loss)


def unigram_loss(train_ids: torch.Tensor, windows: torch.Tensor, vocab_size: int) -> float:
    """The same cross-entropy under the train split's token frequencies (add-one smoothed)."""
    import torch

    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logprobs = counts.log() - counts.sum().log()
    return float(-logprobs[windows[:, 1:]].mean())


def training_record(model_dir: str) -> dict[str, Any] | None:
    """The build's record, if `model_dir` is a quality model's checkpoint."""
    path = Path(model_dir) / TRAINING_RECORD
    return json.loads(path.read_text()) if path.is_file() else None
