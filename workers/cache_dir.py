"""Where tandem keeps what it makes once per machine: built-in models, fetched models,
remembered tokenizer classes."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "tandem"
    return Path.home() / ".cache" / "tandem"
