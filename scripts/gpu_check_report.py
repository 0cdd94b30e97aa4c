#!/usr/bin/env python3
"""gpu_check_report.py OUT PROMPT_LEN: scripts/gpu_check.sh's markdown, from what its halves left in
OUT/.data: the machine, each check's result, the speed table (this project beside FlexGen, with the
counters of each run's busiest decode step and, on a card named below, the decode's share of the
weights' read limit and prefill's of the dense fp16 peak), one decode step's kernels by GPU time
and DRAM bytes read, one prefill layer's, ncu's sections on one decode launch of two kernels, and
the big half's rows (OPT-175B 4-bit) beside the cost model's predictions.

Usage: python3 scripts/gpu_check_report.py OUT PROMPT_LEN   (gpu_check.sh runs it)
"""
import csv
import json
import math
import os
import re
import sys

USAGE = "usage: python3 scripts/gpu_check_report.py OUT PROMPT_LEN"


def usage_error(line):
    print(f"gpu_check_report.py: {line}; {USAGE}", file=sys.stderr)
    sys.exit(2)


if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
    print(__doc__.strip())
    sys.exit(0)
if len(sys.argv) != 3 or not re.fullmatch(r"[1-9][0-9]*", sys.argv[2]):
    usage_error("expected OUT and a positive PROMPT_LEN")
out, prompt = sys.argv[1], int(sys.argv[2])
data = os.path.join(out, ".data")
if not os.path.isdir(data):
    usage_error(f"no {data}: OUT is not a directory scripts/gpu_check.sh wrote")

# Datasheet figures: HBM bandwidth (bytes/s) and dense fp16 tensor throughput (FLOP/s), by name.
CARDS = [("H200", 4.8e12, 989e12), ("H100 NVL", 3.9e12, 835e12), ("H100 PCIe", 2.0e12, 756e12),
         ("H100", 3.35e12, 989e12)]


def read(name):
    try:
        with open(os.path.join(data, name)) as f:
            return f.read()
    except OSError:
        return ""


def cell(text):
    return " ".join(text.split()).replace("|", "/")


def card():
    name = read("machine.md")
    return next(((n, bw, peak) for n, bw, peak in CARDS if n in name), None)


def run_of(text):
    """A run of this project's: its --json object, or the line saying why there is none."""
    try:
        return json.loads(text)
    except ValueError:
        return cell(text) or "not run"


def ours(row):
    return run_of(read(row + ".json"))


def base(row):
    """The BASE checkout's run of a row (gpu_check.sh's BASE), or None where none ran."""
    text = read(row + ".base.json")
    return run_of(text) if text else None


def theirs(row):
    """FlexGen's run of a row: its prefill, decode and total throughput, or why there is none."""
    text = read(row + ".flexgen")
    if not text:
        return None
    found = [re.findall(r"%s throughput: ([0-9.]+) token/s" % k, text) for k in ("prefill", "decode", "total")]
    if not all(found):
        return cell(text.strip().splitlines()[-1]) if text.strip() else "no report"
    return tuple(float(f[-1]) for f in found)


def policy_of(m):
    p = "%d x %d, %s" % (m["gpu_batch_size"], m["num_gpu_batches"], " ".join(map(str, m["percent"])))
    flags = [f for f, key in (("--cpu-cache-compute", "cpu_cache_compute"), ("--compress-weight", "compress_weight"),
                              ("--compress-cache", "compress_cache")) if m.get(key)]
    if m.get("schedule") == "diagonal":
        flags.append("diagonal")
    if m.get("attn_sparsity", 1) < 1:
        flags.append("--attn-sparsity %g" % m["attn_sparsity"])
    return p + (" " + " ".join(flags) if flags else "")


def counters(m):
    most = m.get("device_counts", {}).get("decode_step_most")
    if not most:
        return "-"
    return "%d / %d / %d / %d / %d / %d" % (most["host_waits"], most["launches"], most.get("graph_launches", 0),
                                            most["blas_calls"], most.get("widened", 0), most["copies_in"])


