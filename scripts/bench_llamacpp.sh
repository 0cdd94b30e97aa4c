#!/usr/bin/env bash
# Peer benchmark on the CPU: ./flexgen against llama.cpp on the same random-weight LLaMA checkpoint,
# the same thread count, prompt length and generated length, the two programs alternated.
#
# What it measures (each run is one process; model loading and conversion are not timed):
#   flexgen    ./flexgen --model CKPT --device cpu --prompt-len P --gen-len G --gpu-batch-size B
#              --num-gpu-batches 1 --json --quiet [+ flags], OMP_NUM_THREADS=THREADS: every weight
#              on the gpu tier, which on the CPU backend is host memory; synthetic prompts.
#                fp16   no flags: fp16 weights, fp32 products
#                4bit   --compress-weight: 4-bit group-wise weights (asymmetric, groups of 64)
#                int8   --compress-weight --int8-activations: the same weights, integer products
#   llama.cpp  llama-batched-bench -m CKPT-FMT.gguf -c B*(P+G) -b B*P -ub min(UBATCH, B*P)
#              -npp P -ntg G-1 -npl B -t THREADS -tb THREADS --output-format jsonl: B sequences of
#              P random tokens prefilled in one batch (PP), then G-1 decode steps of B tokens (TG),
#              on the GGUF conversion of the same checkpoint:
#                F16    convert_hf_to_gguf.py --outtype f16 (norms F32, as the converter keeps them)
#                Q4_0   llama-quantize F16 -> Q4_0 (symmetric, blocks of 32), --pure by default
#                Q4_1   llama-quantize F16 -> Q4_1 (asymmetric, blocks of 32), --pure by default
#              (--pure: every matrix in the type, as flexgen's --compress-weight does; without it,
#              QUANT_PURE=0, llama.cpp keeps output.weight at Q6_K.) llama.cpp's Q4 products
#              quantize the activations to 8 bits (Q8_0/Q8_1), as --int8-activations does.
#   The pairs compared (PAIRS): fp16:F16 4bit:Q4_0 4bit:Q4_1 int8:Q4_0 int8:Q4_1.
# Both do the same forward passes: a prefill of B x P tokens that ends with the logits of each
# sequence's last token (the first generated token), then G - 1 decode steps of B tokens each. So:
#   prefill tok/s  B * P / prefill seconds (flexgen's prefill_throughput, llama.cpp's S_PP)
#   decode tok/s   B * (G - 1) / decode seconds (flexgen's decode_throughput, llama.cpp's S_TG)
#   total tok/s    B * G / (prefill + decode seconds) (flexgen's total_throughput)
#   peak RSS MiB   the process's maximum resident set size (/usr/bin/time -v), loading included;
#                  llama.cpp maps the GGUF (mmap), and the pages it touched count
# (llama.cpp feeds random token ids and computes logits without sampling; flexgen samples
# greedily. llama-batched-bench runs a 16-token batch before timing.)
# Run it on a quiet machine: llama.cpp's threads wait for each other by spinning, and with as
# many threads as cores beside another busy process it slows down by up to 10x.
#
# The "model larger than RAM" mode (--big): the shape (default llama-2-13b, 26 GB of fp16
# weights) in fp16 only; flexgen with --policy auto --cpu-mem BIG_CPU_MEM [--gpu-mem BIG_GPU_MEM]
# --max-latency BIG_MAX_LATENCY --offload-dir OFFLOAD_DIR (the policy search picks the block and
# the placement; weights that do not fit go to disk, copied from the checkpoint into the offload
# dir), against llama-batched-bench on the F16 GGUF with mmap (-lm mmap: the page cache holds
# what fits and the rest is read again from disk) at each batch of BIG_BATCHES, and the best of
# those by total tok/s. (On the CPU backend the gpu and cpu tiers are both host memory, and the
# gpu tier's default capacity is the available memory, so the search may place every weight that
# fits there and leave --cpu-mem unused; flexgen plans their sum within the available memory less
# a sixteenth of the machine's. The search's default block can take hours: --max-latency bounds
# it. BENCHMARKS.md's run: DROP_CACHES=1 BIG_BATCHES="8 32 64" ... --big --prompt-len 32
# --gen-len 16 --max-latency 600.)
#
# Setting up:
#   - llama.cpp: the source vendored in llama-cpp-python's sdist (pip download --no-binary :all:
#     --no-deps llama-cpp-python==0.3.36), unpacked; point LLAMA_CPP at its vendor/llama.cpp. If
#     LLAMA_BUILD/bin/ lacks the three tools, this script builds them (CPU only, -march=native):
#       cmake -S $LLAMA_CPP -B $LLAMA_CPP/build-noamx -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON
#         -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
#         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
#         -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX"
#       cmake --build $LLAMA_CPP/build-noamx -j$(nproc) --target llama-bench llama-batched-bench llama-quantize
#     with NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16": on a CPU with AMX (Sapphire Rapids
#     and later), -march=native compiles ggml's AMX buffer type in, and with this source and gcc
#     12.2 its Q4_0 and Q4_1 products crash at their first ldtilecfg (SIGSEGV in
#     ggml_backend_amx_mul_mat: a #GP on a tile configuration with rows set for tiles beyond
#     palette 1's eight, a fault in that version's tile setup). Without AMX, Q4_0's
#     matrices are repacked to q4_0_8x8 (CPU_REPACK) as on other AVX-512/AVX2 CPUs; Q4_1's are
#     used as stored. LLAMA_AMX=1 builds with AMX instead, in $LLAMA_CPP/build.
#   - Python with numpy, torch, transformers and safetensors (the checkpoint writer and
#     llama.cpp's convert_hf_to_gguf.py, which takes gguf-py from its own tree); VENV or PY.
#   - /usr/bin/time (apt-get install -y time).
#
# Run from the repository root:
#   bash scripts/bench_llamacpp.sh [--smoke] [--big] [--shape NAME] [--layers N] [--prompt-len P]
#                                  [--gen-len G] [--batches "1 8 32"] [--rounds N] [--threads N]
#                                  [--pairs LIST] [--llama-bench] [--cache-dir DIR]
#                                  [--results FILE] [--cpu-mem SIZE] [--gpu-mem SIZE]
#                                  [--max-latency S] [--offload-dir DIR] [SHAPE]
#   SHAPE          one of scripts/make_random_llama.py --list: llama-3.2-1b (default), llama-3-8b,
#                  llama-2-7b, llama-2-13b, llama-160m, tiny
#   --layers N     the shape with N decoder layers (a cut-down model for quick runs)
#   --llama-bench  at batch 1, llama-bench too (-p P -n G-1 -d 0,P: prefill at depth 0, decode
#                  at depth P), as rows of its own
#   --smoke        a quick run of the plumbing: shape llama-160m, prompt 16, gen 4, batches 1, 8
#                  and 32, one round, --llama-bench; with --big: llama-160m (324 MB) with
#                  --gpu-mem 128M --cpu-mem 128M --max-latency 60, so that the weights go to disk
#   --big          the "model larger than RAM" mode above (default shape llama-2-13b)
#   --cpu-mem, --gpu-mem, --max-latency, --offload-dir
#                  --big's flexgen flags (BIG_CPU_MEM, BIG_GPU_MEM, BIG_MAX_LATENCY, OFFLOAD_DIR)
#
# Environment (the flags and arguments above win over these):
#   SHAPE        [llama-3.2-1b; --big: llama-2-13b]
#   LAYERS       decoder layers, instead of the shape's [the shape's]
#   PROMPT_LEN   [128]    GEN_LEN [32] (at least 2)
#   BATCHES      batch sizes, separated by spaces or commas [1 8 32]
#   ROUNDS       rounds; each runs every program once per batch, flexgen and llama.cpp
#                alternating, the order reversed every other round [2; --big: 1]
#   THREADS      threads of every run (OMP_NUM_THREADS, llama.cpp's -t and -tb) [2]
#   PAIRS        flexgen:llama.cpp weight pairs [fp16:F16 4bit:Q4_0 4bit:Q4_1 int8:Q4_0 int8:Q4_1]
#   LLAMA_BENCH=1  the --llama-bench rows [0]
#   UBATCH       llama.cpp's physical batch (-ub) cap [512, its default]
#   FLASH_ATTN   llama.cpp's -fa: on, off or auto [auto, its default, which its CPU backend
#                resolves to on]
#   QUANT_PURE=0 llama-quantize without --pure [1]
#   SEED         seed of the random weights [0]
#   CACHE_DIR    checkpoints and GGUF files, made once [/var/tmp/flexgen-llamacpp]
#   RESULTS      raw JSON lines are appended here [build/llamacpp/results.jsonl]
#   LLAMA_CPP    llama.cpp's source tree (required: see "Setting up" above)
#   LLAMA_AMX=1  llama.cpp with ggml's AMX kernels (see above) [0]
#   LLAMA_BUILD  its build directory [$LLAMA_CPP/build-noamx; LLAMA_AMX=1: $LLAMA_CPP/build]
#   VENV         the virtual environment with the Python packages [.venv-peers]; PY overrides it
#   BIG_CPU_MEM  [16G]   BIG_GPU_MEM [not given: flexgen's default, the available memory]
#   BIG_MAX_LATENCY  seconds a block may take in --big (--max-latency) [900]
#   BIG_BATCHES  llama.cpp's batches in --big [the BATCHES]
#   OFFLOAD_DIR  flexgen's --offload-dir in --big [/var/tmp]
#   DROP_CACHES=1  in --big, drop the page cache before each run (needs root) [0]
#   BUILD=0      no `make flexgen` first [1]
#
# It prints a markdown table: for each pair and batch, prefill and decode tok/s of flexgen and
# llama.cpp and their ratio (flexgen / llama.cpp), and the peak RSS of each; each number is the
# best of the rounds (the spreads, (max - min) / min, are in the results file). The header names
# the CPU (lscpu's model name), the threads and both versions. Results lines carry run_id: a
# "meta" line, a "run" line per process (its parsed output under "data", max_rss_bytes), and a
# "summary" line per table row.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

