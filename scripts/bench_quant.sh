#!/usr/bin/env bash
# Compressor and decompressor throughput against memcpy (BENCHMARKS.md, "Compression"):
# builds build/bench_quant (make, from scripts/bench_quant.c and ./flexgen's objects) and runs it
# on MIB MiB of fp32 values.
#
# Run from the repository root:
#   bash scripts/bench_quant.sh [MIB]        MIB: a positive integer [256]
set -euo pipefail

case "${1:-}" in
    -h|--help) sed -n '/^# Run from/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[ $# -le 1 ] || { echo "bench_quant.sh: one argument at most (try --help)" >&2; exit 2; }
mib="${1:-256}"
if ! [[ "$mib" =~ ^[1-9][0-9]*$ ]]; then
    echo "bench_quant.sh: MIB must be a positive integer, got '$mib' (try --help)" >&2
    exit 2
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
make --no-print-directory -s build/bench_quant
./build/bench_quant "$mib"
