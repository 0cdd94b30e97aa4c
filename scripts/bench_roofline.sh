#!/usr/bin/env bash
# The decode step against its roofline on the CPU: for each weight format (fp16 as stored, 4-bit
# with --compress-weight, and 4-bit times int8 activations with --int8-activations, whose bound is
# still taken at the fp32 GEMM rate) and each batch size, ./flexgen's measured time per decode step
# beside the least time the machine allows,
#
#   bound = max(bytes read / stream bandwidth, FLOPs / GEMM rate)
#
# with both rates measured in the same run: the stream bandwidth by scripts/stream_rate.c (a
# read of 1 GiB, best of 5, the same threads), taken before each configuration's runs and after
# the last, the median of those readings (a shared machine's read rate moves: one quiet moment
# can read far above the rest, so the range is printed beside it), and the GEMM rate by
# scripts/sgemm_rate.c at prefill's shape (M = 1024, N = ffn, K = hidden: the machine's
# sustained fp32 rate), taken before and after the runs, the higher of the two (both built by
# make). Per decode step (B sequences, the context c of the step, L layers, hidden h, ffn f,
# vocabulary V, word_dim w):
#   bytes  every weight matrix as stored, once (the layers' and the embedding table as lm_head;
#          2 bytes a weight for fp16, 36 bytes a group of 64 for 4-bit: 32 of values, an fp16 min
#          and scale), the layers' biases and norms (fp16), and the KV cache read by attention:
#          2 (K and V) * 2 bytes * L * B * c * h
#   FLOPs  2 * B * (L * (4 h^2 + 2 h f) + V * w) for the products (plus 2 * B * 2 w h for
#          project_in and project_out where w != h, as in opt-350m), plus 4 * B * L * c * h for
#          attention (QK^T and PV)
# averaged over the steps (c = P + 1 .. P + G - 1). The step time is decode_latency / (G - 1).
# The ratio step / bound is what to read: 1.0 is the roofline. Beside it: tokens per second
# (B / step), the share of the read limit (bytes / bandwidth / step: how close the step comes to
# reading its bytes at the stream rate), and the path of the CPU kernels (--json's cpu_kernels).
#
# With --base BIN, a second binary (another build of ./flexgen, say the previous commit's) runs
# each configuration too, alternating with ./flexgen ROUNDS times (the best run of each is kept),
# so that both face the same machine.
#
# Run from the repository root:
#   bash scripts/bench_roofline.sh [--threads N] [--model NAME] [--batches "1 8 32"]
#                                  [--prompt-len P] [--gen-len G] [--results FILE]
#                                  [--base BIN] [--rounds N]
# Environment: THREADS [nproc], MODEL [opt-1.3b], BATCHES ["1 8 32"], PROMPT_LEN [32],
# GEN_LEN [16], RESULTS [build/roofline.jsonl] (one JSON line per run is appended), WEIGHTS
# (--path of the dummy weights) [~/.cache/flexgen], BASE [none], ROUNDS [1].
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
die() { echo "bench_roofline.sh: $*" >&2; exit 2; }

THREADS="${THREADS:-$(nproc)}"
MODEL="${MODEL:-opt-1.3b}"
BATCHES="${BATCHES:-1 8 32}"
PROMPT_LEN="${PROMPT_LEN:-32}"
GEN_LEN="${GEN_LEN:-16}"
RESULTS="${RESULTS:-build/roofline.jsonl}"
BASE="${BASE:-}"
ROUNDS="${ROUNDS:-1}"
while [ $# -gt 0 ]; do
    case "$1" in
        --threads|--model|--batches|--prompt-len|--gen-len|--results|--base|--rounds)
            [ $# -ge 2 ] || die "$1 needs a value"
            case "$1" in
                --threads) THREADS="$2" ;; --model) MODEL="$2" ;; --batches) BATCHES="$2" ;;
                --prompt-len) PROMPT_LEN="$2" ;; --gen-len) GEN_LEN="$2" ;; --results) RESULTS="$2" ;;
                --base) BASE="$2" ;; --rounds) ROUNDS="$2" ;;
            esac
            shift ;;
        -h|--help) sed -n '/^# Run from/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    shift
