#!/usr/bin/env bash
# Shows, on a machine without a GPU, that a bundle of scripts/gpu_bundle.sh holds all that the
# build and the tests need from outside the CUDA toolkit and the C compiler. In a private mount
# namespace (unshare -m, so nothing changes outside this script) it hides the system's copies of
# the bundled libraries: a tmpfs over OpenBLAS's directories and over cJSON's and CUnit's
# headers, an empty file over every other file of the installed packages libopenblas*, libcjson*,
# libcunit*, libglpk*, libgfortran5, libquadmath0, libamd2, libcolamd2, libsuitesparseconfig5
# and libltdl7 (dpkg -L). It then checks, each check a line:
#   that the hiding works: `make` without DEPS fails on cblas.h, the other headers are gone, and
#     the system's libraries no longer load
#   that the bundle matches its MANIFEST and unpacks into a private prefix (gpu_bundle.sh unpack)
#   that a copy of this tree (git ls-files) builds with `make DEPS=PREFIX MPICC=` (no Open MPI, as
#     on the GPU machine; with CUDA where nvcc is found), with DT_RPATH, and that ldd resolves
#     OpenBLAS, libgfortran, cJSON, CUnit and GLPK and their dependencies into the prefix
#   that ./flexgen generates text (the README's opt-kjv sample) and `make test` passes there
# and prints `N passed, N failed` last; the exit status is 1 if a check failed. The copy and the
# prefix are in a temporary directory, removed at the end. Needs root (for the mounts), unshare,
# dpkg and git.
#
# Usage: bash scripts/check_bundle.sh DIR
# Environment: JOBS (make -j) [2]; SUITE (make test's suite; empty: all) []; NVCC (empty: build
# without CUDA, faster) [as the Makefile finds it]
set -uo pipefail

die() { echo "check_bundle.sh: $*" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ARCH=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)

if [ "${1:-}" != __inside ]; then
    [ $# = 1 ] || die "usage: bash scripts/check_bundle.sh DIR (a bundle of scripts/gpu_bundle.sh)"
    case $1 in -*) die "unknown flag '$1'; usage: bash scripts/check_bundle.sh DIR" ;; esac
    [ -d "$1" ] || die "no directory $1"
    if [ ! -f "$1/MANIFEST" ] || [ ! -d "$1/debs" ]; then
        die "$1 is not a bundle of scripts/gpu_bundle.sh (no MANIFEST or debs/)"
    fi
    [ "$(id -u)" = 0 ] || die "needs root, for the mounts of its namespace"
    for tool in unshare dpkg git gcc make ldd readelf; do
        command -v "$tool" > /dev/null || die "$tool not found"
    done
    BUNDLE=$(cd "$1" && pwd)
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/check-bundle.XXXXXX") || die "cannot make a temporary directory"
    trap 'rm -rf "$WORK"' EXIT
    # the tree as git knows it (tracked, and untracked but not ignored), without build outputs
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - 2> /dev/null) |
        (mkdir -p "$WORK/tree" && cd "$WORK/tree" && tar -xf -) || die "cannot copy the tree into $WORK/tree"
    cp "$0" "$WORK/check_bundle.sh"
    unshare -m --propagation private bash "$WORK/check_bundle.sh" __inside "$BUNDLE" "$WORK" "$ROOT"
    exit
fi

