"""The decode-tile sweep's plumbing on CPU (Triton's interpreter, untimed): every tile runs on
every shape with the engine's split count, and its output matches the default tile's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tandem.bench import decode_tiles
from tandem.bench.decode_tiles import DecodeShape, parse_tiles, sweep
from tandem.workers.kernels import triton_decode

TINY = DecodeShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, capture_len=1024)


def test_every_tile_runs_on_every_shape_and_agrees_with_the_default() -> None:
    figures = sweep(TINY, [2], [5, 20], [(16, 2, 1), (32, 4, 2)], torch.device("cpu"))
    assert figures["default_tiles"] == {"2": "128x4x2"}  # 32-byte rows, 4 row-heads: decode_tile's longest tile
    assert [(r["context"], r["tile"]) for r in figures["results"]] == [
        (5, "128x4x2"), (5, "16x2x1"), (5, "32x4x2"), (20, "128x4x2"), (20, "16x2x1"), (20, "32x4x2")]
    # The split count the engine's bucket would capture: 1024 keys in splits of at least 256
    # (short rows leave some splits empty, as in a bucket's replays).
    assert {r["num_splits"] for r in figures["results"]} == {4}
    for row in figures["results"]:
        assert row["us"] is None and row["kv_tb_s"] is None  # nothing to time off CUDA
        assert row["max_diff"] <= 2 ** -6, row  # bf16: within its last bits of the default's output
    assert figures["best"] == []
    assert triton_decode.decode_tile(16, 2, 4) == (128, 4, 2)  # the patch is undone


def test_the_tile_follows_the_row_width_and_the_rows_in_flight() -> None:
    tile = triton_decode.decode_tile
    assert tile(64, 2, 511) == (128, 4, 2) and tile(64, 2, 512) == (64, 4, 2)  # llama-1b: batch 63 / 64
    assert tile(128, 2, 8) == tile(128, 2, 1024) == (64, 4, 2)  # llama-8b at every batch
    assert tile(128, 4, 8) == (64, 8, 3) and tile(256, 4, 8) == (32, 4, 3)  # float32 rows of 128 / 256 dims


def test_the_cli_writes_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_tiles, "DecodeShape", lambda: replace(TINY, head_dim=32))
    out = tmp_path / "tiles.json"
    assert decode_tiles.main(["--batches", "1", "--contexts", "9", "--tiles", "16x2x1", "--device", "cpu",
                              "--head-dim", "16", "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [r["tile"] for r in figures["results"]] == ["128x4x2", "16x2x1"] and figures["wall_s"] > 0


def test_a_malformed_tile_is_refused() -> None:
    assert parse_tiles("128x8x3, 64x4x2") == [(128, 8, 3), (64, 4, 2)]
    with pytest.raises(ValueError, match="KEYSxWARPSxSTAGES"):
        parse_tiles("64x4")
