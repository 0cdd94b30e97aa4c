#!/usr/bin/env bash
# Policy search benchmarks (BENCHMARKS.md, "Policy search"):
#   predict  this machine's constants (flexgen profile), then for each policy of a list the cost
#            model's prediction (flexgen policy --evaluate) beside a real run's throughput
#   sweep    opt-6.7b with --gpu-mem 12G --cpu-mem 4G (most weights must stay on disk), 32
#            prompts of 16 tokens, 4 generated: --policy auto against a hand sweep of block
#            shapes and weight placements
#   search   time of the whole search, and of one LP (scripts/bench_lp.sh has the LP alone)
# Every run's JSON lands in $OUT; the tables are printed. REUSE=1 keeps runs already in $OUT
# and predicts them again (with another hardware file: HW=...).
#
# Usage (from the repository root; it takes no arguments):
#   bash scripts/bench_policy.sh
# Environment: FLEXGEN_BIN [./flexgen], WEIGHTS [~/.cache/flexgen], OFFLOAD (the disk tier)
# [/var/tmp], OUT [bench-policy-<UTC time>], ONLY (one part: all, predict, sweep or search)
# [all], HW (a hardware file; profiled into $OUT when missing) [$OUT/hw.json], REUSE [0].
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '/^# Usage/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "bench_policy.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
BIN=${FLEXGEN_BIN:-./flexgen}
WEIGHTS=${WEIGHTS:-$HOME/.cache/flexgen}
OFFLOAD=${OFFLOAD:-/var/tmp}
OUT=${OUT:-bench-policy-$(date -u +%Y%m%dT%H%M%SZ)}
ONLY=${ONLY:-all}
case "$ONLY" in
    all|predict|sweep|search) ;;
    *) echo "bench_policy.sh: ONLY must be all, predict, sweep or search, got '$ONLY'" >&2; exit 2 ;;
esac
[ -x "$BIN" ] || { echo "bench_policy.sh: $BIN is not built (make, or FLEXGEN_BIN=)" >&2; exit 2; }
mkdir -p "$OUT"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
HW=${HW:-$OUT/hw.json}
[ -f "$HW" ] || "$BIN" profile --offload-dir "$OFFLOAD" --out "$HW"

# name, model, prompt len, gen len, flags...: prediction and measurement side by side
compare() {
    local name=$1 model=$2 s=$3 n=$4
    shift 4
    local common=(--model "$model" --path "$WEIGHTS" --offload-dir "$OFFLOAD" --prompt-len "$s" --gen-len "$n" "$@")
    "$BIN" policy --evaluate --hw "$HW" --json "${common[@]}" > "$OUT/$name.predicted.json"
    if [ "${REUSE:-0}" != 1 ] || [ ! -s "$OUT/$name.json" ]; then
        "$BIN" --quiet --json "${common[@]}" > "$OUT/$name.json"
    fi
    python3 - "$OUT/$name" "$name" "$*" <<'PY'
import json, sys
p = json.load(open(sys.argv[1] + ".predicted.json"))
m = json.load(open(sys.argv[1] + ".json"))
err = p["predicted_throughput"] / m["total_throughput"] - 1
print(f"| {sys.argv[2]} | `{sys.argv[3]}` | {p['predicted_throughput']:.3f} | {m['total_throughput']:.3f} | {100 * err:+.0f}% |", flush=True)
PY
}