usage_error() {
    echo "bench_llamacpp.sh: $* (try --help)" >&2
    exit 2
}
die() {
    echo "bench_llamacpp.sh: $*" >&2
    exit 1
}
log() { echo "bench_llamacpp.sh: $*" >&2; }
usage() {
    sed -n '/^# Run from the repository root:/,/^# Environment/p' "${BASH_SOURCE[0]}" |
        sed '$d' | sed 's/^# \{0,1\}//'
    echo "see the comment at the top of scripts/bench_llamacpp.sh for what is measured and the environment"
}

smoke=0
big=0
shape_arg=""
declare -A flag=()
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) smoke=1 ;;
        --big) big=1 ;;
        --llama-bench) flag[LLAMA_BENCH]=1 ;;
        --shape|--layers|--prompt-len|--gen-len|--batches|--rounds|--threads|--pairs|--cache-dir|\
        --results|--cpu-mem|--gpu-mem|--max-latency|--offload-dir)
            [ $# -ge 2 ] || usage_error "$1 needs a value"
            case "$1" in
                --shape) shape_arg="$2" ;;
                --layers) flag[LAYERS]="$2" ;;
                --prompt-len) flag[PROMPT_LEN]="$2" ;;
                --gen-len) flag[GEN_LEN]="$2" ;;
                --batches) flag[BATCHES]="$2" ;;
                --rounds) flag[ROUNDS]="$2" ;;
                --threads) flag[THREADS]="$2" ;;
                --pairs) flag[PAIRS]="$2" ;;
                --cache-dir) flag[CACHE_DIR]="$2" ;;
                --results) flag[RESULTS]="$2" ;;
                --cpu-mem) flag[BIG_CPU_MEM]="$2" ;;
                --gpu-mem) flag[BIG_GPU_MEM]="$2" ;;
                --max-latency) flag[BIG_MAX_LATENCY]="$2" ;;
                --offload-dir) flag[OFFLOAD_DIR]="$2" ;;
            esac
            shift ;;
        -h|--help) usage; exit 0 ;;
        -*) usage_error "unknown option '$1'" ;;
        *) [ -z "$shape_arg" ] || usage_error "one shape at a time ('$shape_arg', '$1')"
           shape_arg="$1" ;;
    esac
    shift
