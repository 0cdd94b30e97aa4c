#!/usr/bin/env bash
# Microseconds per lp_solve on random 40 x 40 LPs, median and max (lp.c, §4.3): builds
# build/bench_lp (make, from scripts/bench_lp.c and ./flexgen's objects) and runs it on COUNT LPs.
#
# Run from the repository root:
#   bash scripts/bench_lp.sh [COUNT]        COUNT: the number of LPs, a positive integer [2000]
set -euo pipefail

case "${1:-}" in
    -h|--help) sed -n '/^# Run from/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[ $# -le 1 ] || { echo "bench_lp.sh: one argument at most (try --help)" >&2; exit 2; }
count="${1:-2000}"
if ! [[ "$count" =~ ^[1-9][0-9]*$ ]]; then
    echo "bench_lp.sh: COUNT must be a positive integer, got '$count' (try --help)" >&2
    exit 2
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
make --no-print-directory -s build/bench_lp
./build/bench_lp "$count"
