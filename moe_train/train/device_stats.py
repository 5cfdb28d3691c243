"""What the trainer reads about its GPU: the peak MFU divides by (and whether the GPU is the one the recipe
names), the memory figures per logging interval, and the CUDA math settings it starts with.

- MFU's peak is `launch.gpu`'s dense bf16 figure from the hardware table; a job that lands on another GPU than
  the recipe names would report a wrong MFU without a word, so the trainer warns once, naming both.
- Memory: CUDA's peak is reset after every logged step, so each `memory_bytes` is the peak allocated since the
  previous record (the peak of that logging interval, not of the whole run so far), reported with the
  allocator's reserved bytes (`memory_reserved_bytes`, its peak in the same interval), whose excess over the
  allocated bytes is fragmentation and cache.
- TF32: fp32 matmuls and convolutions on CUDA run on TF32 tensor cores (torch's default is full fp32, several
  times slower); bf16 runs are unaffected, fp32 master weights and optimizer math stay fp32.
"""

from __future__ import annotations

import resource

import torch

from moe_train.config.hardware import hardware_table


def enable_tf32() -> None:
    """fp32 matmuls on TF32 tensor cores (cuBLAS and cuDNN)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def chip_name(gpu: str) -> str:
    """The chip a hardware-table entry names, as CUDA spells it in its device name ('H200' for 'NVIDIA H200
    141GB SXM'); an entry whose name does not start with NVIDIA is matched by its id."""
    words = hardware_table()[gpu].name.split()
    return words[1] if len(words) > 1 and words[0] == "NVIDIA" else gpu


def device_mismatch(gpu: str, device_name: str) -> str | None:
    """The warning when `device_name` (torch.cuda.get_device_name) is not the GPU `launch.gpu` names, or None."""
    chip = chip_name(gpu)
    if chip.lower() in device_name.lower():
        return None
    return (f"launch.gpu is {gpu} ({hardware_table()[gpu].name}) but this job runs on {device_name}: MFU is "
            f"measured against {gpu}'s peak; set launch.gpu to this GPU's entry for a true figure")


def memory_figures(device: torch.device) -> dict[str, int]:
    """{"memory_bytes": peak allocated, "memory_reserved_bytes": peak reserved} since the last reset on CUDA;
    {"memory_bytes": the process's peak RSS} on CPU (Linux reports KiB)."""
    if device.type == "cuda":
        return {"memory_bytes": torch.cuda.max_memory_allocated(device),
                "memory_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return {"memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def start_interval(device: torch.device) -> None:
    """Begin a logging interval: CUDA's peak counters restart from what is allocated now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