done

if [ "$big" = 1 ]; then SHAPE="${SHAPE:-llama-2-13b}"; ROUNDS="${ROUNDS:-1}"; else SHAPE="${SHAPE:-llama-3.2-1b}"; fi
LAYERS="${LAYERS:-}"
PROMPT_LEN="${PROMPT_LEN:-128}"
GEN_LEN="${GEN_LEN:-32}"
BATCHES="${BATCHES:-1 8 32}"
ROUNDS="${ROUNDS:-2}"
THREADS="${THREADS:-2}"
PAIRS="${PAIRS:-fp16:F16 4bit:Q4_0 4bit:Q4_1 int8:Q4_0 int8:Q4_1}"
LLAMA_BENCH="${LLAMA_BENCH:-0}"
UBATCH="${UBATCH:-512}"
FLASH_ATTN="${FLASH_ATTN:-auto}"
QUANT_PURE="${QUANT_PURE:-1}"
SEED="${SEED:-0}"
CACHE_DIR="${CACHE_DIR:-/var/tmp/flexgen-llamacpp}"
RESULTS="${RESULTS:-build/llamacpp/results.jsonl}"
LLAMA_CPP="${LLAMA_CPP:-}"
VENV="${VENV:-.venv-peers}"
BIG_CPU_MEM="${BIG_CPU_MEM:-16G}"
BIG_GPU_MEM="${BIG_GPU_MEM:-}"
BIG_MAX_LATENCY="${BIG_MAX_LATENCY:-900}"
OFFLOAD_DIR="${OFFLOAD_DIR:-/var/tmp}"
DROP_CACHES="${DROP_CACHES:-0}"
BUILD="${BUILD:-1}"
if [ "$smoke" = 1 ]; then
    SHAPE=llama-160m PROMPT_LEN=16 GEN_LEN=4 BATCHES="1 8 32" ROUNDS=1 LLAMA_BENCH=1
    if [ "$big" = 1 ]; then BIG_GPU_MEM=128M BIG_CPU_MEM=128M BIG_MAX_LATENCY=60 LLAMA_BENCH=0; fi
fi
[ -n "$shape_arg" ] && SHAPE="$shape_arg"
for k in "${!flag[@]}"; do printf -v "$k" '%s' "${flag[$k]}"; done
BIG_BATCHES="${BIG_BATCHES:-$BATCHES}"
BATCHES="${BATCHES//,/ }"
BIG_BATCHES="${BIG_BATCHES//,/ }"
PAIRS="${PAIRS//,/ }"
LLAMA_AMX="${LLAMA_AMX:-0}"
[[ "$LLAMA_AMX" =~ ^[01]$ ]] || usage_error "LLAMA_AMX must be 0 or 1, got '$LLAMA_AMX'"
if [ "$LLAMA_AMX" = 1 ]; then
    LLAMA_BUILD="${LLAMA_BUILD:-$LLAMA_CPP/build}" NOAMX=""
else
    LLAMA_BUILD="${LLAMA_BUILD:-$LLAMA_CPP/build-noamx}" NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

is_pos_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
for v in PROMPT_LEN GEN_LEN ROUNDS THREADS UBATCH; do
    is_pos_int "${!v}" || usage_error "$v must be a positive integer, got '${!v}'"
