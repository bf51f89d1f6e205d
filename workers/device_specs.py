"""DeviceSpec: what one device holds and moves, from a datasheet or probed on this machine.

`tandem plan` sizes a deployment against these. The GPU figures are the vendors' datasheet
peaks (dense, no sparsity); memory is the total `nvidia-smi` reports for the card, which is
what the engine's `gpu_memory_utilization` is a fraction of. A CPU has no datasheet here:
its memory is this machine's RAM and its peaks are probed (workers/device_peaks.py) the way
`tandem bench latency` probes them, GEMV read bandwidth being what batch-1 decode streams at.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MIB = 1 << 20
# A CPU decode step's time beyond streaming its bytes at the GEMV probe's bandwidth: the
# engine's host work per step (schedule, sample, emit: TPOT - bare forward is ~0.25 ms there),
# less what a small model's weights gain from the caches. Measured on the demo model (15 MB a
# step, where it is the largest share) as TPOT - bytes / probed bandwidth: four `bench latency`
# runs, each between two probes, gave 0.09-0.28 ms, mean 0.19 (2-core Xeon VM, float32;
# bench/RESULTS.md, "tandem plan: predicted vs measured batch-1 TPOT").
CPU_STEP_OVERHEAD_S = 0.19e-3


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    bytes_per_s: float  # HBM / DRAM bandwidth
    bf16_flops_per_s: float  # dense matmul peak in 16-bit floats
    fp8_flops_per_s: float | None  # dense FP8 matmul peak; None: no FP8 tensor cores (before sm_89)
    # A decode step's time beyond its bytes and FLOPs (see CPU_STEP_OVERHEAD_S); 0 on a GPU's
    # datasheet roofline.
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bytes_per_s <= 0 or self.bf16_flops_per_s <= 0:
            raise ValueError(f"device {self.name}: memory, bandwidth and FLOP/s must be positive")

    def matmul_flops_per_s(self, fp8_matmuls: bool) -> float:
        """The peak a decode step's GEMMs run at: FP8 where weights and activations are FP8 and
        the card multiplies FP8 (W8A8), else the 16-bit one."""
        return self.fp8_flops_per_s if fp8_matmuls and self.fp8_flops_per_s else self.bf16_flops_per_s

    @staticmethod
    def custom(memory_gb: float, bandwidth_gb_s: float | None) -> DeviceSpec:
        """A card given by its memory in GiB (an "80GB" card is ~80 GiB, as nvidia-smi counts) and its
        bandwidth in GB/s (default: an H100 SXM's; its FLOP/s too)."""
        ref = GPU_SPECS["H100-SXM-80GB"]
        if memory_gb <= 0 or (bandwidth_gb_s is not None and bandwidth_gb_s <= 0):
            raise ValueError("--gpu-memory and --gpu-bandwidth must be positive")
        return DeviceSpec(f"{memory_gb:g} GB GPU", int(memory_gb * (1 << 30)),
                          bandwidth_gb_s * 1e9 if bandwidth_gb_s else ref.bytes_per_s,
                          ref.bf16_flops_per_s, ref.fp8_flops_per_s)

    @staticmethod
    def probe_cpu(itemsize: int, step_overhead_s: float = 0.0) -> DeviceSpec:
        """This machine: its RAM, and its GEMV read bandwidth and matmul FLOP/s probed in the
        dtype of `itemsize` bytes (a few seconds)."""
        import torch

        from tandem.workers.device_peaks import gemv_read_bandwidth, matmul_flops

        dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
        cpu = torch.device("cpu")
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceSpec(f"cpu ({os.cpu_count()} cores)", memory, gemv_read_bandwidth(cpu, dtype),
                          matmul_flops(cpu, dtype), None, step_overhead_s)


# Datasheet peaks: NVIDIA's dense Tensor Core figures (BF16 with FP32 accumulate; FP8 dense),
# HBM/GDDR bandwidth, and the memory nvidia-smi shows.
GPU_SPECS: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    DeviceSpec("H100-SXM-80GB", 81559 * MIB, 3.35e12, 989e12, 1979e12),
    DeviceSpec("H100-PCIe", 81559 * MIB, 2.0e12, 756e12, 1513e12),
    DeviceSpec("H200", 143771 * MIB, 4.8e12, 989e12, 1979e12),
    DeviceSpec("A100-80GB", 81920 * MIB, 2.039e12, 312e12, None),
    DeviceSpec("A100-40GB", 40960 * MIB, 1.555e12, 312e12, None),
    DeviceSpec("L40S", 46068 * MIB, 864e9, 362e12, 733e12),
    DeviceSpec("L4", 23034 * MIB, 300e9, 121e12, 242e12),
    DeviceSpec("A10G", 23028 * MIB, 600e9, 125e12, None),  # the A10's datasheet (AWS's A10G is one)
    DeviceSpec("RTX-4090", 24564 * MIB, 1008e9, 165e12, 330e12),  # GeForce: FP32 accumulate at half rate
)}


def gpu_spec(name: str) -> DeviceSpec:
    """The card called `name` (case and -/_ insensitive)."""
    key = name.upper().replace("_", "-")
    for spec in GPU_SPECS.values():
        if spec.name.upper() == key:
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_SPECS)} (or give --gpu-memory GIB)")
