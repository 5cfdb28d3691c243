"""What a rendered job sets besides the recipe's own `launch.env`: the CUDA environment a cluster user expects,
and the CPU cores each node's one task asks SLURM for. Torch-free (login nodes render).

- NCCL's flight recorder: on a collective timeout every rank dumps its last collectives
  (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`, which records nothing unless `TORCH_NCCL_TRACE_BUFFER_SIZE` is > 0), so a hung
  job says which rank stopped in which collective instead of only timing out.
- `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: dropless MoE routing changes tensor sizes every step, and
  the caching allocator otherwise fragments into blocks of the sizes seen so far.
Each is a default: the same name in `launch.env` wins.
"""

from __future__ import annotations

from moe_train.config import Recipe
from moe_train.config.hardware import hardware_table
from moe_train.runtime import DETERMINISTIC_ENV

from .shell import LaunchError

FLIGHT_RECORDER_ENTRIES = 2000  # collectives kept per rank; torchtitan's default
CUDA_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


def job_environment(recipe: Recipe) -> dict[str, str]:
    """Every variable the job exports, in order: the defaults for its device and settings, then `launch.env`
    (which overrides any of them)."""
    out: dict[str, str] = {}
    if recipe.launch.device == "cuda":
        out.update(CUDA_DEFAULTS)
    if recipe.train.deterministic:
        out.update(DETERMINISTIC_ENV)
    out.update(recipe.launch.env)
    return out


def cpus_per_task(recipe: Recipe) -> int:
    """`--cpus-per-task` of the node's one task: every rank of the node runs inside it (torchrun). cpu: one core
    per rank; cuda: gpus_per_node x `launch.slurm.cpus_per_gpu`, defaulting to the hardware table's column.
    Raises LaunchError (field named) for a cuda job where neither says, since SLURM's default of one CPU per
    task would put every rank (and its data loading) on one core."""
    launch = recipe.launch
    if launch.device != "cuda":
        return launch.gpus_per_node
    per_gpu = launch.slurm.cpus_per_gpu
    if per_gpu is None:
        hardware = hardware_table().get(launch.gpu)
        per_gpu = None if hardware is None else hardware.cpus_per_gpu
    if per_gpu is None:
        raise LaunchError([f"launch.slurm.cpus_per_gpu: needed for a cuda job (the hardware table's "
                           f"'{launch.gpu}' has no cpus_per_gpu); set the CPU cores each GPU rank may use"])
    return launch.gpus_per_node * per_gpu
