#!/usr/bin/env bash
# Side-by-side CPU benchmark: ./flexgen against eager PyTorch (transformers' OPT with a KV cache),
# dummy weights (fp16 weights read by fp32 products in ./flexgen, fp32 in PyTorch), plus this
# machine's sgemm rate and flexgen's peak RSS.
#
# Setting up the benchmark environment (Debian/Ubuntu, from the repository root):
#   apt-get install -y python3-venv python3-torch
#   /usr/bin/python3 -m venv --system-site-packages .venv && .venv/bin/pip install transformers==4.38.2
#
# Run from the repository root (it is also what `make bench` runs):
#   bash scripts/bench_cpu.sh [--rss] [--skip-rss] [--threads N] [--reps N] [--results FILE]
#                             [MODEL:BATCH:PROMPT_LEN:GEN_LEN ...]
#
# Environment (the flags and arguments above win over these):
#   CONFIGS     configurations, MODEL:BATCH:PROMPT_LEN:GEN_LEN separated by spaces
#               [opt-125m:32:128:32 opt-1.3b:8:128:32]
#   THREADS     OMP_NUM_THREADS for ./flexgen and sgemm_rate, --threads for PyTorch [nproc]
#   REPS        rounds of (flexgen, pytorch); the best run of each is kept [2]
#   SGEMM_REPS  repetitions of each sgemm_rate measurement (best of) [5]
#   RESULTS     JSON lines appended here [build/bench_results.jsonl]
#   RSS=1       only the peak-RSS run;  SKIP_RSS=1  no peak-RSS run
#   RSS_CONFIG  the peak-RSS run's configuration [opt-1.3b:8:128:32]
#   SEED        --seed of both [0]
#   VENV        the virtual environment with torch and transformers [.venv]
#
# For each configuration it measures the sgemm rate (scripts/sgemm_rate.c, built by make, best of
# SGEMM_REPS, on the OpenBLAS core ./flexgen runs on) at the prefill's dominant shape
# (M = batch*prompt_len, N = ffn = 4*hidden, K = hidden) and at the decode's (M = batch), before
# and after the runs (the higher of the two is used); runs ./flexgen --json and
# scripts/bench_pytorch.py alternately REPS times (so both face the same machine conditions),
# keeping the best (highest total throughput) run of each; and reports, with ./flexgen's OpenBLAS
# core (--json's blas_core) and the targets:
#   ratio        flexgen / pytorch total throughput                                  (>= 2)
#   prefill %    prefill matmul GFLOP/s / the prefill-shape sgemm rate               (>= 60%)
#   step/mm      decode step time (decode_latency / (gen_len-1)) / the time its matmul FLOPs
#                take at the prefill-shape sgemm rate                               (<= 1.5x)
#                (also shown at the decode-shape rate, for context)
# with matmul FLOPs (2 per multiply-add; attention's QK^T and PV are not counted):
#   prefill  2*B*P*L*(4h^2 + 2h*ffn) + 2*B*vocab*word_dim   (+ 2*B*P*word_dim*h project_in and
#            2*B*h*word_dim project_out for opt-350m; the lm_head runs on the last token only)
#   step     2*B*(L*(4h^2 + 2h*ffn) + vocab*word_dim)       (+ both projections for opt-350m)
# Then (unless SKIP_RSS=1) it runs `/usr/bin/time -v ./flexgen` on RSS_CONFIG and sets its
# "Maximum resident set size" against the budget
#   1.1 * (2 bytes * params + KV cache) + 300 MiB,  KV cache = 2 * 2 bytes * L * B * (P+G) * h
# (fp16 weights, as the CPU backend holds them).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

die() {
    echo "bench_cpu.sh: $*" >&2
    exit 1
}
log() { echo "bench_cpu.sh: $*" >&2; }
usage_error() {
    echo "bench_cpu.sh: $*" >&2
    exit 2
}

usage() {
    sed -n '/^# Run from/,/^#$/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    echo "see the comment at the top of scripts/bench_cpu.sh for the environment variables"
}

CONFIGS="${CONFIGS:-opt-125m:32:128:32 opt-1.3b:8:128:32}"
THREADS="${THREADS:-$(nproc)}"
REPS="${REPS:-2}"
SGEMM_REPS="${SGEMM_REPS:-5}"
RESULTS="${RESULTS:-build/bench_results.jsonl}"
RSS="${RSS:-0}"
SKIP_RSS="${SKIP_RSS:-0}"
RSS_CONFIG="${RSS_CONFIG:-opt-1.3b:8:128:32}"
SEED="${SEED:-0}"

