#!/usr/bin/env python3
"""outlier_remedy.py: what --int8-activations costs where a few hidden dimensions carry outliers,
and what the usual remedy would win back, measured in PyTorch on HF's own OPT classes.

The integer mode rounds x to int8 (support/int8.c): prefill rounds each row once (alpha = max|x|
/ 127) against W's int8 columns (7 bits, one scale per column); decode rounds a = x times the
4-bit scale of W's row, per block of 64 k and group of 64 columns, against the 4-bit codes. A row
holding a value 56 times the rest gives the rest the step of that value. The remedy of LLM.int8
(Dettmers et al. 2022): the columns of x that hold outliers are taken out of the rounding and
multiplied in fp32 by W's rows they meet (here W's 4-bit values), beside the integer product of
the rest; W's int8 columns stay as they are (so a copy made once with the weights still serves).
Which columns: those whose largest |x| over the product's rows exceeds THRESHOLD times the mean of
the columns' largest |x| (a scale-free form of LLM.int8's fixed 6.0; the median would not do: the
rows entering fc2 are ReLU's, mostly zeros, and a median of zero takes every column).

For tests/fixtures/opt-outlier (4 of 64 dimensions at 24 to 56 times the rest at every linear
layer's input; scripts/make_reference.py) and opt-tiny (none), every prompt alone, each product
of the decoder's linear layers taken four ways over the same 4-bit weights (quant.c's rounding):
fp32, prefill's scheme, decode's scheme, and each scheme with the remedy. Printed: the logits'
move from the fp32 products in relative RMS over every position, and the columns the remedy took.
tests/test_compress.c's "--int8-activations where a few hidden dimensions carry outliers"
measures the C products' move (0.166 prefill, 0.173 decode on opt-outlier); this script's first
rows stand beside it as a check of the simulation.

    VENV/bin/python scripts/outlier_remedy.py [--threshold T]

Needs torch and transformers (scripts/setup.sh does not install them; CI does not run this).
"""
import argparse
import os

import torch
from transformers import OPTForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
GROUP = 64  # quant.c's Q4_GROUP: 4-bit groups along W's output dimension, per row of [in][out]
W_MAX = 64  # prefill's W columns: 7 bits, |w8| <= 64 (INT8_W_MAX)


def fp16_at_least(x):
    """The smallest fp16 at or above x >= 0, as quant.c's fp16_at_least."""
    h = x.to(torch.float16)
    low = h.float() < x
    h = torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.float()