def shares(m):
    """The decode's share of the weights' read limit and prefill's of the dense fp16 peak: fp16
    weights all on the gpu tier, one GPU batch (each decode step reads every weight once)."""
    c = card()
    if not c or m["percent"][0] != 100 or m["num_gpu_batches"] != 1 or m.get("compress_weight"):
        return "-", "-"
    steps = m["gen_len"] - 1
    if steps < 1 or m["decode_latency"] <= 0:
        return "-", "-"
    weights = m["model_size_bytes"]
    read_share = weights / c[1] / (m["decode_latency"] / steps)
    prefill_share = m["prefill_throughput"] * 2 * (weights / 2) / c[2]
    return "%.0f%%" % (100 * read_share), "%.0f%%" % (100 * prefill_share)


print("# GPU check\n")
print("Written by `scripts/gpu_check.sh`; each step's output is in the log it names beside this file.\n")
print(read("machine.md"))
print("## Checks\n")
print("| half | step | result | seconds | note |")
print("|---|---|---|---|---|")
for line in read("steps.tsv").splitlines():
    half, step, result, secs, note = (line.split("\t") + [""] * 5)[:5]
    print(f"| {half} | {step} | {result} | {secs} | {cell(note)} |")

rows = read("rows").split()
print(f"\n## Speed: dummy weights, prompt {prompt}, each side warmed up, same card, same run\n")
if not rows:
    print("Not run.")
