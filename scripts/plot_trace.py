#!/usr/bin/env python3
"""Draws a window of a --trace file (Chrome trace events) as one lane per thread: compute and
the two I/O links, so the overlap of Fig. 4 can be seen; a pipeline's trace has these lanes for
each stage (one process each), stage by stage. Needs matplotlib.

usage: plot_trace.py TRACE.json OUT.png [--from SECONDS] [--span SECONDS] [--title TEXT]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"decoder layer": "#4c72b0", "input embedding": "#8172b2", "output embedding": "#8172b2",
          "read weights": "#dd8452", "load weights": "#55a868", "read cache": "#c44e52",
          "load cache": "#da8bc3", "store cache": "#937860", "write cache": "#8c8c8c",
          "read activations": "#ccb974", "load activations": "#64b5cd",
          "store activations": "#64b5cd", "write activations": "#ccb974"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--from", dest="start", type=float, default=None)
    ap.add_argument("--span", type=float, default=None)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    events = json.load(open(a.trace))["traceEvents"]
    stages = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("name") == "thread_name"}
    lanes = sorted(threads)  # (stage, thread): a lane each, in stage order
    row = {lane: i for i, lane in enumerate(lanes)}
    spans = [e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in row]
    t0 = a.start if a.start is not None else min(e["ts"] for e in spans) / 1e6
    t1 = t0 + a.span if a.span else max(e["ts"] + e["dur"] for e in spans) / 1e6
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.4 * len(lanes)))
    seen = set()
    for e in spans:
        s, d = e["ts"] / 1e6, e["dur"] / 1e6
        if s + d < t0 or s > t1:
            continue
        label = e["name"] if e["name"] not in seen else None
        seen.add(e["name"])
        ax.broken_barh([(s - t0, d)], (row[(e["pid"], e["tid"])] - 0.4, 0.8),
                       color=COLORS.get(e["name"], "#999"), label=label)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([threads[lane] if len(stages) < 2 else
                        "%s: %s" % (stages.get(lane[0], lane[0]), threads[lane]) for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("seconds")
    ax.set_title(a.title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
