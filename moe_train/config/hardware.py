"""The one hardware table: what `launch.gpu` may name, and the figures the trainer's MFU and the planner use.

Figures are vendor data-sheet values for dense math (no structured sparsity), per GPU. Link bandwidths are
per GPU and per direction. `cpu` has no fixed peak: the trainer measures a matmul peak at start.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class Hardware:
    id: str
    name: str
    memory_bytes: int
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    gpus_per_node: int
    nvlink_domain: int

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_flops > 0


HARDWARE: dict[str, Hardware] = {
    hw.id: hw
    for hw in (
        Hardware("a100-80gb", "NVIDIA A100 80GB SXM", 80 * GB, 312e12, 0.0, 2.039e12, 300 * GB, 25 * GB, 8, 8),
        Hardware("h100", "NVIDIA H100 80GB SXM", 80 * GB, 989e12, 1979e12, 3.35e12, 450 * GB, 50 * GB, 8, 8),
        Hardware("h200", "NVIDIA H200 141GB SXM", 141 * GB, 989e12, 1979e12, 4.8e12, 450 * GB, 50 * GB, 8, 8),
        Hardware("b200", "NVIDIA B200 180GB", 180 * GB, 2250e12, 4500e12, 8.0e12, 900 * GB, 50 * GB, 8, 8),
        Hardware("gb200", "NVIDIA GB200 NVL72", 186 * GB, 2500e12, 5000e12, 8.0e12, 900 * GB, 50 * GB, 4, 72),
        Hardware("gb300", "NVIDIA GB300 NVL72", 288 * GB, 2500e12, 5000e12, 8.0e12, 900 * GB, 100 * GB, 4, 72),
        Hardware("cpu", "CPU (peak measured at start)", 0, 0.0, 0.0, 0.0, 0.0, 0.0, 1024, 1),
    )
}