done
[ -z "$LAYERS" ] || is_pos_int "$LAYERS" || usage_error "LAYERS must be a positive integer, got '$LAYERS'"
[ "$GEN_LEN" -ge 2 ] || usage_error "GEN_LEN must be at least 2 (decode is G - 1 steps), got $GEN_LEN"
[[ "$SEED" =~ ^[0-9]+$ ]] || usage_error "SEED must be a non-negative integer, got '$SEED'"
[[ "$LLAMA_BENCH" =~ ^[01]$ ]] || usage_error "LLAMA_BENCH must be 0 or 1, got '$LLAMA_BENCH'"
[[ "$QUANT_PURE" =~ ^[01]$ ]] || usage_error "QUANT_PURE must be 0 or 1, got '$QUANT_PURE'"
[[ "$DROP_CACHES" =~ ^[01]$ ]] || usage_error "DROP_CACHES must be 0 or 1, got '$DROP_CACHES'"
[[ "$BUILD" =~ ^[01]$ ]] || usage_error "BUILD must be 0 or 1, got '$BUILD'"
[[ "$FLASH_ATTN" =~ ^(on|off|auto)$ ]] || usage_error "FLASH_ATTN must be on, off or auto, got '$FLASH_ATTN'"
[[ "$BIG_MAX_LATENCY" =~ ^[0-9]+([.][0-9]+)?$ ]] || usage_error "BIG_MAX_LATENCY must be a number of seconds"
size_re='^[0-9]+([.][0-9]+)?[KMGT]?$'
[[ "$BIG_CPU_MEM" =~ $size_re ]] || usage_error "bad --cpu-mem '$BIG_CPU_MEM' (e.g. 16G)"
[ -z "$BIG_GPU_MEM" ] || [[ "$BIG_GPU_MEM" =~ $size_re ]] || usage_error "bad --gpu-mem '$BIG_GPU_MEM' (e.g. 8G)"
[ -n "${BATCHES// /}" ] || usage_error "no batches given"
for b in $BATCHES $BIG_BATCHES; do is_pos_int "$b" || usage_error "bad batch size '$b'"; done
[ -n "$LLAMA_CPP" ] || usage_error "LLAMA_CPP is not set: point it at llama.cpp's source tree"
FG_KINDS="fp16 4bit int8"
LC_KINDS="F16 Q4_0 Q4_1"
fg_engines=""
lc_formats=""
add_word() { [[ " ${!1} " == *" $2 "* ]] || printf -v "$1" '%s' "${!1:+${!1} }$2"; }
if [ "$big" = 1 ]; then
    PAIRS="fp16:F16"
    BATCHES="$BIG_BATCHES"
fi
for p in $PAIRS; do
    [[ "$p" =~ ^([a-z0-9]+):([A-Z0-9_]+)$ ]] || usage_error "bad pair '$p' (e.g. 4bit:Q4_0)"
    [[ " $FG_KINDS " == *" ${BASH_REMATCH[1]} "* ]] ||
        usage_error "unknown flexgen weights '${BASH_REMATCH[1]}' in '$p' (known: $FG_KINDS)"
    [[ " $LC_KINDS " == *" ${BASH_REMATCH[2]} "* ]] ||
        usage_error "unknown llama.cpp weights '${BASH_REMATCH[2]}' in '$p' (known: $LC_KINDS)"
    add_word fg_engines "${BASH_REMATCH[1]}"
    add_word lc_formats "${BASH_REMATCH[2]}"
done

# ---- tools ----
if [ -z "${PY:-}" ]; then
    PY="$VENV/bin/python"
fi
SETUP_HINT="see the top of scripts/bench_llamacpp.sh; point VENV or PY at a Python that has them"
[ -x "$PY" ] || command -v "$PY" >/dev/null || die "no Python at $PY; $SETUP_HINT"
for m in numpy torch transformers safetensors; do
    "$PY" -c "import $m" 2>/dev/null || die "the Python module $m is missing from $PY; $SETUP_HINT"
done
"$PY" scripts/make_random_llama.py --shape "$SHAPE" --bytes >/dev/null 2>&1 ||
    usage_error "unknown shape '$SHAPE' (known: $("$PY" scripts/make_random_llama.py --list | awk '{print $1}' | paste -sd ' '))"
command -v /usr/bin/time >/dev/null || die "/usr/bin/time is missing (apt-get install -y time)"
[ -f "$LLAMA_CPP/convert_hf_to_gguf.py" ] ||
    die "no llama.cpp source at LLAMA_CPP=$LLAMA_CPP (convert_hf_to_gguf.py is missing); see the top of this script"
LBIN="$LLAMA_BUILD/bin"
if [ ! -x "$LBIN/llama-batched-bench" ] || [ ! -x "$LBIN/llama-quantize" ] || [ ! -x "$LBIN/llama-bench" ]; then
    log "building llama.cpp's llama-bench, llama-batched-bench and llama-quantize in $LLAMA_BUILD" \
        "(CPU only${NOAMX:+, without AMX})"
    cmake -S "$LLAMA_CPP" -B "$LLAMA_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF \
        -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" >&2 ||
        die "configuring llama.cpp failed"
    cmake --build "$LLAMA_BUILD" --config Release -j"$(nproc)" \
        --target llama-bench llama-batched-bench llama-quantize >&2 || die "building llama.cpp failed"
fi
if [ "$BUILD" = 1 ]; then
    log "building ./flexgen"
    make --no-print-directory flexgen >&2 || die "make flexgen failed"
fi
[ -x ./flexgen ] || die "./flexgen is missing (make flexgen)"

mkdir -p "$CACHE_DIR" "$(dirname "$RESULTS")"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
RUN_ID="$(date -u +%Y%m%dT%H%M%SZ)-$(hostname)-$$"
RUN_FILE="$TMP/run.jsonl"
: >"$RUN_FILE"

# The Python side: parsing each program's output, the results lines and the table.
HELPER_PY='
import json, re, sys

def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]

def append(path, rec):
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")

def max_rss(time_path):
    m = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", open(time_path).read())
    if not m:
        sys.exit("bench_llamacpp.sh: no \"Maximum resident set size\" in " + time_path)
    return int(m.group(1)) * 1024

