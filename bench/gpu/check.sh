#!/bin/bash
# The GPU path's checks on one H200 (issue 21; docs/gpu.md): bench/gpu/check.sh OUT_DIR [check.py options]
# (e.g. --only probe,sdpa; --device cpu for the rehearsal). Installs what the machine lacks, then runs
# bench/gpu/check.py, which writes OUT_DIR/figures.json after every stage and OUT_DIR/check.log.
set -uo pipefail
OUT="${1:?usage: bench/gpu/check.sh OUT_DIR [check.py options]}"
shift
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  echo "moe-train GPU check at $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  # The machine has no pydantic and no torchao (the fp8 stage's scaling): install the wheels carried in .whl/
  # (bench/gpu/fetch_wheels.sh), installed into a folder rather than imported from the zips (pydantic-core's
  # compiled module needs that). transformer-engine is not carried (its CUDA wheels are far over the 64 MiB).
  if ! python3 -c "import pydantic, torchao" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "error: installing .whl/ failed"; exit 1; }
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "error: pydantic or torchao is missing and .whl/ holds no wheels (run bench/gpu/fetch_wheels.sh first)"
      exit 1
    fi
  fi
  # The project over the machine's own torch (runtime.py accepts 2.11).
  python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "error: installing moe-train failed"; exit 1; }
  timeout 420 python3 bench/gpu/check.py --out "$OUT" "$@"
  echo "check.py exit code $?"
} 2>&1 | tee -a "$OUT/driver.log"
