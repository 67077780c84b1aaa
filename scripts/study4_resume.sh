#!/usr/bin/env bash
# Start (or start again) Study 4's step (c) in the background, as registered (docs/results.md, "Study 4"): its two
# halves, `confirm-a` (seeds 22-25) and `confirm-b` (seeds 26-29), each one `safevocab study ... --resume` process,
# niced, from a clean checkout of the registration commit. Outside CI; for the development machine.
#
#   bash scripts/study4_resume.sh [--dry-run]      # anything else: a one-line error, exit 2
#
# What it does, each step only where needed, so that it works on a machine that lost everything but this repository:
#   1. a clean worktree of the registration commit at $STUDY4_DIR (default /work/study4; `git worktree add --detach`);
#   2. its own virtual environment, built by that commit's scripts/setup_env.sh (the versions the runs record);
#   3. each half's results.json, where its run folder has none, put back from docs/data/study4/<half>.results.json.gz
#      (the finished runs this repository recorded: `--resume` keeps them; runs in progress start from step 1, which
#      trains the same run: test_study_is_deterministic_per_seed);
#   4. both halves started with `setsid nohup nice -n 19`, their autogroups' nice set to 19 (nice acts within an
#      autogroup), logs in $STUDY4_DIR/../study4_logs/<half>.<UTC time>.log.
# It refuses when a half is running already, or when the worktree is not clean (a run records a dirty tree).
# Write down each start in docs/results.md, "Study 4: status".
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REGISTRATION=0911bb2e267cd680d71ad2391175576831948d91
DIR="${STUDY4_DIR:-/work/study4}"
LOGS="$(dirname "${DIR}")/study4_logs"
DRY=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    *) printf '[study4] unknown argument %q: accepted --dry-run or nothing\n' "$1" >&2; exit 2 ;;
esac

say() { printf '[study4] %s\n' "$*" >&2; }
run() { if ((DRY)); then say "would run: $*"; else "$@"; fi; }

if pgrep -f "output_dir runs/study4/confirm-" >/dev/null; then
    say "a half of (c) is running already (pgrep -af 'output_dir runs/study4/confirm-'): nothing started"
    ((DRY)) || exit 1
fi
if [[ ! -d "${DIR}" ]]; then
    say "no checkout at ${DIR}: adding a worktree of the registration commit ${REGISTRATION:0:7}"
    run git -C "${ROOT}" worktree add --detach "${DIR}" "${REGISTRATION}"
fi
if ((!DRY)); then
    head="$(git -C "${DIR}" rev-parse HEAD)"
    [[ "${head}" == "${REGISTRATION}" ]] || { say "${DIR} is at ${head}, not ${REGISTRATION}"; exit 1; }
    [[ -z "$(git -C "${DIR}" status --porcelain)" ]] || { say "${DIR} is not clean (git status)"; exit 1; }
fi
if [[ ! -x "${DIR}/.venv/bin/safevocab" ]]; then
    say "building ${DIR}/.venv with the registration commit's scripts/setup_env.sh (minutes)"
    run bash "${DIR}/scripts/setup_env.sh"
fi

COMMON=(--task freetext --threads 1 --no_plots --eval_num_prompts 432 --eval_seeds 0 1 2 3 --eval_on_rule --steps 600)
CONFIRM=(--eval_steps 0 300 400 500 600 --max_completion_length 128 --learning_rate 3e-3 --noise 0
         --sampler_rule min_p=0.05 --dvp_rule min_p=0.05 --arms no_remedy tis dvp no_mismatch)
stamp="$(date -u +%Y%m%dT%H%M%S)"
run mkdir -p "${LOGS}"
for half in a b; do
    seeds=(22 23 24 25)
    [[ "${half}" == b ]] && seeds=(26 27 28 29)
    out="runs/study4/confirm-${half}"
    record="${ROOT}/docs/data/study4/confirm-${half}.results.json.gz"
    if [[ ! -f "${DIR}/${out}/results.json" && -f "${record}" ]]; then
        say "confirm-${half}: putting back its recorded runs from ${record#"${ROOT}"/}"
        run mkdir -p "${DIR}/${out}"
        if ((!DRY)); then gunzip -c "${record}" >"${DIR}/${out}/results.json"; fi
    fi
    log="${LOGS}/confirm-${half}.${stamp}.log"
    cmd=(nice -n 19 "${DIR}/.venv/bin/safevocab" study "${COMMON[@]}" --seeds "${seeds[@]}" "${CONFIRM[@]}"
         --output_dir "${out}" --resume)
    if ((DRY)); then
        say "would start in ${DIR}: ${cmd[*]} > ${log}"
        continue
    fi
    (cd "${DIR}" && OMP_NUM_THREADS=1 setsid nohup "${cmd[@]}" >"${log}" 2>&1 </dev/null &)
    sleep 2
    pid="$(pgrep -f "output_dir ${out} --resume" | head -n 1)"
    echo 19 >"/proc/${pid}/autogroup" 2>/dev/null || say "confirm-${half}: could not set its autogroup's nice"
    say "confirm-${half}: pid ${pid}, log ${log}"
done