def parse_flexgen(out, B, P, G, big):
    lines = [l for l in open(out) if l.strip().startswith("{")]
    if not lines:
        sys.exit("bench_llamacpp.sh: no JSON line in flexgen'"'"'s output " + out)
    d = json.loads(lines[-1])
    if d.get("prompt_len") != P or d.get("gen_len") != G or (not big and d.get("num_prompts") != B):
        sys.exit("bench_llamacpp.sh: flexgen ran another configuration: %s" % lines[-1])
    return d, d["num_prompts"], d["prefill_throughput"], d["decode_throughput"], d["total_throughput"]

def parse_batched(out, B, P, G):
    rows = []
    for l in open(out):
        l = l.strip()
        if l.startswith("{") and "\"speed_pp\"" in l:
            rows.append(json.loads(l))
    rows = [r for r in rows if r["pl"] == B and r["pp"] == P and r["tg"] == G - 1]
    if not rows:
        sys.exit("bench_llamacpp.sh: llama-batched-bench printed no row for pp %d tg %d pl %d "
                 "(the context too small?); its output: %s" % (P, G - 1, B, out))
    d = rows[-1]
    return d, B, d["speed_pp"], d["speed_tg"], B * G / (d["t_pp"] + d["t_tg"])

def parse_llama_bench(out, B, P, G):
    rows = [json.loads(l) for l in open(out) if l.strip().startswith("{")]
    pp = [r for r in rows if r["n_prompt"] == P and r["n_gen"] == 0 and r["n_depth"] == 0]
    tg = [r for r in rows if r["n_prompt"] == 0 and r["n_gen"] == G - 1 and r["n_depth"] == P]
    if not pp or not tg:
        sys.exit("bench_llamacpp.sh: llama-bench printed no pp%d / tg%d@d%d rows: %s" % (P, G - 1, P, out))
    pp, tg = pp[-1]["avg_ts"], tg[-1]["avg_ts"]
    return {"rows": rows}, 1, pp, tg, G / (P / pp + (G - 1) / tg)

def cmd_record(run_id, engine, weights, B, P, G, rnd, threads, big, out, time_path, results, run_file):
    B, P, G, rnd, big = int(B), int(P), int(G), int(rnd), big == "1"
    if engine == "flexgen":
        d, n, pre, dec, tot = parse_flexgen(out, B, P, G, big)
    elif engine == "llama.cpp":
        d, n, pre, dec, tot = parse_batched(out, B, P, G)
    else:
        d, n, pre, dec, tot = parse_llama_bench(out, B, P, G)
    rec = {"kind": "run", "run_id": run_id, "engine": engine, "weights": weights, "batch": B,
           "sequences": n, "prompt_len": P, "gen_len": G, "round": rnd, "threads": int(threads),
           "prefill_tps": pre, "decode_tps": dec, "total_tps": tot,
           "max_rss_bytes": max_rss(time_path), "data": d}
    append(results, rec)
    append(run_file, rec)
    print("%s %s batch %d: prefill %.2f tok/s, decode %.2f tok/s, total %.2f tok/s, peak RSS %.0f MiB"
          % (engine, weights, n, pre, dec, tot, rec["max_rss_bytes"] / 2**20))

def best(runs, key):
    v = [r[key] for r in runs]
    return max(v), (max(v) - min(v)) / min(v) if min(v) > 0 else 0.0

def fmt(x, nd=2):
    return "n/a" if x is None else ("%.*f" % (nd, x))

def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b

def cmd_table(run_id, run_file, results, pairs, batches):
    runs = [r for r in read_jsonl(run_file) if r["kind"] == "run"]
    MiB = 2 ** 20
    def sel(engine, weights, B):
        rs = [r for r in runs if r["engine"] == engine and r["weights"] == weights and r["batch"] == B]
        if not rs:
            return None
        out = {k: best(rs, k) for k in ("prefill_tps", "decode_tps", "total_tps")}
        out["rss"] = max(r["max_rss_bytes"] for r in rs)
        out["rounds"] = len(rs)
        return out
    names = {"fp16": "fp16", "4bit": "4-bit", "int8": "4-bit + int8 act."}
    print("| flexgen / llama.cpp weights | batch | prefill tok/s flexgen | llama.cpp | ratio "
          "| decode tok/s flexgen | llama.cpp | ratio | peak RSS MiB flexgen | llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in pairs.split():
        fw, lw = p.split(":")
        for B in map(int, batches.split()):
            for engine in ("llama.cpp", "llama-bench"):
                f, l = sel("flexgen", fw, B), sel(engine, lw, B)
                if l is None and engine == "llama-bench":
                    continue
                g = lambda s, k: None if s is None else s[k][0]
                row = {"kind": "summary", "run_id": run_id, "flexgen_weights": fw, "peer": engine,
                       "peer_weights": lw, "batch": B}
                for k in ("prefill_tps", "decode_tps", "total_tps"):
                    row["flexgen_" + k], row["peer_" + k] = g(f, k), g(l, k)
                    row["flexgen_" + k + "_spread"] = None if f is None else f[k][1]
                    row["peer_" + k + "_spread"] = None if l is None else l[k][1]
                    row[k + "_ratio"] = ratio(g(f, k), g(l, k))
                row["flexgen_max_rss_bytes"] = None if f is None else f["rss"]
                row["peer_max_rss_bytes"] = None if l is None else l["rss"]
                append(results, row)
                label = "%s / %s%s" % (names[fw], lw, " (llama-bench)" if engine == "llama-bench" else "")
                print("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                    label, B, fmt(row["flexgen_prefill_tps"]), fmt(row["peer_prefill_tps"]),
                    fmt(row["prefill_tps_ratio"]) + ("x" if row["prefill_tps_ratio"] else ""),
                    fmt(row["flexgen_decode_tps"]), fmt(row["peer_decode_tps"]),
                    fmt(row["decode_tps_ratio"]) + ("x" if row["decode_tps_ratio"] else ""),
                    fmt(None if f is None else f["rss"] / MiB, 0),
                    fmt(None if l is None else l["rss"] / MiB, 0)))

def cmd_big_table(run_id, run_file, results):
    runs = [r for r in read_jsonl(run_file) if r["kind"] == "run"]
    MiB = 2 ** 20
    print("| program | batch | placement | prefill tok/s | decode tok/s | total tok/s | peak RSS MiB |")
    print("|---|---:|---|---:|---:|---:|---:|")
    fg = [r for r in runs if r["engine"] == "flexgen"]
    lc = [r for r in runs if r["engine"] == "llama.cpp"]
    def best_of(rs):
        return max(rs, key=lambda r: r["total_tps"]) if rs else None
    f = best_of(fg)
    if f:
        d = f["data"]
        pct = d["percent"]
        place = ("--policy auto: %d x %d, --percent %s%s; weights gpu/cpu/disk %d/%d/%d%%; peak tiers "
                 "gpu %.2f, cpu %.2f, disk %.2f GiB; %.1f GiB read from disk"
                 % (d["gpu_batch_size"], d["num_gpu_batches"], " ".join(map(str, pct)),
                    " --cpu-cache-compute" if d.get("cpu_cache_compute") else "",
                    pct[0], pct[1], 100 - pct[0] - pct[1], d["peak_gpu_bytes"] / 2**30,
                    d["peak_cpu_bytes"] / 2**30, d["peak_disk_bytes"] / 2**30,
                    d["disk_to_cpu_bytes"] / 2**30))
        print("| flexgen fp16 | %d | %s | %.2f | %.2f | %.2f | %.0f |" % (
            f["sequences"], place, f["prefill_tps"], f["decode_tps"], f["total_tps"],
            f["max_rss_bytes"] / MiB))
    by_batch = {}
    for r in lc:
        by_batch.setdefault(r["batch"], []).append(r)
    bests = {B: best_of(rs) for B, rs in by_batch.items()}
    top = max(bests.values(), key=lambda r: r["total_tps"]) if bests else None
    for B in sorted(bests):
        r = bests[B]
        print("| llama.cpp F16%s | %d | mmap (-lm mmap) | %.2f | %.2f | %.2f | %.0f |" % (
            " (best)" if r is top else "", B, r["prefill_tps"], r["decode_tps"], r["total_tps"],
            r["max_rss_bytes"] / MiB))
    if f and top:
        row = {"kind": "summary", "run_id": run_id, "mode": "big", "flexgen_sequences": f["sequences"],
               "peer_best_batch": top["batch"]}
        for k in ("prefill_tps", "decode_tps", "total_tps"):
            row["flexgen_" + k], row["peer_" + k] = f[k], top[k]
            row[k + "_ratio"] = ratio(f[k], top[k])
        row["flexgen_max_rss_bytes"], row["peer_max_rss_bytes"] = f["max_rss_bytes"], top["max_rss_bytes"]
        append(results, row)
        print()
        print("flexgen / llama.cpp at its best batch (%d): prefill %.2fx, decode %.2fx, total %.2fx"
              % (top["batch"], row["prefill_tps_ratio"], row["decode_tps_ratio"], row["total_tps_ratio"]))

def cmd_meta(results, *kv):
    rec = {"kind": "meta"}
    for item in kv:
        k, _, v = item.partition("=")
        rec[k] = v
    append(results, rec)

def cmd_field(run_file, engine, key):
    vals = sorted({str(r["data"].get(key, "not reported")) for r in read_jsonl(run_file)
                   if r["kind"] == "run" and r["engine"] == engine})
    print("/".join(vals) or "n/a")

cmd = sys.argv[1]
{"record": cmd_record, "table": cmd_table, "big-table": cmd_big_table, "meta": cmd_meta,
 "field": cmd_field}[cmd](*sys.argv[2:])
'
helper() { "$PY" -c "$HELPER_PY" "$@"; }

free_bytes() { df -P -B1 "$1" | awk 'NR == 2 {print $4}'; }
need_space() { # dir bytes what
    local have
    have="$(free_bytes "$1")"
    [ "$have" -ge "$2" ] || die "$3 needs about $(($2 / 1000000000)) GB in $1, which has $((have / 1000000000)) GB free"
}

# ---- the checkpoint and its conversions (made once, before anything is timed) ----
name="$SHAPE${LAYERS:+-${LAYERS}layers}-seed$SEED"
CKPT="$CACHE_DIR/$name"
weights_bytes="$("$PY" scripts/make_random_llama.py --shape "$SHAPE" ${LAYERS:+--layers "$LAYERS"} --bytes)"
if [ ! -f "$CKPT/model.safetensors.index.json" ]; then
    need_space "$CACHE_DIR" "$((weights_bytes + weights_bytes / 20))" "the checkpoint $CKPT"
    log "making the random-weight checkpoint $CKPT ($((weights_bytes / 1000000)) MB)"
    "$PY" scripts/make_random_llama.py --shape "$SHAPE" ${LAYERS:+--layers "$LAYERS"} --seed "$SEED" \
        --out "$CKPT" || die "making $CKPT failed"
fi
gguf() { # format -> the GGUF file
    case "$1" in
        F16) echo "$CACHE_DIR/$name-F16.gguf" ;;
        *) echo "$CACHE_DIR/$name-$1$([ "$QUANT_PURE" = 1 ] && echo -pure).gguf" ;;
    esac
}
F16_GGUF="$(gguf F16)"
if [ ! -f "$F16_GGUF" ]; then
    need_space "$CACHE_DIR" "$((weights_bytes + weights_bytes / 20))" "the F16 GGUF $F16_GGUF"
    log "converting $CKPT to $F16_GGUF (convert_hf_to_gguf.py --outtype f16)"
    "$PY" "$LLAMA_CPP/convert_hf_to_gguf.py" "$CKPT" --outtype f16 --outfile "$F16_GGUF.part" \
        >"$TMP/convert.log" 2>&1 || { tail -n 30 "$TMP/convert.log" >&2; die "converting $CKPT to GGUF failed"; }
    mv "$F16_GGUF.part" "$F16_GGUF"
