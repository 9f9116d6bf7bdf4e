#!/usr/bin/env bash
# Runs the multi-process tests (pytest -m multiprocess) N times in a row and reports every failure, to find
# races that one run of the suite rarely shows. Not part of CI: a run of the multi-process tests takes minutes.
#
#   scripts/stress_multiprocess.sh [N] [extra pytest arguments, e.g. a test file or -k EXPR]
#   make stress N=10
#
# Each run's output goes to $STRESS_LOG_DIR/run<i>.log (default: a new temporary directory); the report lists
# each failing test with its run, then one line of totals. Exit status 1 if any run failed.
set -u
N=${1:-10}
shift $(( $# > 0 ? 1 : 0 ))
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
    echo "stress_multiprocess: N must be a positive integer, got '$N'" >&2
    exit 2
fi
PY=${PY:-.venv/bin/python}
LOG_DIR=${STRESS_LOG_DIR:-$(mktemp -d -t fs-stress-XXXXXX)}
mkdir -p "$LOG_DIR"
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(tests)

failed_runs=0
failures=0
start=$(date +%s)
for i in $(seq 1 "$N"); do
    log="$LOG_DIR/run$i.log"
    t0=$(date +%s)
    "$PY" -m pytest -q -m multiprocess -p no:cacheprovider --timeout 300 "${TARGETS[@]}" >"$log" 2>&1
    rc=$?
    summary=$(tail -n 1 "$log")
    echo "run $i/$N: exit $rc in $(( $(date +%s) - t0 )) s: $summary"
    if [ "$rc" -ne 0 ]; then
        failed_runs=$((failed_runs + 1))
        found=$(grep -E '^(FAILED|ERROR) ' "$log" || true)
        if [ -z "$found" ]; then  # no test failed, yet pytest did not pass (a crash, an interrupted session)
            echo "  run $i: pytest exited $rc without a failing test; see $log"
            failures=$((failures + 1))
        else
            while IFS= read -r line; do
                echo "  run $i: $line"
                failures=$((failures + 1))
            done <<<"$found"
        fi
    fi
    # segments whose owner process has ended (a live owner may be another job's, running beside this one)
    leftover=0
    for seg in /dev/shm/fscomm-*; do
        [ -e "$seg" ] || continue
        pid=${seg#/dev/shm/fscomm-}; pid=${pid%%-*}
        [ -d "/proc/$pid" ] || { leftover=$((leftover + 1)); echo "  run $i: left in /dev/shm: ${seg#/dev/shm/}"; }
    done
done
echo "stress: $N run(s) in $(( $(date +%s) - start )) s, $failed_runs failed, $failures failure(s); logs in $LOG_DIR"
[ "$failed_runs" -eq 0 ]
