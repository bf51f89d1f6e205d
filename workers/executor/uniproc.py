"""UniProcExecutor: the whole model in this process (TP = PP = 1)."""

from __future__ import annotations

from typing import Any

from tandem.cluster.placement import DevicePin
from tandem.workers.config import EngineConfig
from tandem.workers.core.scheduler_output import PendingOutput, RunnerOutput, SchedulerOutput
from tandem.workers.distributed.parallel import ParallelContext
from tandem.workers.executor.abstract import InProcess, pick_device
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.runner.model_runner import ModelRunner


class UniProcExecutor(InProcess):
    """The whole model in this process (TP = PP = 1)."""

    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, model_dir: str,
                 show_progress: bool = True) -> None:
        device = pick_device(config.model.device)
        self.device_type = device.type
        self.runner = ModelRunner(config, hf_config, model_dir, ParallelContext(), device)
        self.runner.load_model(show_progress=show_progress)
        self.num_kv_blocks = self.runner.num_blocks_fit()
        if self.num_kv_blocks < 1:
            raise ValueError(f"kv_cache_memory: too small for one KV block "
                             f"({self.runner.kv_bytes_per_block()} bytes per block)")
        self.runner.init_kv_cache(self.num_kv_blocks)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(step)

    def execute_async(self, step: SchedulerOutput) -> PendingOutput:
        return self.runner.launch(step)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def init_host_cache(self, num_slots: int) -> None:
        self.runner.init_host_cache(num_slots)

    def export_blocks(self, block_ids: list[int]) -> list[Any]:
        return [self.runner.export_blocks(block_ids)]

    def import_host_blocks(self, slots: list[int], per_rank: list[Any]) -> None:
        [data] = per_rank
        self.runner.import_host_blocks(slots, data)

    def device_pins(self) -> list[DevicePin]:
        """This process's node and GPU, for a draft model sharing it (none outside Ray)."""
        import ray

        if not ray.is_initialized():
            return []
        gpus = [int(g) for g in ray.get_gpu_ids()]
        if not gpus and self.runner.device.type == "cuda":  # a driver: it sees every GPU
            gpus = [self.runner.device.index or 0]
        return [DevicePin(ray.get_runtime_context().get_node_id(), tuple(gpus))]

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.release()  # the device memory goes back now, not at garbage collection
        self.runner = None
