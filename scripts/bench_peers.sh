#!/usr/bin/env bash
# Peer benchmark on the CPU: ./flexgen against CTranslate2 and PyTorch eager on the same OPT
# checkpoints, the same prompts and the same thread count, in alternating rounds.
#
# The engines (each run is one process, timed by the engine itself, model loading not counted):
#   flexgen       ./flexgen --model CKPT --prompt-ids FILE --gen-len G --gpu-batch-size B
#                 --num-gpu-batches 1 --device cpu --json --quiet (fp16 weights, fp32 compute)
#   flexgen-4bit  the same with --compress-weight (4-bit group-wise weights)
#   flexgen-int8  the same with --compress-weight --int8-activations (integer products)
#   flexgen-bf16  the same with --bf16-prefill (fp16 weights; prefill's products in bf16)
#   ct2-fp32      CTranslate2, the checkpoint converted with float32 weights, compute_type float32
#   ct2-int8      CTranslate2, the checkpoint converted with int8 weights, compute_type int8
#   pytorch       transformers' OPTForCausalLM from the checkpoint, fp32, eager, with a KV cache
# (scripts/bench_peers.py describes how the CTranslate2 and PyTorch runs generate and are timed).
#
# The checkpoints are made once and cached under CACHE_DIR: for each model, an HF OPT directory
# (config.json + model.safetensors, float16) with the real OPT config and random weights from
# SEED, and its two CTranslate2 conversions. The prompts are BATCH lines of PROMPT_LEN token ids
# (2, then random ids in [3, 50000) from SEED), one file given to every engine. Every engine
# generates exactly GEN_LEN tokens per prompt, greedily.
#
# Setting up the Python environment, from the repository root (a CPU-only torch build is enough):
#   python3 -m venv .venv-peers
#   .venv-peers/bin/pip install torch transformers ctranslate2 numpy
# and /usr/bin/time for the peak RSS (apt-get install -y time).
#
# Run from the repository root:
#   bash scripts/bench_peers.sh [--smoke] [--rounds N] [--threads N] [--engines LIST]
#                               [--no-check] [--avx2] [--results FILE] [--cache-dir DIR]
#                               [MODEL:BATCH:PROMPT_LEN:GEN_LEN ...]
#   --smoke        a quick run of the plumbing: opt-125m:2:16:4, one round
#   --no-check     no token check against PyTorch's generated tokens
#   --avx2         every engine held to AVX2 without VNNI, as on a laptop's CPU, on a CPU that has
#                  more: ./flexgen's kernels (FLEXGEN_TEST_CPU=avx2 FLEXGEN_ISA=avx2), oneDNN
#                  (ONEDNN_MAX_CPU_ISA=AVX2), OpenBLAS (OPENBLAS_CORETYPE=Haswell), CTranslate2
#                  (CT2_FORCE_CPU_ISA=AVX2), MKL (MKL_ENABLE_INSTRUCTIONS=AVX2) and PyTorch's own
#                  kernels (ATEN_CPU_CAPABILITY=avx2); each engine reads its own
#
# Environment (the flags and arguments above win over these):
#   CONFIGS    configurations, MODEL:BATCH:PROMPT_LEN:GEN_LEN separated by spaces
#              [opt-125m:32:128:32 opt-1.3b:8:128:32]; MODEL is one of scripts/bench_pytorch.py's
#   ROUNDS     rounds; each runs every engine once, in the order above [2]
#   THREADS    OMP_NUM_THREADS of every run, CTranslate2's intra_threads, torch.set_num_threads
#              [nproc]
#   ENGINES    the engines to run, separated by spaces or commas [all seven]
#   CHECK=0    no token check [1]
#   SEED       seed of the random weights and the prompts [0]
#   CACHE_DIR  checkpoints, conversions and prompt files [build/peers]
#   RESULTS    raw JSON lines are appended here [CACHE_DIR/results.jsonl]
#   VENV       the virtual environment with torch, transformers, ctranslate2 and numpy
#              [./.venv-peers]
#
# It prints a markdown table with, for each configuration, one row per metric and one column per
# engine. Each cell is the first round's number, with the spread between rounds, (max - min) /
# min, in parentheses when there are several rounds. With B prompts of P tokens, G generated:
#   total tok/s    B * G / (prefill + decode seconds)
#   decode tok/s   B * (G - 1) / decode seconds: the generated tokens after the first
#   prefill tok/s  B * P / prefill seconds: the prompts' forward pass and the first token
#   peak RSS MiB   the process's maximum resident set size (/usr/bin/time -f %M): model loading,
#                  and for the Python engines the interpreter and its libraries, included
#   tokens = pytorch
#                  the share of generated tokens equal to PyTorch's (fp32) greedy ones, position
#                  by position; ./flexgen's come from a separate, untimed --dump-logits run after
#                  the rounds (random weights give close logits, so the low-precision engines can
#                  part from PyTorch, and one different token changes the rest of its sequence)
# Results lines carry run_id: one "meta" line (settings, git commit, CPU), then per configuration
# a "run" line per engine and round (the engine's JSON line under "data", max_rss_bytes), the
# "agreement" lines of the token check and a "summary" line (the first round's numbers and the
# spreads).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

