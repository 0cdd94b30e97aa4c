#!/usr/bin/env bash
# Microseconds per lp_solve on random 40 x 40 LPs, median and max (lp.c, §4.3).
#   bash scripts/bench_lp.sh [number of LPs]
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=$(gcc -print-multiarch)
mkdir -p build
gcc -O2 -std=c11 -fopenmp -I. -I/usr/include/$ARCH/openblas-openmp -DFLEXGEN_NO_MAIN \
    -o build/bench_lp scripts/bench_lp.c lp.c support/*.c app/*.c opt_model.c llama_model.c quant.c flexgen.c tiers.c \
    -L/usr/lib/$ARCH/openblas-openmp -Wl,-rpath,/usr/lib/$ARCH/openblas-openmp -lopenblas -lcjson -lm
./build/bench_lp "${1:-2000}"
