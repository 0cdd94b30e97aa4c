#!/usr/bin/env bash
# Prefill on each OpenBLAS core ./flexgen can end up on, alternated in one run (BENCHMARKS.md,
# "OpenBLAS's core"). Three ways of starting the same job:
#
#   as started     no variable: the core the library picks, or the better one ./flexgen starts
#                  itself again on (support/blas_core.c)
#   old core kept  OPENBLAS_CORETYPE=Prescott, a user's setting, which ./flexgen keeps: SSE3
#                  kernels, what a CPU newer than the library's table gets on some machines
#   old core met   the library "picks" Prescott (FLEXGEN_TEST_BLAS_LOW=1 makes the variable stand
#                  for the library's own pick), so ./flexgen starts again on the CPU's best core:
#                  what a newcomer on such a CPU gets
#
# For each: --json's prefill and total throughput, and the core that ran (blas_core). The best
# of ROUNDS runs is kept for each. "as started" and "old core met" should agree within noise.
#
# Run from the repository root:
#   bash scripts/bench_blas_core.sh [--model NAME] [--batch B] [--prompt-len P] [--gen-len G]
#                                   [--threads N] [--rounds N]
# Environment: MODEL [opt-1.3b], BATCH [8], PROMPT_LEN [128], GEN_LEN [8], THREADS [nproc],
# ROUNDS [2], WEIGHTS (--path of the dummy weights).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
die() { echo "bench_blas_core.sh: $*" >&2; exit 2; }

MODEL="${MODEL:-opt-1.3b}"
BATCH="${BATCH:-8}"
PROMPT_LEN="${PROMPT_LEN:-128}"
GEN_LEN="${GEN_LEN:-8}"
THREADS="${THREADS:-$(nproc)}"
ROUNDS="${ROUNDS:-2}"
while [ $# -gt 0 ]; do
    case "$1" in
        --model|--batch|--prompt-len|--gen-len|--threads|--rounds)
            [ $# -ge 2 ] || die "$1 needs a value"
            case "$1" in
                --model) MODEL="$2" ;; --batch) BATCH="$2" ;; --prompt-len) PROMPT_LEN="$2" ;;
                --gen-len) GEN_LEN="$2" ;; --threads) THREADS="$2" ;; --rounds) ROUNDS="$2" ;;
            esac
            shift ;;
        -h|--help) sed -n '/^# Run from/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    shift
done
for v in "$BATCH" "$PROMPT_LEN" "$GEN_LEN" "$THREADS" "$ROUNDS"; do
    [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "expected a positive integer, got '$v'"
done
[ -x ./flexgen ] || die "./flexgen is not built (run make)"

export OMP_NUM_THREADS="$THREADS"
unset OPENBLAS_CORETYPE FLEXGEN_TEST_BLAS_LOW FLEXGEN_BLAS_CORE_FORCED
path_args=()
[ -n "${WEIGHTS:-}" ] && path_args=(--path "$WEIGHTS")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run() { # $1: the way's name; the rest: its environment
    local way="$1"
    shift
    env "$@" ./flexgen --model "$MODEL" --device cpu --gpu-batch-size "$BATCH" --num-gpu-batches 1 \
        --prompt-len "$PROMPT_LEN" --gen-len "$GEN_LEN" --json --quiet "${path_args[@]}" |
        python3 -c "import json, sys; d = json.load(sys.stdin); d['way'] = '$way'; print(json.dumps(d))" >>"$work/runs"
}

for ((round = 1; round <= ROUNDS; round++)); do
    echo "bench_blas_core.sh: round $round of $ROUNDS ..." >&2
    run "as started"
    run "old core kept" OPENBLAS_CORETYPE=Prescott
    run "old core met" OPENBLAS_CORETYPE=Prescott FLEXGEN_TEST_BLAS_LOW=1
done

python3 - "$work/runs" "$MODEL" "$BATCH" "$PROMPT_LEN" "$GEN_LEN" "$THREADS" <<'PY'
import json, sys
runs, model, batch, prompt, gen, threads = sys.argv[1:]
best = {}
for d in map(json.loads, open(runs)):
    if d["way"] not in best or d["prefill_throughput"] > best[d["way"]]["prefill_throughput"]:
        best[d["way"]] = d
print(f"{model}, batch {batch}, prompt {prompt}, {gen} generated, {threads} threads; best of the rounds\n")
print("| started | OpenBLAS core that ran | prefill tok/s | total tok/s |")
print("| --- | --- | --- | --- |")
for way in ["as started", "old core kept", "old core met"]:
    d = best[way]
    print(f"| {way} | {d.get('blas_core', 'not reported')} | {d['prefill_throughput']:.1f} | {d['total_throughput']:.2f} |")
PY
