#!/usr/bin/env python3
"""Writes tests/fixtures/sampling/top_p.json: for rows of logits with tied values at the nucleus's
edge, the tokens HF transformers' warpers leave a draw to, at several temperatures and top-p.

Each case: "logits" (a row), "temperature", "top_p", and "kept": the ids whose score is finite
after TemperatureLogitsWarper then TopPLogitsWarper (min_tokens_to_keep 1), as generate() applies
them before its draw. Among tokens of equal probability at the edge, the warper keeps those it
sorted last (torch.sort ascending, ties in id order): the higher ids. The rows are exact in fp32
(powers of two and small integers), so that ties are ties in both programs.
Deterministic: running it again gives an identical file.

Needs torch and transformers (5.24 wrote the committed file), e.g. in a virtual environment:
    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers
    /tmp/hfvenv/bin/python scripts/make_sampling_fixture.py [--output FILE]
"""
import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "sampling", "top_p.json")

ROWS = [
    [0.0, 1.0, 1.0, 1.0, 1.0, -2.0],          # four tied on top (ids 1 .. 4)
    [3.0, 1.0, 3.0, 2.0, 2.0, 2.0, 0.5],      # two tied on top, then three tied
    [-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0],
    [2.0, 0.5, 1.0, -1.0, 1.9],               # no ties
]
TOP_P = [1e-9, 0.25, 0.3, 0.5, 0.6, 0.75, 0.8, 0.95]
TEMPERATURES = [1.0, 0.5]


def kept(row, temperature, top_p):
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = torch.tensor([row], dtype=torch.float32)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores)
    return [i for i, s in enumerate(scores[0].tolist()) if s != float("-inf")]


def main():
    ap = argparse.ArgumentParser(description="Writes tests/fixtures/sampling/top_p.json from HF transformers' "
                                             "top-p warper.")
    ap.add_argument("--output", default=OUT, help="the file to write [tests/fixtures/sampling/top_p.json]")
    out = ap.parse_args().output
    import transformers

    cases = [{"logits": row, "temperature": t, "top_p": p, "kept": kept(row, t, p)}
             for row in ROWS for t in TEMPERATURES for p in TOP_P]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"transformers": transformers.__version__, "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"{out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
