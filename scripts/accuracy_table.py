#!/usr/bin/env python3
"""Section 5's approximations measured on a trained checkpoint: the perplexity of a held-out text
and the top-1 agreement with fp16, through `flexgen perplexity`, in prefill and in decode.

    python3 scripts/accuracy_table.py [--model models/opt-kjv] [--text models/opt-kjv/heldout.txt]

For each mode (prefill: each window in one pass; decode: the scored tokens one decode step at a
time, as generation reads the KV cache) it runs fp16 first with --predictions, then each
approximation with --compare against fp16's predictions, and prints a Markdown table: the
perplexity, its change from fp16, and the share of scored positions whose most likely next
token is fp16's. --only "NAME;NAME" runs those approximations (fp16 always runs first). Extra
arguments go to every run (e.g. --window 128).
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
    ("4-bit cache", ["--compress-cache"]),
    ("4-bit weights + cache", ["--compress-weight", "--compress-cache"]),
    ("sparsity 0.5", ["--attn-sparsity", "0.5"]),
    ("sparsity 0.2", ["--attn-sparsity", "0.2"]),
    ("sparsity 0.1", ["--attn-sparsity", "0.1"]),
    ("4-bit weights + cache, sparsity 0.1", ["--compress-weight", "--compress-cache", "--attn-sparsity", "0.1"]),
]


def run(flexgen, model, text, flags):
    cmd = [flexgen, "perplexity", "--model", model, "--text", text, "--json", "--quiet"] + flags
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"accuracy_table: {' '.join(cmd)}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/opt-kjv")
    ap.add_argument("--text", default=None, help="[MODEL/heldout.txt]")
    ap.add_argument("--flexgen", default="./flexgen")
    ap.add_argument("--only", default=None, help="approximations to run, by name, separated by semicolons")
    ap.add_argument("flags", nargs="*", help="more flags for every run, after --")
    args = ap.parse_args()
    text = args.text or os.path.join(args.model, "heldout.txt")
    names = [c[0] for c in CONFIGS]
    only = args.only.split(";") if args.only else names
    for name in only:
        if name not in names:
            sys.exit(f"accuracy_table: --only: no approximation named '{name}' (there are: {', '.join(names)})")
    configs = [c for c in CONFIGS if c[0] == "fp16" or c[0] in only]
    print("| mode | approximation | perplexity | change | top-1 agreement with fp16 | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("prefill", "decode"):
            extra = args.flags + (["--decode"] if mode == "decode" else [])
            top1 = os.path.join(tmp, f"{mode}.txt")
            base = None
            for name, flags in configs:
                more = ["--predictions", top1] if base is None else ["--compare", top1]
                r = run(args.flexgen, args.model, text, extra + flags + more)
                base = base or r["perplexity"]
                agree = r.get("top1_agreement", 1.0)
                change = 100 * (r["perplexity"] / base - 1)
                print(f"| {mode} | {name} | {r['perplexity']:.3f} | {change:+.2f}% | {agree:.4f} | "
                      f"{r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