usage_error() {
    echo "bench_peers.sh: $* (try --help)" >&2
    exit 2
}
die() {
    echo "bench_peers.sh: $*" >&2
    exit 1
}
log() { echo "bench_peers.sh: $*" >&2; }
usage() {
    sed -n '/^# Run from the repository root:/,/^# Environment/p' "${BASH_SOURCE[0]}" |
        sed '$d' | sed 's/^# \{0,1\}//'
    echo "see the comment at the top of scripts/bench_peers.sh for what is measured and the environment"
}

ALL_ENGINES="flexgen flexgen-4bit flexgen-int8 flexgen-bf16 ct2-fp32 ct2-int8 pytorch"
CONFIGS="${CONFIGS:-opt-125m:32:128:32 opt-1.3b:8:128:32}"
ROUNDS="${ROUNDS:-2}"
THREADS="${THREADS:-$(nproc)}"
ENGINES="${ENGINES:-$ALL_ENGINES}"
CHECK="${CHECK:-1}"
SEED="${SEED:-0}"
CACHE_DIR="${CACHE_DIR:-build/peers}"
RESULTS="${RESULTS:-}"
VENV="${VENV:-.venv-peers}"

smoke=0
rounds_flag=""
positional=()
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) smoke=1 ;;
        --no-check) CHECK=0 ;;
        --avx2) export FLEXGEN_TEST_CPU=avx2 FLEXGEN_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell \
            CT2_FORCE_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ;;
        --rounds|--threads|--engines|--results|--cache-dir)
            [ $# -ge 2 ] || usage_error "$1 needs a value"
            case "$1" in
                --rounds) rounds_flag="$2" ;;
                --threads) THREADS="$2" ;;
                --engines) ENGINES="$2" ;;
                --results) RESULTS="$2" ;;
                --cache-dir) CACHE_DIR="$2" ;;
            esac
            shift ;;
        -h|--help) usage; exit 0 ;;
        -*) usage_error "unknown option '$1'" ;;
        *) positional+=("$1") ;;
    esac
    shift
done
if [ "$smoke" = 1 ]; then
    CONFIGS="opt-125m:2:16:4"
    ROUNDS=1
