"""Which decoder layers each pipeline stage holds: balanced by what a decode step reads.

Every stage runs its layers on every step, and the last stage also runs the LM head, whose
weight (vocab x hidden) can be as large as several layers in a model with a big vocabulary and
few, narrow layers. Pipelined steps go at the pace of the slowest stage, so the last stage
takes fewer layers when the head would otherwise make it the slowest. The first stage's
embedding is a lookup of a few rows and costs nothing that counts. For the large models that
pipeline parallelism is for, the head is under a layer and the split is the even one, with
earlier stages taking the extra layers.
"""

from __future__ import annotations

import math

from tandem.workers.model.hf_config import HFModelConfig


def head_layers(cfg: HFModelConfig) -> float:
    """The LM head's weight in decoder layers' worth (a decode step reads each once), as the
    engine's cost model counts them."""
    from tandem.workers.model.cost import ModelCost  # cost.py asks this module for a rank's layers

    cost = ModelCost.shard(cfg, itemsize=1)
    return cost.lm_head_params / (cost.linear_params / cost.num_layers)


def layer_counts(num_layers: int, pp_size: int, head: float) -> list[int]:
    """Layers per stage: the last stage's count k minimises the slowest stage (k + head against
    the others' even share of the rest; ties go to the more even split), every stage keeps at
    least one layer where there are enough, and earlier stages take the extra."""
    if pp_size == 1:
        return [num_layers]
    if num_layers <= pp_size:
        return [1 if s < num_layers else 0 for s in range(pp_size)]
    best: tuple[float, float, int] | None = None
    for k in range(1, num_layers - (pp_size - 1) + 1):
        rest = num_layers - k
        slowest = max(math.ceil(rest / (pp_size - 1)), k + head)
        key = (slowest, abs(k - num_layers / pp_size), k)
        if best is None or key < best:
            best = key
    last = best[2]
    base, extra = divmod(num_layers - last, pp_size - 1)
    return [base + (1 if s < extra else 0) for s in range(pp_size - 1)] + [last]


def stage_layers(cfg: HFModelConfig, pp_rank: int, pp_size: int,
                 partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """[start, end) of the decoder layers stage `pp_rank` of `pp_size` holds: as `partition`
    gives them (layers per stage, which must add up to the model's), else balanced."""
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != cfg.num_hidden_layers:
            raise ValueError(f"pipeline_layer_partition: {','.join(map(str, partition))} must give each of the "
                             f"{pp_size} stages its layers, {cfg.num_hidden_layers} in all")
        counts = list(partition)
    elif pp_size == 1:  # one stage holds them all (and the cost model's whole model is this)
        counts = [cfg.num_hidden_layers]
    else:
        counts = layer_counts(cfg.num_hidden_layers, pp_size, head_layers(cfg))
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]
