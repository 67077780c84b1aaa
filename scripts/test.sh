#!/usr/bin/env bash
# Set up the environment (idempotent, see scripts/setup_env.sh), run the fast tests, build the docs.
#
#   bash scripts/test.sh [PYTEST_ARGS...]   # e.g. -x, -k rules, tests/safevocab/test_rules.py, -m slow
#
# Runs `pytest -m "not slow"` (tests/, from pyproject's testpaths; later -m arguments override),
# then `mkdocs build --strict` into a temporary directory, so a broken API reference (a missing
# module, a bad docstring, a dangling cross-reference) fails the run. Both steps always run; the
# exit status is pytest's when it failed, else mkdocs's. pytest's "no tests collected" (exit 5)
# counts as success for the pytest step, with a note.
#
# It says what it does: one `[test] step i/3: ...` line per step (set-up, pytest, docs) and pytest's progress as a
# count of tests done out of the total (`-o console_output_style=count`; a later `-o` of yours overrides it).
#
# Workers: the tests run in parallel processes (pytest-xdist, `-n N --dist loadfile`: a module's tests stay in one
# worker, so its fixtures are built once), at most one per 3 GiB of available memory (a worker that built a vLLM engine
# holds ~1.5 GiB). On an idle machine one per core: each worker imports the whole stack, so more only add imports and
# switching (2 idle cores: two workers 7 min 24 s, four 8 min 29 s to 9 min 04 s). On a busy one (other work keeps half
# of the cores busy or more, measured over one second before the tests start) three per core: the suite's share of the
# cores grows with its processes (beside 8 busy processes two workers had done 65 % after 19 minutes, four finished in
# 25 min 33 s, six in 19 min 31 s). SAFEVOCAB_TEST_WORKERS=N chooses N; 1 runs them in this process (no xdist). A later
# `-n` of yours overrides it too.
#
# Threads: pytest runs with OMP_NUM_THREADS=1 unless you set it. The suite is many small ops; with torch's default of
# one thread per core every op ends at a barrier where the threads wait for any of them the OS preempted, so on a
# busy machine the suite crawls (issue 31: 6 % in 15 minutes at load 7-13). Your own OMP_NUM_THREADS is kept.
#
# Environment: SAFEVOCAB_SKIP_DOCS=1 skips the docs build. SAFEVOCAB_REQUIRE_VLLM=1 (the default when the extras
# include vllm, as the default extras do) turns the real-engine tests' "vLLM is not installed" skip into a failure,
# so a broken vLLM install cannot pass as skipped tests.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"

echo "[test] step 1/3: set up the environment (scripts/setup_env.sh)" >&2
# shellcheck source=scripts/setup_env.sh
source "${ROOT}/scripts/setup_env.sh"

if [[ ",${SAFEVOCAB_EXTRAS:-vllm}," == *",vllm"* ]]; then
    export SAFEVOCAB_REQUIRE_VLLM="${SAFEVOCAB_REQUIRE_VLLM:-1}"
fi

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    export OMP_NUM_THREADS=1
    threads_note="OMP_NUM_THREADS=1 (the default here; set it to choose)"
else
    threads_note="OMP_NUM_THREADS=${OMP_NUM_THREADS} (yours)"
fi
workers="${SAFEVOCAB_TEST_WORKERS:-}"
if [[ -z "${workers}" ]]; then
    # (nproc counts OMP_NUM_THREADS, set above, as a limit: ask it without)
    cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
    # How busy the cores are now: /proc/stat's "cpu" line over one second (the load average would still count a job
    # that ended a minute ago): user..steal, guest time being inside user. It covers every CPU the machine shows, also
    # where this process may use fewer (a pinned job). SAFEVOCAB_CPU_SAMPLES: a file of two such lines (for tests).
    cpu_lines() { awk '/^cpu / { total = 0; for (i = 2; i <= 9; i++) total += $i; print $5 + $6, total }' "$1" 2>/dev/null || true; }
    samples=""
    if [[ -n "${SAFEVOCAB_CPU_SAMPLES:-}" ]]; then
        samples="$(cpu_lines "${SAFEVOCAB_CPU_SAMPLES}")"
    elif [[ -r /proc/stat ]]; then
        samples="$(cpu_lines /proc/stat; sleep 1; cpu_lines /proc/stat)"
    fi
    busy_percent="$(awk 'NR == 1 { i0 = $1; t0 = $2 } NR == 2 { i1 = $1; t1 = $2 }
        END { if (NR == 2 && t1 > t0) printf "%d", 100 * (1 - (i1 - i0) / (t1 - t0)) + 0.5; else print "unknown" }' <<<"${samples}")"
    # three per core when other work keeps at least half of the cores busy, else one
    if [[ "${busy_percent}" =~ ^[0-9]+$ ]] && (( busy_percent >= 50 )); then
        workers=$(( 3 * cores ))
        workers_note="three per core: the cores were ${busy_percent} % busy"
    else
        workers=${cores}
        workers_note="one per core: the cores were ${busy_percent} % busy"
    fi
    by_memory="$(awk '/^MemAvailable:/ { print int($2 / (3 * 1024 * 1024)) }' /proc/meminfo 2>/dev/null || true)"
    if [[ "${by_memory}" =~ ^[0-9]+$ ]] && (( by_memory < workers )); then
        workers=${by_memory}
        workers_note="${workers_note}; at most one per 3 GiB of available memory"
    fi
    (( workers < 1 )) && workers=1
    workers_note="${workers} workers, ${workers_note}"
else
    workers_note="${workers} workers (SAFEVOCAB_TEST_WORKERS)"
fi
[[ "${workers}" =~ ^[1-9][0-9]*$ ]] || { echo "[test] SAFEVOCAB_TEST_WORKERS=${workers} must be a whole number >= 1" >&2; exit 2; }
parallel=()
(( workers > 1 )) && parallel=(-n "${workers}" --dist loadfile)
echo "[test] step 2/3: the fast tests: python -m pytest -m \"not slow\" ${parallel[*]:-} $* under ${threads_note}; ${workers_note}" >&2
pytest_rc=0
python -m pytest -m "not slow" ${parallel[@]+"${parallel[@]}"} -o console_output_style=count "$@" || pytest_rc=$?
if [[ ${pytest_rc} -eq 5 ]]; then
    echo "[test] note: pytest collected no tests (exit 5); counted as success" >&2
    pytest_rc=0
fi

docs_rc=0
if [[ "${SAFEVOCAB_SKIP_DOCS:-0}" == "1" ]]; then
    echo "[test] step 3/3: the docs: skipped (SAFEVOCAB_SKIP_DOCS=1)" >&2
else
    site_dir="$(mktemp -d "${TMPDIR:-/tmp}/safevocab-site.XXXXXX")"
    trap 'rm -rf "${site_dir}"' EXIT
    echo "[test] step 3/3: the docs: mkdocs build --strict -d ${site_dir}" >&2
    # NO_MKDOCS_2_WARNING silences Material's end-of-life banner (noise, not a docs problem).
    NO_MKDOCS_2_WARNING=1 mkdocs build --strict --clean -d "${site_dir}" || docs_rc=$?
fi

if [[ ${pytest_rc} -ne 0 ]]; then
    echo "[test] FAILED: pytest exit ${pytest_rc}$([[ ${docs_rc} -ne 0 ]] && echo ", mkdocs exit ${docs_rc}")" >&2
    exit "${pytest_rc}"
fi
if [[ ${docs_rc} -ne 0 ]]; then
    echo "[test] FAILED: mkdocs build --strict exit ${docs_rc}" >&2
    exit "${docs_rc}"
fi
echo "[test] OK" >&2
