#!/bin/bash
# Download, here (where pip reaches the package index), the wheels the H200 machine lacks into .whl/ (git
# ignores it; bench/gpu/check.sh installs them there). The machine has torch 2.11, transformers, typer, rich,
# pyyaml and jinja2, but no pydantic and no torchao (docs/gpu.md). One version of each; under
# 64 MiB in all (transformer-engine's CUDA wheels are far over it: not carried).
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF "/.whl/" "$EXCLUDE" 2>/dev/null || echo "/.whl/" >> "$EXCLUDE"
mkdir -p .whl
rm -f .whl/*.whl  # one version of each: two of one package stop the whole install there
# torchao: the fp8 stage's scaling and casting (the fp8 extra's bound): one cp310-abi3 manylinux_2_28 wheel,
# 3,372,585 bytes (pip download, 2026-12-02).
for spec in pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
            typing-extensions==4.16.0 torchao==0.18.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls -l .whl