fi
for fmt in $lc_formats; do
    [ "$fmt" = F16 ] && continue
    out="$(gguf "$fmt")"
    [ -f "$out" ] && continue
    need_space "$CACHE_DIR" "$((weights_bytes * 3 / 8))" "the $fmt GGUF $out"
    log "quantizing $F16_GGUF to $out (llama-quantize$([ "$QUANT_PURE" = 1 ] && echo " --pure") $fmt)"
    qflags=()
    [ "$QUANT_PURE" = 1 ] && qflags=(--pure)
    "$LBIN/llama-quantize" "${qflags[@]}" "$F16_GGUF" "$out.part" "$fmt" "$(nproc)" \
        >"$TMP/quantize.log" 2>&1 || { tail -n 30 "$TMP/quantize.log" >&2; die "llama-quantize $fmt failed"; }
    mv "$out.part" "$out"
done

# ---- versions, machine ----
CPU_NAME="$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1)"
[ -n "$CPU_NAME" ] || CPU_NAME="$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1)"
FG_COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD -- 2>/dev/null || FG_COMMIT="$FG_COMMIT (with uncommitted changes)"
LC_VERSION="$("$LBIN/llama-batched-bench" --version 2>&1 | sed -n 's/^version: //p' | head -n 1)"
LC_BUILT="$("$LBIN/llama-batched-bench" --version 2>&1 | sed -n 's/^built with //p' | head -n 1)"
helper meta "$RESULTS" "run_id=$RUN_ID" "mode=$([ "$big" = 1 ] && echo big || echo ram)" "shape=$SHAPE" \
    "layers=$LAYERS" "prompt_len=$PROMPT_LEN" "gen_len=$GEN_LEN" "batches=$BATCHES" "rounds=$ROUNDS" \
    "threads=$THREADS" "pairs=$PAIRS" "seed=$SEED" "cpu=$CPU_NAME" "flexgen=$FG_COMMIT" \
    "llama_cpp=$LC_VERSION" "llama_cpp_built_with=$LC_BUILT" "ubatch=$UBATCH" "flash_attn=$FLASH_ATTN" \
    "quant_pure=$QUANT_PURE" "llama_amx=$LLAMA_AMX" "big_cpu_mem=$BIG_CPU_MEM" "big_gpu_mem=$BIG_GPU_MEM" \
    "big_max_latency=$BIG_MAX_LATENCY" "offload_dir=$OFFLOAD_DIR" || die "writing the run's settings failed"

