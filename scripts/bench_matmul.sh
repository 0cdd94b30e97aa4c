#!/usr/bin/env bash
# One decode product alone against the machine's read rate (BENCHMARKS.md, "Decode at the read
# limit"): scripts/bench_matmul.c on opt-1.3b's fc1 (2048 x 8192) and fc2 (8192 x 2048) from
# memory (copies of W making 1 GiB, past every cache), and on a 256 x 4096 matrix from L2 (the
# kernel's arithmetic alone), for 1 and 8 rows of x, fp16 and 4-bit, on every path of the CPU's
# own kernels this CPU has; scripts/stream_rate.c before and after. Both are built by make
# (build/bench_matmul, build/stream_rate). Each line is bench_matmul's JSON, with the share of the
# read rate (the median of the stream readings).
#
# Run from the repository root:
#   bash scripts/bench_matmul.sh [--threads N]
# Environment: THREADS [nproc].
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
THREADS="${THREADS:-$(nproc)}"
while [ $# -gt 0 ]; do
    case "$1" in
        --threads)
            [ $# -ge 2 ] || { echo "bench_matmul.sh: --threads needs a value" >&2; exit 2; }
            THREADS="$2"
            shift ;;
        -h|--help) sed -n '/^# Run from/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench_matmul.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || { echo "bench_matmul.sh: expected a positive integer, got '$THREADS'" >&2; exit 2; }

export OMP_NUM_THREADS="$THREADS"
make --no-print-directory -s build/stream_rate build/bench_matmul
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

paths="avx512 avx2"
build/stream_rate >>"$work/stream"
for path in $paths; do
    for format in fp16 4-bit; do
        for rows in 1 8; do
            for shape in "2048 8192" "8192 2048" "256 4096 1 500"; do
                # shellcheck disable=SC2086
                FLEXGEN_ISA=$path build/bench_matmul "$rows" "$format" $shape >>"$work/runs" 2>/dev/null ||
                    { echo "bench_matmul.sh: the $path path is not on this CPU" >&2; continue 3; }
            done
        done
    done
    build/stream_rate >>"$work/stream"
done

python3 - "$work" <<'PY'
import json, statistics, sys
work = sys.argv[1]
reads = sorted(json.loads(l)["gbs"] for l in open(f"{work}/stream"))
bw = statistics.median(reads)
print(f"read rate {bw:.1f} GB/s (median of {len(reads)} readings, {reads[0]:.1f} to {reads[-1]:.1f}), "
      f"threads {json.loads(open(f'{work}/stream').readline())['threads']}\n")
print("| path | weights | rows | W (in x out) | from | ms | GB/s | share of the read rate |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for line in open(f"{work}/runs"):
    d = json.loads(line)
    where = "L2" if d["bytes"] < 4 << 20 else "memory"
    print(f"| {d['path']} | {d['format']} | {d['rows']} | {d['in']} x {d['out']} | {where} | {d['ms']:.3f} | "
          f"{d['gbs']:.1f} | {d['gbs'] / bw:.0%} |")
PY
