#!/usr/bin/env bash
# Two builds of ./flexgen side by side on make bench's jobs (dummy weights, CPU backend): runs
# them alternately, ROUNDS times each, and prints each run's prefill, decode and total
# throughput (and the OpenBLAS core it ran on) and the ratio of the medians (NEW / BASE). Use it
# to check that a change keeps the speed: copy the old binary aside first (cp flexgen
# /tmp/flexgen-base), rebuild, then
#   bash scripts/bench_compare.sh /tmp/flexgen-base ./flexgen
# Environment: CONFIGS (MODEL:BATCH:PROMPT_LEN:GEN_LEN, space-separated)
# [opt-125m:32:128:32 opt-1.3b:8:128:32], ROUNDS [3], THREADS (OMP_NUM_THREADS) [nproc], EXTRA
# (more flags for both, e.g. "--compress-weight --int8-activations") [none].
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: bash scripts/bench_compare.sh BASE_BIN NEW_BIN" >&2; exit 2; }
base=$1 new=$2
for b in "$base" "$new"; do [ -x "$b" ] || { echo "bench_compare.sh: $b: not an executable" >&2; exit 2; }; done
CONFIGS=${CONFIGS:-opt-125m:32:128:32 opt-1.3b:8:128:32}
ROUNDS=${ROUNDS:-3}
export OMP_NUM_THREADS=${THREADS:-$(nproc)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d[sys.argv[2]])" "$1" "$2"; }
# The OpenBLAS core a run names (--json's blas_core; older builds do not say).
core() { python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('blas_core', '?'))" "$1"; }
for cfg in $CONFIGS; do
    IFS=: read -r model batch plen glen <<<"$cfg"
    args=(--model "$model" --gpu-batch-size "$batch" --num-gpu-batches 1 --prompt-len "$plen"
          --gen-len "$glen" --device cpu --json --quiet --offload-dir "$work" --path "$work")
    # shellcheck disable=SC2206
    [ -n "${EXTRA:-}" ] && args+=($EXTRA)
    for r in $(seq "$ROUNDS"); do
        for side in base new; do
            bin=$base; [ $side = new ] && bin=$new
            "$bin" "${args[@]}" >"$work/$side.json"
            printf '%-18s round %d %-4s prefill %9.2f  decode %8.2f  total %8.2f token/s  core %s\n' "$cfg" "$r" \
                "$side" "$(field "$work/$side.json" prefill_throughput)" \
                "$(field "$work/$side.json" decode_throughput)" "$(field "$work/$side.json" total_throughput)" \
                "$(core "$work/$side.json")"
            echo "$side $(field "$work/$side.json" prefill_throughput) $(field "$work/$side.json" decode_throughput) $(field "$work/$side.json" total_throughput)" >>"$work/$cfg.txt"
        done
    done
    python3 - "$work/$cfg.txt" "$cfg" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = lambda side, i: statistics.median(float(r[i]) for r in rows if r[0] == side)
print('%-18s new / base (medians): prefill %.3f  decode %.3f  total %.3f' % (sys.argv[2],
      med('new', 1) / med('base', 1), med('new', 2) / med('base', 2), med('new', 3) / med('base', 3)))
PY
done
