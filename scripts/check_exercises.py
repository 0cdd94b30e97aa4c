#!/usr/bin/env python3
"""Checks docs/EXERCISES.md: for each exercise, empties its function in a copy of the tree,
builds with WERROR= (an emptied function leaves unused helpers), runs the suite that grades it,
and prints that suite's first failure lines. Every exercise must fail its suite with a line that
says what was expected and what came, not pass and not crash. Then the same for the wrong
versions (at least three a function): a function written almost right, with one of the mistakes
a student is likely to make, which its suite must still catch (the tiers taken in the wrong
order, synchronize before compute, a clamp left out, ...).

Usage, from the repository root:  python3 scripts/check_exercises.py [FUNCTION ...]
                                  python3 scripts/check_exercises.py --patterns
(--patterns: only that every change still applies to its function, in a second; make test runs it)
(FUNCTION: check only that function's exercise and wrong versions. Each check is a build and a
suite run, minutes each, two at a time (JOBS=N for another count): 54 checks, 12 emptied bodies
and 42 wrong versions; the copies go to a temporary directory, each removed after its check)."""
import concurrent.futures, os, re, shutil, subprocess, sys, tempfile

# function, file, body of the emptied function, suite, environment, make's arguments
EXERCISES = [
    ('compress_group', 'quant.c', '', 'quant', {'FLEXGEN_NO_SIMD': '1'}, []),
    ('decode_groups_scalar', 'quant.c', '', 'quant', {'FLEXGEN_NO_SIMD': '1'}, []),
    ('topk_keep', 'quant.c', '    return 0;\n', 'compress', {}, []),
    ('place_tensors', 'tiers.c', '', 'runtime', {}, []),
    ('decode_attention_terms', 'lp.c', '', 'cost', {}, []),
    ('pivot', 'lp.c', '', 'lp', {}, []),
    ('phase1_costs', 'lp.c', '', 'lp', {}, []),
    ('block_schedule', 'flexgen.c', '', 'model', {}, []),
    ('block_schedule', 'flexgen.c', '', 'runtime', {}, []),
    ('diagonal_slots', 'flexgen.c', '', 'schedule', {}, []),
    # nvcc keeps warnings errors: NVCC= builds without the CUDA backend, as the Grade line says
    ('q4_value', 'model.h', '    return 0;\n', 'quant', {}, ['NVCC=']),
    ('rope', 'llama_model.c', '', 'model', {}, []),
]

