#!/usr/bin/env python3
"""Section 5's approximations measured on a trained checkpoint: the perplexity of a held-out text
and the top-1 agreement with fp16, through `flexgen perplexity`, in prefill and in decode.

    python3 scripts/accuracy_table.py [--model models/opt-kjv] [--text models/opt-kjv/heldout.txt]
                                      [--flexgen ./flexgen] [--only "NAME;NAME"]
                                      [--pair "NAME;OTHER" ...] [-- FLAGS...]

For each mode (prefill: each window in one pass; decode: the scored tokens one decode step at a
time, as generation reads the KV cache) it runs fp16 first with --predictions, then each
approximation with --compare against fp16's predictions (and --predictions of its own), and
prints three Markdown tables:

  1. each approximation against fp16: the perplexity, its change from fp16, the share of scored
     positions whose most likely next token is fp16's, and how many of them changed;
  2. one approximation against another (--pair), counted from the two runs' --predictions files
     as --compare counts: by default 4-bit weights x int8 activations against 4-bit weights
     alone, which is what rounding the activations to int8 changes. Of the changed positions, it
     counts those where the other run had fp16's token (the change moves away from fp16) and
     those where this run has it (the change moves back to fp16): their difference is the move
     in agreement with fp16;
  3. each approximation's decode against its own prefill: which predictions change when the same
     tokens are scored one step at a time instead of in one pass.

The counts come from the --predictions files (one token id a line); the script checks that its
count of the agreement with fp16 is the one `flexgen perplexity --compare` reports.

--only "NAME;NAME" runs those approximations (fp16 always runs first). --pair "NAME;OTHER"
(repeatable, in place of the default pair) reports NAME's agreement with OTHER, running both.
Extra arguments, after --, go to every run (e.g. -- --window 128).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CONFIGS = [
    ("fp16", []),
    ("4-bit weights", ["--compress-weight"]),
    ("4-bit weights x int8 activations", ["--compress-weight", "--int8-activations"]),
    ("bf16 prefill", ["--bf16-prefill"]),
    ("4-bit weights, bf16 prefill", ["--compress-weight", "--bf16-prefill"]),
    ("4-bit cache", ["--compress-cache"]),
    ("4-bit weights + cache", ["--compress-weight", "--compress-cache"]),
    ("sparsity 0.5", ["--attn-sparsity", "0.5"]),
    ("sparsity 0.2", ["--attn-sparsity", "0.2"]),
    ("sparsity 0.1", ["--attn-sparsity", "0.1"]),
    ("4-bit weights + cache, sparsity 0.1", ["--compress-weight", "--compress-cache", "--attn-sparsity", "0.1"]),
]
PAIRS = [("4-bit weights x int8 activations", "4-bit weights")]


def run(flexgen, model, text, flags):
    cmd = [flexgen, "perplexity", "--model", model, "--text", text, "--json", "--quiet"] + flags
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"accuracy_table: {' '.join(cmd)}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def read_predictions(path):
    with open(path) as f:
        return f.read().split()


def changed(a, b):
    """How many positions two runs' --predictions differ at, and how many there are."""
    if len(a) != len(b):
        sys.exit(f"accuracy_table: {len(a)} predictions against {len(b)}")
    return sum(x != y for x, y in zip(a, b)), len(a)


def counts(n, total):
    return f"{n:,} of {total:,}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/opt-kjv")
    ap.add_argument("--text", default=None, help="[MODEL/heldout.txt]")
    ap.add_argument("--flexgen", default="./flexgen")
    ap.add_argument("--only", default=None, help="approximations to run, by name, separated by semicolons")
    ap.add_argument("--pair", action="append", default=None, metavar="NAME;OTHER",
                    help="report NAME's agreement with OTHER (repeatable; replaces the default pair); both run")
    ap.add_argument("flags", nargs="*", help="more flags for every run, after --")
    args = ap.parse_args()
    text = args.text or os.path.join(args.model, "heldout.txt")
    names = [c[0] for c in CONFIGS]
    only = args.only.split(";") if args.only else names
    pairs = []
    for p in args.pair or []:
        two = p.split(";")
        if len(two) != 2:
            sys.exit(f"accuracy_table: --pair '{p}': give two approximations, NAME;OTHER")
        pairs.append(tuple(two))
    for name in only + [n for p in pairs for n in p]:
        if name not in names:
            sys.exit(f"accuracy_table: no approximation named '{name}' (there are: {', '.join(names)})")
    wanted = set(only) | {n for p in pairs for n in p}
    configs = [c for c in CONFIGS if c[0] == "fp16" or c[0] in wanted]
    ran = [c[0] for c in configs]
    if not args.pair:
        pairs = [p for p in PAIRS if p[0] in ran and p[1] in ran]

    predictions = {}  # (mode, name) -> the run's most likely tokens
    print("| mode | approximation | perplexity | change | top-1 agreement with fp16 | predictions changed | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("prefill", "decode"):
            extra = args.flags + (["--decode"] if mode == "decode" else [])
            base = None
            for i, (name, flags) in enumerate(configs):
                mine = os.path.join(tmp, f"{mode}-{i}.txt")
                more = ["--predictions", mine] + (["--compare", os.path.join(tmp, f"{mode}-0.txt")] if i else [])
                r = run(args.flexgen, args.model, text, extra + flags + more)
                predictions[mode, name] = read_predictions(mine)
                n, total = changed(predictions[mode, name], predictions[mode, "fp16"])
                agree = r.get("top1_agreement", 1.0)
                if round(agree * total) != total - n:
                    sys.exit(f"accuracy_table: {name}: flexgen --compare gives {agree}, the files {total - n} of {total}")
                base = base or r["perplexity"]
                change = 100 * (r["perplexity"] / base - 1)
                print(f"| {mode} | {name} | {r['perplexity']:.3f} | {change:+.2f}% | {agree:.4f} | "
                      f"{counts(n, total)} | {r['seconds']:.1f} |", flush=True)

    if pairs:
        print()
        print("| mode | approximation | against | top-1 agreement | predictions changed "
              "| from fp16's token | to fp16's token |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for mode in ("prefill", "decode"):
            for a, b in pairs:
                pa, pb, p16 = predictions[mode, a], predictions[mode, b], predictions[mode, "fp16"]
                n, total = changed(pa, pb)
                away = sum(x != y and y == z for x, y, z in zip(pa, pb, p16))
                back = sum(x != y and x == z for x, y, z in zip(pa, pb, p16))
                print(f"| {mode} | {a} | {b} | {(total - n) / total:.4f} | {counts(n, total)} | {away:,} | {back:,} |")
    print()
    print("| approximation | decode's top-1 agreement with prefill | predictions changed |")
    print("| --- | --- | --- |")
    for name in ran:
        n, total = changed(predictions["decode", name], predictions["prefill", name])
        print(f"| {name} | {(total - n) / total:.4f} | {counts(n, total)} |")


if __name__ == "__main__":
    main()
