#!/usr/bin/env python3
"""The Python side of scripts/bench_peers.sh: checkpoints, prompts, the peers' runs, the table.

Subcommands (scripts/bench_peers.sh calls them; each can be run by hand):

  checkpoint   an HF OPT checkpoint with random weights from a fixed seed: OPTForCausalLM built from
               the model's real OPTConfig fields (scripts/bench_pytorch.py's MODELS table), cast to
               float16 and saved with save_pretrained(safe_serialization=True), so config.json and
               model.safetensors; no tokenizer
  prompts      --batch lines of --prompt-len space-separated token ids: 2 (BOS), then random ids in
               [3, 50000) from a fixed seed (./flexgen --prompt-ids reads this file)
  convert-ct2  the checkpoint converted to a CTranslate2 model (float32 or int8 weights) with
               ctranslate2's TransformersConverter; the checkpoint has no tokenizer, so the
               vocabulary given to the converter names token i "i" (ids 0-3 by OPT's special
               tokens <s> <pad> </s> <unk>)
  ct2          one timed CTranslate2 generation on the CPU
  pytorch      one timed transformers OPTForCausalLM generation (eager, fp32) on the CPU
  argmax       the greedy tokens of a ./flexgen --dump-logits file
  meta         the benchmark run's settings and machine, as a results line
  record       one engine run (its JSON line and /usr/bin/time's peak RSS) as a results line
  agreement    the share of generated tokens equal to PyTorch's, as results lines
  table        the markdown table of one benchmark run's results lines

Every engine run prints one JSON line with ./flexgen --json's throughput keys and FlexGen's
definitions, for B prompts of P tokens and G generated tokens each:

  prefill_throughput = B * P / prefill_latency         (the prompts' forward and the first token)
  decode_throughput  = B * (G - 1) / decode_latency    (the remaining G - 1 tokens)
  total_throughput   = B * G / (prefill_latency + decode_latency)

Model loading, conversion and a short warm-up are not timed.

  ct2:     Generator(device="cpu", compute_type=..., intra_threads=--threads).generate_batch with
           include_prompt_in_result=False (the prompt but its last token is forwarded at once, and
           the decoding loop starts from the last one), greedy (sampling_topk=1, beam_size=1),
           min_length = max_length = G (with the prompt left out of the result, both count
           generated tokens only, so exactly G are made). A step callback stamps the time at
           which the first token of the batch is out: prefill_latency is the time up to there,
           decode_latency the rest of the call.
  pytorch: OPTForCausalLM.from_pretrained(checkpoint) in float32, eval(), torch.inference_mode(),
           torch.set_num_threads(--threads); prefill is one forward over the prompts with
           use_cache=True and the lm_head on the last position, then G - 1 greedy decode steps
           with past_key_values (scripts/bench_pytorch.py's step()).

  python scripts/bench_peers.py checkpoint --model opt-125m --out build/peers/opt-125m-seed0
  python scripts/bench_peers.py prompts --batch 2 --prompt-len 16 --out build/peers/p.txt
  python scripts/bench_peers.py ct2 --ct2-model DIR --compute-type int8 --prompt-ids FILE \\
      --gen-len 4 --threads 1
"""
import argparse
import json
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pytorch import BOS, MAX_POSITIONS, MODELS, VOCAB, model_config  # noqa: E402

ENGINES = ("flexgen", "flexgen-4bit", "flexgen-int8", "flexgen-bf16", "ct2-fp32", "ct2-int8", "pytorch")
SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # OPT's ids 0..3
PROMPT_ID_END = 50000  # prompt ids are drawn from [3, PROMPT_ID_END)


def token_name(i):
    """The vocabulary entry of token id i in the converted CTranslate2 models."""
    return SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else str(i)


def read_prompt_ids(path):
    with open(path) as f:
        prompts = [[int(t) for t in line.split()] for line in f if line.strip()]
    if not prompts:
        sys.exit(f"bench_peers.py: no prompts in {path}")
    if len({len(p) for p in prompts}) != 1:
        sys.exit(f"bench_peers.py: the prompts in {path} differ in length (no padding is done)")
    return prompts


