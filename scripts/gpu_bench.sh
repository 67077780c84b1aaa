#!/usr/bin/env bash
# GPU truth in one run (see scripts/gpu_bench.py): correctness on CUDA, the fused op vs trl's kernel at
# N=16384, H=4096, V=151936 bf16, and a GRPO step on a ~0.5B Qwen2-shaped model; one results file.
#
#   bash scripts/gpu_bench.sh [--out gpu_results.json]      # on a CUDA machine, about 10 minutes
#   bash scripts/gpu_bench.sh --small                        # CPU, small shapes: tests the script
#
# The GPU machine has torch, Triton, transformers and accelerate but no trl/datasets/hypothesis: wheels in
# .whl/ (pure-Python ones can be carried) are installed to /tmp/site first when present.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
PY="${PYTHON:-python3}"
if [[ -x "${ROOT}/.venv/bin/python" && -z "${PYTHON:-}" ]]; then PY="${ROOT}/.venv/bin/python"; fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "${PY}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
else
    export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
fi
exec "${PY}" scripts/gpu_bench.py "$@"