# ---- inside the namespace
BUNDLE=$2 WORK=$3 ROOT=$4
PREFIX=$WORK/prefix
TREE=$WORK/tree
JOBS=${JOBS:-2}
passed=0 failed=0
pass() { echo "PASS: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
check() { # NAME COMMAND...: a check that passes where COMMAND does
    local name=$1
    shift
    if "$@"; then pass "$name"; else fail "$name"; fi
}

echo "== hiding the system's copies"
HIDE_DIRS="/usr/include/cjson /usr/include/CUnit /usr/include/$ARCH/openblas-openmp /usr/lib/$ARCH/openblas-openmp"
for d in $HIDE_DIRS; do
    [ -d "$d" ] && mount -t tmpfs -o size=1m,mode=755 tmpfs "$d"
done
: > "$WORK/empty"
hidden=0
declare -A done_
installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' 'libopenblas*' 'libcjson*' 'libcunit*' 'libglpk*' \
    libgfortran5 libquadmath0 libamd2 libcolamd2 libsuitesparseconfig5 libltdl7 2> /dev/null | awk '$2 == "ii" { print $1 }')
for pkg in $installed; do
    while read -r f; do
        case $f in /usr/share/*) continue ;; esac
        [ -f "$f" ] || continue # a directory, or under a tmpfs above
        real=$(readlink -f "$f")
        [ -n "${done_[$real]:-}" ] && continue
        mount --bind "$WORK/empty" "$real" && done_[$real]=1 && hidden=$((hidden + 1))
    done < <(dpkg -L "$pkg")
done
echo "tmpfs over $HIDE_DIRS; an empty file over $hidden files of: ${installed//$'\n'/ }"

echo "== the hiding works"
(cd "$TREE" && make MPICC= NVCC= flexgen) > "$WORK/plain.log" 2>&1
line=$(grep -m 1 'cblas.h' "$WORK/plain.log")
echo "make without DEPS: ${line:-$(tail -n 1 "$WORK/plain.log")}"
check "make without DEPS fails: cblas.h not found" grep -q "cblas.h: No such file or directory" "$WORK/plain.log"
headers_gone() {
    local h
    for h in cjson/cJSON.h CUnit/Basic.h; do
        if echo "#include <$h>" | gcc -E -x c - > /dev/null 2>&1; then echo "$h is still found"; return 1; fi
    done
    if echo '#include <glpk.h>' | gcc -E -x c - 2> /dev/null | grep -q glp_simplex; then echo "glpk.h still declares glp_simplex"; return 1; fi
}
check "cjson/cJSON.h and CUnit/Basic.h not found, glpk.h empty" headers_gone
libs_gone() {
    python3 - << 'PY'
import ctypes, sys
loaded = []
for lib in ("libopenblas.so.0", "libgfortran.so.5", "libcjson.so.1", "libcunit.so.1", "libglpk.so.40", "libamd.so.2"):
    try:
        ctypes.CDLL(lib)
        loaded.append(lib)
    except OSError as e:
        print(f"{lib}: {e}")
sys.exit(f"still loads: {' '.join(loaded)}" if loaded else 0)
PY
}
check "the system's libraries do not load" libs_gone

echo "== the bundle"
check "the bundle matches its MANIFEST and unpacks" bash "$ROOT/scripts/gpu_bundle.sh" unpack "$BUNDLE" "$PREFIX"
echo "bundle: $(du -sb "$BUNDLE" | cut -f1) bytes ($(du -sh "$BUNDLE" | cut -f1)), $(find "$BUNDLE/debs" -name '*.deb' | wc -l) packages"

echo "== make DEPS=$PREFIX MPICC= -j$JOBS flexgen build/test_flexgen"
start=$(date +%s)
(cd "$TREE" && make DEPS="$PREFIX" MPICC= -j"$JOBS" flexgen build/test_flexgen) > "$WORK/build.log" 2>&1
rc=$?
grep -E '^(gcc|cc|clang|/\S*nvcc)' "$WORK/build.log" | cut -c 1-200 | sed 's/$/ .../'
[ "$rc" = 0 ] || tail -n 20 "$WORK/build.log"
check "make DEPS=PREFIX builds ./flexgen and the tests ($(($(date +%s) - start)) s)" [ "$rc" = 0 ]

if [ "$rc" = 0 ]; then
    echo "== the binaries' libraries"
    rpath=$(readelf -d "$TREE/flexgen" | grep -E 'R(UN)?PATH')
    echo "$rpath"
    check "./flexgen has DT_RPATH (not DT_RUNPATH) into the prefix" grep -q "(RPATH).*$PREFIX" <<< "$rpath"
    in_prefix() { # BINARY LIB...: ldd resolves each LIB into the prefix, and nothing is not found
        local bin=$1 lib line ok=0
        shift
        ldd "$bin" > "$WORK/ldd.txt" 2>&1
        for lib in "$@"; do
            line=$(grep -m 1 "^\s*$lib" "$WORK/ldd.txt")
            [ -n "$line" ] || line="$lib: not listed"
            echo "  $line" | sed -e 's/^\s*//' -e 's/ (0x[0-9a-f]*)//' -e 's/^/  /'
            [[ $line == *"=> $PREFIX/"* ]] || ok=1
        done
        if grep 'not found' "$WORK/ldd.txt"; then ok=1; fi
        return "$ok"
    }
    echo "ldd ./flexgen:"
    check "ldd ./flexgen: OpenBLAS, libgfortran, libquadmath, cJSON in the prefix" \
        in_prefix "$TREE/flexgen" libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libcjson.so.1
    echo "ldd build/test_flexgen:"
    check "ldd build/test_flexgen: CUnit, GLPK and GLPK's libraries in the prefix" \
        in_prefix "$TREE/build/test_flexgen" libcunit.so.1 libglpk.so.40 libamd.so.2 libcolamd.so.2 \
        libsuitesparseconfig.so.5 libltdl.so.7 libgmp.so.10 libopenblas.so.0 libcjson.so.1

    echo "== ./flexgen --model models/opt-kjv --prompt \"In the beginning\" --gen-len 24"
    (cd "$TREE" && ./flexgen --model models/opt-kjv --prompt "In the beginning" --gen-len 24) > "$WORK/run.log" 2>&1
    rc=$?
    head -n 3 "$WORK/run.log"
    generated() { [ "$rc" = 0 ] && grep -q '^\[1\] In the beginning' "$WORK/run.log"; }
    check "./flexgen generates text" generated

    echo "== make DEPS=$PREFIX MPICC= test ${SUITE:+SUITE=$SUITE}"
    start=$(date +%s)
    (cd "$TREE" && make DEPS="$PREFIX" MPICC= test ${SUITE:+SUITE="$SUITE"}) > "$WORK/test.log" 2>&1
    rc=$?
    sed -n '/^== recap/,/^[0-9]* passed, [0-9]* failed$/p' "$WORK/test.log"
    grep -E 'suite skipped' "$WORK/test.log" | head -n 5
    grep -E '^ +[0-9]+\. tests/' "$WORK/test.log" | head -n 10
    [ "$rc" = 0 ] || tail -n 5 "$WORK/test.log"
    check "make test passes against the bundle ($(($(date +%s) - start)) s)" [ "$rc" = 0 ]
fi

echo "check_bundle: $passed passed, $failed failed"
[ "$failed" = 0 ]
