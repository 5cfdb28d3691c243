"""The names of the files and folders in a run folder, in one place both halves import.

The launcher writes some of them (recipe.yaml, logs/, job scripts), the ranks others (metrics.jsonl, COMPLETE,
checkpoints/), `moe-train runs`/`report` read them back, and the job script names them to the shell. One
module, torch-free and importing nothing of the package, so every reader and writer agrees on each name.
"""

from __future__ import annotations

RECIPE_FILE = "recipe.yaml"  # the resolved recipe with provenance: the only input the ranks read
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"  # the default checkpoint.dir under the run folder
REPORT_DIR = "report"  # `moe-train report`'s default output folder
SCRIPT_FILE = "job.sbatch"
PREFLIGHT_SCRIPT_FILE = "preflight.sbatch"
SUBMISSIONS_FILE = "submissions.jsonl"  # one line per sbatch submission (job id, kind, script)
METRICS_FILE = "metrics.jsonl"
ROUTING_TRACE_FILE = "routing.jsonl"  # logging.routing_trace: tokens per expert per MoE layer per step
COMPLETE_FILE = "COMPLETE"  # written by rank 0 when the last step is done: the run is finished, not preempted
FAILED_FILE = "FAILED"  # a runtime failure's reason line (train_and_report), shown by `moe-train runs`
PREEMPT_FILE = "PREEMPT"  # written by the job script on SLURM's signal: save and stop at the next step
LATEST = "latest"  # inside the checkpoint folder: the name of the newest complete checkpoint
