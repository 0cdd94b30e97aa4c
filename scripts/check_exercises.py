#!/usr/bin/env python3
"""Checks docs/EXERCISES.md: for each exercise, empties its function in a copy of the tree,
builds with WERROR= (an emptied function leaves unused helpers), runs the suite that grades it,
and prints that suite's first failure lines. Every exercise must fail its suite with a line that
says what was expected and what came, not pass and not crash. Then the same for the wrong
versions that an emptied body does not stand for: a function written almost right, with the
one mistake its suite must still catch (synchronize before compute, a clamp left out).

Usage, from the repository root:  python3 scripts/check_exercises.py [FUNCTION ...]
(about 5 minutes for all on 2 cores; the copies go to a temporary directory, removed after)."""
import os, re, shutil, subprocess, sys, tempfile

# function, file, body of the emptied function, suite, environment, make's arguments
EXERCISES = [
    ('compress_group', 'quant.c', '', 'quant', {'FLEXGEN_NO_SIMD': '1'}, []),
    ('decode_groups_scalar', 'quant.c', '', 'quant', {'FLEXGEN_NO_SIMD': '1'}, []),
    ('topk_keep', 'quant.c', '    return 0;\n', 'compress', {}, []),
    ('place_tensors', 'flexgen.c', '', 'runtime', {}, []),
    ('decode_attention_terms', 'lp.c', '', 'cost', {}, []),
    ('pivot', 'lp.c', '', 'lp', {}, []),
    ('phase1_costs', 'lp.c', '', 'lp', {}, []),
    ('block_schedule', 'flexgen.c', '', 'model', {}, []),
    ('block_schedule', 'flexgen.c', '', 'runtime', {}, []),
    # nvcc keeps warnings errors: NVCC= builds without the CUDA backend, as the Grade line says
    ('q4_value', 'flexgen.h', '    return 0;\n', 'quant', {}, ['NVCC=']),
]

# function, file, what is wrong, (pattern, replacement) in the function's body, suite, environment
WRONG_VERSIONS = [
    ('block_schedule', 'flexgen.c', 'synchronize before compute',
     (r'(\s*)compute\(bl, now\);(\s*)synchronize\(bl, now\);', r'\1synchronize(bl, now);\2compute(bl, now);'),
     'runtime', {}),
    ('pivot', 'lp.c', 'the right-hand side clamp removed',
     (r'\n[^\n]*if \((?:rp|row)\[t->n\] <= t->eps_b\)[^\n]*', ''), 'lp', {}),
]


def body_span(text, name):
    """Where the body of function `name` starts (after its brace) and ends (at its closing brace)."""
    m = re.search(r'^(static )?[a-z][^\n;]*\b%s\([^)]*\)\s*\{' % name, text, re.M)
    if not m:
        sys.exit('check_exercises.py: no definition of %s' % name)
    i, depth = m.end(), 1
    while depth:
        depth += {'{': 1, '}': -1}.get(text[i], 0)
        i += 1
    return m.end(), i - 1


def emptied(text, name, body):
    start, end = body_span(text, name)
    return text[:start] + '\n' + body + text[end:]


def wrong_version(text, name, change):
    """The function with `change` made in its body; None when the pattern is not there."""
    start, end = body_span(text, name)
    body, n = re.subn(change[0], change[1], text[start:end])
    return text[:start] + body + text[end:] if n else None


def prepared(tmp, key, root, path, edit, make_args, built):
    """A copy of the tree with `edit` made to `path` and built, or None (with a line) if not."""
    if key in built:
        return built[key]
    tree = os.path.join(tmp, key)
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns('.git', 'build-san', 'build-fuzz', 'build-emu', 'build-san-emu', 'peers', '.venv*'))
    src = os.path.join(tree, path)
    text = edit(open(src).read())
    built[key] = None
    if text is None:
        print('%s: the change no longer applies to %s' % (key, path))
        return None
    open(src, 'w').write(text)
    b = subprocess.run(['make', '-j2', 'WERROR='] + make_args + ['flexgen', 'build/test_flexgen'],
                       cwd=tree, capture_output=True, text=True)
    if b.returncode:
        print('%s: the build failed\n%s' % (key, b.stderr[-1500:]))
        return None
    built[key] = tree
    return tree


def graded(tree, label, suite, env):
    """Runs the suite on the changed tree; 0 when it fails as it should, 1 when not."""
    r = subprocess.run(['timeout', '600', './build/test_flexgen', suite], cwd=tree,
                       env=dict(os.environ, FLEXGEN_BIN='./flexgen', **env),
                       capture_output=True, text=True)
    failures = [l.strip() for l in r.stdout.splitlines() if re.match(r'\s+\d+\. ', l)]
    crashed = r.returncode not in (0, 1)
    verdict = 'CRASHED (exit %d)' % r.returncode if crashed else \
        'PASSED: the suite does not grade it' if r.returncode == 0 else \
        '%d failures' % len(failures)
    print('%s, suite %s: %s' % (label, suite, verdict))
    for line in failures[:2]:
        print('    ' + line)
    return int(crashed or r.returncode == 0)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    only = sys.argv[1:]
    checks = [(name, path, 'emptied', lambda t, n=name, b=body: emptied(t, n, b), suite, env, args)
              for name, path, body, suite, env, args in EXERCISES]
    checks += [(name, path, 'with ' + what, lambda t, n=name, c=change: wrong_version(t, n, c), suite, env, [])
               for name, path, what, change, suite, env in WRONG_VERSIONS]
    checks = [c for c in checks if not only or c[0] in only]
    bad, built = 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, what, edit, suite, env, args in checks:
            key = '%s %s' % (name, what)
            tree = prepared(tmp, key.replace(' ', '-'), root, path, edit, args, built)
            bad += graded(tree, key, suite, env) if tree else 1
    print('%d checks, %d not graded as they should be' % (len(checks), bad))
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
