"""Layout: the GPUs a deployment's replica groups need, and the worker pods that hold them."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """What the replica groups need: the layout flags, and how many GPUs a pod has."""

    num_replicas: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpus_per_node: int = 1
    spare_gpus: int = 0  # for draft models (speculative_model), beside the groups' GPUs

    def __post_init__(self) -> None:
        for name in ("num_replicas", "tensor_parallel_size", "pipeline_parallel_size", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.spare_gpus < 0:
            raise ValueError(f"spare_gpus: must be at least 0, got {self.spare_gpus}")
        if self.tensor_parallel_size > self.gpus_per_node:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs that many GPUs on one node, "
                             f"but a worker pod has gpus_per_node={self.gpus_per_node}")

    @property
    def num_gpus(self) -> int:
        return self.num_replicas * self.tensor_parallel_size * self.pipeline_parallel_size + self.spare_gpus

    @property
    def num_worker_pods(self) -> int:
        return math.ceil(self.num_gpus / self.gpus_per_node)

    def flags(self) -> list[str]:
        """The command-line flags that give this layout (a manifest's header records them)."""
        flags = ["--num-replicas", str(self.num_replicas), "-tp", str(self.tensor_parallel_size),
                 "-pp", str(self.pipeline_parallel_size), "--gpus-per-node", str(self.gpus_per_node)]
        return flags + (["--spare-gpus", str(self.spare_gpus)] if self.spare_gpus else [])