done
[ -z "$BASE" ] || [ -x "$BASE" ] || die "--base: $BASE is not an executable"
for v in "$THREADS" "$PROMPT_LEN" "$ROUNDS" $BATCHES; do [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "expected a positive integer, got '$v'"; done
[[ "$GEN_LEN" =~ ^[1-9][0-9]*$ ]] && [ "$GEN_LEN" -ge 2 ] || die "--gen-len must be at least 2, got '$GEN_LEN'"
[ -x ./flexgen ] || die "./flexgen is not built (run make)"

export OMP_NUM_THREADS="$THREADS"
# The model's hidden size and ffn, from scripts/bench_pytorch.py's table (an unknown model stops
# here, before anything is built or run).
dims=$(python3 - "$MODEL" <<'PY'
import sys
sys.path.insert(0, "scripts")
from bench_pytorch import MODELS
m = MODELS.get(sys.argv[1]) or sys.exit(f"bench_roofline.sh: unknown model {sys.argv[1]}")
print(m[1], m[3])
PY
) || exit 2
read -r H FFN <<<"$dims"
mkdir -p build "$(dirname "$RESULTS")"
make --no-print-directory -s build/stream_rate build/sgemm_rate
stream() { build/stream_rate >>"$work/stream"; }
rates() { stream; build/sgemm_rate 1024 "$FFN" "$H" >>"$work/sgemm"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
path_args=()
[ -n "${WEIGHTS:-}" ] && path_args=(--path "$WEIGHTS")
bins=(./flexgen)
[ -n "$BASE" ] && bins+=("$BASE")

# Each run's --json line, with its format and binary added.
TAG_PY='import json, sys
d = json.load(sys.stdin)
d["format"], d["bin"] = sys.argv[1], sys.argv[2]
print(json.dumps(d))'

rates
for fmt in fp16 4-bit 4-bit-int8; do
    extra=()
    [ "$fmt" = 4-bit ] && extra=(--compress-weight)
    [ "$fmt" = 4-bit-int8 ] && extra=(--compress-weight --int8-activations)
    for b in $BATCHES; do
        stream
        for ((round = 0; round < ROUNDS; round++)); do
            for bin in "${bins[@]}"; do
                echo "bench_roofline.sh: $bin $MODEL $fmt batch $b (round $((round + 1)) of $ROUNDS) ..." >&2
                "$bin" --model "$MODEL" --device cpu --gpu-batch-size "$b" --num-gpu-batches 1 \
                    --prompt-len "$PROMPT_LEN" --gen-len "$GEN_LEN" --json --quiet "${path_args[@]}" "${extra[@]}" |
                    python3 -c "$TAG_PY" "$fmt" "$bin" >>"$work/runs"
            done
        done
    done
done
rates

python3 - "$work" "$RESULTS" "$MODEL" <<'PY'
import json, os, statistics, sys
sys.path.insert(0, "scripts")
from bench_pytorch import MODELS, VOCAB
work, results, model = sys.argv[1:]
L, h, heads, ffn, wd, _ = MODELS[model]
# The weights a step reads: every matrix (the layers' and the embedding table, the lm_head) and
# every vector of the layers; not the positional table (a row per sequence).
matrices = L * (4 * h * h + 2 * h * ffn) + VOCAB * wd + (2 * wd * h if wd != h else 0)
vectors = L * (4 * h + ffn + h + 4 * h)
weight_bytes = lambda fmt: 2 * vectors + (2 * matrices if fmt == "fp16" else matrices * 36 / 64)
lines = lambda name: [json.loads(l) for l in open(f"{work}/{name}") if l.strip()]
reads = sorted(r["gbs"] for r in lines("stream"))
n = len(reads)
bw = statistics.median(reads) * 1e9
gemm = max(r["gflops"] for r in lines("sgemm")) * 1e9
cores = "/".join(sorted({d.get("blas_core", "not reported") for d in lines("runs")}))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown")
held = " ".join(f"{k}={os.environ[k]}" for k in ("FLEXGEN_TEST_CPU", "FLEXGEN_ISA", "ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE")
                if k in os.environ)
print(f"CPU: {cpu}" + (f"; held to {held}" if held else ""))
print(f"{model}: stream bandwidth {bw / 1e9:.1f} GB/s (median of {n} readings, {reads[0]:.1f} to {reads[-1]:.1f}), GEMM rate {gemm / 1e9:.1f} GFLOP/s "
      f"(sgemm 1024 x {ffn} x {h}), threads {lines('stream')[0]['threads']}, OpenBLAS core {cores}\n")
print("| binary | cpu kernels | weights | batch | step ms | tok/s | GB read | GFLOP | bytes / bandwidth ms "
      "| FLOPs / GEMM rate ms | share of the read limit | step / bound |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
best = {}  # the fastest run of each binary, format and batch, in the order first run
for d in lines("runs"):
    key = (d["bin"], d["format"], d["gpu_batch_size"])
    if key not in best or d["decode_latency"] < best[key]["decode_latency"]:
        best[key] = d
with open(results, "a") as out:
    for d in sorted(best.values(), key=lambda d: (["fp16", "4-bit", "4-bit-int8"].index(d["format"]),
                                                  d["gpu_batch_size"], d["bin"] != "./flexgen")):
        B, P, G = d["gpu_batch_size"], d["prompt_len"], d["gen_len"]
        ctx = sum(P + s for s in range(1, G)) / (G - 1)
        step = d["decode_latency"] / (G - 1)
        nbytes = weight_bytes(d["format"]) + 2 * 2 * L * B * ctx * h
        proj = 2 * wd * h if wd != h else 0  # project_in and project_out (opt-350m)
        flops = 2 * B * (L * (4 * h * h + 2 * h * ffn) + VOCAB * wd + proj) + 4 * B * L * ctx * h
        t_mem, t_flop = nbytes / bw, flops / gemm
        ratio = step / max(t_mem, t_flop)
        print(f"| {d['bin']} | {d.get('cpu_kernels', 'not reported')} | {d['format']} | {B} | {step * 1e3:.1f} | "
              f"{B / step:.1f} | {nbytes / 1e9:.3f} | {flops / 1e9:.1f} | {t_mem * 1e3:.1f} | {t_flop * 1e3:.1f} | "
              f"{t_mem / step:.0%} | {ratio:.2f} |")
        out.write(json.dumps({"model": model, "bin": d["bin"], "cpu_kernels": d.get("cpu_kernels"),
                              "format": d["format"], "batch": B, "step_s": step,
                              "bytes": nbytes, "flops": flops, "stream_gbs": bw / 1e9,
                              "gemm_gflops": gemm / 1e9, "ratio": ratio}) + "\n")
PY
