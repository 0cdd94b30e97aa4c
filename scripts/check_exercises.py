#!/usr/bin/env python3
"""Checks docs/EXERCISES.md: for each exercise, empties its function in a copy of the tree,
builds with WERROR= (an emptied function leaves unused helpers), runs the suite that grades it,
and prints that suite's first failure lines. Every exercise must fail its suite with a line that
says what was expected and what came, not pass and not crash.

Usage, from the repository root:  python3 scripts/check_exercises.py [FUNCTION ...]
(about 5 minutes for all on 2 cores; the copies go to a temporary directory, removed after)."""
import os, re, shutil, subprocess, sys, tempfile

# function, file, body of the emptied function, suite, environment
EXERCISES = [
    ('compress_group', 'quant.c', '', 'quant', {'FLEXGEN_NO_SIMD': '1'}),
    ('decode_groups_scalar', 'quant.c', '', 'quant', {'FLEXGEN_NO_SIMD': '1'}),
    ('topk_keep', 'quant.c', '    return 0;\n', 'compress', {}),
    ('place_tensors', 'flexgen.c', '', 'runtime', {}),
    ('decode_attention_terms', 'lp.c', '', 'cost', {}),
    ('pivot', 'lp.c', '', 'lp', {}),
    ('phase1_costs', 'lp.c', '', 'lp', {}),
    ('block_schedule', 'flexgen.c', '', 'model', {}),
    ('block_schedule', 'flexgen.c', '', 'runtime', {}),
]


def emptied(text, name, body):
    m = re.search(r'^(static )?[a-z][^\n;]*\b%s\([^)]*\)\s*\{' % name, text, re.M)
    if not m:
        sys.exit('check_exercises.py: no definition of %s' % name)
    i, depth = m.end(), 1
    while depth:
        depth += {'{': 1, '}': -1}.get(text[i], 0)
        i += 1
    return text[:m.end()] + '\n' + body + text[i - 1:]


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    only, bad = sys.argv[1:], 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, body, suite, env in EXERCISES:
            if only and name not in only:
                continue
            tree = os.path.join(tmp, name)
            if not os.path.exists(tree):
                shutil.copytree(root, tree, ignore=shutil.ignore_patterns('.git', 'build-san', '.venv'))
                src = os.path.join(tree, path)
                text = emptied(open(src).read(), name, body)
                open(src, 'w').write(text)
                b = subprocess.run(['make', '-j2', 'WERROR=', 'flexgen', 'build/test_flexgen'], cwd=tree,
                                   capture_output=True, text=True)
                if b.returncode:
                    print('%s: the build failed\n%s' % (name, b.stderr[-1500:]))
                    bad += 1
                    continue
            r = subprocess.run(['timeout', '600', './build/test_flexgen', suite], cwd=tree,
                               env=dict(os.environ, FLEXGEN_BIN='./flexgen', **env),
                               capture_output=True, text=True)
            failures = [l.strip() for l in r.stdout.splitlines() if re.match(r'\s+\d+\. ', l)]
            crashed = r.returncode not in (0, 1)
            verdict = 'CRASHED (exit %d)' % r.returncode if crashed else \
                'PASSED: the suite does not grade it' if r.returncode == 0 else \
                '%d failures' % len(failures)
            print('%s emptied, suite %s: %s' % (name, suite, verdict))
            for line in failures[:2]:
                print('    ' + line)
            bad += crashed or r.returncode == 0
    print('%d checks, %d not graded as they should be' % (len(EXERCISES) if not only else
          sum(1 for e in EXERCISES if e[0] in only), bad))
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