def throughputs(batch, prompt_len, gen_len, prefill, decode):
    total = prefill + decode
    return {
        "prefill_latency": prefill,
        "prefill_throughput": batch * prompt_len / max(prefill, 1e-10),
        "decode_latency": decode,
        "decode_throughput": batch * (gen_len - 1) / max(decode, 1e-10) if gen_len > 1 else 0.0,
        "total_latency": total,
        "total_throughput": batch * gen_len / max(total, 1e-10),
    }


def write_tokens(path, tokens):
    if path:
        with open(path, "w") as f:
            json.dump(tokens, f)


# ---- checkpoint, prompts, conversion ----

def cmd_checkpoint(a):
    import torch
    from transformers import OPTForCausalLM

    if os.path.exists(a.out):
        sys.exit(f"bench_peers.py: {a.out} exists")
    torch.manual_seed(a.seed)
    model = OPTForCausalLM(model_config(a.model)).half().eval()
    tmp = a.out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    os.rename(tmp, a.out)  # complete or absent
    n = sum(p.numel() for p in model.parameters())
    print(f"bench_peers.py: {a.out}: {a.model}, {n} parameters, float16, seed {a.seed}",
          file=sys.stderr)


def cmd_prompts(a):
    rng = random.Random(a.seed)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        for _ in range(a.batch):
            ids = [BOS] + [rng.randrange(3, PROMPT_ID_END) for _ in range(a.prompt_len - 1)]
            f.write(" ".join(map(str, ids)) + "\n")
    os.rename(tmp, a.out)


class IdVocabulary:
    """Stands in for the tokenizer the converter asks for: the token of id i is token_name(i)."""

    bos_token = token_name(2)
    eos_token = token_name(2)
    unk_token = token_name(3)

    def __init__(self, size):
        self.size = size

    def get_vocab(self):
        return {token_name(i): i for i in range(self.size)}


