"""Moving a prompt's cached KV blocks from one replica group to another.

The exporting group reads the blocks it holds on its device for a chain of block
hashes (every rank its shard); the importing group writes them into its host tier,
where admission finds them as host hits and copies them to the device at the start
of the step, exactly as for blocks it had evicted itself. Both run on their engine's
thread between steps (`AsyncEngine.export_prefix`, `AsyncEngine.import_prefix`), so no
step reads or writes the blocks meanwhile. Only groups with the same KV layout (model,
dtype, KV cache dtype, block size, TP, PP; see `kv_layout`) exchange blocks: a rank's shard
has the same shape and the same bytes per value on both. Each rank's export carries its dtype
and per-layer K/V scales (`ExportedKV`), and a rank refuses blocks of another dtype or other
scales before writing any; the slots reserved for them are given back.
"""

from __future__ import annotations

from typing import Any

from tandem.workers.config import EngineConfig
from tandem.workers.engine.group_engine import GroupEngine


def kv_layout(config: EngineConfig) -> str:
    """Groups with equal layouts hold KV blocks of the same shape on each rank."""
    par, model = config.parallel, config.model
    # "fp8" and "fp8_e4m3" are one dtype; "auto" is the model's.
    kv = "" if config.cache.kv_cache_dtype == "auto" else "|kv-fp8e4m3"
    # Quantized weights make other K and V than the full-precision ones (a pre-quantized
    # checkpoint is its own `model`), and a revision is other weights.
    weights = f"|q-{model.quantization}" if model.quantization else ""
    revision = f"@{model.revision}" if model.revision else ""
    return (f"{model.model or 'tandem-demo'}{revision}|{model.dtype}{weights}{kv}|bs{config.cache.block_size}"
            f"|tp{par.tensor_parallel_size}|pp{par.pipeline_parallel_size}")


def held_prefix(engine: GroupEngine, block_hashes: list[int]) -> int:
    """Leading blocks of the chain this group holds, on its device or in its host tier.

    Safe to call off the engine thread as an estimate: it only reads two dicts.
    """
    host = engine.scheduler.kv.host
    num = 0
    for block_hash in block_hashes:
        if engine.pool.lookup(block_hash) is None and (host is None or host.lookup(block_hash) is None):
            break
        num += 1
    return num


def export_prefix(engine: GroupEngine, block_hashes: list[int]) -> tuple[int, list[Any]]:
    """(how many leading blocks of the chain are on the device, each rank's KV of them)."""
    block_ids: list[int] = []
    for block_hash in block_hashes:
        block_id = engine.pool.lookup(block_hash)
        if block_id is None:
            break
        block_ids.append(block_id)
    if not block_ids:
        return 0, []
    return len(block_ids), engine.executor.export_blocks(block_ids)


def import_prefix(engine: GroupEngine, block_hashes: list[int], per_rank: list[Any]) -> int:
    """Put blocks another group exported into this group's host tier; returns how many.

    `block_hashes` are the exported blocks' hashes (in chain order); ones this group
    already holds are skipped. Imported blocks are published like stored ones.
    """
    kv = engine.scheduler.kv
    if kv.host is None:
        return 0
    slots: list[int] = []
    positions: list[int] = []
    for i, block_hash in enumerate(block_hashes):
        if engine.pool.lookup(block_hash) is not None:
            continue
        slot, dropped = kv.host.reserve(block_hash)
        if dropped is not None and engine.pool.lookup(dropped) is None:
            engine.pool.record_removed(dropped)
        if slot is None:
            continue  # already in the host tier
        slots.append(slot)
        positions.append(i)
    if not slots:
        return 0
    if len(positions) < len(block_hashes):
        per_rank = [_select_blocks(data, positions) for data in per_rank]
    try:
        engine.executor.import_host_blocks(slots, per_rank)
    except Exception:  # refused (another KV dtype or scales) or failed: the slots hold nothing
        kv.host.discard([block_hashes[i] for i in positions])
        raise
    for i in positions:
        engine.pool.record_stored(block_hashes[i], block_hashes[i - 1] if i else None)
    return len(slots)


def _select_blocks(data: Any, positions: list[int]) -> Any:
    import torch

    if not isinstance(data, torch.Tensor):  # an object ref: fetch it here to cut it
        import ray

        data = ray.get(data)
    return data.select(positions)
