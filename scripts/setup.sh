#!/usr/bin/env bash
# Installs what `make` and `make test` need on Debian 12 (or Ubuntu), as root or through sudo:
# gcc, g++ (the emulated GPU, tests/cuda_emu) and make, OpenBLAS's OpenMP build, cJSON, CUnit and
# GLPK (the tests' reference for the simplex), oneDNN (the opt-in prefill schemes' products;
# without it they run on plain loops), Open MPI (pipeline stages; without it the build leaves
# them out) and python3 (scripts/gpu_check.sh's report, which the GPU suite runs on the emulated
# GPU), clang-format and clang with omp.h (`make test`'s style check, scripts/check_style.sh).
# `make fuzz` needs clang's libFuzzer besides: scripts/setup_fuzz.sh installs it. The CUDA toolkit
# is not installed here: where nvcc is found, `make` builds the CUDA backend as well.
# Usage: bash scripts/setup.sh   (it takes no arguments)
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "setup.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends \
    gcc g++ make libc6-dev libopenblas-openmp-dev libcjson-dev libcunit1-dev libglpk-dev libsimde-dev libdnnl-dev \
    openmpi-bin libopenmpi-dev xz-utils python3 \
    clang-format clang libomp-14-dev >/dev/null
echo "setup: the build's packages are installed"