else:
    print("Token/s as each program reports them (FlexGen's formulas). Counters: this project's busiest")
    print("decode step, host waits / kernel launches / graph launches (a layer's kernels each) / cuBLAS")
    print("products / 4-bit slices widened / copies to the device")
    print("(docs/GPU.md derives them). Read limit: the fp16 weights over the card's datasheet HBM")
    print("bandwidth, against a decode step's time; fp16 peak: prefill's 2 x parameters FLOPs a token")
    print("against the card's dense fp16 tensor peak.\n")
    print("| row | policy | program | prefill tok/s | decode tok/s | total tok/s | this / FlexGen, total, decode | "
          "counters | decode of read limit | prefill of fp16 peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        m, f = ours(row), theirs(row)
        if isinstance(m, str):
            print(f"| {row} | - | this | {m} | | | | | | |")
        else:
            read_share, peak_share = shares(m)
            ratio = "-"
            if isinstance(f, tuple) and f[2] > 0 and f[1] > 0:
                ratio = "%.2fx, %.2fx" % (m["total_throughput"] / f[2], m["decode_throughput"] / f[1])
            cold = " (cold run %.1f s)" % m["warmup_latency"] if "warmup_latency" in m else ""
            print(f"| {row} | {policy_of(m)}, gen {m['gen_len']} | this{cold} | {m['prefill_throughput']:.1f} | "
                  f"{m['decode_throughput']:.1f} | {m['total_throughput']:.1f} | {ratio} | {counters(m)} | "
                  f"{read_share} | {peak_share} |")
        if isinstance(f, tuple):
            print(f"| {row} | the same | FlexGen | {f[0]:.1f} | {f[1]:.1f} | {f[2]:.1f} | | | | |")
        elif f:
            print(f"| {row} | the same | FlexGen | {f} | | | | | | |")
        b = base(row)
        if isinstance(b, dict):
            ratio = "-"
            total, decode = b["total_throughput"], b["decode_throughput"]
            if isinstance(m, dict) and total > 0 and decode > 0:
                ratio = "this / base: %.2fx, %.2fx" % (m["total_throughput"] / total,
                                                      m["decode_throughput"] / decode)
            read_share, peak_share = shares(b)
            print(f"| {row} | the same | base | {b['prefill_throughput']:.1f} | {decode:.1f} | "
                  f"{total:.1f} | {ratio} | {counters(b)} | {read_share} | {peak_share} |")
        elif b:
            print(f"| {row} | the same | base | {b} | | | | | | |")

def kernel_window(name):
    """ncu's rows of the window (name.csv): {kernel: [ns, launches, bytes read]}, or None."""
    sums = {}
    try:
        with open(os.path.join(data, name + ".csv")) as f:
            lines = [line for line in f if line.startswith('"')]
        for r in csv.DictReader(lines):
            metric, unit = r.get("Metric Name"), r.get("Metric Unit", "")
            if metric not in ("gpu__time_duration.sum", "dram__bytes_read.sum"):
                continue
            kernel = r.get("Kernel Name", "?").split("(")[0]
            value = float(r.get("Metric Value", "0").replace(",", ""))
            entry = sums.setdefault(kernel, [0.0, 0, 0.0])
            if metric == "gpu__time_duration.sum":
                entry[0] += value * {"usecond": 1e3, "msecond": 1e6}.get(unit, 1)
                entry[1] += 1
            else:
                entry[2] += value * {"Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)
    except (OSError, ValueError):
        return None
    return sums or None


def kernel_table(window, per, unit, read_rate=None):
    """The window's 15 longest kernels, each's launches, time and bytes divided by `per` (decode
    steps, or layers) a `unit`; where read_rate is given (0: the card is not known), a column of the
    kernel's bytes over its time as a share of it."""
    total = sum(t for t, _, _ in window.values())
    rate_head, rate_rule = (" share of read rate |", "---|") if read_rate is not None else ("", "")
    print(f"| kernel | launches a {unit} | us a {unit} | share of time | MB read a {unit} |{rate_head}")
    print(f"|---|---|---|---|---|{rate_rule}")
    for kernel, (t, n, b) in sorted(window.items(), key=lambda kv: -kv[1][0])[:15]:
        rate = ""
        if read_rate is not None:
            rate = " %.0f%% |" % (100 * b / (t * 1e-9) / read_rate) if read_rate and t > 0 else " - |"
        print(f"| {cell(kernel)[:80]} | {n / per:.1f} | {t / per / 1e3:.1f} | {100 * t / total:.0f}% | "
              f"{b / per / 1e6:.1f} |{rate}")


LAYERS = 32  # opt-6.7b's: attention runs once a layer and decode step (its merge, where split)
# opt-6.7b's weights: 6.44e9 in its layers and 0.21e9 in lm_head, 2 bytes each in fp16 and 9/16 of
# one in 4-bit (a byte a pair of codes, and a group of 64's fp16 min and scale)
for name, weights, weight_mb, batch in (("kernels", "fp16", "13,300", 4), ("kernels-4bit", "4-bit", "3,740", 4),
                                        ("kernels-32x1", "fp16", "13,300", 32),
                                        ("kernels-4bit-32x1", "4-bit", "3,740", 32)):
    print(f"\n## One decode step's kernels by GPU time (opt-6.7b, {batch} x 1, all on the GPU, {weights} weights)\n")
    window = kernel_window(name)
    once = ("attention_merge_kernel", "attention_kernel", "attention_q4_kernel")  # one a layer
    attention = next((k for k in once if window and k in window), "attention_kernel")
    steps = window.get(attention, [0, 0, 0])[1] / LAYERS if window else 0
    if not steps:
        print(cell(read(name + ".txt")) or "Not measured (kernels.log says why).")
        continue
    total = sum(t for t, _, _ in window.values()) / steps
    read_bytes = sum(b for _, _, b in window.values()) / steps
    c = card()
    print(f"ncu's kernel times and DRAM bytes read over a window of {steps:.2f} decode steps ({attention}'s")
    print(f"launches over {LAYERS} layers), divided by the steps: {total / 1e3:.0f} us of kernels and")
    print(f"{read_bytes / 1e6:.0f} MB read a step; the weights the step needs are {weight_mb} MB ({weights}), its")
    # the window's decode steps come right after prefill: their context, the prompt and a few tokens
    ctx = prompt + math.ceil(steps)
    print(f"keys and values {batch} x {ctx} x 32 layers x 2 x 8 KB = {batch * ctx * 32 * 2 * 8192 / 1e6:,.0f} MB "
          f"at the window's last step (the prompt, {prompt}, and about {math.ceil(steps)} tokens).")
    print("Share: of the card's datasheet read rate, the kernel's bytes over its time.\n")
    kernel_table(window, steps, "step", c[1] if c else 0)

# opt-6.7b's products a prefill layer: 2 FLOPs a weight (12 h^2 of them, h = 4096) a token of
# 32 x 512
PREFILL_LAYER_FLOPS = 2 * 12 * 4096 ** 2 * 32 * 512
print("\n## One prefill layer's kernels by GPU time (opt-6.7b, 32 x 1, all on the GPU, fp16 weights)\n")
window = kernel_window("prefill-32x1")
layers = window.get("prefill_softmax_kernel", [0, 0, 0])[1] / 32 if window else 0  # 32 sequences
if not layers:
    print(cell(read("prefill-32x1.txt")) or "Not measured (kernels.log says why).")
else:
    total = sum(t for t, _, _ in window.values()) / layers
    products = sum(t for k, (t, _, _) in window.items() if "gemm" in k.lower() or "nvjet" in k or "xmma" in k) / layers
    c = card()
    m = ours("opt-6.7b-32x1")
    measured = f"; the row's whole prefill took {m['prefill_latency'] * 1e3:.0f} ms" if isinstance(m, dict) else ""
    rate = f", {PREFILL_LAYER_FLOPS / (products * 1e-9) / c[2]:.0%} of the card's dense fp16 peak" if c and products else ""
    print(f"ncu's kernel times and DRAM bytes read over a window of {layers:.2f} layers (prefill_softmax_kernel's")
    print(f"launches, one a sequence and layer), divided by the layers: {total / 1e3:.0f} us of kernels a layer, "
          f"{LAYERS * total / 1e6:.0f} ms over the {LAYERS} layers{measured}.")
    print(f"The products (cuBLAS's kernels) take {products / 1e3:.0f} us a layer for its "
          f"{PREFILL_LAYER_FLOPS / 1e12:.1f} TFLOP of weight products{rate} (attention's own products, about")
    print("2% more FLOPs, run among them).\n")
    kernel_table(window, layers, "layer")

print("\n## Why two kernels read below the card's rate (Nsight Compute's sections, one decode launch)\n")
for name, what in (("q4", "`q4_rows_kernel`, opt-6.7b's 4-bit products at 4 x 1"),
                   ("attention", "`attention_span_kernel`, opt-6.7b at 32 x 1")):
    text = read("stalls-" + name + ".txt").strip()
    print(f"{what}:\n")
    if not text.startswith("not measured") and "Section:" in text:
        print("```\n" + text + "\n```\n")
    else:
        print((cell(text.splitlines()[-1]) if text else "Not measured") + " (kernels.log says why).\n")



def predicted(name):
    """The cost model's prediction of a run (flexgen policy --evaluate's line), or why there is none."""
    text = read(name + ".predicted")
    found = re.findall(r"predicted: ([0-9.]+(?:e[-+]?[0-9]+)?) token/s", text)
    if found:
        return float(found[-1])
    return cell(text.strip().splitlines()[-1]) if text.strip() else "not predicted"


big = read("rows-big").split()
print("\n## Big: OPT-175B, 4-bit weights and cache, beside the cost model\n")
if not big:
    print("Not run.")
else:
    print("Measured total token/s (FlexGen's formula) beside the cost model's prediction of the same")
    print("run (`flexgen policy --evaluate`, this machine's profile), and the rows the speed half has no")
    print("time for.\n")
    print("| row | policy | prefill tok/s | decode tok/s | total tok/s | predicted total tok/s | counters |")
    print("|---|---|---|---|---|---|---|")
    for row in big:
        m, p = ours(row), predicted(row)
        p = ("%.3g" % p if isinstance(p, float) else p) if row.startswith("opt-175b") else "-"
        if isinstance(m, str):
            print(f"| {row} | - | {m} | | | {p} | |")
        else:
            print(f"| {row} | {policy_of(m)}, gen {m['gen_len']} | {m['prefill_throughput']:.2f} | "
                  f"{m['decode_throughput']:.2f} | {m['total_throughput']:.3f} | {p} | {counters(m)} |")
    print("\nThe paper's T4 setup (`hardware/t4-flexgen.json`, --gpu-mem 16G --cpu-mem 208G --disk-mem 1500G,")
    print("prompt 512, 32 tokens), the cost model's prediction beside Table 2's published figure:\n")
    print("| row | policy | published tok/s | predicted tok/s |")
    print("|---|---|---|---|")
    for name, policy, published in (("t4-fp16", "32 x 8, --percent 0 50 0 0 0 100 --cpu-cache-compute", 0.69),
                                    ("t4-4bit", "14 x 8, --percent 0 100 8 92 100 0, 4-bit weights and cache",
                                     1.12)):
        p = predicted(name)
        print(f"| OPT-175B {name[3:]} | {policy} | {published} | {'%.3f' % p if isinstance(p, float) else p} |")
