#!/usr/bin/env bash
# Runs each fuzz harness that `make fuzz` built (build-fuzz/fuzz_*) for SECONDS, starting from its
# seeds (tests/fuzz/corpus/TARGET) and the corpus earlier runs grew (build-fuzz/corpus/TARGET),
# and prints per target the executions and the findings of this run: the crash, leak, timeout
# and out-of-memory files libFuzzer wrote (build-fuzz/findings/TARGET/, replay one with
# `build-fuzz/fuzz_TARGET FILE`). Exits 1 if any target found something or did not run.
#
#   bash scripts/fuzz.sh SECONDS [TARGET...]     e.g. bash scripts/fuzz.sh 60 config hardware
#
# SECONDS is a positive integer. FUZZ_RUNS=N stops each target after N executions instead,
# SECONDS then being a bound.
set -uo pipefail

usage="usage: bash scripts/fuzz.sh SECONDS [TARGET...]"
case "${1:-}" in
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
seconds=${1:-}
# libFuzzer reads a -max_total_time that is not a number as 0, which means no limit.
if ! [[ $seconds =~ ^[1-9][0-9]*$ ]]; then
    echo "fuzz.sh: SECONDS must be a positive integer, got '$seconds'; $usage" >&2
    exit 2
fi
shift
if [ -n "${FUZZ_RUNS:-}" ] && ! [[ $FUZZ_RUNS =~ ^[1-9][0-9]*$ ]]; then
    echo "fuzz.sh: FUZZ_RUNS must be a positive integer, got '$FUZZ_RUNS'" >&2
    exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit
targets=("$@")
if [ ${#targets[@]} = 0 ]; then
    for bin in build-fuzz/fuzz_*; do targets+=("${bin#build-fuzz/fuzz_}"); done
fi

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0 passed=0 failed=0
for t in "${targets[@]}"; do
    bin=build-fuzz/fuzz_$t corpus=build-fuzz/corpus/$t findings=build-fuzz/findings/$t
    log=build-fuzz/logs/$t.log
    if [ ! -x "$bin" ]; then
        echo "fuzz_$t: not built (make fuzz)"
        status=1 failed=$((failed + 1))
        continue
    fi
    rm -rf "$findings"
    mkdir -p "$corpus" "$findings" build-fuzz/logs
    start=$SECONDS
    "$bin" -max_total_time="$seconds" -runs="${FUZZ_RUNS:--1}" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$findings/" "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1
    took=$((SECONDS - start))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    found=$(find "$findings" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
            -o -name 'oom-*' \) | sort)
    printf 'fuzz_%-12s %10s executions in %s s, %d findings\n' "$t" "${execs:-no}" "$took" \
        "$(printf '%s' "$found" | grep -c .)"
    if [ -z "$found" ] && [ -n "$execs" ]; then
        passed=$((passed + 1))
    else
        status=1 failed=$((failed + 1))
        printf '%s\n' "$found" | sed 's/^/    /'
        grep -m1 -E 'ERROR|runtime error|failed without|!=|accepted|outside' "$log" | sed 's/^/    /'
        echo "    (log: $log)"
    fi
done
echo "fuzz: $passed passed, $failed failed"
exit $status
