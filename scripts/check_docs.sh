#!/usr/bin/env bash
# check_docs.sh: the docs that describe the code's structure, held to the code, so that they
# cannot drift from it:
#   - docs/DESIGN.md's file-level call graph (the block under "The file-level call graph") is
#     scripts/call_graph.sh's output, arrow for arrow;
#   - docs/TESTS.md's list of suites (the sentence "`make test SUITE=name` runs one (...)") names
#     exactly the suites that tests/ registers (CU_add_suite);
#   - no doc points at code by line number (`file.c:123`): docs name functions, and only the
#     maps at the top of flexgen.c, tiers.c, lp.c, flexgen.cu, opt_model.c and llama_model.c give
#     lines, which check_layout.sh keeps;
#   - a file's size stated as "`name` (N lines)" is the file's;
#   - DESIGN.md's block of calls through tables names every function pointer of each struct it
#     names (`lp.c ==> fg_search_request.check`: .place too).
# Usage: bash scripts/check_docs.sh [OBJECTS]          (from anywhere, after `make`)
#        bash scripts/check_docs.sh --write [OBJECTS]  (first writes DESIGN.md's graph anew)
#   OBJECTS: the build's objects (make test passes build/obj), as for scripts/call_graph.sh.
# Prints what disagrees; exits 1 on a disagreement, 2 when the graph cannot be made.
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '/^# Usage:/,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
write=0
if [ "${1:-}" = --write ]; then
    write=1
    shift
