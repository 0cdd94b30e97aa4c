#!/usr/bin/env bash
# check_style.sh: the house style of every C, CUDA and header file outside tests/ and the
# generated tables, held by tools rather than by hand:
#   - clang-format (the root's .clang-format) would change nothing: `make format` writes it;
#   - no line over 100 columns, and no file over 1,500 lines;
#   - no comma-chained statement (`a = 1, b = 2;`, `if (x) return f(), 0;`): a statement does
#     one thing on its line. clang's syntax tree finds them: a comma operator that is neither in
#     a for loop's header nor inside another comma; and, in flexgen.c and flexgen.cu, no
#     declaration of several variables outside a for loop's header (`int a = 1, b = 2;`).
# Usage: bash scripts/check_style.sh           (from anywhere; prints what it finds, exits 1)
#        bash scripts/check_style.sh --files   (prints the files it holds, one a line)
# The CUDA files are read as the emulated GPU's build compiles them (build-emu/, after `make
# flexgen-emu`), as C++ on tests/cuda_emu's headers; where that copy is missing they are
# formatted and measured but not parsed.
set -euo pipefail
cd "$(dirname "$0")/.."
generated='^support/(nfc|unicode)_tables\.h$'
files=$(git ls-files '*.c' '*.h' '*.cu' | grep -v -e '^tests/' | grep -v -E "$generated")
if [ "${1:-}" = --files ]; then
    echo "$files"
    exit 0
fi
fail=0
for tool in clang-format clang; do
    if ! command -v $tool >/dev/null; then
        echo "check_style.sh: $tool is not installed (bash scripts/setup.sh installs it)" >&2
        exit 2
    fi
done

# shellcheck disable=SC2086
unformatted=$(for f in $files; do
    clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || echo "$f"
done)
if [ -n "$unformatted" ]; then
    echo "MISS  clang-format would change (make format writes them):" $unformatted
    fail=1
else
    echo "ok    clang-format: every file as .clang-format writes it"
fi

# shellcheck disable=SC2086
wide=$(python3 -c '
import sys
for path in sys.argv[1:]:
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        if len(line.rstrip("\n")) > 100:
            print(f"{path}:{n}")' $files)
if [ -n "$wide" ]; then
    echo "MISS  lines over 100 columns:" $wide
    fail=1
else
    echo "ok    lines over 100 columns: none"
fi

# shellcheck disable=SC2086
long=$(wc -l $files | awk '$2 != "total" && $1 > 1500 { print $2 " (" $1 " lines)" }')
if [ -n "$long" ]; then
    echo "MISS  files over 1,500 lines:" $long
    fail=1
else
    echo "ok    files over 1,500 lines: none"
fi

c_flags=$(MAKEFLAGS='' make -s print-cflags | sed 's/-Werror//; s/-O2//')
cu_flags="-x c++ -std=c++17 -I. -Itests/cuda_emu -DFLEXGEN_CUDA_EMU"
commas=$(python3 - "$c_flags" "$cu_flags" $files <<'PY'
import os, re, subprocess, sys

# A location in clang's dump: a file's line, another line of the same file, or a column of the
# same line. The dump prints each only where it changes, so a node's line is what was last read.
LOC = re.compile(r'(?:([\w./+-]+\.(?:c|h|cu)):(\d+):\d+|line:(\d+):\d+|col:\d+)')

# The files whose declarations name one variable each (`int a = 1, b = 2;` is two lines there):
# the schedule and the CUDA backend, which a reader reads beside each other.
ONE_A_DECLARATION = {'flexgen.c', 'flexgen.cu'}

def comma_chains(path, source, flags, held):
    dump = subprocess.run(['clang', '-fsyntax-only', '-fno-color-diagnostics', '-w',
                           '-Xclang', '-ast-dump', *flags, source], capture_output=True, text=True)
    if dump.returncode != 0:
        return [f'{path}: clang cannot read it: ' + (dump.stderr.strip().splitlines() or [''])[0]]
    found, kinds = [], []
    file = line = None
    declaration = None  # a DeclStmt's depth, its variables so far, where, whether a for's header
    for text in dump.stdout.splitlines():
        m = re.search(r'[A-Za-z<]', text)
        if not m:
            continue
        depth = m.start() // 2
        comma = text.startswith('BinaryOperator', m.start()) and text.endswith("','")
        del kinds[depth:]
        kinds.append('comma' if comma else text[m.start():].split(' ', 1)[0])
        first = None
        for t in LOC.finditer(text):
            if t.group(1):
                file, line = t.group(1), int(t.group(2))
            elif t.group(3):
                line = int(t.group(3))
            if first is None:
                first = (file, line)
        parent = kinds[-2] if len(kinds) > 1 else ''
        where = os.path.normpath(first[0]) if first and first[0] else None
        if comma and where in held and parent not in ('ForStmt', 'comma'):
            found.append(f'{where}:{first[1]}')
        if declaration and depth <= declaration[0]:
            declaration = None
        if kinds[-1] == 'DeclStmt':
            declaration = [depth, 0, where, first[1] if first else 0, parent == 'ForStmt']
        elif declaration and depth == declaration[0] + 1 and kinds[-1] == 'VarDecl':
            declaration[1] += 1
            if declaration[1] == 2 and not declaration[4] and declaration[2] in ONE_A_DECLARATION:
                found.append(f'{declaration[2]}:{declaration[3]} (several variables)')
    return found

c_flags = sys.argv[1].split()
cu_flags = sys.argv[2].split()
held = set(sys.argv[3:])  # a header's commas are found through the files that include it
for path in sys.argv[3:]:
    if path.endswith('.h'):
        continue
    if path.endswith('.cu'):
        source = os.path.join('build-emu', path)
        if os.path.exists(source):
            print('\n'.join(comma_chains(path, source, cu_flags, held)))
    else:
        print('\n'.join(comma_chains(path, path, c_flags, held)))
PY
)
commas=$(echo "$commas" | sort -u | grep . || true)
if [ -n "$commas" ]; then
    echo "MISS  comma-chained statements:" $commas
    fail=1
else
    echo "ok    comma-chained statements, and several variables declared in flexgen.c(u): none"
fi
exit $fail