def compress_4bit(w_in_out):
    """W [in][out] grouped along out by 64: codes [in][out], and per (k, group) min and scale."""
    n_in, n_out = w_in_out.shape
    g = w_in_out.reshape(n_in, n_out // GROUP, GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    mn = lo.to(torch.float16).float()
    scale = torch.where(hi > mn, fp16_at_least((hi - mn) / 15), torch.zeros_like(hi))
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.clamp(torch.round((g - mn[..., None]) * inv[..., None]), 0, 15)
    return codes.reshape(n_in, n_out), mn, scale


def values_4bit(codes, mn, scale):
    n_in, n_out = codes.shape
    g = codes.reshape(n_in, n_out // GROUP, GROUP)
    return (mn[..., None] + g * scale[..., None]).reshape(n_in, n_out)


def prefill_scheme(x, w4):
    """Rows of x rounded once, W's columns to 7 bits, one exact integer product (float64)."""
    alpha = x.abs().amax(dim=1, keepdim=True) / 127
    x8 = torch.round(torch.where(alpha > 0, x / alpha, torch.zeros_like(x)))
    col = w4.abs().amax(dim=0, keepdim=True) / W_MAX
    w8 = torch.round(torch.where(col > 0, w4 / col, torch.zeros_like(w4)))
    return ((x8.double() @ w8.double()) * alpha.double() * col.double()).float()


def decode_scheme(x, codes, mn, scale):
    """a = x times the scale of W's row, rounded per block of 64 k and group of 64 columns,
    against the codes; plus x times the mins (support/int8.c's decode)."""
    rows, n_in = x.shape
    groups = codes.shape[1] // GROUP
    a = x[:, :, None] * scale[None]  # [rows][in][groups]
    blocks = a.reshape(rows, n_in // 64, 64, groups)
    alpha = blocks.abs().amax(dim=2, keepdim=True) / 127
    a8 = torch.round(torch.where(alpha > 0, blocks / alpha, torch.zeros_like(blocks)))
    c = codes.reshape(n_in // 64, 64, groups, GROUP).double()
    isum = torch.einsum("rbkg,bkgj->rbgj", a8.double(), c)  # per row, block, group, column
    y = (isum * alpha.double().squeeze(2)[..., None]).sum(dim=1).reshape(rows, groups * GROUP)
    return (y + (x.double() @ torch.repeat_interleave(mn, GROUP, dim=1).double())).float()


def outlier_columns(x, threshold):
    peak = x.abs().amax(dim=0)
    return peak > threshold * peak.mean()


class Product(torch.nn.Module):
    """A linear layer whose product is taken in one of the schemes, over 4-bit weights."""

    def __init__(self, linear, stats):
        super().__init__()
        w = linear.weight.detach().float().t().contiguous()  # [in][out]
        self.codes, self.mn, self.scale = compress_4bit(w)
        self.w4 = values_4bit(self.codes, self.mn, self.scale)
        self.bias = linear.bias.detach().float() if linear.bias is not None else None
        self.scheme, self.remedy, self.threshold, self.stats = "fp32", False, 6.0, stats

    def integer(self, x):
        if self.scheme == "prefill":
            return prefill_scheme(x, self.w4)
        return decode_scheme(x, self.codes, self.mn, self.scale)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        if self.scheme == "fp32":
            y = x @ self.w4
        elif not self.remedy:
            y = self.integer(x)
        else:
            out = outlier_columns(x, self.threshold)
            self.stats.append(int(out.sum()))
            rest = torch.where(out[None], torch.zeros_like(x), x)
            y = self.integer(rest) + x[:, out] @ self.w4[out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)


def load(name):
    model = OPTForCausalLM.from_pretrained(os.path.join(FIXTURES, name), torch_dtype=torch.float32)
    model.eval()
    stats, products = [], []
    for layer in model.model.decoder.layers:
        attn = layer.self_attn
        for owner, attr in ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"),
                            (attn, "out_proj"), (layer, "fc1"), (layer, "fc2")):
            p = Product(getattr(owner, attr), stats)
            setattr(owner, attr, p)
            products.append(p)
    with open(os.path.join(FIXTURES, name, "prompts.txt")) as f:
        prompts = [[int(t) for t in line.split()] for line in f if line.strip()]
    return model, products, stats, prompts


def run(model, products, prompts, scheme, remedy, threshold):
    for p in products:
        p.scheme, p.remedy, p.threshold = scheme, remedy, threshold
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in prompts]


def rel_rms(a, b):
    diff = sum(float(((x - y) ** 2).sum()) for x, y in zip(a, b))
    norm = sum(float((y**2).sum()) for y in b)
    return (diff / norm) ** 0.5


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threshold", type=float, default=6.0,
                    help="a column is an outlier where its largest |x| exceeds this many times "
                         "the mean of the columns' largest (default 6)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"threshold {args.threshold}; relative RMS of the logits from fp32 products of the "
          "same 4-bit weights, every position of every prompt")
    for name in ("opt-tiny", "opt-outlier"):
        model, products, stats, prompts = load(name)
        fp32 = run(model, products, prompts, "fp32", False, args.threshold)
        for scheme in ("prefill", "decode"):
            plain = rel_rms(run(model, products, prompts, scheme, False, args.threshold), fp32)
            stats.clear()
            kept = rel_rms(run(model, products, prompts, scheme, True, args.threshold), fp32)
            taken = sum(stats) / len(stats)
            print(f"{name:12s} {scheme:8s} scheme: {plain:.4f}; with the outlier columns in fp32: "
                  f"{kept:.4f} ({taken:.2f} columns a product on average, max {max(stats)})")


if __name__ == "__main__":
    main()
