"""The tokenizer class `AutoTokenizer` picks for a model directory, remembered on this node.

`AutoTokenizer` picks the class from the model's config (its model type, the Hub's known
wrong classes, a ByteLevel `tokenizer.json` under a Llama class), and reading that config
goes through transformers' configuration code, which imports torch: ~4 s of CPU and ~230 MB
of memory in a process that only tokenizes (an ingress replica). Once one process has let
`AutoTokenizer` choose, the class is written down here, and every later load of the same
directory calls that class's `from_pretrained` with the arguments `AutoTokenizer` passes it:
the same tokenizer, without torch.

An entry is keyed by the directory's path, the name, size and mtime of each of its files
other than weights (what `AutoTokenizer` reads, and which files it finds), and transformers'
and tokenizers' versions: any change to the tokenizer, the config or the libraries is a new
key, so a stale entry is never read. Remote-code classes (`trust_remote_code`) are never
remembered. A process that must not load torch (an ingress replica) and finds no entry has
`AutoTokenizer` pick in a child process, which remembers the pick."""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from tandem.workers.cache_dir import cache_dir

logger = logging.getLogger(__name__)

# Files whose bytes AutoTokenizer never reads; a group fetches them and an ingress does not,
# so they stay out of the key (names starting with "." are tandem's fetch markers).
_NOT_KEYED = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.ckpt",
              "*.index.json", ".*")


def _classes_dir() -> Path:
    return cache_dir() / "tokenizer-classes"


def entry_key(model_dir: str) -> str:
    """The key of `model_dir`'s entry, as the directory and the libraries stand now."""
    digest = hashlib.sha256()
    digest.update(f"{version('transformers')}\0{version('tokenizers')}\0{os.path.abspath(model_dir)}\0".encode())
    with os.scandir(model_dir) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in _NOT_KEYED) or not entry.is_file():
                continue
            stat = entry.stat()
            digest.update(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def remembered_class(model_dir: str) -> type | None:
    """The class AutoTokenizer picked for `model_dir` as it is now, or None (never picked here,
    or the entry unreadable: the caller lets AutoTokenizer pick)."""
    try:
        path = _classes_dir() / f"{entry_key(model_dir)}.json"
        if not path.is_file():
            return None
        return _class_of(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        logger.debug("tandem: tokenizer class entry for %s not used: %s", model_dir, exc)
        return None


def picked_in_child(model_dir: str, timeout_s: float = 300.0) -> type | None:
    """The class AutoTokenizer picks for `model_dir`, picked in a child process (which imports
    torch, remembers the pick and exits), or None when the child fails: the caller then lets
    AutoTokenizer pick in its own process, which raises the reason."""
    try:
        child = subprocess.run([sys.executable, "-m", __name__, model_dir], capture_output=True, text=True,
                               timeout=timeout_s, check=True)
        return _class_of(json.loads(child.stdout.strip().splitlines()[-1]))
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as exc:
        logger.debug("tandem: no tokenizer class picked in a child for %s: %s", model_dir, exc)
        return None


def _entry_of(cls: type) -> str:
    return json.dumps({"module": cls.__module__, "name": cls.__qualname__})


def _class_of(entry: dict) -> type | None:
    try:
        module, name = entry["module"], entry["name"]
        if not module.startswith("transformers."):
            return None
        cls = getattr(importlib.import_module(module), name)
    except (KeyError, TypeError, ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


def remember_class(model_dir: str, cls: type) -> None:
    """Write down that AutoTokenizer picked `cls` for `model_dir`; a class from outside
    transformers (remote code) is not written, and a failed write only costs the next load."""
    if not cls.__module__.startswith("transformers."):
        return
    try:
        directory = _classes_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{entry_key(model_dir)}.json"
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(_entry_of(cls))
        os.replace(temporary, path)  # another process writing the same entry writes the same bytes
    except OSError as exc:
        logger.debug("tandem: tokenizer class for %s not remembered: %s", model_dir, exc)


if __name__ == "__main__":  # picked_in_child's child
    from tandem.workers.text.tokenizer import load_tokenizer

    print(_entry_of(type(load_tokenizer(sys.argv[1]))))
