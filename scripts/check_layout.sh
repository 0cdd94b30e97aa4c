#!/usr/bin/env bash
# check_layout.sh: the layout a reader is promised, checked: the top level holds the paper's source
# files (opt_model.c, quant.c, flexgen.c and tiers.c, lp.c, flexgen.cu) and the LLaMA family's
# forward pass beside OPT's (llama_model.c, at most 200 lines); the services beneath them are in
# support/ and the program around them in app/; the paper's five C files (opt_model.c, quant.c,
# flexgen.c, tiers.c, lp.c) fit a reader's afternoon (4,000 lines together), README.md 200. What a
# reader meets within them: no function in a paper file over 60 lines, nor any elsewhere over 100
# (the --help text aside); Fig. 4's loop and all it calls, its verbs' I/O tasks too, within
# flexgen.c's first 750 lines (step_ends, the last, defined there); the CUDA backend's layer
# (cuda_layer) within flexgen.cu's first 300 lines; and the maps at the top of flexgen.c, tiers.c,
# lp.c, flexgen.cu, opt_model.c and llama_model.c give each function's line. Columns, file lengths
# and the formatter's style are scripts/check_style.sh's.
# Usage: bash scripts/check_layout.sh   (from anywhere; prints what it counted, exits 1 on a miss)
#        bash scripts/check_layout.sh --fix-maps   (first writes each map row's line number anew)
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.."
fail=0
# The line of each function named in a file's map, where its definition begins.
# (A CUDA kernel's begins with __global__; a forward declaration, ending in ';', is not one, and
# the last match, the definition below its declarations, is the line.)
defined_at='/^[a-z_]/ && !/;$/ { for (n in want) if (index($0, n "(") && $0 ~ "^(static )?(__global__ )?[a-z][^;(]*[ *]" n "\\(") got[n] = FNR }'
map_row='/^ \* +[0-9]+  [a-z_][a-z0-9_]* /'
mapped="flexgen.c tiers.c lp.c flexgen.cu opt_model.c llama_model.c"
if [ "${1:-}" = --fix-maps ]; then
    for f in $mapped; do
        awk 'FNR == NR && FNR < 40 && '"$map_row"' { want[$3] = 1 }
            FNR == NR && '"$defined_at"'
            FNR != NR && FNR < 40 && '"$map_row"' && ($3 in got) {
                sub(/^ \* +[0-9]+/, sprintf(" * %5d", got[$3])) }
            FNR != NR { print }' "$f" "$f" > "$f.maps" && mv "$f.maps" "$f"
    done
fi
check() { # what, value, limit
    if [ "$2" -le "$3" ]; then echo "ok    $1: $2 (at most $3)"; else echo "MISS  $1: $2 (at most $3)"; fail=1; fi
}
listed() { # what, the lines found (empty: none)
    if [ -z "$2" ]; then echo "ok    $1: none"; else echo "MISS  $1:"; echo "$2"; fail=1; fi
}
paper_c="opt_model.c quant.c flexgen.c tiers.c lp.c"
paper="$paper_c llama_model.c flexgen.cu"
top=$(ls *.c *.cu | tr '\n' ' ')
if [ "$top" = "flexgen.c flexgen.cu llama_model.c lp.c opt_model.c quant.c tiers.c " ]; then echo "ok    top-level sources: $top"
else echo "MISS  top-level sources: $top"; fail=1; fi
# shellcheck disable=SC2086
check "paper C files (wc -l $paper_c)" "$(cat $paper_c | wc -l)" 4000
check "llama_model.c" "$(wc -l <llama_model.c)" 200
check "README.md" "$(wc -l <README.md)" 200
# A function: a header at column 0 (a name and its '('), through the line that ends with '{', to
# the '}' at column 0 that closes it. Prints those longer than `limit` lines.
long_functions() { # limit, files...
    local limit=$1
    shift
    awk -v limit="$limit" 'FNR == 1 { start = 0; head = 0 }
        !start && !head && /^[A-Za-z_][^;=]*\(/ && !/^(typedef|struct|enum|#)/ { head = FNR; name = $0 }
        head && !start && /;$/ { head = 0 }
        head && !start && /\{$/ { start = head; head = 0 }
        /^\}/ && start { n = FNR - start + 1
                         if (n > limit && name !~ /usage/) printf "%s:%d %d lines: %s\n", FILENAME, start, n, name
                         start = 0 }' "$@"
}
# shellcheck disable=SC2086
listed "functions over 60 lines in the paper files" "$(long_functions 60 $paper)"
listed "functions over 100 lines elsewhere" "$(long_functions 100 support/*.c support/*.cu app/*.c)"
# Fig. 4's loop, its verbs with the I/O tasks they hand the links' threads, and a step's edges
# read on a reader's first screens: step_ends, the last of them, is defined within flexgen.c's
# first 750 lines.
check "the line of flexgen.c that defines step_ends" \
    "$(awk '/^static void step_ends\(.*\{$/ { print FNR; exit }' flexgen.c)" 750
# What the verbs hand the I/O threads on the screens after the verbs: the KV cache's first task
# (cache_in_task) is defined before a step's edges begin (step_begins).
tasks_at=$(awk '/^static void cache_in_task\(.*\{$/ { print FNR; exit }' flexgen.c)
edges_at=$(awk '/^static int step_begins\(.*\{$/ { print FNR; exit }' flexgen.c)
check "flexgen.c's I/O tasks (cache_in_task) before the step's edges (step_begins, line ${edges_at:-0})" \
    "${tasks_at:-99999}" "${edges_at:-0}"
# The schedule's own rules live with the schedule (tiers.h, flexgen.c), not in the services below
# it: the support layer walks the diagonal's staircase it is handed (kv_pool_shape's starts).
listed "the diagonal schedule's staircase (diagonal_start) in support/" \
    "$(grep -n 'diagonal_start *(' support/*.c support/*.h support/*.cu)"
# flexgen.cu's first screen: the layer that mirrors opt_model.c's opt_layer, soon after the map.
layer_at=$(awk '/^static void cuda_layer\(/ { print FNR; exit }' flexgen.cu)
check "flexgen.cu's cuda_layer begins at line" "${layer_at:-99999}" 300
# The maps: " *  LINE  NAME  what" rows in a file's top comment, each the line of NAME's definition.
for f in $mapped; do
    wrong=$(awk 'NR < 40 && '"$map_row"' { want[$3] = $2 }
        '"$defined_at"'
        END { for (n in want) if (got[n] != want[n]) printf "%s at %s, not %s (--fix-maps writes it)\n", n, got[n], want[n] }' "$f")
    rows=$(awk 'NR < 40 && '"$map_row" "$f" | wc -l)
    if [ "$rows" -gt 0 ] && [ -z "$wrong" ]; then echo "ok    $f's map: each of its $rows lines is its function's"
    else echo "MISS  $f's map ($rows rows):"; echo "$wrong"; fail=1; fi
done
exit $fail
