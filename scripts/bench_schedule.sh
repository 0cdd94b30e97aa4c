#!/usr/bin/env bash
# The diagonal schedule (Appendix A.2) against zig-zag (§4.2) in the same memory: for each
# schedule, the largest block (GPU batches of GBS) whose plan the gpu tier's capacity GPU_MEM
# accepts, then the same job of N_PROMPTS prompts of PROMPT_LEN tokens, GEN_LEN generated, run
# with each schedule at its largest block, alternated, ROUNDS times. Weights on the disk tier
# (--percent 0 0 100 0 100 0): each step loads every layer, so a larger block generates more
# tokens a load.
#
# A block is accepted when ./flexgen does not refuse its plan ("the plan needs ...") within a few
# seconds of starting; the plan check runs before any compute.
#
# Each run prints its throughput and its mean time to a completed sequence (from the job's start),
# then the cost model's prediction for each schedule at its block.
#
# Usage (from the repository root, after make; it takes no arguments):
#   bash scripts/bench_schedule.sh
# Environment: MODEL [opt-125m], PROMPT_LEN [32], GEN_LEN [128], GBS [4], GPU_MEM [360M],
# N_PROMPTS [192], MAX_BATCHES [32], ROUNDS [2], THREADS [nproc], SEED [0], WEIGHTS (the dummy
# weights' directory) [~/.cache/flexgen].
set -euo pipefail
usage_error() {
    echo "bench_schedule.sh: $* (try --help)" >&2
    exit 2
}
case "${1:-}" in
    -h|--help) sed -n '/^# Usage/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) usage_error "unknown argument '$1'" ;;
esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL=${MODEL:-opt-125m}
PROMPT_LEN=${PROMPT_LEN:-32}
GEN_LEN=${GEN_LEN:-128}
GBS=${GBS:-4}
GPU_MEM=${GPU_MEM:-360M}
N_PROMPTS=${N_PROMPTS:-192}
MAX_BATCHES=${MAX_BATCHES:-32}
ROUNDS=${ROUNDS:-2}
SEED=${SEED:-0}
THREADS=${THREADS:-$(nproc)}
for v in PROMPT_LEN GEN_LEN GBS N_PROMPTS MAX_BATCHES ROUNDS THREADS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || usage_error "$v must be a positive integer, got '${!v}'"
done
[[ $SEED =~ ^[0-9]+$ ]] || usage_error "SEED must be a non-negative integer, got '$SEED'"
export OMP_NUM_THREADS=$THREADS
[ -x ./flexgen ] || { echo "bench_schedule.sh: ./flexgen: not built (make)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
weights=${WEIGHTS:-$HOME/.cache/flexgen}
python3 - "$N_PROMPTS" "$PROMPT_LEN" "$SEED" >"$work/prompts.txt" <<'EOF'
import random, sys
n, length, seed = map(int, sys.argv[1:])
r = random.Random(seed)
for _ in range(n):
    print(" ".join(str(r.randrange(3, 50000)) for _ in range(length)))
EOF
args=(--model "$MODEL" --device cpu --percent 0 0 100 0 100 0 --gpu-batch-size "$GBS" --gpu-mem "$GPU_MEM"
      --gen-len "$GEN_LEN" --quiet --offload-dir "$work" --path "$weights")

# 0: the plan of `ngb` batches fits; 1: refused.
fits() {
    local rc=0
    timeout 5 ./flexgen "${args[@]}" --schedule "$1" --num-gpu-batches "$2" --prompt-ids "$work/prompts.txt" \
        >/dev/null 2>"$work/probe.err" || rc=$?
    if grep -q "the plan needs" "$work/probe.err"; then return 1; fi
    [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || { cat "$work/probe.err" >&2; exit 1; }
}
largest() {
    local best=0
    for ((n = 1; n <= MAX_BATCHES; n++)); do
        if fits "$1" "$n"; then best=$n; else break; fi
    done
    echo "$best"
}
./flexgen "${args[@]}" --num-gpu-batches 1 --prompt-len 8 --gen-len 2 >/dev/null # dummy weights, once
declare -A ngb
for s in zigzag diagonal; do
    ngb[$s]=$(largest "$s")
    if [ "${ngb[$s]}" -eq 0 ]; then
        echo "bench_schedule.sh: $s: not even one GPU batch of $GBS fits --gpu-mem $GPU_MEM" >&2
        exit 1
    fi
    echo "$s: the largest block in --gpu-mem $GPU_MEM: $GBS x ${ngb[$s]} = $((GBS * ngb[$s])) sequences" >&2
done
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
for ((r = 1; r <= ROUNDS; r++)); do
    for s in zigzag diagonal; do
        start=$(date +%s.%N)
        ./flexgen "${args[@]}" --schedule "$s" --num-gpu-batches "${ngb[$s]}" --prompt-ids "$work/prompts.txt" \
            --json >"$work/$s.json"
        end=$(date +%s.%N)
        printf '%-8s round %d  block %3d  total %8.2f token/s  wall %6.1f s  peak gpu tier %7.1f MiB  mean time to a completed sequence %6.1f s\n' \
            "$s" "$r" "$((GBS * ngb[$s]))" "$(field "$work/$s.json" total_throughput)" \
            "$(python3 -c "print($end - $start)")" "$(python3 -c "print($(field "$work/$s.json" peak_gpu_bytes) / 1048576)")" \
            "$(field "$work/$s.json" mean_completion_seconds)"
    done
done
# The cost model's prediction for each schedule at its block (flexgen policy --evaluate, this
# machine's hardware file), and the search's own choice for these capacities, given the GPU batch.
for s in zigzag diagonal; do
    printf '%-8s predicted %8.2f token/s at its block\n' "$s" "$(./flexgen policy --evaluate "${args[@]}" --schedule "$s" \
        --num-gpu-batches "${ngb[$s]}" --prompt-ids "$work/prompts.txt" --json | python3 -c \
        "import json,sys; print(json.load(sys.stdin)['predicted_throughput'])")"
done
