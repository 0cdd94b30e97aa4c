#!/usr/bin/env python3
"""The latency-throughput frontier of the paper's Fig. 1, from the policy search.

For each bound on a block's latency (--max-latency, log-spaced), `flexgen policy --json` gives
the best policy the cost model finds and its predicted throughput; the points trace the frontier.
Two panels: the paper's T4 setup (hardware/t4-flexgen.json, 16 GB GPU, 208 GB CPU, 1.5 TB disk,
s = 512, n = 32) for OPT-30B and OPT-175B, and this machine (a hardware file from `flexgen
profile`) for opt-1.3b at s = 64, n = 8, with the predicted and measured points of
scripts/bench_policy.sh (its $OUT directory) beside it.

usage: plot_frontier.py --hw THIS_MACHINE.json --bench BENCH_OUT_DIR --out PNG [--bin ./flexgen]
                        [--path DIR]      (DIR: the dummy weights' directory [~/.cache/flexgen])
Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import glob
import json
import os
import subprocess
import sys


def search(binary, hw, model, s, n, extra, max_latency=None):
    """flexgen policy's --json, or (None, its error) where it refuses or fails."""
    cmd = [binary, "policy", "--json", "--hw", hw, "--model", model, "--prompt-len", str(s),
           "--gen-len", str(n)] + extra
    if max_latency:
        cmd += ["--max-latency", "%g" % max_latency]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"plot_frontier.py: cannot run {binary}: {e}")
    if r.returncode != 0:
        return None, f"{' '.join(cmd)}: {r.stderr.strip()}"
    return json.loads(r.stdout), ""


def frontier(binary, hw, model, s, n, extra):
    best, error = search(binary, hw, model, s, n, extra)
    if best is None:  # no policy at all: the search's own error says why
        sys.exit(f"plot_frontier.py: {error}")
    points, lat = [], best["block_latency"]
    # from the unbounded optimum's latency down, until nothing fits
    for _ in range(40):
        d, _ = search(binary, hw, model, s, n, extra, lat)
        if not d:  # nothing fits a tighter bound: the frontier ends
            break
        points.append((d["block_latency"], d["predicted_throughput"]))
        lat = d["block_latency"] / 1.5
    return sorted(points)


def main():
    ap = argparse.ArgumentParser(description="The latency-throughput frontier of the paper's Fig. 1.")
    ap.add_argument("--hw", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bin", default="./flexgen")
    ap.add_argument("--path", default=os.path.expanduser("~/.cache/flexgen"))
    a = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_frontier.py: matplotlib is missing (Debian: apt-get install python3-matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (t4, cpu) = plt.subplots(1, 2, figsize=(12, 4.5))
    t4_caps = ["--gpu-mem", "16G", "--cpu-mem", "208G", "--disk-mem", "1500G"]
    for model, extra, style in [("opt-30b", [], "C0-"), ("opt-175b", [], "C1-"),
                                ("opt-175b", ["--compress-weight", "--compress-cache"], "C1--")]:
        pts = frontier(a.bin, "hardware/t4-flexgen.json", model, 512, 32, t4_caps + extra)
        label = model + (" (4-bit)" if extra else "")
        t4.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=label)
    t4.set(xscale="log", yscale="log", xlabel="block latency (s)", ylabel="throughput (token/s)",
           title="predicted: the paper's T4 setup, s = 512, n = 32")
    t4.legend()
    pts = frontier(a.bin, a.hw, "opt-1.3b", 64, 8, ["--path", a.path])
    cpu.plot([p[0] for p in pts], [p[1] for p in pts], "C0-", marker=".", label="frontier (predicted)")
    for f in sorted(glob.glob(os.path.join(a.bench, "*.predicted.json"))):
        name = os.path.basename(f)[: -len(".predicted.json")]
        run = f[: -len(".predicted.json")] + ".json"
        try:
            p, m = json.load(open(f)), json.load(open(run))
        except (OSError, ValueError):  # a run still going, or missing
            continue
        if m["model"] != "opt-1.3b":
            continue
        cpu.plot([p["block_latency"], m["total_latency"]], [p["predicted_throughput"], m["total_throughput"]],
                 "k:", lw=0.8)
        cpu.plot(p["block_latency"], p["predicted_throughput"], "o", mfc="none", mec="C1")
        cpu.plot(m["total_latency"], m["total_throughput"], "s", color="C2")
        cpu.annotate(name, (m["total_latency"], m["total_throughput"]), fontsize=7,
                     xytext=(3, 3), textcoords="offset points")
    cpu.plot([], [], "o", mfc="none", mec="C1", label="a policy, predicted")
    cpu.plot([], [], "s", color="C2", label="the same, measured")
    cpu.set(xscale="log", yscale="log", xlabel="block latency (s)", ylabel="throughput (token/s)",
            title="this machine (CPU backend): opt-1.3b, s = 64, n = 8")
    cpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
