#!/usr/bin/env python3
"""gpu_check_report.py OUT PROMPT_LEN: scripts/gpu_check.sh's markdown, from what its halves left in
OUT/.data: the machine, each check's result, the speed table (this project beside FlexGen, with the
counters of each run's busiest decode step and, on a card named below, the decode's share of the
weights' read limit and prefill's of the dense fp16 peak) and one decode step's kernels by GPU time.
"""
import csv
import json
import os
import re
import sys

out, prompt = sys.argv[1], int(sys.argv[2])
data = os.path.join(out, ".data")

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


def ours(row):
    """This project's run of a row: its --json object, or the line saying why there is none."""
    text = read(row + ".json")
    try:
        return json.loads(text)
    except ValueError:
        return cell(text) or "not run"


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
    flags = [f for f, key in (("--cpu-cache-compute", "cpu_cache_compute"), ("--compress-weight", "compress_weight"))
             if m.get(key)]
    if m.get("schedule") == "diagonal":
        flags.append("diagonal")
    return p + (" " + " ".join(flags) if flags else "")


def counters(m):
    most = m.get("device_counts", {}).get("decode_step_most")
    if not most:
        return "-"
    return "%d / %d / %d / %d" % (most["host_waits"], most["launches"], most["blas_calls"], most["copies_in"])


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
    print("decode step, host waits / kernel launches / cuBLAS products / copies to the device")
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

print("\n## One decode step's kernels by GPU time (opt-6.7b, 4 x 1, all on the GPU)\n")


def kernel_window():
    """ncu's rows of the window (kernels.csv): {kernel: [ns, launches]}, or None."""
    sums = {}
    try:
        with open(os.path.join(data, "kernels.csv")) as f:
            lines = [line for line in f if line.startswith('"')]
        for r in csv.DictReader(lines):
            if r.get("Metric Name") != "gpu__time_duration.sum":
                continue
            name = r.get("Kernel Name", "?").split("(")[0]
            ns = float(r.get("Metric Value", "0").replace(",", ""))
            if r.get("Metric Unit") == "usecond":
                ns *= 1e3
            entry = sums.setdefault(name, [0.0, 0])
            entry[0] += ns
            entry[1] += 1
    except (OSError, ValueError):
        return None
    return sums or None


window = kernel_window()
LAYERS = 32  # opt-6.7b's: decode attention ends once a layer and step, in one of these
ATTENTION_ENDS = ("attention_kernel", "attention_merge_kernel")
steps = sum(window.get(k, [0, 0])[1] for k in ATTENTION_ENDS) / LAYERS if window else 0
if not steps:
    print(cell(read("kernels.txt")) or "Not measured (kernels.log says why).")
else:
    total = sum(t for t, _ in window.values()) / steps
    print(f"ncu's kernel times over a window of {steps:.2f} decode steps (attention's last")
    print(f"launches over {LAYERS} layers), divided by the steps: {total / 1e3:.0f} us of kernels")
    print("a step.\n")
    print("| kernel | launches a step | us a step | share |")
    print("|---|---|---|---|")
    for name, (t, n) in sorted(window.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"| {cell(name)[:80]} | {n / steps:.1f} | {t / steps / 1e3:.1f} | {100 * t / steps / total:.0f}% |")
