#!/usr/bin/env bash
# Set up the environment (idempotent, see scripts/setup_env.sh), then run the main job.
#
#   bash scripts/main.sh [ARGS...]     # ARGS are passed to the main job
#
# The main job: `safevocab-grpo` (= `safevocab grpo`) with no arguments runs GRPO with Dynamic Vocabulary
# Pruning on the bundled tiny model and arithmetic task (trl_integration/demo: 200 steps, about 30 s of training
# on a CPU) and prints a summary.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"

# Sourcing sets up the venv if needed and activates it in this shell.
# shellcheck source=scripts/setup_env.sh
source "${ROOT}/scripts/setup_env.sh"

# The main job, one line (the core benchmark is `python -m safevocab.bench`).
MAIN_JOB=(safevocab-grpo)

echo "[main] ${MAIN_JOB[*]} $*" >&2
exec "${MAIN_JOB[@]}" "$@"
