"""The Executor seam: how an engine reaches its model, in this process or over Ray worker actors.

The engine calls `execute_async(step) -> PendingOutput` (and `execute` where it must
wait at once); everything about where the shards live stays behind this seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tandem.cluster.placement import DevicePin
from tandem.workers.core.scheduler_output import PendingOutput, RunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerProbe:
    dead: list[str] = field(default_factory=list)  # rank names whose process is gone
    silent: list[str] = field(default_factory=list)  # rank names that did not answer in time


class Executor(Protocol):
    num_kv_blocks: int
    device_type: str  # "cuda" or "cpu": where the model runs; "sim": nowhere (simulated_step_ms)

    def execute(self, step: SchedulerOutput) -> RunnerOutput: ...

    def execute_async(self, step: SchedulerOutput) -> PendingOutput:
        """Start the step; its output may still be on its way (the device, the workers)."""
        ...

    def kv_bytes_per_block(self) -> int:
        """One block's KV over the whole group (every rank's shard)."""
        ...

    def init_host_cache(self, num_slots: int) -> None: ...

    def export_blocks(self, block_ids: list[int]) -> list[Any]:
        """Each rank's KV of these blocks (CPU tensors, or object refs to them), in rank order."""
        ...

    def import_host_blocks(self, slots: list[int], per_rank: list[Any]) -> None: ...

    def device_pins(self) -> list[DevicePin]:
        """Each rank's node and GPUs, in rank order (a draft model may share them); [] outside Ray."""
        ...

    def worker_pids(self) -> list[int]:
        """The process of each Ray worker, in rank order; [] with the model in this process."""
        ...

    def probe_workers(self) -> WorkerProbe:
        """One probe of every worker: those whose process is gone, and those that did not answer
        in time (busy, or stopped: a watchdog tells them apart by how long the silence lasts)."""
        ...

    def fail(self, reason: str) -> None:
        """Give the group up from outside a step (a watchdog found a worker dead): stop what is
        left of it; every later step raises."""
        ...

    def abandon(self) -> None:
        """The group's process is ending while a step is stuck (a stopped worker, a hung
        device): stop its workers without waiting for anything, the stuck step included."""
        ...

    def shutdown(self) -> None: ...


class InProcess:
    """What an executor whose model (or simulated device) runs in the engine's own process says
    of its processes: there are none but this one, and a watchdog never finds it dead."""

    def worker_pids(self) -> list[int]:
        return []

    def probe_workers(self) -> WorkerProbe:
        return WorkerProbe()

    def fail(self, reason: str) -> None:
        """Nothing to stop: a failure here is the engine's own."""

    def abandon(self) -> None:
        """Nothing to stop but this process, which is ending."""


def pick_device(option: str) -> torch.device:
    if option == "cuda" or (option == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
