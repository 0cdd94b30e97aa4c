#!/usr/bin/env bash
# bench_contention.sh: decode speed alone and beside a busy neighbour (a second copy of the same
# run at the same moment), with the OpenMP spin ./flexgen sets (GOMP_SPINCOUNT=1000) and with
# libgomp's default (300000), in alternating rounds. Prints each run's decode token/s and the
# ratio of the two concurrent runs' speed to the lone run's.
# Usage: bash scripts/bench_contention.sh [ROUNDS] [flexgen flags...]
#        (default: 3 rounds of opt-125m, prompt 32, 32 tokens, a GPU batch of 8)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--model opt-125m --prompt-len 32 --gen-len 32 --gpu-batch-size 8 --num-gpu-batches 1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
decode() { # env..., prints the run's decode token/s
    env "$@" ./flexgen "${flags[@]}" --quiet --path "$work" --offload-dir "$work" |
        awk '/decode throughput/ { print $(NF - 1) }'
}
echo "flags: ${flags[*]}, OMP_NUM_THREADS=${OMP_NUM_THREADS:-all cores}"
printf '%-22s %10s %10s %10s %8s\n' spin alone "beside 1" "beside 2" ratio
for _ in $(seq "$rounds"); do
    for spin in 1000 300000; do
        env=("GOMP_SPINCOUNT=$spin")
        [ $spin = 1000 ] && env=(FLEXGEN_BENCH=1) # ./flexgen's own setting
        alone=$(decode "${env[@]}")
        decode "${env[@]}" > "$work/a" & decode "${env[@]}" > "$work/b" & wait
        a=$(cat "$work/a") b=$(cat "$work/b")
        printf '%-22s %10s %10s %10s %8.2f\n' "$([ $spin = 1000 ] && echo "1000 (./flexgen's)" || echo "300000 (libgomp's)")" \
            "$alone" "$a" "$b" "$(echo "($a + $b) / 2 / $alone" | bc -l)"
    done
done
