#!/usr/bin/env bash
# check_deps.sh: each object depends on every file its source includes, so that an edit to one
# builds the object again. The compiler lists the included files beside each object (OBJ.d,
# DEPFLAGS in the Makefile) and make reads those lists back; were they lost, an object could
# keep code its source no longer has (avx512_simde.o, which #includes support/avx512.c, ran the
# old SIMDe kernels after an edit to avx512.c). For each object below and a file it includes that
# no rule of the Makefile names, make is asked what it would do were that file new (make -n -W,
# its flags file held old): it must compile the object again.
# Then three promises of the Makefile's own variables, read from make -n: a CFLAGS given on the
# command line replaces the optimisation alone (the include paths and defines stay), an LDFLAGS
# and an LDLIBS are added to the link (its libraries stay), and where nvcc is a link to a toolkit
# elsewhere, the CUDA libraries are linked from that toolkit.
# Usage: bash scripts/check_deps.sh   (after a build; make test runs it; exits 1 on a miss)
set -uo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.." || exit
make=${MAKE:-make}
fail=0
check() { # object, a file its source includes
    local flags
    flags="$(dirname "$1")/.flags"
    while [ ! -e "$flags" ] && [ "$flags" != ./.flags ]; do flags="$(dirname "$(dirname "$flags")")/.flags"; done
    if ! "$make" --no-print-directory -n -o "$flags" -W "$2" "$1" 2>/dev/null | grep -q -- "-o $1 "; then
        echo "check_deps: $1 does not depend on $2, which its source includes (the Makefile's .d files)"
        fail=1
    fi
}
check build/obj/support/avx512_simde.o support/avx512.c
check build/obj/support/matmul.o support/support.h
check build/obj-tests/tests/test_main.o tests/tests.h
[ $fail = 0 ] && echo "check_deps: each object checked depends on the files its source includes"

compile=$("$make" --no-print-directory -n -W support/matmul.c CFLAGS=-O1 build/obj/support/matmul.o 2>/dev/null |
    grep -- "-o build/obj/support/matmul.o")
if ! grep -q -- "-O1 .*-I\. " <<<"$compile"; then
    echo "check_deps: make CFLAGS=-O1 compiles without the Makefile's own flags: ${compile:-no compile line}"
    fail=1
fi
link=$("$make" --no-print-directory -n -W flexgen.c LDFLAGS=-Wl,-O1 LDLIBS=-lrt flexgen 2>/dev/null |
    grep -- "-o flexgen ")
if ! grep -q -- "-Wl,-O1 .*-lrt .*-lopenblas" <<<"$link"; then
    echo "check_deps: make LDFLAGS=-Wl,-O1 LDLIBS=-lrt links without them or without the build's libraries: ${link:-no link line}"
    fail=1
fi
# The toolkit's own nvcc, an executable (ELF) in TOOLKIT/bin: the nvcc first on the PATH may be a
# shell script that runs it (/usr/local/bin/nvcc on some machines), and a link to a script would
# not test where make looks.
nvcc=
for candidate in "$(command -v nvcc 2>/dev/null)" /usr/local/cuda/bin/nvcc; do
    candidate=$(readlink -f "$candidate" 2>/dev/null) || continue
    if [ -x "$candidate" ] && [ "$(head -c 4 "$candidate" | tail -c 3)" = ELF ]; then
        nvcc=$candidate
        break
    fi
done
if [ -n "$nvcc" ]; then
    toolkit=$(dirname "$(dirname "$nvcc")")
    links=$(mktemp -d)
    trap 'rm -rf "$links"' EXIT
    ln -s "$nvcc" "$links/nvcc"
    link=$(env -u CUDA_HOME "$make" --no-print-directory -n -W flexgen.c NVCC="$links/nvcc" flexgen 2>/dev/null |
        grep -o -- "-L[^ ]*/lib64" | head -1)
    if [ "$link" != "-L$toolkit/lib64" ]; then
        echo "check_deps: with nvcc a link to $toolkit, make links the CUDA libraries from '${link#-L}'"
        fail=1
    fi
fi
[ $fail = 0 ] && echo "check_deps: CFLAGS=, LDFLAGS=, LDLIBS= and a linked nvcc keep the Makefile's flags, libraries and toolkit"
exit $fail
