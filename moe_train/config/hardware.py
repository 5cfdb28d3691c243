"""The one hardware table: what `launch.gpu` may name, and the figures the trainer's MFU and the planner use.

Figures are vendor data-sheet values for dense math (no structured sparsity), per GPU. Link bandwidths are
per GPU and per direction. `cpu` has no fixed peak: the trainer measures a matmul peak at start.
`host_link_bytes_per_s` is the GPU's link to host memory, per direction (what activation offloading's copies
cross, parallel/offload.py): PCIe Gen4 x16 on A100 nodes (32 GB/s: the A100 data sheet's 64 GB/s both ways),
PCIe Gen5 x16 on H100, H200 and B200 nodes (64 GB/s: the data sheets' 128 GB/s both ways), NVLink-C2C on
GB200/GB300 (the Grace CPU's 900 GB/s both ways, shared by its two GPUs: 225 GB/s a GPU and direction).
A cluster adds its own GPU or interconnect in YAML (`hardware_table()`): e.g. an H100 cluster whose network
gives each GPU 25 GB/s is `h100-ib: {extends: h100, network_bytes_per_s: 25.0e9}`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

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
    # CPU cores per GPU of the vendor's reference node (DGX, an NVL72 tray): the sbatch default of
    # launch.slurm.cpus_per_gpu. Optional: a cluster's own entry may leave it out.
    cpus_per_gpu: int | None = None
    # CUDA compute capability (9.0: Hopper), for what a kernel needs (mxfp8: 10.0). Optional like cpus_per_gpu.
    compute_capability: float | None = None
    # The GPU's link to host memory, per direction (module docstring). Optional: a cluster's own entry may leave it
    # out, and then plan does not price activation offloading's copies.
    host_link_bytes_per_s: float | None = None

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_flops > 0


HARDWARE: dict[str, Hardware] = {
    hw.id: hw
    for hw in (
        Hardware("a100-80gb", "NVIDIA A100 80GB SXM", 80 * GB, 312e12, 0.0, 2.039e12, 300 * GB, 25 * GB, 8, 8, 16, 8.0,
                 32 * GB),
        Hardware("h100", "NVIDIA H100 80GB SXM", 80 * GB, 989e12, 1979e12, 3.35e12, 450 * GB, 50 * GB, 8, 8, 14, 9.0,
                 64 * GB),
        Hardware("h200", "NVIDIA H200 141GB SXM", 141 * GB, 989e12, 1979e12, 4.8e12, 450 * GB, 50 * GB, 8, 8, 14, 9.0,
                 64 * GB),
        Hardware("b200", "NVIDIA B200 180GB", 180 * GB, 2250e12, 4500e12, 8.0e12, 900 * GB, 50 * GB, 8, 8, 14, 10.0,
                 64 * GB),
        Hardware("gb200", "NVIDIA GB200 NVL72", 186 * GB, 2500e12, 5000e12, 8.0e12, 900 * GB, 50 * GB, 4, 72, 36, 10.0,
                 225 * GB),
        Hardware("gb300", "NVIDIA GB300 NVL72", 288 * GB, 2500e12, 5000e12, 8.0e12, 900 * GB, 100 * GB, 4, 72, 36,
                 10.3, 225 * GB),
        Hardware("cpu", "CPU (peak measured at start)", 0, 0.0, 0.0, 0.0, 0.0, 0.0, 1024, 1),
    )
}


# ------------------------------------------------------------------------------- a cluster's own hardware

HARDWARE_ENV = "MOE_TRAIN_HARDWARE"
USER_HARDWARE_FILE = Path("~/.config/moe-train/hardware.yaml")


class HardwareError(ValueError):
    """A hardware file that cannot be read or holds an invalid entry; the message is one line."""


def hardware_files() -> list[Path]:
    """Files that extend the table, in order (a later entry of the same id wins): each path of
    $MOE_TRAIN_HARDWARE (os.pathsep-separated), then ~/.config/moe-train/hardware.yaml when it exists."""
    listed = [Path(p).expanduser() for p in os.environ.get(HARDWARE_ENV, "").split(os.pathsep) if p]
    user = USER_HARDWARE_FILE.expanduser()
    return [*listed, *([user] if user.is_file() else [])]


def _entry(path: Path, hw_id: str, spec: object, table: dict[str, Hardware]) -> Hardware:
    where = f"hardware file {path}: {hw_id}"
    if not isinstance(spec, dict):
        raise HardwareError(f"{where}: expected a mapping of fields")
    spec = dict(spec)
    base_id = spec.pop("extends", None)
    if base_id is not None:
        if base_id not in table:
            raise HardwareError(f"{where}: extends unknown '{base_id}'; known: {', '.join(table)}")
        values = {**asdict(table[base_id]), "name": spec.get("name", hw_id)}
    else:
        values = {"name": hw_id}
    allowed = [f.name for f in fields(Hardware) if f.name != "id"]
    optional = {"cpus_per_gpu", "compute_capability", "host_link_bytes_per_s"}
    unknown = sorted(str(k) for k in spec if k not in allowed)
    if unknown:
        raise HardwareError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: extends, {', '.join(allowed)}")
    values.update(spec)
    values["id"] = hw_id
    missing = [name for name in allowed if name not in values and name not in optional]
    if missing:
        raise HardwareError(f"{where}: missing {', '.join(missing)} (or name a built-in with extends)")
    for name in allowed[1:]:
        value = values.get(name)
        if name in optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise HardwareError(f"{where}: {name} must be a number >= 0, got {value!r}")
    for name in ("gpus_per_node", "nvlink_domain", "cpus_per_gpu"):
        if name in optional and values.get(name) is None:
            continue
        if int(values[name]) != values[name] or values[name] < 1:
            raise HardwareError(f"{where}: {name} must be a whole number >= 1, got {values[name]!r}")
    return Hardware(**{**values, "memory_bytes": int(values["memory_bytes"]),
                       "gpus_per_node": int(values["gpus_per_node"]), "nvlink_domain": int(values["nvlink_domain"]),
                       "cpus_per_gpu": None if values.get("cpus_per_gpu") is None else int(values["cpus_per_gpu"])})


def load_hardware_file(path: Path, table: dict[str, Hardware]) -> dict[str, Hardware]:
    """Entries of one YAML file: a mapping `id: {field: value, ...}`, each either complete or `extends: ID`
    (a built-in or an earlier entry) with the fields that differ. Values in SI units (bytes, FLOP/s)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise HardwareError(f"hardware file {path}: cannot be read: {' '.join(str(error).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HardwareError(f"hardware file {path}: expected a mapping of GPU ids to their fields")
    out: dict[str, Hardware] = {}
    for hw_id, spec in data.items():
        out[str(hw_id)] = _entry(path, str(hw_id), spec, {**table, **out})
    return out


def hardware_table() -> dict[str, Hardware]:
    """The built-in table extended by the hardware files (`hardware_files()`). Raises HardwareError."""
    files = hardware_files()
    return dict(_table(tuple((path, path.stat().st_mtime_ns if path.is_file() else None) for path in files)))


@functools.lru_cache(maxsize=8)
def _table(files: tuple[tuple[Path, int | None], ...]) -> tuple[tuple[str, Hardware], ...]:
    """The table for these files as they were last modified: read once (`plan --search` validates thousands
    of layouts, each asking for the table)."""
    table = dict(HARDWARE)
    for path, _ in files:
        table.update(load_hardware_file(path, table))
    return tuple(table.items())
