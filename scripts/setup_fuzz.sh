#!/usr/bin/env bash
# Installs what `make fuzz` needs besides scripts/setup.sh's packages, on Debian 12 (or Ubuntu), as
# root or through sudo: clang, its libFuzzer and sanitizer runtimes (libclang-rt-14-dev), and the
# omp.h that clang compiles support/*.c with (libomp-14-dev). `make` and `make test` need none
# of them.
set -euo pipefail
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev libomp-14-dev >/dev/null
echo "setup_fuzz: clang, libFuzzer and omp.h are installed"
