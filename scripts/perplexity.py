#!/usr/bin/env python3
"""Perplexity of a real OPT checkpoint on a text file, through ./flexgen, with any of its flags
(so section 5's approximations can be compared with fp16 on real weights).

    python3 scripts/perplexity.py --model /path/to/opt-125m --text file.txt [--max-tokens 256] \\
        [-- --compress-weight --compress-cache --attn-sparsity 0.5]

The text is tokenized with the checkpoint's vocab.json and merges.txt (`flexgen tokenize`), cut
to --max-tokens, and scored token by token: every prefix </s> t_1 .. t_i is a prompt of one
batch and the logits of its next token give log p(t_{i+1} | prefix). Perplexity is
exp(-mean log p). Each prefix is a separate prompt, so this costs O(T^2) tokens of compute:
keep T modest on the CPU.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory with vocab.json, merges.txt")
    ap.add_argument("--text", required=True)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--flexgen", default="./flexgen")
    ap.add_argument("--batch", type=int, default=16, help="--gpu-batch-size")
    ap.add_argument("flags", nargs="*", help="more ./flexgen flags, after --")
    args = ap.parse_args()
    vocab, merges = (os.path.join(args.model, f) for f in ("vocab.json", "merges.txt"))
    for path in (args.text, vocab, merges):
        if not os.path.exists(path):
            sys.exit(f"perplexity: {path}: no such file")
    text = open(args.text, encoding="utf-8").read().replace("\n", " ")
    out = subprocess.run([args.flexgen, "tokenize", "--vocab", vocab, "--merges", merges], input=text,
                         capture_output=True, text=True, check=True).stdout
    ids = [int(t) for t in out.split()][: args.max_tokens]
    if len(ids) < 2:
        sys.exit("perplexity: the text has fewer than 2 tokens")
    bos = 2
    with tempfile.TemporaryDirectory() as tmp:
        prompts, dump = os.path.join(tmp, "prompts.txt"), os.path.join(tmp, "logits.bin")
        with open(prompts, "w") as f:
            for i in range(len(ids)):  # prefix </s> t_1 .. t_i predicts t_{i+1}
                f.write(" ".join(str(t) for t in [bos] + ids[:i]) + "\n")
        subprocess.run([args.flexgen, "--model", args.model, "--prompt-ids", prompts, "--gen-len", "1",
                        "--gpu-batch-size", str(args.batch), "--num-gpu-batches", "1", "--quiet", "--json",
                        "--dump-logits", dump] + args.flags, check=True, stdout=subprocess.DEVNULL)
        logits = np.fromfile(dump, dtype=np.float32).reshape(len(ids), -1).astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll = -logp[np.arange(len(ids)), ids].mean()
    print(f"{len(ids)} tokens, flags {' '.join(args.flags) or '(fp16)'}: perplexity {np.exp(nll):.3f}")


if __name__ == "__main__":
    main()