# function, file, what is wrong, (pattern, replacement) in the function's body, suite, environment.
# Each is a mistake a student is likely to make; the patterns match the statement that goes wrong
# (an expression, a comparison, a call), not the names of the variables around it.
NO_SIMD = {'FLEXGEN_NO_SIMD': '1'}
WRONG_VERSIONS = [
    # 1. compress_group
    ('compress_group', 'quant.c', 'rounding by truncation, not to the nearest level',
     (r'\s*\+\s*0\.5f', ''), 'quant', NO_SIMD),
    ('compress_group', 'quant.c', 'the nibbles of a pair swapped (the first in the low nibble)',
     (r'\(uint8_t\)\((\w+)\[0\] << 4 \| \1\[1\]\)', r'(uint8_t)(\1[1] << 4 | \1[0])'), 'quant', NO_SIMD),
    ('compress_group', 'quant.c', 'one value past the partial last group packed (e > n)',
     (r'if \((\w+) >= (\w+)\) break;', r'if (\1 > \2) break;'), 'quant', NO_SIMD),
    ('compress_group', 'quant.c', 'the range of a partial last group taken over 64 values',
     (r'(\w+) < n && !(\w+); \1\+\+', r'\1 < Q4_GROUP && !\2; \1++'), 'quant', NO_SIMD),
    # 2. decode_groups_scalar
    ('decode_groups_scalar', 'quant.c', 'the nibbles of a pair swapped',
     (r'\((\w+) % 2 \? 0 : 4\)', r'(\1 % 2 ? 4 : 0)'), 'quant', NO_SIMD),
    ('decode_groups_scalar', 'quant.c', 'the partial last group left out',
     (r'(\w+) \* Q4_GROUP < (\w+);', r'(\1 + 1) * Q4_GROUP <= \2;'), 'quant', NO_SIMD),
    ('decode_groups_scalar', 'quant.c', 'the low nibble not masked',
     (r' & 15\)', ')'), 'quant', NO_SIMD),
    # 3. topk_keep
    ('topk_keep', 'quant.c', 'ties to the later index',
     (r'for \(int (\w+) = 0; \1 < n; \1\+\+\)(\s*)if \((.*)\) keep\[(\w+)\+\+\] = \1;',
      r'for (int \1 = n - 1; \1 >= 0; \1--)\2if (\3) keep[\4++] = \1;\n'
      r'    for (int a = 0, b = \4 - 1; a < b; a++, b--) { int s = keep[a]; keep[a] = keep[b]; keep[b] = s; }'),
     'compress', {}),
    ('topk_keep', 'quant.c', 'every value equal to the threshold kept',
     (r'\|\| \(w\[(\w+)\] == (\w+) && \w+-- > 0\)', r'|| w[\1] == \2'), 'compress', {}),
    ('topk_keep', 'quant.c', 'one tie too many kept (ties-- >= 0)',
     (r'(\w+)-- > 0', r'\1-- >= 0'), 'compress', {}),
    ('topk_keep', 'quant.c', 'the values above the threshold counted with >=',
     (r'\+= w\[(\w+)\] > (\w+);', r'+= w[\1] >= \2;'), 'compress', {}),
    # 4. place_tensors
    ('place_tensors', 'tiers.c', 'the tiers taken in the order gpu, cpu, disk',
     (r'(\w+)\s*<\s*(\w+)\s*\?\s*TIER_DISK\s*:\s*\1\s*<\s*(\w+)\s*\?\s*TIER_CPU\s*:\s*TIER_GPU',
      r'\1 < 100 - \3 ? TIER_GPU : \1 < 100 - \2 ? TIER_CPU : TIER_DISK'), 'runtime', {}),
    ('place_tensors', 'tiers.c', "a tensor's start, not its midpoint",
     (r'\(\s*([\w>.-]+)\s*\+\s*([\w>.\[\]-]+)\s*/\s*2(?:\.0)?\s*\)', r'(\1)'), 'runtime', {}),
    ('place_tensors', 'tiers.c', "a tensor's end, not its midpoint",
     (r'\(\s*([\w>.-]+)\s*\+\s*([\w>.\[\]-]+)\s*/\s*2(?:\.0)?\s*\)', r'(\1 + \2)'), 'runtime', {}),
    # 5. decode_attention_terms
    ('decode_attention_terms', 'lp.c', 'the disk share of the cache left out (k < X_CN)',
     (r'<= X_CN', '< X_CN'), 'cost', {}),
    ('decode_attention_terms', 'lp.c', "delegated attention at the compute device's rate",
     (r'hw->cpu_flops', 'hw->bmm_flops_g'), 'cost', {}),
    ('decode_attention_terms', 'lp.c', 'the new rows not carried back (no gpu -> cpu term)',
     (r'\n[^\n]*add\(&\w+\[T_GTOC\][^\n]*', ''), 'cost', {}),
    ('decode_attention_terms', 'lp.c', "the new rows carried back at the hidden states' rate",
     (r'gtoc_bdw_cache', 'gtoc_bdw_hidden'), 'cost', {}),
    # 6. pivot
    ('pivot', 'lp.c', 'the right-hand side clamp removed',
     (r'\n[^\n]*if \(row\[t->n\] <= LP_ZERO_TOL[^\n]*', ''), 'lp', {}),
    ('pivot', 'lp.c', "each row's rhs_scale left at its own b (the pivot row's not carried in)",
     (r'\n[^\n]*rhs_scale\[\w+\] = fmax[^\n]*', ''), 'lp', {}),
    ('pivot', 'lp.c', 'the pivot row not divided',
     (r'\n[^\n]*\*= *\w+;', ''), 'lp', {}),
    ('pivot', 'lp.c', 'the pivot row divided in place by its own entry (rp[j] /= rp[q])',
     (r'(\w+)\[(\w+)\] \*= *\w+;', r'\1[\2] /= \1[q];'), 'lp', {}),
    ('pivot', 'lp.c', 'the reduced costs not updated',
     (r'\n[^\n]*eliminate\(t->d,[^\n]*', ''), 'lp', {}),
    ('pivot', 'lp.c', 'the new basic variable not recorded',
     (r'\n[^\n]*->basis\[\w+\] = \w+;', ''), 'lp', {}),
    # 7. phase1_costs
    ('phase1_costs', 'lp.c', 'the sum added, not subtracted',
     (r'(->d\[\w+\]) -= ', r'\1 += '), 'lp', {}),
    ('phase1_costs', 'lp.c', 'the rows whose basic variable is not an artificial summed',
     (r'(basis\[\w+\]) == ART', r'\1 != ART'), 'lp', {}),
    ('phase1_costs', 'lp.c', 'each artificial row assigned, not summed',
     (r'(->d\[\w+\]) -= ', r'\1 = -'), 'lp', {}),
    # 8. block_schedule
    ('block_schedule', 'flexgen.c', 'synchronize before compute',
     (r'(\s*)compute\((\w+), (\w+)\);(\s*)synchronize\(\2, \3\);', r'\1synchronize(\2, \3);\4compute(\2, \3);'),
     'runtime', {}),
    ('block_schedule', 'flexgen.c', "this iteration's results stored before its compute, not the previous one's",
     (r'(?s)(\w+) = before\((\w+), (\w+)\)(.*?)store_activation\(\2, \1\);(\s*)store_cache\(\2, \1\);',
      r'\1 = before(\2, \3)\4store_activation(\2, \3);\5store_cache(\2, \3);'), 'model', {}),
    ('block_schedule', 'flexgen.c', "this iteration's cache and activations loaded, not the next one's",
     (r'(?s)(\w+) = after\((\w+), (\w+)\)(.*?)load_cache\(\2, \1\);(\s*)load_activation\(\2, \1\);',
      r'\1 = after(\2, \3)\4load_cache(\2, \3);\5load_activation(\2, \3);'), 'model', {}),
    ('block_schedule', 'flexgen.c', 'the next iteration loaded after compute',
     (r'(\s*)(load_cache\((\w+), \w+\);\s*load_activation\(\3, \w+\);)(\s*)(compute\(\3, \w+\);)',
      r'\1\5\4\2'), 'runtime', {}),
    ('block_schedule', 'flexgen.c', "the step loop stopped before the last step's tokens come back (i < steps)",
     (r'(\w+) <= (\w+)->steps;', r'\1 < \2->steps;'), 'model', {}),
    # 9. q4_value
    ('q4_value', 'model.h', 'the nibbles of a pair swapped',
     (r'\((\w+) % 2 \? 0 : 4\)', r'(\1 % 2 ? 4 : 0)'), 'quant', {}),
    ('q4_value', 'model.h', 'the groups counted rounding down',
     (r'\((\w+) \+ Q4_GROUP - 1\) / Q4_GROUP', r'\1 / Q4_GROUP'), 'quant', {}),
    ('q4_value', 'model.h', "min and scale indexed by the group alone, not the column's",
     (r'(\w+)\[(\w+) \* inner \+ \w+\]\)', r'\1[\2])'), 'quant', {}),
    # 10. diagonal_slots
    ('diagonal_slots', 'flexgen.c', 'every batch started at step 0: a zig-zag order passed off as diagonal',
     (r'diagonal_start\([^;]*\)', '0'), 'schedule', {}),
    ('diagonal_slots', 'flexgen.c', 'the batches staggered by one step, not by n / K',
     (r'diagonal_start\((\w+)[^;]*\)', r'\1'), 'schedule', {}),
    ('diagonal_slots', 'flexgen.c', "an ended batch's pages not given back",
     (r'(\s*)if \(([^;]*)\) end_sequence\(([^;]*)\);', r'\1(void)0;'), 'schedule', {}),
    # 11. rope
    ('rope', 'llama_model.c', "a row's place among the new tokens as its position, not its cache slot",
     (r'\(float\)slot_of\(\w+, (\w+) / (\w+)->n_new, \1 % \2->n_new\)', r'(float)(\1 % \2->n_new)'), 'model', {}),
    ('rope', 'llama_model.c', 'the angles turned the other way (the sine negated)',
     (r'sinf\((\w+)\)', r'-sinf(\1)'), 'model', {}),
    ('rope', 'llama_model.c', "k's heads counted as q's (n_heads, not the K/V heads)",
     (r'(\w+) < cfg_kv_heads\(c\);', r'\1 < c->n_heads;'), 'model', {}),
    ('rope', 'llama_model.c', "q's heads counted as k's (the K/V heads only)",
     (r'(\w+) < c->n_heads;', r'\1 < cfg_kv_heads(c);'), 'model', {}),
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


# The suites that run ./flexgen itself; the others need only the test program.
RUN_THE_PROGRAM = ('runtime', 'cli', 'checkpoint', 'jobs', 'pipeline')


def prepared(tmp, key, root, path, edit, make_args, suite, say):
    """A copy of the tree with `edit` made to `path` and built (without the CUDA backend: every
    graded suite runs on the CPU), or None (with a line) if not."""
    tree = os.path.join(tmp, key)
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns('.git', 'build-san', 'build-fuzz', 'build-emu', 'build-san-emu', 'peers', '.venv*'))
    src = os.path.join(tree, path)
    text = edit(open(src).read())
    if text is None:
        say('%s: the change no longer applies to %s' % (key, path))
        return None
    open(src, 'w').write(text)
    targets = ['build/test_flexgen'] + (['flexgen'] if suite in RUN_THE_PROGRAM else [])
    b = subprocess.run(['make', '-j2', 'WERROR=', 'NVCC='] + make_args + targets,
                       cwd=tree, capture_output=True, text=True)
    if b.returncode:
        say('%s: the build failed\n%s' % (key, b.stderr[-1500:]))
        return None
    return tree