# ---- the runs ----
drop_caches() {
    [ "$DROP_CACHES" = 1 ] || return 0
    sync
    echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || log "DROP_CACHES=1: cannot write /proc/sys/vm/drop_caches (not root?)"
}
fg_flags() { # flexgen's weights -> its flags, into the array fgf
    fgf=()
    case "$1" in 4bit) fgf=(--compress-weight) ;; int8) fgf=(--compress-weight --int8-activations) ;; esac
}
run_one() { # engine weights batch round
    local engine="$1" w="$2" B="$3" round="$4" out="$TMP/out.txt" err="$TMP/err.txt"
    local -a cmd env=()
    case "$engine" in
        flexgen)
            env=(OMP_NUM_THREADS="$THREADS")
            fg_flags "$w"
            cmd=(./flexgen --model "$CKPT" --device cpu --prompt-len "$PROMPT_LEN" --gen-len "$GEN_LEN"
                --seed "$SEED" --json --quiet "${fgf[@]}")
            if [ "$big" = 1 ]; then
                cmd+=(--policy auto --cpu-mem "$BIG_CPU_MEM" ${BIG_GPU_MEM:+--gpu-mem "$BIG_GPU_MEM"}
                    --max-latency "$BIG_MAX_LATENCY" --offload-dir "$OFFLOAD_DIR")
            else
                cmd+=(--gpu-batch-size "$B" --num-gpu-batches 1)
            fi ;;
        llama.cpp)
            local ctx=$((B * (PROMPT_LEN + GEN_LEN))) nb=$((B * PROMPT_LEN)) ub
            ub=$((nb < UBATCH ? nb : UBATCH))
            cmd=("$LBIN/llama-batched-bench" -m "$(gguf "$w")" -c "$ctx" -b "$nb" -ub "$ub"
                -npp "$PROMPT_LEN" -ntg "$((GEN_LEN - 1))" -npl "$B" -t "$THREADS" -tb "$THREADS"
                -fa "$FLASH_ATTN" --output-format jsonl)
            [ "$big" = 1 ] && cmd+=(-lm mmap) ;;
        llama-bench)
            cmd=("$LBIN/llama-bench" -m "$(gguf "$w")" -p "$PROMPT_LEN" -n "$((GEN_LEN - 1))"
                -d "0,$PROMPT_LEN" -b "$PROMPT_LEN" -ub "$((PROMPT_LEN < UBATCH ? PROMPT_LEN : UBATCH))"
                -t "$THREADS" -fa "$FLASH_ATTN" -r 1 -o jsonl) ;;
    esac
    drop_caches
    log "[batch $([ "$B" = 0 ] && echo "by --policy auto" || echo "$B"), round $round] $engine $w:" \
        "${env[*]:+${env[*]} }${cmd[*]}"
    if ! env "${env[@]}" /usr/bin/time -v -o "$TMP/time.txt" "${cmd[@]}" >"$out" 2>"$err"; then
        echo "---- stderr (last 20 lines) ----" >&2
        tail -n 20 "$err" >&2
        grep -q "Command terminated by signal 11" "$TMP/time.txt" && [ "$engine" != flexgen ] &&
            log "$engine died of SIGSEGV: with AMX, see LLAMA_AMX at the top of this script"
        die "[batch $B, round $round] $engine $w failed: ${cmd[*]}"
    fi
    [ "$engine" = flexgen ] || cat "$err" >>"$out" # llama.cpp's JSON line: stdout, logs: stderr
    helper record "$RUN_ID" "$engine" "$w" "$B" "$PROMPT_LEN" "$GEN_LEN" "$round" "$THREADS" "$big" \
        "$out" "$TMP/time.txt" "$RESULTS" "$RUN_FILE" >&2 ||
        die "[batch $B, round $round] reading $engine's output failed (kept in $out)"
}

