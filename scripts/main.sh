#!/usr/bin/env bash
# Set up the environment (idempotent, see scripts/setup_env.sh), then run the main job.
#
#   bash scripts/main.sh [ARGS...]     # ARGS are passed to the main job
#
# The main job is the core benchmark for now (it prints a table of timings and memory ratios).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"

# Sourcing sets up the venv if needed and activates it in this shell.
# shellcheck source=scripts/setup_env.sh
source "${ROOT}/scripts/setup_env.sh"

# The main job, one line: becomes `MAIN_JOB=(safevocab-grpo)` once the TRL command line exists.
MAIN_JOB=(python -m safevocab.bench)

echo "[main] ${MAIN_JOB[*]} $*" >&2
exec "${MAIN_JOB[@]}" "$@"