fi
[ ${#positional[@]} -gt 0 ] && CONFIGS="${positional[*]}"
[ -n "$rounds_flag" ] && ROUNDS="$rounds_flag"
RESULTS="${RESULTS:-$CACHE_DIR/results.jsonl}" # after the flags, so that --cache-dir moves it
ENGINES="${ENGINES//,/ }"

is_pos_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_pos_int "$ROUNDS" || usage_error "ROUNDS must be a positive integer, got '$ROUNDS'"
is_pos_int "$THREADS" || usage_error "THREADS must be a positive integer, got '$THREADS'"
[[ "$SEED" =~ ^[0-9]+$ ]] || usage_error "SEED must be a non-negative integer, got '$SEED'"
[[ "$CHECK" =~ ^[01]$ ]] || usage_error "CHECK must be 0 or 1, got '$CHECK'"
[ -n "${ENGINES// /}" ] || usage_error "no engines given"
for e in $ENGINES; do
    [[ " $ALL_ENGINES " == *" $e "* ]] || usage_error "unknown engine '$e' (known: $ALL_ENGINES)"
done
has_engine() { [[ " $ENGINES " == *" $1 "* ]]; }
# The models of scripts/bench_pytorch.py's MODELS table (its import needs no torch).
KNOWN_MODELS=$(cd scripts && python3 -c 'from bench_pytorch import MODELS; print(*MODELS)') ||
    die "cannot read the models of scripts/bench_pytorch.py"
for cfg in $CONFIGS; do
    [[ "$cfg" =~ ^([A-Za-z0-9._-]+):([1-9][0-9]*):([1-9][0-9]*):([1-9][0-9]*)$ ]] ||
        usage_error "bad configuration '$cfg': expected MODEL:BATCH:PROMPT_LEN:GEN_LEN," \
            "e.g. opt-125m:32:128:32"
    [[ " $KNOWN_MODELS " == *" ${BASH_REMATCH[1]} "* ]] ||
        usage_error "unknown model '${BASH_REMATCH[1]}' in '$cfg' (known: $KNOWN_MODELS)"
    [ $((BASH_REMATCH[3] + BASH_REMATCH[4])) -le 2048 ] ||
        usage_error "PROMPT_LEN + GEN_LEN must be <= 2048 in '$cfg'"
done

# ---- tools ----
PY="$VENV/bin/python"
SETUP_HINT="set up the environment (see the top of scripts/bench_peers.sh) or point VENV at one"
[ -x "$PY" ] || die "no Python at VENV=$VENV ($PY is missing); $SETUP_HINT"
need_py="transformers torch numpy"
if has_engine ct2-fp32 || has_engine ct2-int8; then need_py="$need_py ctranslate2"; fi
for m in $need_py; do
    "$PY" -c "import $m" 2>/dev/null || die "the Python module $m is missing from VENV=$VENV; $SETUP_HINT"
done
command -v /usr/bin/time >/dev/null || die "/usr/bin/time is missing (apt-get install -y time)"
py_helper() { "$PY" scripts/bench_peers.py "$@"; }
flexgen_flags() { # an engine of ours: its flags beyond the common ones
    case "$1" in
        flexgen-4bit) echo --compress-weight ;;
        flexgen-int8) echo --compress-weight --int8-activations ;;
        flexgen-bf16) echo --bf16-prefill ;;
    esac
}

if has_engine flexgen || has_engine flexgen-4bit || has_engine flexgen-int8 || has_engine flexgen-bf16; then
    log "building ./flexgen"
    make --no-print-directory flexgen >&2 || die "make flexgen failed"
fi

mkdir -p "$CACHE_DIR" "$(dirname "$RESULTS")"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
RUN_ID="$(date -u +%Y%m%dT%H%M%SZ)-$(hostname)-$$"
RUN_FILE="$TMP/run.jsonl"
: >"$RUN_FILE"
export OMP_NUM_THREADS="$THREADS"

# ---- checkpoints, conversions, prompts (made once, before anything is timed) ----
ckpt_dir() { echo "$CACHE_DIR/$1-seed$SEED"; }
prompts_file() { echo "$CACHE_DIR/prompts-b$1-p$2-seed$SEED.txt"; }
for cfg in $CONFIGS; do
    IFS=: read -r model batch plen glen <<<"$cfg"
    ckpt="$(ckpt_dir "$model")"
    if [ ! -f "$ckpt/model.safetensors" ]; then
        log "[$model] making the random-weight checkpoint $ckpt"
        py_helper checkpoint --model "$model" --seed "$SEED" --out "$ckpt" ||
            die "[$model] making $ckpt failed"
    fi
    for q in float32 int8; do
        if has_engine "ct2-${q/float32/fp32}" && [ ! -f "$ckpt-ct2-$q/model.bin" ]; then
            log "[$model] converting $ckpt to CTranslate2 ($q weights)"
            py_helper convert-ct2 --checkpoint "$ckpt" --quantization "$q" --out "$ckpt-ct2-$q" ||
                die "[$model] the CTranslate2 conversion ($q) failed"
        fi
    done
    pf="$(prompts_file "$batch" "$plen")"
    [ -f "$pf" ] || py_helper prompts --batch "$batch" --prompt-len "$plen" --seed "$SEED" --out "$pf" ||
        die "writing $pf failed"
done

# ---- the runs ----
py_helper meta --run-id "$RUN_ID" --configs "$CONFIGS" --engines "$ENGINES" --rounds "$ROUNDS" \
    --threads "$THREADS" --seed "$SEED" --results "$RESULTS" || die "writing the run's settings failed"

