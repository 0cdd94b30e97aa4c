#!/usr/bin/env bash
# GPU benchmarks of the CUDA backend (BENCHMARKS.md, "CUDA backend"); run on a machine with a GPU:
#   hardware  what the machine allows: `flexgen profile --device cuda` (pinned cpu -> gpu
#             bandwidth, decode and prefill FLOP/s of cuBLAS fp16 products in a layer, disk)
#   runs      opt-6.7b, opt-13b, opt-30b, dummy weights, s = 512, n = 32, --gpu-mem 16G (a T4's
#             memory on any larger card), each with a fixed policy and with --policy auto: the
#             throughput, peak gpu memory, bytes per link and a Chrome trace of each run, and
#             the cost model's prediction for the same policy with the measured constants, so
#             that each run is also a fraction of its bound
# Every run's JSON and trace land in $OUT; a markdown table is printed. A run that is refused (the
# plan does not fit), fails or times out is a row saying so, and the next run goes on.
#
# Usage (from the repository root):
#   bash scripts/bench_gpu.sh                   the runs above
#   bash scripts/bench_gpu.sh policy MODEL      prints MODEL's fixed policy and exits
# Environment: FLEXGEN_BIN [./flexgen], WEIGHTS (dummy weights on disk) [~/.cache/flexgen],
# OFFLOAD (the disk tier) [/var/tmp], OUT [bench-gpu-<UTC time>], MODELS [opt-6.7b opt-13b
# opt-30b], HW (a hardware file; profiled into $OUT when missing), MAX_LATENCY (auto's bound on a
# block, seconds) [600], RUN_TIMEOUT (seconds for each run and for the profile; 0: none) [0].
set -euo pipefail

# The fixed policies: opt-30b's is FlexGen's published one (§6, Table 5's setting, 16 GB T4);
# those of 6.7b (all on the GPU) and 13b (weights split, cache on the CPU) follow the same
# reasoning for 16 GB and are ours.
policy_for() {
    case $1 in
        opt-6.7b) echo "--percent 100 0 100 0 100 0 --gpu-batch-size 4 --num-gpu-batches 1" ;;
        opt-13b) echo "--percent 40 60 0 100 0 100 --gpu-batch-size 32 --num-gpu-batches 4 --cpu-cache-compute" ;;
        opt-30b) echo "--percent 20 80 0 100 0 100 --gpu-batch-size 48 --num-gpu-batches 3 --cpu-cache-compute" ;;
        *) echo "bench_gpu.sh: no fixed policy for $1" >&2; return 1 ;;
    esac
}
usage_error() {
    echo "bench_gpu.sh: $* (try --help)" >&2
    exit 2
}
case "${1:-}" in
    -h|--help) sed -n '/^# Usage/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    policy)
        [ $# = 2 ] || usage_error "usage: bash scripts/bench_gpu.sh policy MODEL"
        policy_for "$2" || exit 2
        exit 0 ;;
    "") ;;
    *) usage_error "unknown argument '$1'" ;;
esac

BIN=${FLEXGEN_BIN:-./flexgen}
WEIGHTS=${WEIGHTS:-$HOME/.cache/flexgen}
OFFLOAD=${OFFLOAD:-/var/tmp}
OUT=${OUT:-bench-gpu-$(date -u +%Y%m%dT%H%M%SZ)}
MODELS=${MODELS:-opt-6.7b opt-13b opt-30b}
RUN_TIMEOUT=${RUN_TIMEOUT:-0}
[[ $RUN_TIMEOUT =~ ^[0-9]+$ ]] || usage_error "RUN_TIMEOUT must be a number of seconds, got '$RUN_TIMEOUT'"
for model in $MODELS; do policy_for "$model" >/dev/null || exit 2; done
command -v nvidia-smi >/dev/null || { echo "bench_gpu.sh: no nvidia-smi: run it on a machine with a GPU" >&2; exit 1; }
[ -x "$BIN" ] || { echo "bench_gpu.sh: $BIN is not built (make, or FLEXGEN_BIN=)" >&2; exit 1; }
mkdir -p "$OUT"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee "$OUT/when.txt"
HW=${HW:-$OUT/hardware.json}
[ -f "$HW" ] || timeout -k 10 "$RUN_TIMEOUT" "$BIN" profile --device cuda --offload-dir "$OFFLOAD" --out "$HW"

run() { # name, model, flags... (without --model)
    local name=$1 model=$2 rc=0
    shift 2
    local common=(--model "$model" --device cuda --gpu-mem 16G --path "$WEIGHTS" --offload-dir "$OFFLOAD"
                  --prompt-len 512 --gen-len 32 "$@")
    timeout -k 10 "$RUN_TIMEOUT" "$BIN" --quiet --json --trace "$OUT/$name.trace.json" "${common[@]}" \
        > "$OUT/$name.json" 2> "$OUT/$name.err" || rc=$?
    if [ "$rc" != 0 ]; then
        local what="failed (exit status $rc)"
        [ "$rc" = 2 ] && what=refused
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && what="timed out after $RUN_TIMEOUT s"
        echo "| $name | \`$*\` | $what: $(head -c 300 "$OUT/$name.err" | tr '\n|' '  ') |"
        return 0
    fi
    local chosen
    chosen=$(python3 -c 'import json,sys; o=json.load(open(sys.argv[1])); p=o["percent"]; print("--gpu-batch-size %d --num-gpu-batches %d --percent %s%s" % (o["gpu_batch_size"], o["num_gpu_batches"], " ".join(map(str, p)), " --cpu-cache-compute" if o["cpu_cache_compute"] else ""))' "$OUT/$name.json")
    # the prediction of the policy that ran (for auto: the one the search chose)
    # shellcheck disable=SC2086
    if ! "$BIN" policy --evaluate --json --hw "$HW" --device cuda --gpu-mem 16G --path "$WEIGHTS" \
        --offload-dir "$OFFLOAD" --prompt-len 512 --gen-len 32 --model "$model" $chosen \
        > "$OUT/$name.predicted.json" 2> "$OUT/$name.predicted.err"; then
        echo "| $name | \`$chosen\` | ran, but no prediction: $(head -c 300 "$OUT/$name.predicted.err" | tr '\n|' '  ') |"
        return 0
    fi
    python3 - "$OUT/$name" "$name" "$chosen" <<'PY'
import json, sys
m = json.load(open(sys.argv[1] + ".json"))
p = json.load(open(sys.argv[1] + ".predicted.json"))
G = 2 ** 30
print(f"| {sys.argv[2]} | `{sys.argv[3]}` | {m['total_throughput']:.2f} | {m['decode_throughput']:.2f} | "
      f"{p['predicted_throughput']:.2f} | {m['total_throughput'] / p['predicted_throughput']:.2f} | "
      f"{m['peak_gpu_bytes'] / G:.2f} | {m['cpu_to_gpu_bytes'] / G:.1f} | {m['gpu_to_cpu_bytes'] / G:.1f} | "
      f"{m['disk_to_cpu_bytes'] / G:.1f} |", flush=True)
PY
}

echo "| run | policy | total tok/s | decode tok/s | predicted tok/s | fraction of bound | peak gpu GiB | cpu->gpu GiB | gpu->cpu GiB | disk->cpu GiB |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for model in $MODELS; do
    # shellcheck disable=SC2046
    run "$model-fixed" "$model" $(policy_for "$model")
    run "$model-auto" "$model" --policy auto --hw "$HW" --max-latency "${MAX_LATENCY:-600}"
done
