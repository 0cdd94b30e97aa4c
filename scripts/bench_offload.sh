#!/usr/bin/env bash
# Disk-offload benchmarks of the runtime (BENCHMARKS.md, "Offloading to disk"):
#   1. opt-6.7b and opt-13b (larger than RAM) with all weights on disk and --cpu-mem below their
#      size, overlap on and off: wall time against max(compute, disk read) of the same run;
#   2. a Table 5-style ablation on opt-1.3b with weights on disk and the KV cache on cpu;
#   3. §5's 4-bit weights (--compress-weight) for opt-6.7b, opt-13b and opt-30b, the policy of 1.
#      (opt-30b in fp16, 60 GB, does not fit this machine's disk beside the others).
# Each run's JSON, /usr/bin/time -v and (for some) its --trace land in $OUT.
# Dummy weights are written once to $WEIGHTS (26 GB for opt-13b, 4-bit: 3.8, 7.3 and 16.9 GB
# for opt-6.7b, opt-13b and opt-30b) and reused.
#
# Usage (from the repository root; it takes no arguments):
#   bash scripts/bench_offload.sh
# Environment: FLEXGEN_BIN [./flexgen], WEIGHTS [~/.cache/flexgen], OFFLOAD (the disk tier)
# [/var/tmp], OUT [bench-offload-<UTC time>], ONLY (one group: all, large, ablation or compress)
# [all].
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '/^# Usage/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "bench_offload.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
BIN=${FLEXGEN_BIN:-./flexgen}
WEIGHTS=${WEIGHTS:-$HOME/.cache/flexgen}
OFFLOAD=${OFFLOAD:-/var/tmp}
OUT=${OUT:-bench-offload-$(date -u +%Y%m%dT%H%M%SZ)}
ONLY=${ONLY:-all}
case "$ONLY" in
    all|large|ablation|compress) ;;
    *) echo "bench_offload.sh: ONLY must be all, large, ablation or compress, got '$ONLY'" >&2; exit 2 ;;
esac
[ -x "$BIN" ] || { echo "bench_offload.sh: $BIN is not built (make, or FLEXGEN_BIN=)" >&2; exit 2; }
mkdir -p "$OUT"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

run() { # name, flags...
    local name=$1
    shift
    /usr/bin/time -v -o "$OUT/$name.time" "$BIN" --quiet --json --path "$WEIGHTS" \
        --offload-dir "$OFFLOAD" "$@" > "$OUT/$name.json"
    python3 - "$OUT/$name.json" "$OUT/$name.time" "$name" <<'PY'
import json, re, sys
d = json.load(open(sys.argv[1]))
m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(sys.argv[2]).read())
rss = int(m.group(1)) * 1024 if m else float("nan")
GiB = 1 << 30
bound = max(d["compute_seconds"], d["disk_read_seconds"])
print(f"{sys.argv[3]:<28} total {d['total_throughput']:8.3f} tok/s  decode {d['decode_throughput']:8.3f} tok/s  "
      f"wall {d['total_latency']:7.1f} s  compute {d['compute_seconds']:7.1f} s  disk {d['disk_read_seconds']:7.1f} s  "
      f"wall/max {d['total_latency'] / bound:5.2f}  wall/sum {d['total_latency'] / (d['compute_seconds'] + d['disk_read_seconds']):5.2f}  "
      f"peak gpu {d['peak_gpu_bytes'] / GiB:6.2f} cpu {d['peak_cpu_bytes'] / GiB:6.2f} disk {d['peak_disk_bytes'] / GiB:6.2f} GiB  "
      f"rss {rss / GiB:6.2f} GiB  disk->cpu {d['disk_to_cpu_bytes'] / GiB:7.1f} GiB", flush=True)
PY
}

echo "# $(date -u +%Y%m%dT%H%M%SZ) $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, $BIN"
if [ "$ONLY" = all ] || [ "$ONLY" = large ]; then
    for model in opt-6.7b opt-13b; do
        for overlap in 1 0; do
            trace=()
            [ "$overlap" = 1 ] && trace=(--trace "$OUT/$model.trace.json")
            run "$model-overlap$overlap" --model "$model" --percent 0 0 100 0 100 0 --cpu-mem 4G \
                --gpu-mem 8G --gpu-batch-size 8 --num-gpu-batches 2 --prompt-len 16 --gen-len 4 \
                --overlap "$overlap" "${trace[@]}"
        done
    done
fi
if [ "$ONLY" = all ] || [ "$ONLY" = ablation ]; then
    common=(--model opt-1.3b --prompt-len 16 --gen-len 4 --cpu-mem 4G)
    run ablation-all "${common[@]}" --percent 0 0 0 100 100 0 --gpu-batch-size 8 --num-gpu-batches 4 --cpu-cache-compute
    run ablation-no-overlap "${common[@]}" --percent 0 0 0 100 100 0 --gpu-batch-size 8 --num-gpu-batches 4 --cpu-cache-compute --overlap 0
    run ablation-no-delegation "${common[@]}" --percent 0 0 0 100 100 0 --gpu-batch-size 8 --num-gpu-batches 4
    run ablation-one-gpu-batch "${common[@]}" --percent 0 0 0 100 100 0 --gpu-batch-size 8 --num-gpu-batches 1 --cpu-cache-compute
    run ablation-deepspeed-like "${common[@]}" --percent 0 0 100 0 100 0 --gpu-batch-size 4 --num-gpu-batches 1
fi
if [ "$ONLY" = all ] || [ "$ONLY" = compress ]; then
    for model in opt-6.7b opt-13b opt-30b; do
        run "$model-q4" --model "$model" --percent 0 0 100 0 100 0 --cpu-mem 4G --gpu-mem 8G \
            --gpu-batch-size 8 --num-gpu-batches 2 --prompt-len 16 --gen-len 4 --compress-weight
    done
fi