fi
if [ $# -gt 1 ] || [[ "${1:-}" == -* ]]; then
    echo "check_docs.sh: usage: bash scripts/check_docs.sh [--write] [OBJECTS]" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
graph=$(mktemp)
trap 'rm -f "$graph"' EXIT
# call_graph.sh exits 1 on a cycle or a call up a level; that is its own check's failure, and
# the graph it printed is still the one to compare.
bash scripts/call_graph.sh "$@" >"$graph" || [ $? -eq 1 ] || exit 2
python3 - "$graph" "$write" <<'PY'
import glob, os, re, sys, textwrap

graph_file, write = sys.argv[1], sys.argv[2] == '1'
fail = False

# The graph: call_graph.sh's lines `FILE -> FILE FILE ...`, wrapped at 100 columns.
arrows = {}
for line in open(graph_file):
    m = re.match(r'^(\S+)\s+->(.*)$', line)
    if m:
        arrows[m.group(1)] = m.group(2).split()
def drawn(arrows):
    out = []
    for f in sorted(arrows):
        head = f'{f:24} -> '
        body = ' '.join(arrows[f]) or '(nothing)'
        out += textwrap.wrap(body, 100, initial_indent=head, subsequent_indent=' ' * len(head),
                             break_on_hyphens=False)
    return out

design = 'docs/DESIGN.md'
text = open(design).read()
begin = '<!-- the arrows below are scripts/call_graph.sh\'s output'
m = re.search(re.escape(begin) + r'[^\n]*\n```\n(.*?)```\n', text, re.S)
if not m:
    print(f'{design}: no call graph block (a line starting "{begin}", then a fenced block)')
    sys.exit(1)
def parse(lines):  # a drawn block back into {file: [files]}
    documented, current = {}, None
    for line in lines:
        if not line.startswith(' '):
            current = line.split('->', 1)[0].strip()
            documented[current] = []
        documented[current] += [t for t in line.split('->', 1)[-1].split() if t != '(nothing)']
    return documented

documented = parse(m.group(1).splitlines())
if 'flexgen.cu' not in arrows:
    # No CUDA object in this build (no nvcc): hold the C files' arrows alone.
    documented.pop('flexgen.cu', None)
    documented = {f: [g for g in to if g != 'flexgen.cu'] for f, to in documented.items()}
if write:
    text = text[:m.start(1)] + '\n'.join(drawn(arrows)) + '\n' + text[m.end(1):]
    open(design, 'w').write(text)
    print(f'{design}: call graph written, {len(arrows)} files')
elif documented != arrows:
    fail = True
    print(f"{design}: the call graph differs from scripts/call_graph.sh's "
          '(bash scripts/check_docs.sh --write writes it anew):')
    for f in sorted(set(arrows) | set(documented)):
        if f not in arrows or f not in documented:
            where = 'the code' if f in arrows else 'the docs'
            print(f'  {f}: a file only in {where}')
            continue
        extra = sorted(set(arrows[f]) - set(documented[f]))
        gone = sorted(set(documented[f]) - set(arrows[f]))
        if extra:
            print(f'  {f} -> {" ".join(extra)}: in the code, not in the docs')
        if gone:
            print(f'  {f} -> {" ".join(gone)}: in the docs, not in the code')

# The suites: registered in tests/ against those docs/TESTS.md lists.
registered = set()
for path in glob.glob('tests/*.c') + glob.glob('tests/*.cu') + glob.glob('tests/cuda_emu/*'):
    registered |= set(re.findall(r'CU_add_suite\("([^"]+)"', open(path, errors='replace').read()))
tests_md = open('docs/TESTS.md').read()
m = re.search(r'`make test SUITE=name` runs one \((.*?)\)', tests_md, re.S)
listed = set(re.findall(r'`([^`]+)`', m.group(1))) if m else set()
if not m:
    fail = True
    print('docs/TESTS.md: no sentence "`make test SUITE=name` runs one (...)" listing the suites')
for s in sorted(registered - listed):
    fail = True
    print(f'docs/TESTS.md: suite {s} is registered in tests/ but not listed')
for s in sorted(listed - registered):
    fail = True
    print(f'docs/TESTS.md: suite {s} is listed but no test file registers it')

# Line numbers: docs name functions.
for path in sorted(glob.glob('docs/*.md')) + ['README.md', 'BENCHMARKS.md']:
    for n, line in enumerate(open(path), 1):
        for ref in re.findall(r'\b[\w/.-]+\.(?:c|cu|h):\d+', line):
            fail = True
            print(f'{path}:{n}: points at {ref} by line; name the function instead')

# A file's size in lines, where a doc states it ("`emu.cpp` (1,409 lines)"): the file's own.
tracked = [line.strip() for line in os.popen('git ls-files')]
sizes = 0
for path in sorted(glob.glob('docs/*.md')) + ['README.md']:
    for n, line in enumerate(open(path), 1):
        for name, count in re.findall(r'`([\w/.-]+\.\w+)` \(([\d,]+) lines\)', line):
            files = [t for t in tracked if t == name or t.endswith('/' + name)]
            lines = sum(1 for _ in open(files[0], errors='replace')) if len(files) == 1 else None
            sizes += 1
            if lines != int(count.replace(',', '')):
                fail = True
                print(f'{path}:{n}: says `{name}` has {count} lines; it has '
                      f'{lines if lines is not None else "no one file of that name"}')

# The table calls' block in DESIGN.md: each `X ==> struct.field (...)` names a field the code
# assigns somewhere (`.field = ` or `->field = `), so that a pointer the code adds shows there.
calls = re.search(r'The calls that go through tables of functions[^`]*```\n(.*?)```', text, re.S)
named = set(re.findall(r'==> (\w+)\.(\w+)', calls.group(1))) if calls else set()
if not named:
    fail = True
    print(f'{design}: no block of table calls (the words "The calls that go through tables of '
          'functions", then a fenced block of `X ==> struct.field` lines)')
sources = ' '.join(open(p, errors='replace').read() for p in tracked if p.endswith(('.c', '.cu', '.h'))
                   and not p.startswith('tests/'))
for struct in sorted({s for s, _ in named}):
    decl = re.search(r'typedef struct \{((?:(?!typedef struct).)*?)\} ' + struct + ';', sources, re.S)
    if not decl:
        fail = True
        print(f'{design}: the block of table calls names {struct}, which no '
              f'`typedef struct {{...}} {struct};` of the sources declares')
        continue
    pointers = set(re.findall(r'\(\*(\w+)\)', decl.group(1)))
    pointer_types = set(re.findall(r'typedef [^;{]*\(\*(\w+)\)\(', sources))
    for kind in pointer_types:  # fields of a function pointer type by name: `fg_plan_check check;`
        pointers |= set(re.findall(r'\b' + kind + r'\s+(\w+);', decl.group(1)))
    for field in sorted(pointers - {f for s, f in named if s == struct}):
        fail = True
        print(f'{design}: the block of table calls has no `{struct}.{field}` (a function pointer of '
              f'{struct})')

if not fail:
    print(f'docs agree with the code: call graph ({len(arrows)} files), '
          f'{len(registered)} suites, no line numbers, {sizes} file sizes')
sys.exit(1 if fail else 0)
PY
