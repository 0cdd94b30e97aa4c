#!/usr/bin/env bash
# check_readme.sh: every sample in README.md is what the command prints today. A sample is a
# ```console block: its first line `$ command`, the rest the output. Each command runs from the
# repository root (after `make`), with --offload-dir and --path in a temporary directory that is
# removed after; its stdout and stderr are compared line by line with the sample: exactly, except
# on lines that carry measured times (latency, throughput, compute, disk reads, the mean time to
# a completed sequence, the search's seconds), whose numbers are masked and the rest compared,
# and on the `blas:` line, which names this machine's library and core and is compared in its
# shape only.
# Prints `same` or `DIFF` per sample (with the first differing line), then `N passed, M failed`;
# exits 1 if any sample differs, 2 without ./flexgen.
# Usage: bash scripts/check_readme.sh   (from anywhere, after `make`; make test runs it)
set -uo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/.." || exit
[ -x ./flexgen ] || { echo "check_readme.sh: ./flexgen is not built (run make)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import re, shlex, subprocess, sys
work = sys.argv[1]
text = open('README.md').read()
samples = re.findall(r'```console\n\$ (.*?)\n(.*?)```', text, re.S)
timed = re.compile(r'latency|throughput|compute:|disk reads:|^search:|^mean time')
def mask(line):
    if line.startswith('blas: '):
        return re.sub(r'^blas: .+, core \S+ \(.+\)\tcpu kernels: \S+$', 'blas: #, core # (#)\tcpu kernels: #', line)
    return re.sub(r'[0-9][0-9.e+-]*', '#', line) if timed.search(line) else line
passed = failed = 0
for cmd, want in samples:
    args = shlex.split(cmd) + (['--offload-dir', work, '--path', work] if cmd.split()[:2] != ['./flexgen', 'policy'] else [])
    try:
        got = subprocess.run(args, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        failed += 1
        print('DIFF  %s\n      it did not run to its end: %s' % (cmd, e))
        continue
    got_lines = (got.stdout + got.stderr).rstrip('\n').split('\n')
    want_lines = want.rstrip('\n').split('\n')
    diff = next((i for i in range(max(len(got_lines), len(want_lines)))
                 if i >= len(got_lines) or i >= len(want_lines) or mask(got_lines[i]) != mask(want_lines[i])), None)
    if diff is None and got.returncode == 0:
        passed += 1
        print('same  ' + cmd)
    else:
        failed += 1
        g = got_lines[diff] if diff is not None and diff < len(got_lines) else '(nothing)'
        w = want_lines[diff] if diff is not None and diff < len(want_lines) else '(nothing)'
        print('DIFF  %s\n      line %s: README has %r, the command printed %r (exit %d)' % (cmd, diff, w, g, got.returncode))
print('%d passed, %d failed' % (passed, failed))
sys.exit(1 if failed else 0)
PY