# The order of a round: flexgen and llama.cpp alternating, pair by pair.
order=()
read -r -a fgl <<<"$fg_engines"
read -r -a lcl <<<"$lc_formats"
n=$(( ${#fgl[@]} > ${#lcl[@]} ? ${#fgl[@]} : ${#lcl[@]} ))
for ((i = 0; i < n; i++)); do
    [ "$i" -lt "${#fgl[@]}" ] && order+=("flexgen:${fgl[$i]}")
    [ "$i" -lt "${#lcl[@]}" ] && order+=("llama.cpp:${lcl[$i]}")
done
if [ "$big" = 1 ]; then
    for round in $(seq 1 "$ROUNDS"); do
        log "round $round/$ROUNDS: flexgen --policy auto, then llama.cpp F16 (mmap) at batches $BATCHES"
        run_one flexgen fp16 0 "$round"
        for B in $BATCHES; do run_one llama.cpp F16 "$B" "$round"; done
    done
else
    for B in $BATCHES; do
        for round in $(seq 1 "$ROUNDS"); do
            seq_=("${order[@]}")
            if [ $((round % 2)) = 0 ]; then # reversed every other round
                seq_=()
                for ((i = ${#order[@]} - 1; i >= 0; i--)); do seq_+=("${order[$i]}"); done
            fi
            [ "$LLAMA_BENCH" = 1 ] && [ "$B" = 1 ] && for f in $lc_formats; do seq_+=("llama-bench:$f"); done
            for e in "${seq_[@]}"; do run_one "${e%%:*}" "${e#*:}" "$B" "$round"; done
        done
    done
fi

# ---- the table ----
echo
echo "flexgen against llama.cpp on the CPU: $CPU_NAME, $THREADS thread(s) each, shape $SHAPE" \
    "${LAYERS:+($LAYERS layers) }(random weights, seed $SEED), prompt $PROMPT_LEN, $GEN_LEN generated" \
    "($((GEN_LEN - 1)) decode steps), best of $ROUNDS round(s), run $RUN_ID"
echo "flexgen $FG_COMMIT (OpenBLAS core $(helper field "$RUN_FILE" flexgen blas_core)," \
    "cpu kernels $(helper field "$RUN_FILE" flexgen cpu_kernels)); llama.cpp ${LC_VERSION:-unknown}" \
    "(${LC_BUILT:-?}$([ "$LLAMA_AMX" = 1 ] || echo ", without AMX"); llama-batched-bench, -ub <= $UBATCH," \
    "-fa $FLASH_ATTN; Q4 by llama-quantize$([ "$QUANT_PURE" = 1 ] && echo " --pure"))"
echo
if [ "$big" = 1 ]; then
    echo "Model larger than RAM: flexgen --policy auto --cpu-mem $BIG_CPU_MEM${BIG_GPU_MEM:+ --gpu-mem $BIG_GPU_MEM}" \
        "--max-latency $BIG_MAX_LATENCY --offload-dir $OFFLOAD_DIR; llama.cpp -lm mmap" \
        "($(free -g | awk '/^Mem:/ {print $2}') GiB of RAM, weights $((weights_bytes / 1000000)) MB fp16)"
    echo
    helper big-table "$RUN_ID" "$RUN_FILE" "$RESULTS" || die "the table failed"
else
    helper table "$RUN_ID" "$RUN_FILE" "$RESULTS" "$PAIRS" "$BATCHES" || die "the table failed"
    echo
    echo "(ratio = flexgen / llama.cpp; prefill B*P / prefill s, decode B*(G-1) / decode s)"
fi
echo
echo "raw results appended to $RESULTS"
