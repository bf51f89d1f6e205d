"""Helpers of the bench tests: running `tandem bench ...` in this process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.bench.bench_models import BenchShape
from tandem.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The code path of --bench-model at the size of the tests' tiny models.
TINY_SHAPE = BenchShape("llama-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                        max_position_embeddings=512, tie_word_embeddings=True)


def bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    """`tandem bench ARGV --output-json ...` through the CLI's entry point; the figures it wrote."""
    out = tmp_path / "figures.json"
    assert main(["bench", *argv, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())
