"""The decode-tile sweep's plumbing on CPU (Triton's interpreter, untimed): every tile runs on
every shape with the engine's split count, and its output matches the default tile's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.bench import decode_tiles
from tandem.bench.decode_tiles import DecodeShape, parse_tiles, sweep
from tandem.workers.kernels import triton_decode

TINY = DecodeShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, capture_len=1024)


def test_every_tile_runs_on_every_shape_and_agrees_with_the_default() -> None:
    figures = sweep(TINY, [2], [5, 20], [(16, 2, 1), (32, 4, 2)], torch.device("cpu"))
    assert figures["default_tile"] == "128x8x3"  # 32-byte rows: decode_tile's widest tile
    assert [(r["context"], r["tile"]) for r in figures["results"]] == [
        (5, "128x8x3"), (5, "16x2x1"), (5, "32x4x2"), (20, "128x8x3"), (20, "16x2x1"), (20, "32x4x2")]
    # The split count the engine's bucket would capture: 1024 keys in splits of at least 256
    # (short rows leave some splits empty, as in a bucket's replays).
    assert {r["num_splits"] for r in figures["results"]} == {4}
    for row in figures["results"]:
        assert row["us"] is None and row["kv_tb_s"] is None  # nothing to time off CUDA
        assert row["max_diff"] <= 2 ** -6, row  # bf16: within its last bits of the default's output
    assert figures["best"] == []
    assert triton_decode.decode_tile(16, 2) == (128, 8, 3)  # the patch is undone


def test_the_cli_writes_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_tiles, "DecodeShape", lambda: TINY)
    out = tmp_path / "tiles.json"
    assert decode_tiles.main(["--batches", "1", "--contexts", "9", "--tiles", "16x2x1", "--device", "cpu",
                              "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [r["tile"] for r in figures["results"]] == ["128x8x3", "16x2x1"] and figures["wall_s"] > 0


def test_a_malformed_tile_is_refused() -> None:
    assert parse_tiles("128x8x3, 64x4x2") == [(128, 8, 3), (64, 4, 2)]
    with pytest.raises(ValueError, match="KEYSxWARPSxSTAGES"):
        parse_tiles("64x4")
