#!/usr/bin/env bash
# Compressor and decompressor throughput against memcpy (BENCHMARKS.md, "Compression").
#   bash scripts/bench_quant.sh [MiB]
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=$(gcc -print-multiarch)
mkdir -p build
gcc -O2 -std=c11 -fopenmp -I. -I/usr/include/$ARCH/openblas-openmp -DFLEXGEN_NO_MAIN \
    -o build/bench_quant scripts/bench_quant.c quant.c support/util.c support/simd.c \
    -L/usr/lib/$ARCH/openblas-openmp -Wl,-rpath,/usr/lib/$ARCH/openblas-openmp -lopenblas -lcjson -lm
./build/bench_quant "${1:-256}"