def cmd_convert_ct2(a):
    from ctranslate2.converters import TransformersConverter

    with open(os.path.join(a.checkpoint, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return IdVocabulary(vocab_size)

    if os.path.exists(a.out):
        sys.exit(f"bench_peers.py: {a.out} exists")
    tmp = a.out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    Converter(a.checkpoint).convert(tmp, quantization=a.quantization, force=True)
    os.rename(tmp, a.out)
    print(f"bench_peers.py: {a.out}: {a.checkpoint} as a CTranslate2 model, {a.quantization} "
          "weights", file=sys.stderr)


# ---- engine runs ----

def cmd_ct2(a):
    import ctranslate2

    prompts = read_prompt_ids(a.prompt_ids)
    batch, plen, glen = len(prompts), len(prompts[0]), a.gen_len
    gen = ctranslate2.Generator(a.ct2_model, device="cpu", compute_type=a.compute_type,
                                intra_threads=a.threads)
    start = [[token_name(i) for i in p] for p in prompts]
    opts = dict(include_prompt_in_result=False, beam_size=1, sampling_topk=1)

    # Warm-up, not timed: a short prompt and two tokens.
    gen.generate_batch([start[0][:8]], max_length=2, min_length=2, **opts)

    first = []

    def on_step(step):
        if not first:
            first.append(time.perf_counter())
        return False

    t0 = time.perf_counter()
    res = gen.generate_batch(start, max_length=glen, min_length=glen, callback=on_step, **opts)
    t2 = time.perf_counter()
    tokens = [r.sequences_ids[0] for r in res]
    if any(len(t) != glen for t in tokens):
        sys.exit(f"bench_peers.py: CTranslate2 generated {sorted({len(t) for t in tokens})} "
                 f"tokens, not {glen}")
    t1 = first[0]
    out = {"impl": "ct2-" + a.compute_type, "compute_type": a.compute_type, "num_prompts": batch,
           "prompt_len": plen, "gen_len": glen, "threads": a.threads,
           "ctranslate2_version": ctranslate2.__version__}
    out.update(throughputs(batch, plen, glen, t1 - t0, t2 - t1))
    write_tokens(a.tokens_out, tokens)
    print(json.dumps(out), flush=True)


def cmd_pytorch(a):
    import torch
    import transformers
    from transformers import OPTForCausalLM

    from bench_pytorch import step

    torch.set_num_threads(a.threads)
    prompts = read_prompt_ids(a.prompt_ids)
    batch, plen, glen = len(prompts), len(prompts[0]), a.gen_len
    # transformers 5 names the argument dtype; 4.x named it torch_dtype.
    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    model = OPTForCausalLM.from_pretrained(a.checkpoint, **kw).float().eval()
    ids = torch.tensor(prompts, dtype=torch.long)

    with torch.inference_mode():
        # Warm-up, not timed: a short prefill and one decode step.
        tok, past = step(model, ids[:1, :8], None)
        step(model, tok, past)
        del tok, past

        out_toks = []
        t0 = time.perf_counter()
        tok, past = step(model, ids, None)
        t1 = time.perf_counter()
        out_toks.append(tok)
        for _ in range(glen - 1):
            tok, past = step(model, tok, past)
            out_toks.append(tok)
        t2 = time.perf_counter()

    tokens = torch.cat(out_toks, dim=1).tolist()
    out = {"impl": "pytorch", "num_prompts": batch, "prompt_len": plen, "gen_len": glen,
           "threads": a.threads, "torch_version": torch.__version__,
           "transformers_version": transformers.__version__}
    out.update(throughputs(batch, plen, glen, t1 - t0, t2 - t1))
    write_tokens(a.tokens_out, tokens)
    print(json.dumps(out), flush=True)


def cmd_argmax(a):
    import numpy as np

    logits = np.fromfile(a.logits, dtype=np.float32)
    per_prompt = a.gen_len * VOCAB
    if logits.size == 0 or logits.size % per_prompt:
        sys.exit(f"bench_peers.py: {a.logits} holds {logits.size} floats, not a multiple of "
                 f"gen_len * vocab = {per_prompt}")
    tokens = logits.reshape(-1, a.gen_len, VOCAB).argmax(axis=-1).tolist()
    write_tokens(a.out, tokens)


# ---- results ----

def parse_config(cfg):
    model, b, p, g = cfg.split(":")
    return model, int(b), int(p), int(g)


def cmd_meta(a):
    import platform
    import subprocess

    def git(*args):
        r = subprocess.run(["git", *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), None)
    except OSError:
        pass
    rec = {"kind": "meta", "run_id": a.run_id, "configs": a.configs.split(),
           "engines": a.engines.split(), "rounds": a.rounds, "threads": a.threads,
           "seed": a.seed, "git_commit": git("rev-parse", "HEAD"),
           "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
           "cpu": cpu, "nproc": os.cpu_count(), "machine": platform.machine(),
           "python": platform.python_version(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "held_to": {k: os.environ[k] for k in ("FLEXGEN_TEST_CPU", "FLEXGEN_ISA", "ONEDNN_MAX_CPU_ISA",
                                                  "OPENBLAS_CORETYPE", "CT2_FORCE_CPU_ISA",
                                                  "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
                       if k in os.environ}}
    with open(a.results, "a") as f:
        f.write(json.dumps(rec) + "\n")


def cmd_record(a):
    text = sys.stdin.read().strip().splitlines()
    if not text:
        sys.exit(f"bench_peers.py: [{a.config}] {a.engine} printed no JSON line")
    data = json.loads(text[-1])
    with open(a.time_file) as f:
        kb = f.read().strip().splitlines()
    if not kb or not kb[-1].strip().isdigit():
        sys.exit(f"bench_peers.py: no peak RSS in {a.time_file} (/usr/bin/time -f %M)")
    model, b, p, g = parse_config(a.config)
    got = (data.get("num_prompts"), data.get("prompt_len"), data.get("gen_len"))
    if got != (b, p, g):
        sys.exit(f"bench_peers.py: [{a.config}] {a.engine} ran {got} (prompts, prompt_len, "
                 f"gen_len), not {(b, p, g)}")
    rec = {"kind": "run", "run_id": a.run_id, "config": a.config, "model": model, "batch": b,
           "prompt_len": p, "gen_len": g, "threads": a.threads, "round": a.round,
           "engine": a.engine, "max_rss_bytes": int(kb[-1]) * 1024, "data": data}
    line = json.dumps(rec)
    for path in (a.results, a.run_file):
        with open(path, "a") as f:
            f.write(line + "\n")
    print("%-13s total %9.1f  decode %9.1f  prefill %9.1f tok/s  peak RSS %7.1f MiB" % (
        a.engine, data["total_throughput"], data["decode_throughput"],
        data["prefill_throughput"], rec["max_rss_bytes"] / 2**20), file=sys.stderr)


def cmd_agreement(a):
    def load(path):
        with open(path) as f:
            return json.load(f)

    ref = load(a.reference)
    with open(a.results, "a") as res, open(a.run_file, "a") as run:
        for spec in a.engines:
            engine, path = spec.split("=", 1)
            toks = load(path)
            if len(toks) != len(ref) or any(len(x) != len(y) for x, y in zip(toks, ref)):
                sys.exit(f"bench_peers.py: [{a.config}] {engine}'s tokens have another shape "
                         "than PyTorch's")
            n = sum(len(y) for y in ref)
            same = sum(u == v for x, y in zip(toks, ref) for u, v in zip(x, y))
            whole = sum(x == y for x, y in zip(toks, ref))
            rec = {"kind": "agreement", "run_id": a.run_id, "config": a.config, "engine": engine,
                   "reference": "pytorch", "tokens": n, "same_tokens": same,
                   "same_share": same / n, "same_sequences": whole, "sequences": len(ref)}
            line = json.dumps(rec)
            res.write(line + "\n")
            run.write(line + "\n")


def cmd_table(a):
    with open(a.run_file) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    runs = [r for r in recs if r["kind"] == "run"]
    if not runs:
        sys.exit(f"bench_peers.py: {a.run_file} holds no run to tabulate")
    agree = {(r["config"], r["engine"]): r for r in recs if r["kind"] == "agreement"}
    configs = list(dict.fromkeys(r["config"] for r in runs))
    engines = [e for e in ENGINES if any(r["engine"] == e for r in runs)]
    metrics = (("total tok/s", lambda r: r["data"]["total_throughput"], "%.1f"),
               ("decode tok/s", lambda r: r["data"]["decode_throughput"], "%.1f"),
               ("prefill tok/s", lambda r: r["data"]["prefill_throughput"], "%.1f"),
               ("peak RSS MiB", lambda r: r["max_rss_bytes"] / 2**20, "%.0f"))
    rounds = max(r["round"] for r in runs)

    print("| configuration | metric | " + " | ".join(engines) + " |")
    print("|---|---|" + "---:|" * len(engines))
    worst = (0.0, None)
    summaries = []
    for cfg in configs:
        model, b, p, g = parse_config(cfg)
        label = f"{model} b{b} p{p} g{g}"
        summary = {"kind": "summary", "run_id": a.run_id, "config": cfg, "rounds": rounds,
                   "first_round": {}, "spread": {}}
        for name, get, fmt in metrics:
            cells = []
            for e in engines:
                mine = sorted((r for r in runs if r["config"] == cfg and r["engine"] == e),
                              key=lambda r: r["round"])
                if not mine:
                    cells.append("n/a")
                    continue
                vals = [get(r) for r in mine]
                spread = (max(vals) - min(vals)) / min(vals) if min(vals) > 0 else 0.0
                summary["first_round"].setdefault(e, {})[name] = vals[0]
                summary["spread"].setdefault(e, {})[name] = spread
                cell = fmt % vals[0]
                if len(vals) > 1:
                    cell += " (%.0f%%)" % (100 * spread)
                    if spread > worst[0]:
                        worst = (spread, f"{label}, {e}, {name}")
                cells.append(cell)
            print(f"| {label} | {name} | " + " | ".join(cells) + " |")
        if any((cfg, e) in agree for e in engines):
            cells = []
            for e in engines:
                r = agree.get((cfg, e))
                if e == "pytorch":
                    cells.append("(reference)")
                else:
                    cells.append("n/a" if r is None else "%.0f%%" % (100 * r["same_share"]))
            print(f"| {label} | tokens = pytorch | " + " | ".join(cells) + " |")
        summaries.append(summary)
    print()
    if rounds > 1:
        print("Each cell is the first round's number; in parentheses the spread between the %d "
              "rounds, (max - min) / min. Largest spread: %.1f%% (%s)."
              % (rounds, 100 * worst[0], worst[1] or "none"))
    else:
        print("One round: the numbers are that round's.")
    if agree:
        print("tokens = pytorch: the share of generated tokens (position by position) equal to "
              "PyTorch's greedy tokens.")
    with open(a.results, "a") as f:
        for s in summaries:
            f.write(json.dumps(s) + "\n")


# ---- command line ----

def positive(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("checkpoint", help="an HF OPT checkpoint with random float16 weights")
    s.add_argument("--model", required=True, choices=sorted(MODELS))
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)

    s = sub.add_parser("prompts", help="a --prompt-ids file of random prompts")
    s.add_argument("--batch", type=positive, required=True)
    s.add_argument("--prompt-len", type=positive, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)

    s = sub.add_parser("convert-ct2", help="the checkpoint as a CTranslate2 model")
    s.add_argument("--checkpoint", required=True)
    s.add_argument("--quantization", required=True, choices=("float32", "int8"))
    s.add_argument("--out", required=True)

    for name in ("ct2", "pytorch"):
        s = sub.add_parser(name, help=f"one timed {name} run; prints a JSON line")
        if name == "ct2":
            s.add_argument("--ct2-model", required=True, help="a converted CTranslate2 model")
            s.add_argument("--compute-type", required=True, choices=("float32", "int8"))
        else:
            s.add_argument("--checkpoint", required=True, help="the HF checkpoint directory")
        s.add_argument("--prompt-ids", required=True)
        s.add_argument("--gen-len", type=positive, required=True)
        s.add_argument("--threads", type=positive, required=True)
        s.add_argument("--tokens-out", help="write the generated token ids here (JSON)")

    s = sub.add_parser("argmax", help="greedy tokens of a ./flexgen --dump-logits file")
    s.add_argument("--logits", required=True)
    s.add_argument("--gen-len", type=positive, required=True)
    s.add_argument("--out", required=True)

    s = sub.add_parser("meta", help="the run's settings and machine as a results line")
    for k in ("run-id", "configs", "engines", "results"):
        s.add_argument("--" + k, required=True)
    s.add_argument("--rounds", type=positive, required=True)
    s.add_argument("--threads", type=positive, required=True)
    s.add_argument("--seed", type=int, required=True)

    s = sub.add_parser("record", help="an engine's JSON line (stdin) as a results line")
    for k in ("run-id", "config", "engine", "time-file", "results", "run-file"):
        s.add_argument("--" + k, required=True)
    s.add_argument("--round", type=positive, required=True)
    s.add_argument("--threads", type=positive, required=True)

    s = sub.add_parser("agreement", help="generated tokens against PyTorch's")
    for k in ("run-id", "config", "reference", "results", "run-file"):
        s.add_argument("--" + k, required=True)
    s.add_argument("engines", nargs="+", metavar="ENGINE=TOKENS_FILE")

    s = sub.add_parser("table", help="the markdown table of one run")
    for k in ("run-id", "run-file", "results"):
        s.add_argument("--" + k, required=True)

    a = p.parse_args(argv)
    if getattr(a, "prompt_len", None) and a.prompt_len > MAX_POSITIONS:
        p.error(f"--prompt-len must be <= {MAX_POSITIONS}")
    return a


def main(argv):
    a = parse_args(argv)
    {"checkpoint": cmd_checkpoint, "prompts": cmd_prompts, "convert-ct2": cmd_convert_ct2,
     "ct2": cmd_ct2, "pytorch": cmd_pytorch, "argmax": cmd_argmax, "meta": cmd_meta,
     "record": cmd_record,
     "agreement": cmd_agreement, "table": cmd_table}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
