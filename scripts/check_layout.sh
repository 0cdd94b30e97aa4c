#!/usr/bin/env bash
# check_layout.sh: the layout a reader is promised, checked: the top level holds the paper's five
# source files (opt_model.c, quant.c, flexgen.c, lp.c, flexgen.cu) and everything else is in
# support/; the four C files fit a reader's afternoon (3,200 lines together), the paper's header
# 350 lines, README.md 200; no function anywhere is over 100 lines (the --help text aside).
# Usage: bash scripts/check_layout.sh   (from anywhere; prints what it counted, exits 1 on a miss)
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
check() { # what, value, limit
    if [ "$2" -le "$3" ]; then echo "ok    $1: $2 (at most $3)"; else echo "MISS  $1: $2 (at most $3)"; fail=1; fi
}
top=$(ls *.c *.cu | tr '\n' ' ')
if [ "$top" = "flexgen.c flexgen.cu lp.c opt_model.c quant.c " ]; then echo "ok    top-level sources: $top"
else echo "MISS  top-level sources: $top"; fail=1; fi
check "paper C files (wc -l opt_model.c quant.c flexgen.c lp.c)" "$(cat opt_model.c quant.c flexgen.c lp.c | wc -l)" 3200
check "flexgen.h" "$(wc -l <flexgen.h)" 350
check "README.md" "$(wc -l <README.md)" 200
# A function: a line that opens at column 0 with '{' at its end, closed by a '}' at column 0.
long=$(awk 'FNR == 1 { start = 0 }
    /^[A-Za-z_].*\) *\{$/ || /^[A-Za-z_].*\{$/ && !/^(typedef|struct|enum|static const|const)/ { start = FNR; name = $0 }
    /^\}/ && start { n = FNR - start + 1; if (n > 100 && name !~ /usage/) printf "%s:%d %d lines: %s\n", FILENAME, start, n, name; start = 0 }' \
    *.c *.cu support/*.c)
if [ -z "$long" ]; then echo "ok    no function over 100 lines"; else echo "MISS  functions over 100 lines:"; echo "$long"; fail=1; fi
exit $fail
