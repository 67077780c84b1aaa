#!/usr/bin/env bash
# The whole device measurement in one call (see scripts/gpu_bench.py), sized to finish within 9 minutes on one
# H100/H200: the CUDA fuzz of the reference tests (300 examples a property), the op table at N=8192, H=4096,
# V=151936 bf16 on the synthetic and the LM-like logits profile (fused vs trl's kernel vs the floor, support replay
# of 64 ids), the per-kernel profile of fused and trl for none/min_p/top_k/top_p, and 30 interleaved pairs of GRPO
# steps (stock vs SafeVocab) on a ~0.5B Qwen2-shaped model; one results file (JSON and Markdown), written after
# every section so a timeout loses only the section it hit.
#
#   bash scripts/gpu_bench.sh [--out gpu_results.json]      # on a CUDA machine
#   bash scripts/gpu_bench.sh --small --grpo-pairs 3 --out /tmp/g.json    # CPU, small shapes: tests the script
#
# Later flags override the defaults below (argparse keeps the last value).
#
# The GPU machine has torch, Triton, transformers and accelerate but no trl/datasets/hypothesis: wheels in
# .whl/ (pure-Python ones can be carried) are installed to /tmp/site first when present and trl is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
PY="${PYTHON:-python3}"
if [[ -x "${ROOT}/.venv/bin/python" && -z "${PYTHON:-}" ]]; then PY="${ROOT}/.venv/bin/python"; fi
# (only where trl is missing: a machine that has it, e.g. a CPU checkout keeping last device run's .whl/, keeps its own)
if compgen -G ".whl/*.whl" >/dev/null && ! "${PY}" -c "import trl" >/dev/null 2>&1; then
    # by project name from the folder, so that pip takes the one wheel of each that fits this Python (hypothesis ships
    # one a CPython version: cp311, cp312, cp313)
    mapfile -t projects < <(for wheel in .whl/*.whl; do basename "${wheel}" | cut -d- -f1; done | sort -u)
    "${PY}" -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${projects[@]}"
    export PYTHONPATH="/tmp/site:${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
else
    export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
fi
DEVICE_RUN=(
    --sections correctness,op,profile,pairs
    --tests tests/safevocab/test_reference_fuzz.py,tests/safevocab/test_kernels.py --fuzz-examples 300 --correctness-timeout 120
    --n 8192 --no-naive --op-variants floor,fused,trl --op-timeout 40 --profiles synthetic,lm
    --rules "none;min_p=0.001;top_k=50;top_p=0.9;top_k=50,min_p=0.01" --lm-rules "min_p=0.01;top_p=0.9;top_k=50"
    --replay top_k=64 --profile-timeout 120 --grpo-pairs 30
)
exec "${PY}" scripts/gpu_bench.py "${DEVICE_RUN[@]}" "$@"
