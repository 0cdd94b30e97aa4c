#!/usr/bin/env bash
# Pipeline parallelism (§4.4, Table 3's argument) on one machine (BENCHMARKS.md, "Pipeline"):
# opt-6.7b with --cpu-mem so low that one process must keep part of the weights on disk, against
# two stages (mpirun -np 2) whose halves of the layers fit in their --cpu-mem. Same prompts, same
# cores (one process with all OpenMP threads; two with half each), runs alternated REPEAT times.
# Each run's --json lands in $OUT; the table has decode, prefill and total throughput, the ratio
# of two stages over one, and each stage's bubble (its compute thread waiting for the other).
# Needs Open MPI (mpirun) and dummy weights written once to $WEIGHTS (13.4 GB for opt-6.7b).
#
# Usage (from the repository root; it takes no arguments):
#   bash scripts/bench_pipeline.sh
# Environment: FLEXGEN_BIN [./flexgen], WEIGHTS [~/.cache/flexgen], OFFLOAD (the disk tier)
# [/var/tmp], OUT [bench-pipeline-<UTC time>], MODEL [opt-6.7b], CPU_MEM (--cpu-mem of each
# process: below the model's weights, above half of them) [7G], PROMPTS (how many) [16],
# PROMPT_LEN [16], GEN_LEN [8], GBS (--gpu-batch-size) [4], NGB (--num-gpu-batches) [2],
# REPEAT [1], ONE_CPU_PERCENT (the one stage's share of the weights on the cpu tier) [45].
set -euo pipefail
usage_error() {
    echo "bench_pipeline.sh: $* (try --help)" >&2
    exit 2
}
case "${1:-}" in
    -h|--help) sed -n '/^# Usage/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) usage_error "unknown argument '$1'" ;;
esac
BIN=${FLEXGEN_BIN:-./flexgen}
WEIGHTS=${WEIGHTS:-$HOME/.cache/flexgen}
OFFLOAD=${OFFLOAD:-/var/tmp}
OUT=${OUT:-bench-pipeline-$(date -u +%Y%m%dT%H%M%SZ)}
MODEL=${MODEL:-opt-6.7b}
CPU_MEM=${CPU_MEM:-7G}
PROMPTS=${PROMPTS:-16}
PROMPT_LEN=${PROMPT_LEN:-16}
GEN_LEN=${GEN_LEN:-8}
GBS=${GBS:-4}
NGB=${NGB:-2}
REPEAT=${REPEAT:-1}
ONE_CPU_PERCENT=${ONE_CPU_PERCENT:-45}
for v in PROMPTS PROMPT_LEN GEN_LEN GBS NGB REPEAT; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || usage_error "$v must be a positive integer, got '${!v}'"
done
if ! [[ $ONE_CPU_PERCENT =~ ^[0-9]+$ ]] || [ "$ONE_CPU_PERCENT" -gt 100 ]; then
    usage_error "ONE_CPU_PERCENT must be 0 to 100, got '$ONE_CPU_PERCENT'"
fi
[ -x "$BIN" ] || { echo "bench_pipeline.sh: $BIN is not built (make, or FLEXGEN_BIN=)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "bench_pipeline.sh: no mpirun: install Open MPI" >&2; exit 2; }
CORES=$(nproc)
mkdir -p "$OUT"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The same synthetic prompts for both: PROMPTS lines of BOS + PROMPT_LEN - 1 ids.
python3 - "$OUT/prompts.txt" "$PROMPTS" "$PROMPT_LEN" <<'PY'
import random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for _ in range(int(sys.argv[2])):
        f.write(" ".join(["2"] + [str(random.randrange(3, 50272)) for _ in range(int(sys.argv[3]) - 1)]) + "\n")
PY
COMMON=(--model "$MODEL" --prompt-ids "$OUT/prompts.txt" --gen-len "$GEN_LEN" --gpu-batch-size "$GBS"
        --num-gpu-batches "$NGB" --cpu-mem "$CPU_MEM" --path "$WEIGHTS" --offload-dir "$OFFLOAD"
        --device cpu --quiet --json)
# One stage: as much of the weights on the cpu tier as --cpu-mem holds, the rest on disk.
ONE=(--percent 0 "$ONE_CPU_PERCENT" 100 0 100 0)
# Two stages: each one's half of the layers on its cpu tier.
TWO=(--percent 0 100 100 0 100 0)

summary() { # name, json
    python3 - "$2" "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
G = 1 << 30
line = (f"{sys.argv[2]:<14} decode {d['decode_throughput']:7.3f}  prefill {d['prefill_throughput']:7.2f}  "
        f"total {d['total_throughput']:7.3f} tok/s  wall {d['total_latency']:7.1f} s  "
        f"disk->cpu {d['disk_to_cpu_bytes'] / G:6.1f} GiB  peak cpu {d['peak_cpu_bytes'] / G:5.2f} GiB")
for i, s in enumerate(d.get("stages", [])):
    line += (f"  | stage {i + 1}: layers {s['first_layer']}-{s['end_layer'] - 1} compute {s['compute_seconds']:.1f} s "
             f"bubble {s['bubble_seconds']:.1f} s sent {s['bytes_sent'] / (1 << 20):.1f} MiB "
             f"peak cpu {s['peak_cpu_bytes'] / G:.2f} GiB")
print(line, flush=True)
PY
}

echo "# $(date -u +%Y%m%dT%H%M%SZ) $CORES cores, $(free -g | awk '/Mem:/ {print $2}') GiB, $MODEL, $PROMPTS prompts x $PROMPT_LEN + $GEN_LEN, block $GBS x $NGB, --cpu-mem $CPU_MEM per process"
for r in $(seq 1 "$REPEAT"); do
    OMP_NUM_THREADS=$CORES "$BIN" "${COMMON[@]}" "${ONE[@]}" > "$OUT/one-$r.json"
    summary "1 stage #$r" "$OUT/one-$r.json"
    OMP_NUM_THREADS=$(( CORES / 2 > 0 ? CORES / 2 : 1 )) mpirun -np 2 --bind-to none \
        "$BIN" "${COMMON[@]}" "${TWO[@]}" > "$OUT/two-$r.json"
    summary "2 stages #$r" "$OUT/two-$r.json"
done
python3 - "$OUT" "$REPEAT" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
for key in ("decode_throughput", "prefill_throughput", "total_throughput"):
    ratios = [json.load(open(f"{out}/two-{r}.json"))[key] / json.load(open(f"{out}/one-{r}.json"))[key]
              for r in range(1, n + 1)]
    print(f"2 stages / 1 stage, {key}: " + " ".join(f"{x:.2f}x" for x in ratios))
PY
