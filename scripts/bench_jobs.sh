#!/usr/bin/env bash
# bench_jobs.sh: a batch job of mixed prompt lengths, run as before (one generate() over the file,
# blocks in file order), as a job (--output: windows of rounds, each window longest first) and as a
# job with --refill (a sequence that ends gives its slot to the next prompt), in alternating
# rounds. The prompts: N passages of models/opt-kjv/heldout.txt of 3 to 72 words (4 to 162 tokens
# with BOS; the model has 256 positions, less --gen-len 64), with --stop-at-eos.
# Prints for each run its seconds, useful tokens a second (the prompts' own tokens plus the tokens
# generated before each sequence's end, counted from the job's records: greedy, the three runs
# generate the same, and the script checks --refill's tokens against the job's), the share of
# prefill's rows that were padding (--json's prompt_tokens against prefill_tokens; with --refill,
# the decoding rows beside a new prompt count as padding), and the share of all rows computed
# (--json's rows_computed) that were padding or sequences already ended: a prompt needs its own
# tokens plus one row per generated token but the last.
# Then the KV cache a sequence holds, in rows per sequence (--json's kv_cache_rows: its pages at its
# end), against its real length (the tokens in them, kv_cache_tokens), and against what the cache
# before pages gave each sequence: its generate() call's longest prompt + 64 rows (a call is the
# whole file for the plain run, a round of the window for the job, a window for --refill).
# Usage: bash scripts/bench_jobs.sh [ROUNDS] [N] [GPU_BATCH]   (default 2 rounds, 1000 prompts, 16)
# MODEL (default models/opt-kjv) runs another model on the same prompts, tokenized with opt-kjv's
# tokenizer (an OPT size name: dummy weights); FLAGS adds flags to every run, for example
#     MODEL=opt-1.3b FLAGS='--percent 100 0 0 100 100 0' bash scripts/bench_jobs.sh 1 128 16
set -euo pipefail
usage="usage: bash scripts/bench_jobs.sh [ROUNDS] [N] [GPU_BATCH]"
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[ $# -le 3 ] || { echo "bench_jobs.sh: three arguments at most; $usage" >&2; exit 2; }
rounds=${1:-2} n=${2:-1000} gbs=${3:-16}
for v in "$rounds" "$n" "$gbs"; do
    if ! [[ $v =~ ^[1-9][0-9]*$ ]]; then
        echo "bench_jobs.sh: expected a positive integer, got '$v'; $usage" >&2
        exit 2
    fi
done
cd "$(dirname "$0")/.."
[ -x ./flexgen ] || { echo "bench_jobs.sh: ./flexgen is not built (run make)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
MODEL=${MODEL:-models/opt-kjv} FLAGS=${FLAGS:-} python3 - "$rounds" "$n" "$gbs" "$work" <<'PY'
import json, os, random, subprocess, sys, time
rounds, n, gbs, work = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


def run(cmd, **kwargs):
    """cmd's stdout; on a failure, its stderr and one line, and the script stops."""
    r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        sys.exit(f"bench_jobs.sh: {' '.join(cmd[:2])} ... failed (exit status {r.returncode})")
    return r.stdout


words = open('models/opt-kjv/heldout.txt').read().split()
random.seed(1)
with open(work + '/prompts.txt', 'w') as f:
    for _ in range(n):
        k, at = random.randint(3, 72), random.randrange(len(words) - 140)
        f.write(' '.join(words[at:at + k]) + '\n')
tokenizer = ['--vocab', 'models/opt-kjv/vocab.json', '--merges', 'models/opt-kjv/merges.txt']
common = ['./flexgen', '--model', os.environ['MODEL'], '--prompt-file', work + '/prompts.txt', '--gen-len', '64',
          '--stop-at-eos', '--gpu-batch-size', str(gbs), '--num-gpu-batches', '1', '--json', '--quiet',
          '--offload-dir', work] + tokenizer + os.environ['FLAGS'].split()
ids = run(['./flexgen', 'tokenize'] + tokenizer, stdin=open(work + '/prompts.txt')).splitlines()
lens = [len(l.split()) + 1 for l in ids]  # with BOS
window = 8 * gbs  # --output's window: 8 rounds of a block
def unpaged(mode):  # rows per sequence of the cache before pages: the call's longest prompt + 64
    if mode == 'plain':
        return max(lens) + 64
    rows = 0
    for w0 in range(0, n, window):
        w = sorted(lens[w0:w0 + window], reverse=True)
        calls = [w] if mode == 'refill' else [w[i:i + gbs] for i in range(0, len(w), gbs)]
        rows += sum(len(c) * (max(c) + 64) for c in calls)
    return rows / n
print('%s, %d prompts, GPU batches of %d, --gen-len 64, --stop-at-eos %s' % (os.environ['MODEL'], n, gbs, os.environ['FLAGS']))
print('%-6s %8s %14s %9s %12s %12s %12s %12s' % ('run', 'seconds', 'useful tok/s', 'padding', 'rows wasted',
                                                  'cache rows', 'its tokens', 'unpaged rows'))
flags = {'plain': [], 'job': ['--output'], 'refill': ['--refill', '--output']}
for r in range(rounds):
    results = []
    for mode in ('plain', 'job', 'refill'):
        out = work + '/out.%s.%d.jsonl' % (mode, r)
        t0 = time.time()
        cmd = common + flags[mode] + ([out] if mode != 'plain' else [])  # --output takes out
        rep = json.loads(run(cmd))
        secs = time.time() - t0
        if mode != 'plain':
            got = [json.loads(l)['tokens'] for l in open(out).read().splitlines()[1:]]
            generated = sum(len(t) for t in got)
            if mode == 'refill' and got != first_tokens:
                sys.exit('--refill generated other tokens than the job without it')
            first_tokens = got
        results.append((mode, secs, rep))
    for m, s, rep in results:
        own, pre, rows = rep['prompt_tokens'], rep['prefill_tokens'], rep['rows_computed']
        needed = own + generated - n
        print('%-6s %8.1f %14.0f %8.1f%% %11.1f%% %12.1f %12.1f %12.1f' % (
            m, s, (own + generated) / s, 100 * (1 - own / pre), 100 * (1 - needed / rows),
            rep['kv_cache_rows'] / n, rep['kv_cache_tokens'] / n, unpaged(m)))
print('useful tokens: prompt tokens + %d generated (from the job records)' % generated)
print('cache: rows a sequence held at its end (its pages), the tokens in them, and the rows the cache '
      'before pages held for it; per sequence, mean over %d' % n)
PY
