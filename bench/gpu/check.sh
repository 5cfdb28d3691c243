#!/bin/bash
# The GPU path's checks on one H200 (docs/gpu.md): bench/gpu/check.sh OUT_DIR [check.py options]
# (e.g. --only probe,sdpa; --device cpu for the rehearsal). Installs what the machine lacks without the network,
# then runs bench/gpu/check.py, which keeps its own deadline (--deadline, 480 s) and writes OUT_DIR/figures.json
# after every stage (and on SIGTERM) and OUT_DIR/check.log.
set -uo pipefail
OUT="${1:?usage: bench/gpu/check.sh OUT_DIR [check.py options]}"
shift
cd "$(dirname "$0")/../.."
REPO="$(pwd)"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# What a real job's environment sets (moe_train/launch/job_env.py): the allocator's expandable segments.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
{
  echo "moe-train GPU check at $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  # The machine has no pydantic and no torchao (the fp8 stage's scaling): install the wheels carried in .whl/
  # (bench/gpu/fetch_wheels.sh; the device call names .whl in `carry`) into a folder, not imported from the zips
  # (pydantic-core's compiled module needs that). No index, no version check: nothing waits on a network.
  if ! python3 -c "import pydantic, torchao" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
      timeout 120 "${PIP[@]}" --upgrade --target /tmp/site .whl/*.whl || { echo "error: installing .whl/ failed"; exit 1; }
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "error: pydantic or torchao is missing and .whl/ holds no wheels (run bench/gpu/fetch_wheels.sh first)"
      exit 1
    fi
  fi
  # The project over the machine's own torch (runtime.py accepts 2.11), without a build backend (no setuptools
  # needed): pyproject's package-dir mapping laid out as folders (cli/, recipes/, slurm/ inside moe_train/).
  SRC=/tmp/moe-train-src
  rm -rf "$SRC" && mkdir -p "$SRC" && cp -r moe_train "$SRC/" && cp -r cli "$SRC/moe_train/cli" \
    && cp -r recipes "$SRC/moe_train/recipes" && cp -r slurm "$SRC/moe_train/slurm" \
    || { echo "error: laying out moe-train in $SRC failed"; exit 1; }
  export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
  timeout 540 python3 "$REPO/bench/gpu/check.py" --out "$OUT" "$@"
  echo "check.py exit code $?"
} 2>&1 | tee -a "$OUT/driver.log"