echo "# $(date -u +%Y%m%dT%H%M%SZ) $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, $BIN, hardware $HW"
if [ "$ONLY" = all ] || [ "$ONLY" = predict ]; then
    echo "| run | policy | predicted tok/s | measured tok/s | error |"
    echo "|---|---|---|---|---|"
    B=(--gpu-batch-size 8 --num-gpu-batches 2)
    compare all-in-ram opt-1.3b 64 8 "${B[@]}" --percent 100 0 100 0 100 0
    compare weights-cpu opt-1.3b 64 8 "${B[@]}" --percent 0 100 100 0 100 0
    compare weights-disk opt-1.3b 64 8 "${B[@]}" --percent 0 0 100 0 100 0
    compare cache-cpu-delegated opt-1.3b 64 8 "${B[@]}" --percent 100 0 0 100 100 0 --cpu-cache-compute
    compare cache-disk opt-1.3b 64 8 "${B[@]}" --percent 100 0 0 0 100 0
    compare activations-disk opt-1.3b 64 8 "${B[@]}" --percent 100 0 100 0 0 0
    compare q4-weights-disk opt-1.3b 64 8 "${B[@]}" --percent 0 0 100 0 100 0 --compress-weight
    compare q4-cache opt-1.3b 64 8 "${B[@]}" --percent 100 0 100 0 100 0 --compress-cache
    compare 6.7b-weights-disk opt-6.7b 16 4 --gpu-batch-size 8 --num-gpu-batches 2 --percent 0 0 100 0 100 0 --cpu-mem 4G
fi
if [ "$ONLY" = all ] || [ "$ONLY" = sweep ]; then
    python3 -c "
import random
random.seed(5)
for i in range(32): print(' '.join(['2'] + [str(random.randrange(3, 50000)) for _ in range(15)]))" > "$OUT/prompts32.txt"
    C=(--prompt-ids "$OUT/prompts32.txt" --gpu-mem 12G --cpu-mem 4G)
    echo "| run | policy | predicted tok/s | measured tok/s | error |"
    echo "|---|---|---|---|---|"
    for shape in "8 4" "16 2" "32 1"; do
        read -r gbs ngb <<<"$shape"
        for pct in "0 0 100 0 100 0" "25 0 100 0 100 0"; do
            read -ra percent <<<"$pct"
            compare "sweep-${gbs}x$ngb-w${pct// /-}" opt-6.7b 16 4 "${C[@]}" --gpu-batch-size "$gbs" \
                --num-gpu-batches "$ngb" --percent "${percent[@]}"
        done
    done
    A=(--hw "$HW" --model opt-6.7b --gen-len 4 "${C[@]}" --path "$WEIGHTS" --offload-dir "$OFFLOAD")
    "$BIN" policy "${A[@]}" | sed 's/^/    /'
    "$BIN" policy --json "${A[@]}" > "$OUT/auto.predicted.json"
    "$BIN" --json --policy auto "${A[@]}" > "$OUT/auto.json"
    python3 - "$OUT" <<'PY'
import json, sys
p = json.load(open(sys.argv[1] + "/auto.predicted.json"))
m = json.load(open(sys.argv[1] + "/auto.json"))
flags = (f"--gpu-batch-size {m['gpu_batch_size']} --num-gpu-batches {m['num_gpu_batches']} --percent "
         + " ".join(map(str, m["percent"])) + (" --cpu-cache-compute" if m["cpu_cache_compute"] else ""))
err = p["predicted_throughput"] / m["total_throughput"] - 1
print(f"| auto | `{flags}` | {p['predicted_throughput']:.3f} | {m['total_throughput']:.3f} | {100 * err:+.0f}% |")
PY
fi
if [ "$ONLY" = all ] || [ "$ONLY" = search ]; then
    for m in opt-1.3b opt-6.7b opt-30b opt-175b; do
        "$BIN" policy --json --hw "$HW" --model "$m" --prompt-len 512 --gen-len 32 --disk-mem 2T --path "$WEIGHTS" --offload-dir "$OFFLOAD" |
            python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"$m (this machine): {d['lps']} LPs, search {1000 * d['search_seconds']:.1f} ms\")"
        "$BIN" policy --json --hw hardware/t4-flexgen.json --model "$m" --prompt-len 512 --gen-len 32 --gpu-mem 16G --cpu-mem 208G --disk-mem 1500G |
            python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"$m (T4 setup): {d['lps']} LPs, search {1000 * d['search_seconds']:.1f} ms\")"
    done
fi
