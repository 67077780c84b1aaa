#!/usr/bin/env bash
# The wheels a device call carries (.whl/, git-ignored): what the GPU machine lacks for scripts/gpu_bench.sh's plan
# (torch, Triton, transformers and accelerate are there; trl, pytest, hypothesis and pytest-xdist are not). Pure-Python
# wheels, plus hypothesis's one a CPython version (3.11-3.13); scripts/gpu_bench.sh installs the one of each that fits.
# About 7 MB, under the device tool's 64 MiB carry. trl's backward needs pandas/datasets through trl.trainer.utils:
# scripts/gpu_bench.py stands in for it (trl_backward_context) instead of carrying them.
#
#   bash scripts/gpu_wheels.sh            # then: run(command="bash scripts/gpu_bench.sh ...", carry=[".whl"])
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
PY="${PYTHON:-python3}"
if [[ -x "${ROOT}/.venv/bin/python" && -z "${PYTHON:-}" ]]; then PY="${ROOT}/.venv/bin/python"; fi
mkdir -p .whl
rm -f .whl/*.whl  # gpu_bench.sh installs by project name: an older download's newer wheel would win over the pins
"${PY}" -m pip download -q --no-deps --only-binary=:all: --dest .whl trl==1.16.0 sortedcontainers pytest iniconfig \
    pluggy pygments pytest-xdist execnet liger-kernel
for version in 3.11 3.12 3.13; do
    "${PY}" -m pip download -q --no-deps --only-binary=:all: --python-version "${version}" \
        --platform manylinux2014_x86_64 --dest .whl hypothesis==6.170.17
done
ls -1 .whl
du -sh .whl