positional=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rss) RSS=1 ;;
        --skip-rss) SKIP_RSS=1 ;;
        --threads) [ $# -ge 2 ] || usage_error "--threads needs a value"; THREADS="$2"; shift ;;
        --reps) [ $# -ge 2 ] || usage_error "--reps needs a value"; REPS="$2"; shift ;;
        --results) [ $# -ge 2 ] || usage_error "--results needs a value"; RESULTS="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) usage_error "unknown option '$1' (try --help)" ;;
        *) positional+=("$1") ;;
    esac
    shift
done
[ ${#positional[@]} -gt 0 ] && CONFIGS="${positional[*]}"

is_pos_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_pos_int "$THREADS" || usage_error "THREADS must be a positive integer, got '$THREADS'"
is_pos_int "$REPS" || usage_error "REPS must be a positive integer, got '$REPS'"
is_pos_int "$SGEMM_REPS" || usage_error "SGEMM_REPS must be a positive integer, got '$SGEMM_REPS'"
[[ "$SEED" =~ ^[0-9]+$ ]] || usage_error "SEED must be a non-negative integer, got '$SEED'"
check_config() {
    [[ "$1" =~ ^[A-Za-z0-9._-]+:[1-9][0-9]*:[1-9][0-9]*:[1-9][0-9]*$ ]] ||
        usage_error "bad configuration '$1': expected MODEL:BATCH:PROMPT_LEN:GEN_LEN, e.g. opt-125m:32:128:32"
}
for cfg in $CONFIGS; do check_config "$cfg"; done
check_config "$RSS_CONFIG"

# ---- Python: the venv (torch, transformers) for the PyTorch runs and for the arithmetic ----
VENV="${VENV:-.venv}"
SETUP_HINT="set up the benchmark environment (see the top of scripts/bench_cpu.sh):
  apt-get install -y python3-venv python3-torch
  /usr/bin/python3 -m venv --system-site-packages .venv && .venv/bin/pip install transformers==4.38.2
or point VENV at an environment that has torch and transformers"
PY="$VENV/bin/python"
if [ "$RSS" = 1 ]; then
    # The peak-RSS run needs no torch: any Python 3 does the arithmetic.
    [ -x "$PY" ] || PY="$(command -v python3 || true)"
    [ -n "$PY" ] || die "no Python 3 found (VENV=$VENV has none, and python3 is not on PATH)"
else
    [ -x "$PY" ] || die "no virtual environment at VENV=$VENV ($PY is missing); $SETUP_HINT"
    "$PY" -c 'import torch, transformers' 2>/dev/null ||
        die "torch or transformers is missing from VENV=$VENV; $SETUP_HINT"
fi

# The arithmetic, in one place; the model dims come from scripts/bench_pytorch.py's table.
CALC_PY='
import json, re, sys
sys.path.insert(0, "scripts")
from bench_pytorch import MODELS, VOCAB

def dims(model):
    if model not in MODELS:
        sys.exit("bench_cpu.sh: unknown model %r (known: %s)" % (model, ", ".join(MODELS)))
    L, h, heads, ffn, wd, ln_before = MODELS[model]
    return L, h, ffn, wd, ln_before

def matmul_flops(model, B, P):
    """(prefill, one decode step) matmul FLOPs, 2 per multiply-add."""
    L, h, ffn, wd, _ = dims(model)
    layer = 4 * h * h + 2 * h * ffn
    proj = wd * h if wd != h else 0  # project_in / project_out (opt-350m)
    prefill = 2 * B * P * (L * layer + proj) + 2 * B * (VOCAB * wd + proj)
    step = 2 * B * (L * layer + 2 * proj + VOCAB * wd)
    return prefill, step

def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]

def cmd_dims(model):
    L, h, ffn, wd, _ = dims(model)
    print(L, h, ffn, wd)

def cmd_summary(run_id, cfg, threads, fg_path, pt_path, sgp_path, sgd_path, results, out):
    model, B, P, G = cfg.split(":")
    B, P, G, threads = int(B), int(P), int(G), int(threads)
    fg_runs, pt_runs = read_jsonl(fg_path), read_jsonl(pt_path)
    sgp_runs, sgd_runs = read_jsonl(sgp_path), read_jsonl(sgd_path)
    sg_pre = max(sgp_runs, key=lambda r: r["gflops"])
    sg_dec = max(sgd_runs, key=lambda r: r["gflops"])
    for r in fg_runs:
        if r.get("num_prompts") != B or r.get("prompt_len") != P or r.get("gen_len") != G:
            sys.exit("bench_cpu.sh: flexgen ran another configuration than %s: %s" % (cfg, r))
    fg = max(fg_runs, key=lambda r: r["total_throughput"])
    pt = max(pt_runs, key=lambda r: r["total_throughput"])
    pre_flops, step_flops = matmul_flops(model, B, P)
    rate_pre, rate_dec = sg_pre["gflops"] * 1e9, sg_dec["gflops"] * 1e9

    def prefill_gflops(run):
        return pre_flops / run["prefill_latency"] / 1e9
    def step_s(run):
        return run["decode_latency"] / (G - 1) if G > 1 else None

    mm_pre, mm_dec = step_flops / rate_pre, step_flops / rate_dec
    s = {
        "kind": "summary", "run_id": run_id, "config": cfg, "model": model, "batch": B,
        "prompt_len": P, "gen_len": G, "threads": threads,
        "flexgen_total_throughput": fg["total_throughput"],
        "pytorch_total_throughput": pt["total_throughput"],
        "throughput_ratio": fg["total_throughput"] / pt["total_throughput"],
        "sgemm_prefill_shape_gflops": sg_pre["gflops"],
        "sgemm_decode_shape_gflops": sg_dec["gflops"],
        "prefill_matmul_flops": pre_flops,
        "flexgen_prefill_gflops": prefill_gflops(fg),
        "flexgen_prefill_frac_of_sgemm": prefill_gflops(fg) / sg_pre["gflops"],
        "pytorch_prefill_gflops": prefill_gflops(pt),
        "pytorch_prefill_frac_of_sgemm": prefill_gflops(pt) / sg_pre["gflops"],
        "decode_step_matmul_flops": step_flops,
        "decode_step_matmul_s_at_prefill_rate": mm_pre,
        "decode_step_matmul_s_at_decode_rate": mm_dec,
        "flexgen_decode_step_s": step_s(fg),
        "pytorch_decode_step_s": step_s(pt),
        "flexgen_step_over_matmul": step_s(fg) / mm_pre if G > 1 else None,
        "flexgen_step_over_matmul_decode_rate": step_s(fg) / mm_dec if G > 1 else None,
        "targets": {"throughput_ratio": ">= 2", "flexgen_prefill_frac_of_sgemm": ">= 0.60",
                    "flexgen_step_over_matmul": "<= 1.5"},
    }
    with open(results, "a") as f:
        tag = {"run_id": run_id, "config": cfg, "threads": threads}
        for shape, runs in (("prefill", sgp_runs), ("decode", sgd_runs)):
            for when, r in zip(("before", "after"), runs):
                f.write(json.dumps(dict(kind="sgemm", shape=shape, when=when, **tag, data=r)) + "\n")
        for i, (a, b) in enumerate(zip(fg_runs, pt_runs)):
            f.write(json.dumps(dict(kind="flexgen", round=i + 1, **tag, data=a)) + "\n")
            f.write(json.dumps(dict(kind="pytorch", round=i + 1, **tag, data=b)) + "\n")
        f.write(json.dumps(s) + "\n")
    with open(out, "a") as f:
        f.write(json.dumps(s) + "\n")

def mark(ok):
    return " " if ok else "!"

def cmd_table(path):
    rows = read_jsonl(path)
    hdr = ("model", "batch", "prompt", "gen", "flexgen tok/s", "pytorch tok/s", "ratio",
           "prefill % sgemm", "step/mm", "step/mm(dec)")
    fmt = "%-9s %5s %6s %4s %13s %13s %7s %15s %8s %12s"
    print(fmt % hdr)
    print(fmt % ("", "", "", "", "", "", "(>=2)", "(>=60%)", "(<=1.5)", "(context)"))
    for s in rows:
        r, f = s["throughput_ratio"], s["flexgen_prefill_frac_of_sgemm"]
        d, dd = s["flexgen_step_over_matmul"], s["flexgen_step_over_matmul_decode_rate"]
        print(fmt % (s["model"], s["batch"], s["prompt_len"], s["gen_len"],
                     "%.1f" % s["flexgen_total_throughput"], "%.1f" % s["pytorch_total_throughput"],
                     "%.2f%s" % (r, mark(r >= 2)), "%.1f%%%s" % (100 * f, mark(f >= 0.60)),
                     "n/a" if d is None else "%.2fx%s" % (d, mark(d <= 1.5)),
                     "n/a" if dd is None else "%.2fx" % dd))
    print("(! marks a missed target)")
    print()
    for s in rows:
        fs, ps = s["flexgen_decode_step_s"], s["pytorch_decode_step_s"]
        print("%s b%d p%d g%d, %d thread(s): sgemm %.1f GFLOP/s at M=%d (prefill), %.1f at M=%d "
              "(decode); prefill matmuls %.3g GFLOP: flexgen %.1f GFLOP/s, pytorch %.1f (%.1f%%); "
              "decode step matmuls %.3g GFLOP = %.2f ms at the prefill rate, %.2f ms at the decode "
              "rate; step: flexgen %s ms, pytorch %s ms"
              % (s["model"], s["batch"], s["prompt_len"], s["gen_len"], s["threads"],
                 s["sgemm_prefill_shape_gflops"], s["batch"] * s["prompt_len"],
                 s["sgemm_decode_shape_gflops"], s["batch"], s["prefill_matmul_flops"] / 1e9,
                 s["flexgen_prefill_gflops"], s["pytorch_prefill_gflops"],
                 100 * s["pytorch_prefill_frac_of_sgemm"], s["decode_step_matmul_flops"] / 1e9,
                 1e3 * s["decode_step_matmul_s_at_prefill_rate"],
                 1e3 * s["decode_step_matmul_s_at_decode_rate"],
                 "n/a" if fs is None else "%.2f" % (1e3 * fs),
                 "n/a" if ps is None else "%.2f" % (1e3 * ps)))

def cmd_rss(run_id, cfg, threads, time_path, fg_path, results):
    model, B, P, G = cfg.split(":")
    B, P, G = int(B), int(P), int(G)
    L, h, ffn, wd, ln_before = dims(model)
    text = open(time_path).read()
    m = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", text)
    if not m:
        sys.exit("bench_cpu.sh: no \"Maximum resident set size\" in /usr/bin/time -v output:\n" + text)
    rss = int(m.group(1)) * 1024
    layer = 4 * (h * h + h) + 2 * h * ffn + ffn + h + 4 * h
    proj = 2 * wd * h if wd != h else 0
    params = L * layer + VOCAB * wd + (2048 + 2) * h + proj + (2 * h if ln_before else 0)
    weights = 2 * params
    kv = 2 * 2 * L * B * (P + G) * h
    MiB = 1 << 20
    budget = 1.1 * (weights + kv) + 300 * MiB
    fg = read_jsonl(fg_path)
    rec = {"kind": "rss", "run_id": run_id, "config": cfg, "threads": int(threads),
           "max_rss_bytes": rss, "params": params, "fp16_weights_bytes": weights,
           "kv_cache_bytes": kv, "budget_bytes": budget, "within_budget": rss <= budget,
           "data": fg[-1] if fg else None}
    with open(results, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print("peak RSS, %s batch %d prompt %d gen %d:" % (model, B, P, G))
    print("  Maximum resident set size  %9.1f MiB" % (rss / MiB))
    print("  budget                     %9.1f MiB = 1.1 * (fp16 weights %.1f MiB [%d params] "
          "+ KV cache %.1f MiB) + 300 MiB" % (budget / MiB, weights / MiB, params, kv / MiB))
    print("  %s (%.1f%% of the budget)" % ("within budget" if rss <= budget else "OVER BUDGET",
                                           100.0 * rss / budget))

cmd = sys.argv[1]
{"dims": cmd_dims, "summary": cmd_summary, "table": cmd_table, "rss": cmd_rss}[cmd](*sys.argv[2:])
'
calc() { "$PY" -c "$CALC_PY" "$@"; }
# Unknown models fail here, before anything is built or run.
if [ "$RSS" = 1 ]; then check_models="$RSS_CONFIG"; else check_models="$CONFIGS"; fi
[ "$RSS" = 1 ] || [ "$SKIP_RSS" = 1 ] || check_models="$check_models $RSS_CONFIG"
for cfg in $check_models; do calc dims "${cfg%%:*}" >/dev/null || exit 1; done

# ---- build ----
log "building ./flexgen"
make --no-print-directory flexgen >&2 || die "make flexgen failed"
mkdir -p build "$(dirname "$RESULTS")"
if [ "$RSS" != 1 ]; then
    log "building build/sgemm_rate"
    make --no-print-directory build/sgemm_rate >&2 || die "make build/sgemm_rate failed"
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
RUN_ID="$(date -u +%Y%m%dT%H%M%SZ)-$(hostname)-$$"
export OMP_NUM_THREADS="$THREADS"

# ---- throughput ----
run_throughput() {
    local cfg model batch plen glen dimsline h ffn r fg pt n=0
    : >"$TMP/summaries.jsonl"
    for cfg in $CONFIGS; do
        n=$((n + 1))
        IFS=: read -r model batch plen glen <<<"$cfg"
        dimsline="$(calc dims "$model")" || exit 1
        read -r _ h ffn _ <<<"$dimsline"
        : >"$TMP/sgp$n.jsonl"
        : >"$TMP/sgd$n.jsonl"
        sgemm_rates() { # $1: before|after
            log "[$cfg] sgemm rate ($1 the runs) at M=$((batch * plen)) N=$ffn K=$h and at M=$batch" \
                "(OMP_NUM_THREADS=$THREADS)"
            build/sgemm_rate $((batch * plen)) "$ffn" "$h" "$SGEMM_REPS" >>"$TMP/sgp$n.jsonl" ||
                die "[$cfg] sgemm_rate failed"
            build/sgemm_rate "$batch" "$ffn" "$h" "$SGEMM_REPS" >>"$TMP/sgd$n.jsonl" ||
                die "[$cfg] sgemm_rate failed"
            log "[$cfg] $(tail -n 1 "$TMP/sgp$n.jsonl") $(tail -n 1 "$TMP/sgd$n.jsonl")"
        }
        sgemm_rates before
        : >"$TMP/fg$n.jsonl"
        : >"$TMP/pt$n.jsonl"
        for r in $(seq 1 "$REPS"); do
            fg="$(./flexgen --model "$model" --gpu-batch-size "$batch" --num-gpu-batches 1 \
                --prompt-len "$plen" --gen-len "$glen" --seed "$SEED" --json --quiet | tail -n 1)" ||
                die "[$cfg] ./flexgen failed"
            echo "$fg" >>"$TMP/fg$n.jsonl"
            pt="$("$PY" scripts/bench_pytorch.py --model "$model" --batch "$batch" --prompt-len "$plen" \
                --gen-len "$glen" --threads "$THREADS" --seed "$SEED" | tail -n 1)" ||
                die "[$cfg] scripts/bench_pytorch.py failed"
            echo "$pt" >>"$TMP/pt$n.jsonl"
            log "[$cfg] round $r/$REPS: total throughput flexgen $(echo "$fg" | "$PY" -c \
                'import json,sys; print("%.2f" % json.load(sys.stdin)["total_throughput"])') tok/s," \
                "pytorch $(echo "$pt" | "$PY" -c \
                'import json,sys; print("%.2f" % json.load(sys.stdin)["total_throughput"])') tok/s"
        done
        sgemm_rates after
        calc summary "$RUN_ID" "$cfg" "$THREADS" "$TMP/fg$n.jsonl" "$TMP/pt$n.jsonl" \
            "$TMP/sgp$n.jsonl" "$TMP/sgd$n.jsonl" "$RESULTS" "$TMP/summaries.jsonl" ||
            die "[$cfg] summary failed"
    done
    # The OpenBLAS core of ./flexgen's runs (--json's blas_core); sgemm_rate takes the same one.
    local core
    core="$(cat "$TMP"/fg*.jsonl | "$PY" -c 'import json, sys
print("/".join(sorted({json.loads(l).get("blas_core", "not reported") for l in sys.stdin if l.strip()})))')"
    echo
    echo "FlexGen (C, fp16 weights) vs PyTorch eager (fp32), dummy weights, OMP_NUM_THREADS=$THREADS, OpenBLAS core" \
        "$core, best of $REPS round(s) (run $RUN_ID)"
    calc table "$TMP/summaries.jsonl"
}

# ---- peak RSS ----
run_rss() {
    local model batch plen glen
    IFS=: read -r model batch plen glen <<<"$RSS_CONFIG"
    [ -x /usr/bin/time ] || die "/usr/bin/time is missing (apt-get install -y time)"
    log "[$RSS_CONFIG] peak RSS: /usr/bin/time -v ./flexgen ... (OMP_NUM_THREADS=$THREADS)"
    /usr/bin/time -v -o "$TMP/time.txt" ./flexgen --model "$model" --gpu-batch-size "$batch" \
        --num-gpu-batches 1 --prompt-len "$plen" --gen-len "$glen" --seed "$SEED" --quiet --json \
        >"$TMP/rss.jsonl" || die "[$RSS_CONFIG] ./flexgen failed under /usr/bin/time -v"
    echo
    calc rss "$RUN_ID" "$RSS_CONFIG" "$THREADS" "$TMP/time.txt" "$TMP/rss.jsonl" "$RESULTS"
}

if [ "$RSS" = 1 ]; then
    run_rss
else
    run_throughput
    [ "$SKIP_RSS" = 1 ] || run_rss
fi
echo
echo "raw results appended to $RESULTS"
