#!/usr/bin/env bash
# The wheel route (issue 53): build the sdist and the wheel, check them with twine, check that both hold the bundled
# models, then install the wheel with the `trl` extra in a fresh venv *outside the clone* and run there what a user
# runs first: `safevocab-grpo` (the main job) for a few steps and the README's Python quick start.
#
#   bash scripts/check_wheel.sh            # uses .venv's python for build/twine (the `test` extra has them)
#
# Environment: PYTHON (the interpreter of the fresh venv, default python3), SAFEVOCAB_WHEEL_STEPS (default 5).
# Without a CUDA GPU the fresh venv gets the CPU build torch==2.13.0 first, as scripts/setup_env.sh does.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_BIN="${SAFEVOCAB_VENV:-${ROOT}/.venv}/bin"
WORK="$(mktemp -d -t safevocab-wheel.XXXXXX)"
trap 'rm -rf "${WORK}"' EXIT
say() { printf '[check_wheel] %s\n' "$*" >&2; }

say "building the sdist and the wheel into ${WORK}/dist"
"${VENV_BIN}/python" -m build --outdir "${WORK}/dist" "${ROOT}" >"${WORK}/build.log" 2>&1 || { tail -n 30 "${WORK}/build.log"; exit 1; }
"${VENV_BIN}/python" -m twine check --strict "${WORK}"/dist/*
WHEEL="$(ls "${WORK}"/dist/*.whl)"
SDIST="$(ls "${WORK}"/dist/*.tar.gz)"
"${VENV_BIN}/python" -m zipfile -l "${WHEEL}" >"${WORK}/wheel.txt"
tar tzf "${SDIST}" >"${WORK}/sdist.txt"
for asset in tiny-arith/model.safetensors tiny-arith/tokenizer.json testbed/model.safetensors testbed/tokenizer.json \
             testbed/freetext_texts.json.gz; do
    grep -q "trl_integration/demo/assets/${asset}" "${WORK}/wheel.txt" || { say "the wheel lacks ${asset}"; exit 1; }
    grep -q "trl_integration/demo/assets/${asset}" "${WORK}/sdist.txt" || { say "the sdist lacks ${asset}"; exit 1; }
done
say "both hold the bundled models and tokenizers"

say "a fresh venv outside the clone: ${WORK}/venv"
"${PYTHON:-python3}" -m venv "${WORK}/venv"
PIP=("${WORK}/venv/bin/python" -m pip install --progress-bar off -q)
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
    "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" "${WHEEL}[trl]"

cd "${WORK}"  # nothing of the clone on sys.path
say "safevocab-grpo (the main job) for ${SAFEVOCAB_WHEEL_STEPS:-5} steps"
OMP_NUM_THREADS=1 "${WORK}/venv/bin/safevocab-grpo" --max_steps "${SAFEVOCAB_WHEEL_STEPS:-5}" --eval_num_prompts 20 \
    --output_dir "${WORK}/run" --disable_tqdm true >"${WORK}/main.log" 2>&1 || { tail -n 30 "${WORK}/main.log"; exit 1; }
test -f "${WORK}/run/model.safetensors" || { say "the main job saved no model"; tail -n 30 "${WORK}/main.log"; exit 1; }

say "the README's Python quick start"
"${WORK}/venv/bin/python" - "${ROOT}/README.md" >"${WORK}/quickstart.py" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
section = text[text.index("## Train in Python"):]
print(re.search(r"```python\n(.*?)```", section, re.S).group(1))
PY
OMP_NUM_THREADS=1 "${WORK}/venv/bin/python" "${WORK}/quickstart.py" >"${WORK}/quickstart.log" 2>&1 \
    || { tail -n 30 "${WORK}/quickstart.log"; exit 1; }
"${WORK}/venv/bin/python" -c "import safevocab, trl_integration, sys; \
assert not safevocab.__file__.startswith('${ROOT}'), safevocab.__file__; print('installed at', safevocab.__file__)"
say "ok: the wheel installs, its main job and the README quick start run outside the clone"
