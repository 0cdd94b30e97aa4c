#!/usr/bin/env bash
# check_clang.sh: the program and its tests built by clang, the other compiler a laptop may have,
# with warnings as errors (gcc and clang warn of different things), into a copy of the tracked
# tree; then, on that build, the matmul suite (every path of the kernels held to the portable
# path's bits: the AVX-512 ones too, which clang builds through its own target attribute) and the
# cli suite's run of every FLEXGEN_ISA to the same logits. The CUDA backend is left out (nvcc
# compiles it with its own host compiler). clang's -fopenmp brings LLVM's OpenMP runtime beside
# the GCC one that OpenBLAS's build uses (its -fopenmp=libgomp links GCC's but ignores every
# OpenMP pragma): the matmul suite's test of 1, 2 and 3 threads holds the bits on that pair too.
# Usage: bash scripts/check_clang.sh   (clang and omp.h installed: scripts/setup.sh installs them;
#        .ci/run runs this after make test-san). Exits 1 if the build or a test fails.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
command -v clang >/dev/null || { echo "check_clang.sh: no clang (bash scripts/setup.sh installs it)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$work"
cd "$work" || exit 2
if ! make --no-print-directory CC=clang NVCC= -j2 flexgen build/test_flexgen >build.log 2>&1; then
    grep -E "error:|warning:" build.log | head -20
    echo "check_clang.sh: the build with clang failed"
    exit 1
fi
FLEXGEN_BIN=./flexgen build/test_flexgen matmul >matmul.log 2>&1
matmul=$?
FLEXGEN_BIN=./flexgen build/test_flexgen cli "FLEXGEN_ISA: every path*" >cli.log 2>&1
cli=$?
tail -1 matmul.log | sed 's/^/check_clang.sh: matmul: /'
tail -1 cli.log | sed 's/^/check_clang.sh: cli, every FLEXGEN_ISA: /'
if [ $matmul -ne 0 ] || [ $cli -ne 0 ]; then
    grep -h -B1 -A3 "FAILED\|failed:" matmul.log cli.log | head -30
    exit 1
fi
kernels=$(./flexgen --model models/opt-kjv --prompt-len 4 --gen-len 2 2>&1 | grep -o 'cpu kernels: [a-z0-9-]*')
echo "check_clang.sh: clang $(clang -dumpversion) builds without a warning; its ./flexgen's ${kernels:-report names no kernels}"
