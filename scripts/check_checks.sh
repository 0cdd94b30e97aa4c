#!/usr/bin/env bash
# check_checks.sh: the check scripts, checked. Each case copies the tracked tree (less the models,
# fixtures and pictures) into a temporary directory, plants one violation there, runs one check
# script on the copy and expects it to fail, naming the violation; and, for the limits, a copy
# that stays just within the limit passes. So a check that counts a function one line short,
# leaves *.cu out of its files or reads no doc still fails here:
#   check_layout.sh   a 61-line function in a paper file (a 60-line one passes); a map row one
#                     line off; flexgen.c's I/O tasks after the step's edges; the diagonal's
#                     staircase in the support layer
#   check_style.sh    a 101-column line in flexgen.cu (100 columns pass); a comma chain in a .c
#                     file; a declaration of two variables in flexgen.c
#   check_docs.sh     a doc pointing at code by line; a wrong file size; a function pointer the
#                     block of table calls leaves out; a DESIGN.md without that block
#   call_graph.sh     a support/ file that includes an app/ header; a paper file that includes a
#                     support header other than support.h; two support/ files that call each
#                     other (a cycle); a support/ file that calls app/ (up a level)
#   check_deps.sh     a Makefile that no longer reads the compiler's lists of included files (a
#                     copy that still reads them passes); one whose flags a CFLAGS on the command
#                     line drops; one whose libraries an LDLIBS on the command line drops; one
#                     that takes a linked nvcc's folder for the CUDA toolkit (where nvcc is found)
#   check_readme.sh   a README of the policy search's sample alone (it needs no model; ./flexgen
#                     copied in): as it is it passes, with a number of its policy changed it
#                     fails, with the search's timings changed it passes (they are masked)
# Usage: bash scripts/check_checks.sh [OBJECTS]   (OBJECTS: the build's objects, as for
#        scripts/check_docs.sh; make test passes build/obj). Prints a line a case; the last,
#        "N passed, N failed"; exits 1 if a case failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
root=$(pwd)
case "${1:-}" in
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
if [ $# -gt 1 ] || [ ! -d "${1:-build/obj}" ]; then
    echo "check_checks.sh: no objects in ${1:-build/obj}; usage: bash scripts/check_checks.sh [OBJECTS]" >&2
    exit 2
fi
objects=$(cd "${1:-build/obj}" && pwd) || exit 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0

# A fresh copy of the tracked tree in $work/tree, a git repository of its own (check_style.sh
# lists its files with git ls-files).
fresh_copy() {
    rm -rf "$work/tree"
    mkdir "$work/tree"
    git ls-files | grep -v -E '^(models|tests/fixtures)/|\.png$' | tar -cf - -T - | tar -xf - -C "$work/tree"
    (cd "$work/tree" && git init -q && git add -A) || exit 2
    mkdir -p "$work/tree/build" # the CUDA objects, which call_graph.sh reads from build/
    for cu in "$root"/build/flexgen_cu.o "$root"/build/cuda_device_cu.o; do
        [ ! -f "$cu" ] || cp "$cu" "$work/tree/build/"
    done
}

# CASE SCRIPT EXPECT WANT [OBJECTS]: run SCRIPT on the copy (given OBJECTS, or the build's);
# EXPECT fail: a non-zero exit and a line holding WANT; pass: exit 0; clear: no line holding WANT
# (whatever else the script finds).
expect() {
    local case=$1 script=$2 want_exit=$3 want=$4 objs=${5:-$objects} out rc
    out=$(cd "$work/tree" && bash "$script" "$objs" 2>&1)
    rc=$?
    if [ "$want_exit" = fail ] && [ $rc -ne 0 ] && grep -qF -- "$want" <<<"$out"; then
        echo "ok    $case: $(grep -F -m 1 -- "$want" <<<"$out" | cut -c1-120)"
        passed=$((passed + 1))
    elif [ "$want_exit" = pass ] && [ $rc -eq 0 ]; then
        echo "ok    $case: passes"
        passed=$((passed + 1))
    elif [ "$want_exit" = clear ] && ! grep -qF -- "$want" <<<"$out"; then
        echo "ok    $case: no '$want'"
        passed=$((passed + 1))
    else
        echo "MISS  $case: expected it to $want_exit${want:+ naming '$want'}; exit $rc:"
        echo "$out" | grep -v '^ok' | head -5
        failed=$((failed + 1))
    fi
}

# A function of `lines` lines (its header through its closing brace) at the end of file.
function_of() { # file, name, lines
    {
        echo ""
        echo "int $2(int x) {"
        for ((i = 0; i < $3 - 3; i++)); do echo "    x += $i;"; done
        echo "    return x;"
        echo "}"
    } >>"$1"
}

# ---- check_layout.sh ----
fresh_copy
function_of "$work/tree/quant.c" planted_long 61
expect "check_layout.sh, a 61-line function in quant.c" scripts/check_layout.sh fail "quant.c:"
fresh_copy
function_of "$work/tree/quant.c" planted_long 60
sed -i 's/^check "paper C files/check_off "paper C files/; s/^check() {/check_off() { :; }\ncheck() {/' \
    "$work/tree/scripts/check_layout.sh" # the planted lines may pass the files' total
expect "check_layout.sh, a 60-line function in quant.c" scripts/check_layout.sh pass ""
fresh_copy
line=$(grep -n -m 1 '^static' "$work/tree/flexgen.c" | cut -d: -f1)
sed -i "${line}i\\
/* a line that moves every function below it */" "$work/tree/flexgen.c"
expect "check_layout.sh, flexgen.c's map one line off" scripts/check_layout.sh fail "flexgen.c's map"
fresh_copy
python3 - "$work/tree/flexgen.c" <<'PY' # the verbs' I/O tasks' section moved to the file's end
import sys
path = sys.argv[1]
text = open(path).read()
start = text.index('/* ====', text.index('static void store_last_iteration(block *bl) {'))
end = text.index('/* ====', text.index('static void bind_batch(block *bl, iteration it) {'))
open(path, 'w').write(text[:start] + text[end:] + '\n' + text[start:end])
PY
expect "check_layout.sh, flexgen.c's I/O tasks after the step's edges" scripts/check_layout.sh fail \
    "flexgen.c's I/O tasks"
fresh_copy
printf 'static inline int diagonal_start(int k, int groups, int n) { return k * n / groups; }\n' \
    >>"$work/tree/support/kv_pages.c"
expect "check_layout.sh, the staircase in support/" scripts/check_layout.sh fail "support/kv_pages.c:"

# ---- check_style.sh (its clang parse of flexgen.cu needs build-emu/; the columns do not) ----
fresh_copy
printf '/* %095d */\n' 0 >>"$work/tree/flexgen.cu"
expect "check_style.sh, a 101-column line in flexgen.cu" scripts/check_style.sh fail "flexgen.cu:"
fresh_copy
printf '/* %094d */\n' 0 >>"$work/tree/flexgen.cu"
expect "check_style.sh, a 100-column line in flexgen.cu" scripts/check_style.sh clear "MISS  lines over 100"
fresh_copy
cat >>"$work/tree/quant.c" <<'EOF'

int planted_commas(int x) {
    int y = 0;
    x = 1, y = 2;
    return x + y;
}
EOF
expect "check_style.sh, a comma chain in quant.c" scripts/check_style.sh fail "comma-chained statements: quant.c:"
fresh_copy
line=$(grep -n -m 1 '^static void load_weight_now(.*{$' "$work/tree/flexgen.c" | cut -d: -f1)
sed -i "$((line + 1))i\\
    int planted_a = 1, planted_b = 2;" "$work/tree/flexgen.c"
expect "check_style.sh, two variables in one declaration in flexgen.c" scripts/check_style.sh fail \
    "(several variables)"

# ---- check_docs.sh ----
fresh_copy
echo "See flexgen.c:120 for the loop." >>"$work/tree/docs/DESIGN.md"
expect "check_docs.sh, a doc pointing at flexgen.c by line" scripts/check_docs.sh fail "points at flexgen.c:120"
fresh_copy
echo "The emulator is \`emu.cpp\` (12 lines)." >>"$work/tree/docs/GPU.md"
expect "check_docs.sh, a wrong file size" scripts/check_docs.sh fail "says \`emu.cpp\` has 12 lines"
fresh_copy
sed -i '/==> fg_search_request.place/d' "$work/tree/docs/DESIGN.md"
expect "check_docs.sh, the table calls without fg_search_request.place" scripts/check_docs.sh fail \
    "fg_search_request.place"
fresh_copy
sed -i 's/The calls that go through tables of functions/The calls through tables/' "$work/tree/docs/DESIGN.md"
expect "check_docs.sh, a DESIGN.md without the block of table calls" scripts/check_docs.sh fail \
    "no block of table calls"

# ---- call_graph.sh (its includes from the sources, its calls from objects) ----
# The build's objects with planted files' objects beside them, in $work/obj: FILE (under the
# tree) compiled from the copy.
planted_object() {
    mkdir -p "$work/obj/$(dirname "$1")"
    gcc -c -o "$work/obj/${1%.c}.o" "$work/tree/$1" || exit 2
}
fresh_copy
echo '#include "app/app.h"' >>"$work/tree/support/util.c"
expect "call_graph.sh, a support/ file that includes an app/ header" scripts/call_graph.sh fail \
    "a support/ file includes flexgen.h or an app/ header: support/util.c"
fresh_copy
echo '#include "support/tools.h"' >>"$work/tree/quant.c"
expect "call_graph.sh, a paper file that includes support/tools.h" scripts/call_graph.sh fail \
    "a paper file includes another support header"
fresh_copy
rm -rf "$work/obj"
cp -a "$objects" "$work/obj"
printf 'void planted_b(int n);\nvoid planted_a(int n) { if (n) planted_b(n - 1); }\n' >"$work/tree/support/planted_a.c"
printf 'void planted_a(int n);\nvoid planted_b(int n) { if (n) planted_a(n - 1); }\n' >"$work/tree/support/planted_b.c"
planted_object support/planted_a.c
planted_object support/planted_b.c
expect "call_graph.sh, two support/ files that call each other" scripts/call_graph.sh fail \
    "cycle through: support/planted_a.c support/planted_b.c" "$work/obj"
fresh_copy
rm -rf "$work/obj"
cp -a "$objects" "$work/obj"
printf 'void usage(void);\nvoid planted_up(void) { usage(); }\n' >"$work/tree/support/planted_up.c"
planted_object support/planted_up.c
expect "call_graph.sh, a support/ file that calls app/" scripts/call_graph.sh fail \
    "support/planted_up.c -> app/args.c" "$work/obj"

# ---- check_deps.sh (make in the copy, beside the build's objects and their lists, times kept) ----
fresh_copy
cp -a "$root/build/obj" "$root/build/obj-tests" "$work/tree/build/"
expect "check_deps.sh, the Makefile as it is" scripts/check_deps.sh pass ""
sed -i '/^-include .*\.d/d' "$work/tree/Makefile"
expect "check_deps.sh, a Makefile that reads no list of included files" scripts/check_deps.sh fail \
    "does not depend on support/avx512.c"
cp "$root/Makefile" "$work/tree/Makefile"
sed -i 's/^override CFLAGS += -std=c11/CFLAGS += -std=c11/' "$work/tree/Makefile"
expect "check_deps.sh, a Makefile whose flags a command-line CFLAGS drops" scripts/check_deps.sh fail \
    "make CFLAGS=-O1 compiles without the Makefile's own flags"
cp "$root/Makefile" "$work/tree/Makefile"
sed -i 's/^override LDLIBS += -L$(BLAS_LIB)/LDLIBS := -L$(BLAS_LIB)/' "$work/tree/Makefile"
expect "check_deps.sh, a Makefile whose libraries a command-line LDLIBS drops" scripts/check_deps.sh fail \
    "links without them or without the build's libraries"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    cp "$root/Makefile" "$work/tree/Makefile"
    sed -i 's/,$(realpath $(NVCC)))$/,$(NVCC))/' "$work/tree/Makefile"
    expect "check_deps.sh, a Makefile that takes a linked nvcc's folder for the toolkit" \
        scripts/check_deps.sh fail "make links the CUDA libraries from"
fi

# ---- check_readme.sh (a README of one sample: the policy search's, which needs no model) ----
# README.md of the copy: the root README's `./flexgen policy` sample alone, FROM replaced by TO in
# its output.
policy_sample_readme() {
    python3 - "$root/README.md" "$work/tree/README.md" "$1" "$2" <<'PY' || exit 2
import re, sys
source, target, old, new = sys.argv[1:]
sample = next(s for s in re.findall(r'```console\n.*?```', open(source).read(), re.S)
              if s.startswith('```console\n$ ./flexgen policy'))
_, command, output = sample.split('\n', 2)
assert old in output, f'{old!r} is not in the sample'
open(target, 'w').write('```console\n' + command + '\n' + output.replace(old, new, 1) + '\n')
PY
}
[ -x "$root/flexgen" ] || { echo "check_checks.sh: ./flexgen is not built (run make)" >&2; exit 2; }
fresh_copy
cp "$root/flexgen" "$work/tree/flexgen"
policy_sample_readme "policy: " "policy: "
expect "check_readme.sh, the policy sample as it is" scripts/check_readme.sh pass ""
policy_sample_readme "--num-gpu-batches " "--num-gpu-batches 1"
expect "check_readme.sh, the policy sample with another block" scripts/check_readme.sh fail "DIFF  ./flexgen policy"
policy_sample_readme " plans checked, " " plans checked, 9"
expect "check_readme.sh, the policy sample with other timings" scripts/check_readme.sh pass ""

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
