"""A pipeline's stages as runners in one process, for tests of what each stage runs.

Each stage is a real ModelRunner of its own layers (a ParallelContext with its pp_rank), and a
step runs stage by stage with the hidden states handed on, as a Ray group's workers hand them on
(workers/executor/worker.py) without the sends. A test monkeypatches the graph mode, which a Ray
worker's process would not see; here every stage runs the graph path the test chose.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.workers.config import EngineConfig
from tandem.workers.core.scheduler_output import PendingOutput, RunnerOutput, SchedulerOutput
from tandem.workers.distributed.parallel import ParallelContext
from tandem.workers.executor.abstract import InProcess
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.runner.model_runner import ModelRunner


class StagesInProcess(InProcess):
    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, model_dir: str, device: str) -> None:
        assert config.parallel.tensor_parallel_size == 1, "stages of one rank each: no collectives here"
        pp = config.parallel.pipeline_parallel_size
        self.device_type = device
        self.runners = [ModelRunner(config, hf_config, model_dir, ParallelContext(pp_rank=k, pp_size=pp),
                                    torch.device(device)) for k in range(pp)]
        for runner in self.runners:
            runner.load_model(show_progress=False)
        assert config.cache.num_kv_blocks is not None, "stages sharing one device: give num_kv_blocks"
        self.num_kv_blocks = config.cache.num_kv_blocks
        for runner in self.runners:
            runner.init_kv_cache(self.num_kv_blocks)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        hidden = None
        for runner in self.runners:
            hidden = runner.execute(step, hidden)
        return hidden

    def execute_async(self, step: SchedulerOutput) -> PendingOutput:
        return PendingOutput.done(self.execute(step))

    def kv_bytes_per_block(self) -> int:
        return sum(runner.kv_bytes_per_block() for runner in self.runners)

    def init_host_cache(self, num_slots: int) -> None:
        raise NotImplementedError("no host tier in the test's stage chain")

    def export_blocks(self, block_ids: list[int]) -> list[Any]:
        raise NotImplementedError("no KV export in the test's stage chain")

    def import_host_blocks(self, slots: list[int], per_rank: list[Any]) -> None:
        raise NotImplementedError("no KV import in the test's stage chain")

    def device_pins(self) -> list:
        return []

    def shutdown(self) -> None:
        for runner in self.runners:
            runner.release()


def use_stage_chain(monkeypatch, device: str) -> None:
    """Groups with PP > 1 start their stages in this process (StagesInProcess), not on Ray workers."""
    from tandem.workers.engine import builder

    start = builder._start_executor

    def start_executor(config, hf_config, model_dir, show_progress, tokenizer):
        if config.parallel.pipeline_parallel_size > 1:
            return StagesInProcess(config, hf_config, model_dir, device)
        return start(config, hf_config, model_dir, show_progress, tokenizer)

    monkeypatch.setattr(builder, "_start_executor", start_executor)
