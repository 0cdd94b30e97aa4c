#!/usr/bin/env bash
# The file-level call graph of the sources, as the linker sees it: compiles each .c file, the
# paper's at the top level and the support layer's in support/ (and uses build/flexgen_cu.o when
# there is one), then for each object lists the files whose symbols it uses, and says whether
# the graph has a cycle. It also checks that the paper's files include no support header but
# support/support.h. docs/DESIGN.md draws the same graph.
# Usage: bash scripts/call_graph.sh   (from the repository root, after `make`)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
flags=$(make -s print-cflags)
for f in *.c support/*.c; do
    # shellcheck disable=SC2086
    ${CC:-gcc} $flags -c -o "$dir/$(echo "${f%.c}" | tr / +).o" "$f"
done
bad=$(grep -l '#include "support/' *.c flexgen.cu | xargs grep -h '#include "support/' | grep -v 'support/support.h' || true)
if [ -n "$bad" ]; then echo "a paper file includes another support header: $bad"; exit 1; fi
[ -f build/flexgen_cu.o ] && cp build/flexgen_cu.o "$dir/flexgen.cu.o"
python3 - "$dir" <<'PY'
import glob, os, subprocess, sys
defined, used = {}, {}
for o in sorted(glob.glob(sys.argv[1] + '/*.o')):
    name = os.path.basename(o)[:-2].replace('+', '/')
    name = name if name.endswith('.cu') else name + '.c'
    used[name] = set()
    for line in subprocess.run(['nm', o], capture_output=True, text=True).stdout.splitlines():
        p = line.split()
        if len(p) == 3 and p[1] in 'TDRB': defined[p[2]] = name
        elif len(p) == 2 and p[0] == 'U': used[name].add(p[1])
graph = {f: sorted({defined[s] for s in u if s in defined and defined[s] != f}) for f, u in used.items()}
for f in sorted(graph): print(f'{f:24} -> {" ".join(graph[f])}')
def reaches(a, b, seen=()):
    return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph[a])
cycles = [f for f in graph if reaches(f, f)]
print('cycle through: ' + ' '.join(cycles) if cycles else 'no cycle')
sys.exit(1 if cycles else 0)
PY
