"""The decode kernel's tile against the batches and contexts it meets: a sweep for a GPU.

`python -m tandem.bench.decode_tiles [--batches 32,64,128] [--contexts 160,512,2048]
[--tiles 128x8x3,64x4x2,...] [--heads 32 --kv-heads 8 --head-dim 128] [--output-json F]`

`triton_decode.decode_tile` gives the tile (keys per tile, warps, pipeline stages) for a head
width and the rows x KV heads of a launch. This times each tile on each (batch, context), the
shape's heads and the split count the engine's graph bucket would use, one launch captured as
the engine captures its graphs and replayed in batches, the median of five timings: a tile's
figure is the K/V bytes read over its time, and each shape's best tile is set against
decode_tile's own choice at that batch ("the default"), whose output each tile's is checked
against. On CPU (Triton's interpreter) the same code runs once a tile, untimed: a check of
the sweep.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from tandem.workers.device_peaks import time_median
from tandem.workers.kernels import triton_decode
from tandem.workers.kernels.decode_splits import default_num_splits
from tandem.workers.runner.cuda_graphs import capture_graph


@dataclass(frozen=True)
class DecodeShape:
    num_heads: int = 32  # llama-1b's
    num_kv_heads: int = 8
    head_dim: int = 64
    block_size: int = 16
    capture_len: int = 8192  # the graphs' longest context: what a bucket's split count is fixed for
    dtype: torch.dtype = torch.bfloat16


Tile = tuple[int, int, int]  # (keys per tile, warps, stages)


def parse_tiles(text: str) -> list[Tile]:
    """"128x8x3,64x4x2" -> [(128, 8, 3), (64, 4, 2)]."""
    tiles = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a tile is KEYSxWARPSxSTAGES, e.g. 64x4x2; got {item!r}")
        tiles.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return tiles


def _inputs(shape: DecodeShape, batch: int, context: int, device: torch.device, seed: int = 0) -> dict:
    """A decode step of `batch` rows of `context` keys each over a paged cache, its blocks shuffled."""
    gen = torch.Generator(device).manual_seed(seed)  # drawn where they live: GBs of cache at batch 128
    per_row = -(-context // shape.block_size)
    num_blocks = batch * per_row
    order = torch.randperm(num_blocks, generator=gen, device=device)
    kv_shape = (num_blocks * shape.block_size, shape.num_kv_heads, shape.head_dim)
    cache = [torch.randn(kv_shape, generator=gen, device=device, dtype=shape.dtype) for _ in range(2)]
    return dict(query=torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen, device=device,
                                  dtype=shape.dtype),
                key_cache=cache[0], value_cache=cache[1], block_tables=order.view(batch, per_row).to(torch.int32),
                seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device))


def _launch(shape: DecodeShape, inputs: dict, out: torch.Tensor, num_splits: int) -> Callable[[], torch.Tensor]:
    """One decode launch into `out` (returned: what a captured graph's replays write)."""
    def launch() -> torch.Tensor:
        triton_decode.decode_attention(
            inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"], inputs["seq_lens"],
            shape.block_size, shape.head_dim ** -0.5, 0, out, num_splits)
        return out
    return launch


@contextmanager
def tile_patched(tile: Tile) -> Iterator[None]:
    """`decode_tile` answers `tile` inside the block (a launch captured there keeps it)."""
    default = triton_decode.decode_tile
    triton_decode.decode_tile = lambda block_d, elem_size, row_heads: tile
    try:
        yield
    finally:
        triton_decode.decode_tile = default


def _time_us(launch: Callable[[], torch.Tensor], device: torch.device, replays: int) -> float | None:
    """Microseconds a launch, captured as the engine captures its graphs and replayed `replays`
    times a timing, the median of five (None off CUDA: nothing to time)."""
    if device.type != "cuda":
        launch()
        return None
    graph, _ = capture_graph(launch, torch.cuda.graph_pool_handle(), device)
    return time_median(lambda: [graph.replay() for _ in range(replays)], device) * 1e6 / replays


def sweep(shape: DecodeShape, batches: list[int], contexts: list[int], tiles: list[Tile], device: torch.device,
          replays: int = 200) -> dict:
    """Every (batch, context, tile): microseconds, TB/s of K/V read, and the largest difference of
    its output from the default tile's; per (batch, context) the best tile against the default."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    rows, best, defaults = [], [], {}
    for batch in batches:
        default = defaults[batch] = triton_decode.decode_tile(
            triton_decode.head_dim_block(shape.head_dim), shape.dtype.itemsize, batch * shape.num_kv_heads)
        for context in contexts:
            inputs = _inputs(shape, batch, context, device)
            splits = default_num_splits(batch, shape.num_kv_heads, shape.capture_len, shape.block_size, num_sms)
            kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
            reference = torch.empty_like(inputs["query"])
            _launch(shape, inputs, reference, splits)()
            timed: dict[Tile, float | None] = {}
            for tile in [default, *[t for t in tiles if t != default]]:
                out = torch.empty_like(reference)
                with tile_patched(tile):
                    us = timed[tile] = _time_us(_launch(shape, inputs, out, splits), device, replays)
                rows.append({"batch": batch, "context": context, "num_splits": splits, "tile": "x".join(map(str, tile)),
                             "us": us, "kv_tb_s": kv_bytes / (us * 1e-6) / 1e12 if us else None,
                             "max_diff": (out.float() - reference.float()).abs().max().item()})
            if timed[default] is not None:
                tile, us = min(timed.items(), key=lambda item: item[1])
                best.append({"batch": batch, "context": context, "tile": "x".join(map(str, tile)), "us": us,
                             "speedup_vs_default": timed[default] / us})
    return {"default_tiles": {str(b): "x".join(map(str, t)) for b, t in defaults.items()}, "results": rows,
            "best": best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,64,128")
    parser.add_argument("--contexts", default="160,512,2048")
    parser.add_argument("--tiles", default="128x8x3,128x4x2,64x4x2,64x4x3,64x8x2,32x4x2")
    parser.add_argument("--heads", type=int, help="query heads (default: llama-1b's 32)")
    parser.add_argument("--kv-heads", type=int, help="KV heads (default: llama-1b's 8)")
    parser.add_argument("--head-dim", type=int, help="head width (default: llama-1b's 64; llama-8b's is 128)")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    shape = DecodeShape()
    heads = {"num_heads": args.heads, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim}
    shape = replace(shape, **{k: v for k, v in heads.items() if v is not None})
    figures = sweep(shape, [int(b) for b in args.batches.split(",")],
                    [int(c) for c in args.contexts.split(",")], parse_tiles(args.tiles), device, args.replays)
    figures["wall_s"] = time.perf_counter() - started
    for row in figures["results"]:
        us = "untimed" if row["us"] is None else f"{row['us']:8.2f} us {row['kv_tb_s']:5.2f} TB/s"
        print(f"batch {row['batch']:4d} context {row['context']:5d} splits {row['num_splits']:2d} "
              f"tile {row['tile']:>8}: {us}  max diff {row['max_diff']:.3g}", flush=True)
    for row in figures["best"]:
        print(f"best at batch {row['batch']} context {row['context']}: {row['tile']} "
              f"({row['speedup_vs_default']:.2f}x the default {figures['default_tiles'][str(row['batch'])]})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
