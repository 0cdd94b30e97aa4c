#!/usr/bin/env bash
# bench_contention.sh: decode speed alone and beside a busy neighbour (a second copy of the same
# run at the same moment), with the OpenMP spin ./flexgen sets (GOMP_SPINCOUNT=1000) and with
# libgomp's default (300000), in alternating rounds. Prints each run's decode token/s and the
# ratio of the two concurrent runs' speed to the lone run's.
# Usage: bash scripts/bench_contention.sh [ROUNDS [flexgen flags...]]
#        ROUNDS: a positive integer [3]; flags: ./flexgen's (default: opt-125m, prompt 32,
#        32 tokens, a GPU batch of 8)
set -euo pipefail

usage() {
    sed -n '/^# Usage:/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
esac
rounds=${1:-3}
if ! [[ $rounds =~ ^[1-9][0-9]*$ ]]; then
    echo "bench_contention.sh: ROUNDS must be a positive integer, got '$rounds' (try --help)" >&2
    exit 2
fi
shift || true
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--model opt-125m --prompt-len 32 --gen-len 32 --gpu-batch-size 8 --num-gpu-batches 1)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x ./flexgen ] || { echo "bench_contention.sh: ./flexgen is not built (run make)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
decode() { # env..., prints the run's decode token/s
    env "$@" ./flexgen "${flags[@]}" --quiet --path "$work" --offload-dir "$work" |
        awk '/decode throughput/ { print $(NF - 1) }'
}
# Fails with one line where a run failed or printed no decode throughput.
check() { # what, value
    [ -n "$2" ] && return 0
    echo "bench_contention.sh: the $1 run printed no decode throughput (its error is above)" >&2
    exit 1
}
echo "flags: ${flags[*]}, OMP_NUM_THREADS=${OMP_NUM_THREADS:-all cores}"
printf '%-22s %10s %10s %10s %8s\n' spin alone "beside 1" "beside 2" ratio
for _ in $(seq "$rounds"); do
    for spin in 1000 300000; do
        env=("GOMP_SPINCOUNT=$spin")
        [ $spin = 1000 ] && env=(FLEXGEN_BENCH=1) # ./flexgen's own setting
        alone=$(decode "${env[@]}") || true
        check lone "$alone"
        decode "${env[@]}" >"$work/a" &
        pid_a=$!
        decode "${env[@]}" >"$work/b" &
        pid_b=$!
        wait "$pid_a" || true
        wait "$pid_b" || true
        a=$(cat "$work/a")
        b=$(cat "$work/b")
        check "first concurrent" "$a"
        check "second concurrent" "$b"
        printf '%-22s %10s %10s %10s %8.2f\n' "$([ $spin = 1000 ] && echo "1000 (./flexgen's)" || echo "300000 (libgomp's)")" \
            "$alone" "$a" "$b" "$(echo "($a + $b) / 2 / $alone" | bc -l)"
    done
done
