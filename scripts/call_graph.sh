#!/usr/bin/env bash
# The file-level call graph of the sources, as the linker sees it: compiles each .c file, the
# paper's at the top level, the services beneath them in support/ and the program around them in
# app/ (and uses build/flexgen_cu.o and build/cuda_device_cu.o when there are), then for each object
# lists the files whose symbols it uses, and says whether the graph has a cycle. It checks the
# levels too: a support/ file uses nothing of the paper's files or app/, and a paper file nothing of
# app/ (the paper's runtime reaches app/ only through tables of functions: the backends, the stage
# hooks). And it checks the includes: the paper's files include no support header but
# support/support.h (and flexgen.cu its plumbing's, support/cuda_device.h, and its kernels' helpers,
# support/cuda_kernels.h), and no support/ file includes flexgen.h or an app/ header. docs/DESIGN.md
# draws the same graph.
# Usage: bash scripts/call_graph.sh [OBJECTS]   (from the repository root, after `make`)
#   OBJECTS: a directory of the build's objects (make test passes build/obj), instead of compiling
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
objects="${1:-}"
[ -z "$objects" ] || [ -d "$objects" ] || { echo "call_graph.sh: no directory $objects" >&2; exit 2; }
[ -n "$objects" ] || flags=$(make -s print-cflags)
for f in *.c support/*.c app/*.c; do
    o="$dir/$(echo "${f%.c}" | tr / +).o"
    if [ -n "$objects" ]; then
        cp "$objects/${f%.c}.o" "$o" || { echo "call_graph.sh: $objects has no object of $f (run make)" >&2; exit 2; }
        continue
    fi
    # shellcheck disable=SC2086
    ${CC:-gcc} $flags -c -o "$o" "$f"
done
bad=$( (grep -h '#include "support/' *.c; grep -h '#include "support/' flexgen.cu | grep -vE 'support/cuda_(device|kernels)\.h') \
    | grep -v 'support/support.h' || true)
if [ -n "$bad" ]; then echo "a paper file includes another support header: $bad"; exit 1; fi
bad=$(grep -lE '#include "(flexgen\.h|tiers\.h|app/)' support/*.c support/*.h || true)
if [ -n "$bad" ]; then echo "a support/ file includes flexgen.h or an app/ header: $bad"; exit 1; fi
[ -f build/flexgen_cu.o ] && cp build/flexgen_cu.o "$dir/flexgen.cu.o"
[ -f build/cuda_device_cu.o ] && cp build/cuda_device_cu.o "$dir/support+cuda_device.cu.o"
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
def level(f):  # the program around the paper, the paper, the services beneath it
    return 2 if f.startswith('app/') else 0 if f.startswith('support/') else 1
upward = [f'{f} -> {g}' for f in sorted(graph) for g in graph[f] if level(g) > level(f)]
def reaches(a, b, seen=()):
    return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph[a])
cycles = [f for f in graph if reaches(f, f)]
print('cycle through: ' + ' '.join(cycles) if cycles else 'no cycle')
if upward: print('calls up a level (support/ < the paper < app/): ' + ', '.join(upward))
sys.exit(1 if cycles or upward else 0)
PY