def graded(tree, label, suite, env, say):
    """Runs the suite on the changed tree; 0 when it fails as it should, 1 when not."""
    r = subprocess.run(['timeout', '1200', './build/test_flexgen', suite], cwd=tree,
                       env=dict(os.environ, FLEXGEN_BIN='./flexgen', **env),
                       capture_output=True, text=True)
    failures = [l.strip() for l in r.stdout.splitlines() if re.match(r'\s+\d+\. ', l)]
    crashed = r.returncode not in (0, 1)
    verdict = 'CRASHED (exit %d)' % r.returncode if crashed else \
        'PASSED: the suite does not grade it' if r.returncode == 0 else \
        '%d failures' % len(failures)
    say('%s, suite %s: %s' % (label, suite, verdict))
    for line in failures[:2]:
        say('    ' + line)
    return int(crashed or r.returncode == 0)


def patterns_apply(root, checks):
    """--patterns: each change still applies to its file (make test checks this, fast)."""
    stale = []
    for name, path, what, edit, suite, env, args in checks:
        if edit(open(os.path.join(root, path)).read()) is None:
            stale.append('%s %s: the change no longer applies to %s' % (name, what, path))
    for line in stale:
        print('check_exercises.py: ' + line)
    return 1 if stale else 0


def usage():
    """The Usage lines of the docstring."""
    return __doc__[__doc__.index('Usage,'):]


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = sys.argv[1:]
    if '-h' in args or '--help' in args:
        print(usage())
        sys.exit(0)
    patterns = args == ['--patterns']
    only = [] if patterns else args
    known = {name for name, *_ in EXERCISES}
    unknown = [a for a in only if a not in known]
    if unknown:
        print('check_exercises.py: no exercise %s (known: %s)\n%s'
              % (', '.join(unknown), ', '.join(sorted(known)), usage()), file=sys.stderr)
        sys.exit(2)
    checks = [(name, path, 'emptied', lambda t, n=name, b=body: emptied(t, n, b), suite, env, args)
              for name, path, body, suite, env, args in EXERCISES]
    make_args = {name: args for name, path, body, suite, env, args in EXERCISES}
    checks += [(name, path, 'with ' + what, lambda t, n=name, c=change: wrong_version(t, n, c), suite, env,
                make_args[name]) for name, path, what, change, suite, env in WRONG_VERSIONS]
    checks = [c for c in checks if not only or c[0] in only]
    if patterns:
        sys.exit(patterns_apply(root, checks))

    def check(c):
        """One check's lines and whether it went wrong; its own copy of the tree."""
        name, path, what, edit, suite, env, args = c
        key = '%s %s' % (name, what)
        lines = []
        tree = prepared(tmp, re.sub(r'[^\w.-]+', '-', key + ' ' + suite), root, path, edit, args, suite,
                        lines.append)
        bad = graded(tree, key, suite, env, lines.append) if tree else 1
        if tree:
            shutil.rmtree(tree, ignore_errors=True)
        return ''.join(line + '\n' for line in lines), bad

    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        with concurrent.futures.ThreadPoolExecutor(int(os.environ.get('JOBS', '2'))) as pool:
            for lines, wrong in pool.map(check, checks):  # in the checks' order
                print(lines, end='', flush=True)
                bad += wrong
    print('%d checks, %d not graded as they should be' % (len(checks), bad))
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