run_engine() { # engine cfg round
    local engine="$1" cfg="$2" round="$3" model batch plen glen ckpt pf tokens="" out
    IFS=: read -r model batch plen glen <<<"$cfg"
    ckpt="$(ckpt_dir "$model")"
    pf="$(prompts_file "$batch" "$plen")"
    [ "$round" = 1 ] && tokens="$TMP/tokens-$cfg-$engine.json"
    local -a cmd
    case "$engine" in
        flexgen|flexgen-4bit|flexgen-int8|flexgen-bf16)
            local -a extra
            read -r -a extra <<< "$(flexgen_flags "$engine")"
            cmd=(./flexgen --model "$ckpt" --prompt-ids "$pf" --gen-len "$glen"
                --gpu-batch-size "$batch" --num-gpu-batches 1 --device cpu --json --quiet
                ${extra[@]+"${extra[@]}"}) ;;
        ct2-fp32|ct2-int8)
            local q=float32
            [ "$engine" = ct2-int8 ] && q=int8
            cmd=("$PY" scripts/bench_peers.py ct2 --ct2-model "$ckpt-ct2-$q" --compute-type "$q"
                --prompt-ids "$pf" --gen-len "$glen" --threads "$THREADS")
            [ -n "$tokens" ] && cmd+=(--tokens-out "$tokens") ;;
        pytorch)
            cmd=("$PY" scripts/bench_peers.py pytorch --checkpoint "$ckpt" --prompt-ids "$pf"
                --gen-len "$glen" --threads "$THREADS")
            [ -n "$tokens" ] && cmd+=(--tokens-out "$tokens") ;;
    esac
    out="$TMP/out.json"
    /usr/bin/time -f %M -o "$TMP/time.txt" "${cmd[@]}" >"$out" ||
        die "[$cfg] round $round: $engine failed: ${cmd[*]}"
    py_helper record --run-id "$RUN_ID" --config "$cfg" --engine "$engine" --round "$round" \
        --threads "$THREADS" --time-file "$TMP/time.txt" --results "$RESULTS" \
        --run-file "$RUN_FILE" <"$out" || die "[$cfg] recording $engine's run failed"
}

for cfg in $CONFIGS; do
    for round in $(seq 1 "$ROUNDS"); do
        log "[$cfg] round $round/$ROUNDS, $THREADS thread(s)"
        for engine in $ENGINES; do run_engine "$engine" "$cfg" "$round"; done
    done
    if [ "$CHECK" = 1 ] && has_engine pytorch; then
        IFS=: read -r model batch plen glen <<<"$cfg"
        specs=()
        for engine in $ENGINES; do
            [ "$engine" = pytorch ] && continue
            tokens="$TMP/tokens-$cfg-$engine.json"
            if [[ "$engine" == flexgen* ]]; then
                log "[$cfg] $engine: an untimed --dump-logits run for the token check"
                read -r -a extra <<<"$(flexgen_flags "$engine")"
                ./flexgen --model "$(ckpt_dir "$model")" \
                    --prompt-ids "$(prompts_file "$batch" "$plen")" \
                    --gen-len "$glen" --gpu-batch-size "$batch" --num-gpu-batches 1 --device cpu \
                    --json --quiet --dump-logits "$TMP/logits.bin" "${extra[@]}" >/dev/null ||
                    die "[$cfg] $engine --dump-logits failed"
                py_helper argmax --logits "$TMP/logits.bin" --gen-len "$glen" --out "$tokens" ||
                    die "[$cfg] reading $engine's logits failed"
                rm -f "$TMP/logits.bin"
            fi
            specs+=("$engine=$tokens")
        done
        [ ${#specs[@]} -eq 0 ] || py_helper agreement --run-id "$RUN_ID" --config "$cfg" \
            --reference "$TMP/tokens-$cfg-pytorch.json" --results "$RESULTS" --run-file "$RUN_FILE" \
            "${specs[@]}" || die "[$cfg] the token check failed"
    fi
done

# The OpenBLAS core of ./flexgen's runs (--json's blas_core).
core="$("$PY" -c 'import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("/".join(sorted({r["data"].get("blas_core", "not reported") for r in runs
                       if r["kind"] == "run" and r["engine"].startswith("flexgen")})) or "n/a")' "$RUN_FILE")"
echo
echo "Peer benchmark on the CPU, $THREADS thread(s), $ROUNDS round(s), random-weight checkpoints" \
    "(seed $SEED), ./flexgen's OpenBLAS core $core, run $RUN_ID"
echo
py_helper table --run-id "$RUN_ID" --run-file "$RUN_FILE" --results "$RESULTS" || die "the table failed"
echo
echo "raw results appended to $RESULTS"
