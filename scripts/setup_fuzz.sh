#!/usr/bin/env bash
# Installs what `make fuzz` needs beyond scripts/setup.sh's packages, on Debian 12 (or Ubuntu), as
# root or through sudo: clang's libFuzzer and sanitizer runtimes (libclang-rt-14-dev), with clang
# and the omp.h that clang compiles support/*.c with (libomp-14-dev), which scripts/setup.sh
# installs too (make test's style check uses them). `make` needs none of them.
# Usage: bash scripts/setup_fuzz.sh   (it takes no arguments)
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "setup_fuzz.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev libomp-14-dev >/dev/null
echo "setup_fuzz: clang, libFuzzer and omp.h are installed"
