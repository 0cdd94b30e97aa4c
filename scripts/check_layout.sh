#!/usr/bin/env bash
# check_layout.sh: the layout a reader is promised, checked: the top level holds the paper's five
# source files (opt_model.c, quant.c, flexgen.c, lp.c, flexgen.cu) and the LLaMA family's forward
# pass beside OPT's (llama_model.c, at most 200 lines), and everything else is in support/; the
# four paper C files fit a reader's afternoon (3,800 lines together), the paper's two headers
# (model.h, flexgen.h) 700 lines (both model families), README.md 200; no function
# anywhere is over 100 lines (the --help text aside); and the map at the top of flexgen.c gives
# each function's line.
# Usage: bash scripts/check_layout.sh   (from anywhere; prints what it counted, exits 1 on a miss)
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
check() { # what, value, limit
    if [ "$2" -le "$3" ]; then echo "ok    $1: $2 (at most $3)"; else echo "MISS  $1: $2 (at most $3)"; fail=1; fi
}
top=$(ls *.c *.cu | tr '\n' ' ')
if [ "$top" = "flexgen.c flexgen.cu llama_model.c lp.c opt_model.c quant.c " ]; then echo "ok    top-level sources: $top"
else echo "MISS  top-level sources: $top"; fail=1; fi
check "paper C files (wc -l opt_model.c quant.c flexgen.c lp.c)" "$(cat opt_model.c quant.c flexgen.c lp.c | wc -l)" 3800
check "llama_model.c" "$(wc -l <llama_model.c)" 200
check "model.h and flexgen.h" "$(cat model.h flexgen.h | wc -l)" 700
check "README.md" "$(wc -l <README.md)" 200
# A function: a line that opens at column 0 with '{' at its end, closed by a '}' at column 0.
long=$(awk 'FNR == 1 { start = 0 }
    /^[A-Za-z_].*\) *\{$/ || /^[A-Za-z_].*\{$/ && !/^(typedef|struct|enum|static const|const)/ { start = FNR; name = $0 }
    /^\}/ && start { n = FNR - start + 1; if (n > 100 && name !~ /usage/) printf "%s:%d %d lines: %s\n", FILENAME, start, n, name; start = 0 }' \
    *.c *.cu support/*.c)
if [ -z "$long" ]; then echo "ok    no function over 100 lines"; else echo "MISS  functions over 100 lines:"; echo "$long"; fail=1; fi
# The map: " *  LINE  NAME  what" rows in flexgen.c's top comment, each the line of NAME's definition.
wrong=$(awk 'NR < 40 && /^ \* +[0-9]+  [a-z_]+ / { want[$3] = $2 }
    /^[a-z]/ { for (n in want) if (index($0, n "(") && $0 ~ "^(static )?[a-z][^;(]*[ *]" n "\\(") got[n] = FNR }
    END { for (n in want) if (got[n] != want[n]) printf "%s at %s, not %s\n", n, got[n], want[n] }' flexgen.c)
if [ -z "$wrong" ]; then echo "ok    flexgen.c's map: each line is its function's"; else echo "MISS  flexgen.c's map:"; echo "$wrong"; fail=1; fi
exit $fail
