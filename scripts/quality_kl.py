#!/usr/bin/env python3
"""Quality loss of section 5's approximations on checkpoints at hand (BENCHMARKS.md, "Compression").

For each checkpoint directory (with prompts.txt: one prompt a line, token ids), runs ./flexgen
greedily in fp16 and with --compress-weight, --compress-cache, both, and both plus
--attn-sparsity 0.1, dumps the logits, and reports the mean KL divergence KL(fp16 || approx) of
the next-token distributions. A step counts while the greedy tokens before it agree (the two runs
then saw the same prefix); the report gives how many steps that was.

    python3 scripts/quality_kl.py [--flexgen ./flexgen] [--gen-len N] CHECKPOINT_DIR...
    e.g. python3 scripts/quality_kl.py tests/fixtures/opt-tiny tests/fixtures/opt-tiny-350m
(--gen-len: the tokens generated a prompt [8].)
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

VARIANTS = [
    ("4-bit weights", ["--compress-weight"]),
    ("4-bit cache", ["--compress-cache"]),
    ("4-bit weights + cache", ["--compress-weight", "--compress-cache"]),
    ("4-bit weights + cache, sparsity 0.1", ["--compress-weight", "--compress-cache", "--attn-sparsity", "0.1"]),
]


def run(flexgen, model, prompts, n, gen_len, flags, out):
    subprocess.run([flexgen, "--model", model, "--prompt-ids", prompts, "--gen-len", str(gen_len),
                    "--gpu-batch-size", str(n), "--num-gpu-batches", "1", "--quiet", "--json",
                    "--dump-logits", out] + flags, check=True, stdout=subprocess.DEVNULL)
    logits = np.fromfile(out, dtype=np.float32)
    return logits.reshape(n, gen_len, -1).astype(np.float64)


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(ref, approx):
    """Mean KL over the steps whose greedy prefixes agree, that count, and token agreement."""
    lp, lq = log_softmax(ref), log_softmax(approx)
    kls, same = [], 0
    n, steps, _ = ref.shape
    for b in range(n):
        for s in range(steps):
            p = np.exp(lp[b, s])
            kls.append(float((p * (lp[b, s] - lq[b, s])).sum()))
            agree = ref[b, s].argmax() == approx[b, s].argmax()
            same += agree
            if not agree:  # later steps saw different prefixes
                break
    return float(np.mean(kls)), len(kls), same


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="checkpoint directories holding prompts.txt")
    ap.add_argument("--flexgen", default="./flexgen")
    ap.add_argument("--gen-len", type=int, default=8)
    args = ap.parse_args()
    print("| model | approximation | mean KL(fp16 ‖ approx), nats | steps compared | greedy tokens equal |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            prompts = os.path.join(model, "prompts.txt")
            if not os.path.exists(prompts):
                sys.exit(f"quality_kl: {prompts}: no such file")
            n = sum(1 for line in open(prompts) if line.strip())
            ref = run(args.flexgen, model, prompts, n, args.gen_len, [], os.path.join(tmp, "ref.bin"))
            for name, flags in VARIANTS:
                approx = run(args.flexgen, model, prompts, n, args.gen_len, flags, os.path.join(tmp, "q.bin"))
                kl, count, same = compare(ref, approx)
                print(f"| {os.path.basename(model.rstrip('/'))} | {name} | {kl:.4f} | {count} | {same} |")


if __name__ == "__main__":
    main()
