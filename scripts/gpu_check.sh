#!/usr/bin/env bash
# gpu_check.sh: the CUDA backend checked on a GPU machine (a 16-core H100 or H200; no network
# needed) in three parts, the halves, each of which runs in at most 5 minutes, so that each can be
# a command of its own: check and speed (the first 10 minutes), then big.
#   check  build for the card's own SM only (make CUDA_SM=its capability)                [150 s]
#          the kernel suite and the GPU suite, natively on the GPU                        [100 s]
#          compute-sanitizer's memcheck over the kernel suite                              [60 s]
#          models/opt-kjv's and models/llama-kjv's greedy texts on cuda against cpu: the same
#          text (docs/GPU.md, "A first run on a laptop GPU", says why they must be)        [40 s]
#   speed  this project beside FlexGen 0.1.8 on the same card in the same run, each warmed up
#          (--warmup; FlexGen's flex_opt warms itself up), dummy weights, prompt 512, --gpu-mem
#          16G (32G at 32 x 1, whose cache needs it), in this order while the half's time lasts:
#          opt-1.3b all on the GPU at 4 x 1 (and with FLEXGEN_CUDA_GRAPHS=0: each kernel launched on
#          its own) and 32 x 1 (a small model: launches set its pace);
#          opt-6.7b all on the GPU at 4 x 1 and 32 x 1, and 4-bit at 4 x 1 and 32 x 1
#          (--compress-weight, FlexGen's too); opt-6.7b at 4 x 1 again with
#          FLEXGEN_CUDA_PRODUCTS=cublas (cuBLAS's default algorithm for every product, none
#          timed); opt-13b offloaded (weights 40/60, cache and activations on the cpu,
#          --cpu-cache-compute, 32 x 4); the llama-2-7b shape all on the GPU, fp16 and 4-bit
#          (FlexGen has no LLaMA); where ncu is found, one decode step's kernels by GPU time and
#          DRAM bytes read (opt-6.7b, 4 x 1 and 32 x 1, fp16 and 4-bit; ncu_window below says how),
#          and ncu's warp-state and memory sections on one decode launch of the 4-bit product
#          (4 x 1) and of attention (32 x 1) (decode_stalls), and one prefill layer's kernels at
#          32 x 1 (ncu_window). 32 tokens are generated, 8 in the offloaded rows (FlexGen's opt-13b
#          decodes at about 30 token/s).
#          Each row of ours gives the counters of its busiest decode step (host waits, launches,
#          cuBLAS products, copies in), and where the card is known, the decode's share of the
#          weights' read limit and prefill's of the dense fp16 peak.
#   big    the paper's headline, OPT-175B 4-bit (weights and cache), beside the cost model's
#          prediction for the same run (a profile of this machine, `flexgen profile`, first):
#          all on the GPU where it fits (about 98 GB of weights: an H200; elsewhere the plan
#          says in one line that it does not), and as the paper's T4 ran it, --gpu-mem 16G with
#          the weights in CPU memory (8 x 2, half the cache on the GPU, 8 tokens); the cost
#          model's T4 predictions of Table 2's rows (hardware/t4-flexgen.json); then, while time
#          is left, opt-13b with --schedule diagonal, opt-6.7b with --policy auto, opt-30b with
#          FlexGen's published policy (weights 20/80, cache on the cpu, 48 x 3), and opt-6.7b at
#          32 x 1 and at 4 x 1 with §5's top-K (--attn-sparsity 0.1, FlexGen's too; at 4 x 1 the
#          split's spans score the keys), and at 4 x 1 with top-K over a cache on the cpu tier (of
#          V, the kept rows alone cross the link).
# Every run has a limit of its own and none starts past its half's 5 minutes (a row then says so).
# Results: $OUT/gpu-check.md, and at most 8 logs beside it: build.log, suites.log, sanitizer.log,
# kjv.log, speed.log, flexgen.log, kernels.log, big.log; the runs' own output (JSON, FlexGen's
# report, ncu's table, the cost model's predictions) in $OUT/.data, from which the markdown is
# written (scripts/gpu_check_report.py). The halves may run as separate commands with the same OUT,
# in any order; a half run again replaces its results. The exit status is 1 if a check failed, 2 for
# bad usage. Ctrl-C (SIGINT), SIGTERM or SIGHUP (its terminal hung up) stops the run at once: the
# running step's processes are ended (each run under a limit leads a process group of its own, which
# a terminal's Ctrl-C or hang-up does not reach), FlexGen's offload directory is removed, and the
# exit status is 130, 143 or 129.
#
# --dry: the same plumbing on the emulated GPU (./flexgen-emu; docs/GPU.md), on models/opt-kjv and
# models/llama-kjv at prompt 16 and 4 tokens, in under a minute, without FlexGen, compute-sanitizer
# or ncu: what CI runs.
# --bundle DIR: what the machine lacks, from scripts/gpu_bundle.sh's bundle (docs/GPU.md,
# "Without a network"): the build's libraries (make DEPS=), FlexGen's wheel and its tokenizer.
#
# Usage: bash scripts/gpu_check.sh [--bundle DIR] [--dry] [check] [speed] [big]
#        (no half: all three, big last)
# Environment: OUT [gpu-check-<UTC time>], PYTHON (with a CUDA build of torch) [python3], WEIGHTS
# (dummy weights on disk) [~/.cache/flexgen], OFFLOAD (the disk tier) [/var/tmp], ONLY (row names,
# e.g. "opt-6.7b-32x1 opt-175b-4bit-t4 stalls-q4": the speed and big halves skip every other row,
# Nsight Compute's too: kernels, kernels-4bit, kernels-32x1, kernels-4bit-32x1, prefill-32x1,
# stalls-q4, stalls-attention) [every row], BASE (a second checkout, e.g. of the commit before a
# change: the check half builds its flexgen too, and each row of ours runs it first, the same way,
# for the table's this / base) [none], FLEXGEN (0: FlexGen's runs are left out; row names: FlexGen
# runs beside those rows alone) [1], HALF_SECONDS (the speed and big halves' time each: less where a
# command has less than 5 minutes, more for longer runs) [290]
set -uo pipefail

usage="usage: bash scripts/gpu_check.sh [--bundle DIR] [--dry] [check] [speed] [big]"
BUNDLE="" DRY=0 HALVES=""
while [ $# -gt 0 ]; do
    case $1 in
        --bundle) [ $# -ge 2 ] || { echo "gpu_check.sh: --bundle needs a directory; $usage" >&2; exit 2; }
            BUNDLE=$2; shift 2 ;;
        --dry) DRY=1; shift ;;
        check | speed | big) HALVES="$HALVES $1"; shift ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
HALVES=${HALVES:-check speed big}
HALF_SECONDS=${HALF_SECONDS:-290}
case $HALF_SECONDS in
    '' | *[!0-9]*) echo "gpu_check.sh: HALF_SECONDS must be whole seconds, got '$HALF_SECONDS'" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 2
# The bundle before OUT is made, so that a wrong --bundle leaves no directory behind.
if [ -n "$BUNDLE" ]; then
    DEPS=$(bash scripts/gpu_bundle.sh prefix "$BUNDLE") || exit 2
    export DEPS PYTHONPATH=$DEPS/python${PYTHONPATH:+:$PYTHONPATH}
    export HF_HOME=$DEPS/hf HF_HUB_CACHE=$DEPS/hf/hub HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi

OUT=${OUT:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
PYTHON=${PYTHON:-python3} WEIGHTS=${WEIGHTS:-$HOME/.cache/flexgen} OFFLOAD=${OFFLOAD:-/var/tmp}
ONLY=${ONLY:-} BASE=${BASE:-} FLEXGEN=${FLEXGEN:-1}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
JOBS=$(nproc)
failed=0

# A run under a limit goes in the background and the script waits for it, so that a signal's trap
# runs at once rather than after the run: `timeout` leads a process group of its own, whose every
# process the trap ends (TERM; KILL to what is left once `timeout` has ended, at most its -k 10 s).
running="" scratch=""
exec 9>&2 # the script's stderr, for stop(), which runs inside a call whose output goes to a log
limited() { # LIMIT command...: runs it under LIMIT seconds; its exit status
    timeout -k 10 "$1" "${@:2}" 9>&- &
    running=$!
    wait "$running"
    local rc=$?
    running=""
    return $rc
}
stop() { # SIGNAL STATUS
    trap '' INT TERM HUP
    if [ -n "$running" ]; then
        kill -TERM -- "-$running" 2>/dev/null || kill -TERM "$running" 2>/dev/null
        wait "$running" 2>/dev/null
        kill -KILL -- "-$running" 2>/dev/null
    fi
    [ -z "$scratch" ] || rm -rf "$scratch"
    echo "gpu_check.sh: stopped by SIG$1; the results so far are in $OUT/.data" >&9
    exit "$2"
}
trap 'stop INT 130' INT
trap 'stop TERM 143' TERM
trap 'stop HUP 129' HUP # the terminal hung up

if [ "$DRY" = 1 ]; then
    BIN=./flexgen-emu TESTS=./build-emu/test_flexgen GPU_MEM=1G GPU_MEM_32=1G
    PROMPT=16 GEN=4 GEN_OFFLOADED=4
    export GOMP_SPINCOUNT=1000 # the emulated kernels run on one thread (the Makefile's EMU_ENV)
else
    BIN=./flexgen TESTS=./build/test_flexgen GPU_MEM=16G GPU_MEM_32=32G # 32 x 1's cache needs 22G
    PROMPT=512 GEN=32 GEN_OFFLOADED=8
fi

record() { # HALF STEP RESULT SECONDS NOTE: a row of the results
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$OUT/.data/steps.tsv"
    echo "== $2: $3 in $4 s${5:+: $5}"
    [ "$3" != fail ] || failed=1
}

step() { # HALF NAME LIMIT LOG command...: run under its limit, output appended to LOG; recorded
    local half=$1 name=$2 limit=$3 log=$4 start rc=0
    shift 4
    echo "== $name (at most $limit s)" | tee -a "$OUT/$log"
    start=$(date +%s)
    limited "$limit" bash -c '"$@"' step "$@" >> "$OUT/$log" 2>&1 || rc=$? # the functions are exported
    local secs=$(($(date +%s) - start)) note
    note=$(grep -m 1 -E '^ +[0-9]+\. tests/|ERROR SUMMARY: [1-9]|error:|^flexgen:|differ' "$OUT/$log" | head -c 300)
    case $rc in
        0) record "$half" "$name" pass "$secs" "" ;;
        3) record "$half" "$name" skip "$secs" "$(tail -n 1 "$OUT/$log")" ;;
        124 | 137) record "$half" "$name" fail "$secs" "stopped after $limit s" ;;
        *) record "$half" "$name" fail "$secs" "${note:-exit status $rc; see $log}" ;;
    esac
}

sm_of_card() { nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '. '; }

do_build() {
    if [ "$DRY" = 1 ]; then
        make -j"$JOBS" flexgen-emu build-emu/test_flexgen || return
        [ -z "$BASE" ] || make -C "$BASE" -j"$JOBS" flexgen-emu
        return
    fi
    local sm
    sm=$(sm_of_card) || { echo "no GPU: nvidia-smi cannot say its compute capability"; return 1; }
    # built for this card's SM alone
    rm -f build/flexgen_cu.o build/cuda_device_cu.o build/test_kernels.o
    make -j"$JOBS" flexgen build/test_flexgen CUDA_SM="$sm" || return
    [ -z "$BASE" ] || make -C "$BASE" -j"$JOBS" flexgen CUDA_SM="$sm"
}

do_suites() {
    local rc=0 suite
    for suite in kernels gpu; do
        if [ "$DRY" = 1 ] && [ $suite = gpu ]; then # the counters' test stands for the suite
            FLEXGEN_BIN=$BIN "$TESTS" gpu "a decode step on the gpu tier*" || rc=1
        else
            FLEXGEN_BIN=$BIN "$TESTS" $suite || rc=1
        fi
    done
    ! grep -q 'suite skipped' "$OUT/suites.log" || { echo "the GPU suites skipped"; rc=1; }
    return $rc
}

do_sanitizer() {
    [ "$DRY" = 0 ] || { echo "skipped: compute-sanitizer needs a GPU"; return 3; }
    local cs
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    FLEXGEN_BIN=$BIN "$cs" --tool memcheck --error-exitcode 1 "$TESTS" kernels
}

do_kjv() {
    local rc=0 model device
    for model in opt-kjv llama-kjv; do
        local prompts=(--prompt "In the beginning God" --prompt "And the LORD spake unto Moses, saying," --gen-len 16)
        [ $model = opt-kjv ] || prompts=(--prompt "Speak unto the children of" --prompt "And they shall make an" --gen-len 12)
        local ran=1
        for device in cuda cpu; do
            "$BIN" --quiet --model "models/$model" --device $device "${prompts[@]}" > "$OUT/$model-$device.txt" || ran=0
            echo "$model, --device $device:"
            sed '/^model size: /,$d' "$OUT/$model-$device.txt" | tee "$OUT/$model-$device.text"
        done
        if [ $ran = 0 ]; then echo "$model: a run failed"; rc=1
        elif cmp -s "$OUT/$model-cuda.text" "$OUT/$model-cpu.text"; then echo "$model: the same text"
        else echo "$model: the texts differ"; rc=1; fi
        rm -f "$OUT/$model"-{cuda,cpu}.{txt,text}
    done
    return $rc
}

# ---- the speed half: each row a run of ours and, where FlexGen has the model, one of FlexGen's

HALF_END=0
time_left() { echo $((HALF_END - $(date +%s))); }

# The rows of the half that runs: each row's name a line of .data/$ROWS, whose files a run of the
# half again first removes. ROW_GPU_MEM: a row's --gpu-mem (empty: the device's own memory).
ROWS=rows LOG=speed.log ROW_GPU_MEM=""
start_rows() { # LIST LOG: the half's rows begin again
    ROWS=$1 LOG=$2
    if [ -f "$OUT/.data/$ROWS" ]; then
        while read -r name; do
            rm -f "$OUT/.data/$name".{json,base.json,flexgen,predicted}
        done < "$OUT/.data/$ROWS"
    fi
    rm -f "$OUT/.data/$ROWS"
}

ours() { # NAME TIMEOUT flags...: its --json into .data/NAME.json (BASE's: NAME.base.json), its
    # stderr into the half's log
    local name=$1 limit=$2 cap=() bin out
    shift 2
    [ -z "$ROW_GPU_MEM" ] || cap=(--gpu-mem "$ROW_GPU_MEM")
    for bin in ${BASE:+"$BASE/${BIN#./}"} "$BIN"; do
        out=$name.json
        [ "$bin" = "$BIN" ] || out=$name.base.json
        echo "== ours ($bin), $name: $*" >> "$OUT/$LOG"
        limited "$limit" "$bin" --quiet --json --warmup --device cuda "${cap[@]}" \
            --path "$WEIGHTS" --offload-dir "$OFFLOAD" "$@" > "$OUT/.data/$out" 2>> "$OUT/$LOG" ||
            echo "failed: exit status $? ($LOG)" > "$OUT/.data/$out"
    done
}

predict() { # NAME MODEL GEN flags...: the cost model's prediction of a row into .data/NAME.predicted
    local name=$1 model=$2 gen=$3
    shift 3
    [ "$DRY" = 0 ] || model=models/opt-kjv
    limited 60 "$BIN" policy --evaluate --model "$model" --prompt-len "$PROMPT" --gen-len "$gen" "$@" \
        > "$OUT/.data/$name.predicted" 2>&1 || echo "no prediction: exit status $?" >> "$OUT/.data/$name.predicted"
}

flexgen_module() { # the module of FlexGen's that imports, with torch on a GPU; else why not
    local m
    for m in flexgen flexllmgen; do
        if "$PYTHON" -c "import torch, $m.flex_opt, sys; sys.exit(not torch.cuda.is_available())" 2>> "$OUT/flexgen.log"; then
            echo "$m"
            return 0
        fi
    done
    echo "FlexGen (flexgen 0.1.8 with a CUDA build of torch) does not import in $PYTHON"
    return 1
}

theirs() { # NAME TIMEOUT MODEL GEN flags...: FlexGen's report into .data/NAME.flexgen
    local name=$1 limit=$2 model=$3 gen=$4 dir
    shift 4
    if ! FLEXGEN_MODULE=${FLEXGEN_MODULE:-$(flexgen_module)}; then
        echo "not run: $FLEXGEN_MODULE" > "$OUT/.data/$name.flexgen"
        return
    fi
    dir=$(mktemp -d "$OFFLOAD/flexgen-offload.XXXXXX") || return
    scratch=$dir
    echo "== FlexGen, $name: $*" >> "$OUT/flexgen.log"
    limited "$limit" "$PYTHON" -m "$FLEXGEN_MODULE.flex_opt" --model "facebook/$model" --path _DUMMY_ \
        --offload-dir "$dir" --prompt-len "$PROMPT" --gen-len "$gen" "$@" > "$OUT/.data/$name.flexgen" 2>> "$OUT/flexgen.log" ||
        echo "failed: exit status $? (flexgen.log)" >> "$OUT/.data/$name.flexgen"
    rm -rf "$dir"
    scratch=""
}

flexgen_beside() { # NAME: whether FLEXGEN asks for FlexGen's run beside the row
    case $FLEXGEN in
        0) return 1 ;;
        1) return 0 ;;
        *) [[ " $FLEXGEN " == *" $1 "* ]] ;;
    esac
}

row() { # NAME MODEL GEN FLEXGEN(0|1) flags...: a row, if time is left
    local name=$1 model=$2 gen=$3 with_flexgen=$4 left
    shift 4
    [[ -z "$ONLY" || " $ONLY " == *" $name "* ]] || return 0
    left=$(time_left)
    if [ "$left" -lt 30 ]; then
        echo "not run: the half's time is spent" > "$OUT/.data/$name.json"
        return
    fi
    echo "$name" >> "$OUT/.data/$ROWS"
    local m=$model
    [ "$DRY" = 0 ] || m=models/$([ "${model#llama}" = "$model" ] && echo opt-kjv || echo llama-kjv)
    ours "$name" "$((left - 5))" --model "$m" --prompt-len "$PROMPT" --gen-len "$gen" "$@"
    if [ "$with_flexgen" = 1 ] && [ "$DRY" = 0 ] && flexgen_beside "$name"; then
        left=$(time_left)
        if [ "$left" -ge 30 ]; then theirs "$name" "$((left - 5))" "$model" "$gen" "$@"
        else echo "not run: the half's time is spent" > "$OUT/.data/$name.flexgen"; fi
    fi
}

do_speed() {
    HALF_END=$(($(date +%s) + HALF_SECONDS))
    start_rows rows speed.log
    ROW_GPU_MEM=$GPU_MEM
    rm -f "$OUT/.data"/kernels* "$OUT/.data"/prefill-32x1* "$OUT/.data"/stalls-*
    local g=$GEN o=$GEN_OFFLOADED big=32
    [ "$DRY" = 0 ] || big=4
    local gpu=(--percent 100 0 100 0 100 0 --num-gpu-batches 1)
    local offloaded=(--percent 40 60 0 100 0 100 --gpu-batch-size "$big" --num-gpu-batches 4 --cpu-cache-compute)
    row opt-1.3b-4x1 opt-1.3b "$g" 1 "${gpu[@]}" --gpu-batch-size 4
    FLEXGEN_CUDA_GRAPHS=0 row opt-1.3b-4x1-no-graphs opt-1.3b "$g" 0 "${gpu[@]}" --gpu-batch-size 4
    row opt-1.3b-32x1 opt-1.3b "$g" 1 "${gpu[@]}" --gpu-batch-size "$big"
    row opt-6.7b-4x1 opt-6.7b "$g" 1 "${gpu[@]}" --gpu-batch-size 4
    ROW_GPU_MEM=$GPU_MEM_32 row opt-6.7b-32x1 opt-6.7b "$g" 1 "${gpu[@]}" --gpu-batch-size "$big"
    row opt-6.7b-4bit opt-6.7b "$g" 1 "${gpu[@]}" --gpu-batch-size 4 --compress-weight
    ROW_GPU_MEM=$GPU_MEM_32 row opt-6.7b-4bit-32x1 opt-6.7b "$g" 1 "${gpu[@]}" --gpu-batch-size "$big" \
        --compress-weight
    FLEXGEN_CUDA_PRODUCTS=cublas row opt-6.7b-4x1-cublas opt-6.7b "$g" 0 "${gpu[@]}" --gpu-batch-size 4
    row opt-13b-offloaded opt-13b "$o" 1 "${offloaded[@]}"
    row llama-2-7b-fp16 llama-2-7b "$g" 0 "${gpu[@]}" --gpu-batch-size 4
    row llama-2-7b-4bit llama-2-7b "$g" 0 "${gpu[@]}" --gpu-batch-size 4 --compress-weight
    ncu_window kernels-32x1 "$big" decode
    ncu_window kernels-4bit 4 decode --compress-weight
    decode_stalls q4 q4_rows_kernel 4 64 --compress-weight
    decode_stalls attention attention_span_kernel "$big" 40
    ncu_window prefill-32x1 "$big" prefill
    ncu_window kernels 4 decode
    ncu_window kernels-4bit-32x1 "$big" decode --compress-weight
    return 0
}

# The big half: OPT-175B 4-bit beside the cost model's prediction of each run, the paper's T4
# rows as the cost model predicts them, then the rows the speed half has no time for.
do_big() {
    HALF_END=$(($(date +%s) + HALF_SECONDS))
    start_rows rows-big big.log
    rm -f "$OUT/.data"/t4-*.predicted
    local g=$GEN o=$GEN_OFFLOADED offloaded b30=48 hw=() mem=()
    [ "$DRY" = 0 ] || b30=4
    offloaded=(--percent 40 60 0 100 0 100 --gpu-batch-size "$([ "$DRY" = 1 ] && echo 4 || echo 32)"
        --num-gpu-batches 4 --cpu-cache-compute)
    if [ "$DRY" = 1 ]; then # the emulated GPU's profile means nothing: the T4's constants
        hw=(--hw hardware/t4-flexgen.json) mem=(--cpu-mem 8G --disk-mem 100G)
    else # this machine's profile, once, for the predictions
        limited 120 "$BIN" profile --device cuda >> "$OUT/big.log" 2>&1 || echo "profile: exit status $?" >> "$OUT/big.log"
    fi
    local q4=(--compress-weight --compress-cache)
    local on_gpu=(--percent 100 0 100 0 100 0 --gpu-batch-size 32 --num-gpu-batches 1 "${q4[@]}")
    # the weights in CPU memory, half the cache on the GPU: the plan's 16 GiB hold two layers'
    # staging (4-bit codes, 2.0 GB) and 5.5 GB of cache
    local t4=(--percent 0 100 50 50 100 0 --gpu-batch-size 8 --num-gpu-batches 2 "${q4[@]}")
    local device_mem=$GPU_MEM
    [ "$DRY" = 1 ] || device_mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)M
    predict opt-175b-4bit-gpu opt-175b "$g" "${hw[@]}" --gpu-mem "$device_mem" "${mem[@]}" "${on_gpu[@]}"
    ROW_GPU_MEM="" row opt-175b-4bit-gpu opt-175b "$g" 0 "${on_gpu[@]}"
    predict opt-175b-4bit-t4 opt-175b "$o" "${hw[@]}" --gpu-mem 16G "${mem[@]}" "${t4[@]}"
    ROW_GPU_MEM=16G row opt-175b-4bit-t4 opt-175b "$o" 0 "${t4[@]}"
    local paper=(--hw hardware/t4-flexgen.json --gpu-mem 16G --cpu-mem 208G --disk-mem 1500G --model opt-175b
        --prompt-len 512 --gen-len 32)
    "$BIN" policy --evaluate "${paper[@]}" --percent 0 50 0 0 0 100 --gpu-batch-size 32 --num-gpu-batches 8 \
        --cpu-cache-compute > "$OUT/.data/t4-fp16.predicted" 2>&1
    "$BIN" policy --evaluate "${paper[@]}" --percent 0 100 8 92 100 0 --gpu-batch-size 14 --num-gpu-batches 8 \
        "${q4[@]}" > "$OUT/.data/t4-4bit.predicted" 2>&1
    ROW_GPU_MEM=$GPU_MEM
    row opt-13b-diagonal opt-13b "$o" 0 "${offloaded[@]}" --schedule diagonal
    row opt-6.7b-auto opt-6.7b "$g" 0 --policy auto "${hw[@]}"
    row opt-30b-offloaded opt-30b "$o" 1 --percent 20 80 0 100 0 100 --gpu-batch-size "$b30" --num-gpu-batches 3 --cpu-cache-compute
    ROW_GPU_MEM=$GPU_MEM_32 row opt-6.7b-32x1-topk opt-6.7b "$g" 1 --percent 100 0 100 0 100 0 --num-gpu-batches 1 \
        --gpu-batch-size "$([ "$DRY" = 1 ] && echo 4 || echo 32)" --attn-sparsity 0.1
    row opt-6.7b-4x1-topk opt-6.7b "$g" 1 --percent 100 0 100 0 100 0 --num-gpu-batches 1 --gpu-batch-size 4 \
        --attn-sparsity 0.1
    row opt-6.7b-cpu-cache-topk opt-6.7b "$o" 1 --percent 100 0 0 100 100 0 --num-gpu-batches 1 --gpu-batch-size 4 \
        --attn-sparsity 0.1
    return 0
}

# Nsight Compute's path into the caller's $ncu and the half's seconds left into its $left; or, where
# ONLY leaves the row out, there is no GPU, no ncu or under 45 s left, why not into FILE (and
# fails).
ncu_ready() { # FILE (.data/ROW.txt)
    local why="" name
    name=$(basename "$1" .txt)
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
    left=$(time_left)
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then why="ONLY leaves $name out"
    elif [ "$DRY" = 1 ]; then why="no GPU"
    elif [ -z "$ncu" ]; then why="no ncu"
    elif [ "$left" -lt 45 ]; then why="too little time left"
    fi
    [ -n "$why" ] || return 0
    echo "not measured: $why" > "$1"
    return 1
}

# The caller's $run: this project's flags for opt-6.7b all on the GPU at BATCH x 1, then flags...
decode_run() { # BATCH flags...
    local batch=$1 gpu_mem=$GPU_MEM
    shift
    [ "$batch" -le 4 ] || gpu_mem=$GPU_MEM_32
    run=(--quiet --device cuda --gpu-mem "$gpu_mem" --path "$WEIGHTS" --model opt-6.7b --prompt-len "$PROMPT"
        --percent 100 0 100 0 100 0 --gpu-batch-size "$batch" --num-gpu-batches 1 "$@")
}

# Kernels by GPU time and DRAM bytes read, from Nsight Compute (ncu), over a window of launches
# that a first run's own counters place (--json's device_counts; a cuBLAS product launches one
# kernel or two, so twice its calls bound its launches), into .data/NAME.csv. NAME BATCH PART
# flags...: opt-6.7b at BATCH x 1, PART decode (a window past every prefill kernel and long enough
# to hold two whole decode steps of 24 tokens; the report divides the window's sums by the steps in
# it: attention_merge_kernel, or attention_kernel or attention_q4_kernel, runs once a layer and
# step) or prefill (the second thirty-second of prefill's launches, about one of its 32 layers
# past the first; the report divides by prefill_softmax_kernel's launches, one a sequence and
# layer). Every run launches each kernel on its own (FLEXGEN_CUDA_GRAPHS=0), so that the counters'
# launches are every kernel (a graph's are not among them).
ncu_window() {
    local name=$1 batch=$2 part=$3 ncu left skip count run gen=24
    shift 3
    [ "$part" = decode ] || gen=1
    ncu_ready "$OUT/.data/$name.txt" || return 0
    decode_run "$batch" "$@"
    local -x FLEXGEN_CUDA_GRAPHS=0
    limited $((left - 10)) "$BIN" "${run[@]}" --json --gen-len 2 > "$OUT/.data/$name-counts.json" \
        2>> "$OUT/kernels.log" || return
    read -r skip count < <("$PYTHON" -c 'import json, sys
c = json.load(open(sys.argv[1]))["device_counts"]
p, s = c["prefill"], c["decode_step_most"]
p, s = p["launches"] + 2 * p["blas_calls"], s["launches"] + 2 * s["blas_calls"]
print(*{"decode": (p, 2 * s), "prefill": (p // 32, p // 32)}[sys.argv[2]])' "$OUT/.data/$name-counts.json" "$part")
    echo "== ncu, $name: launches $skip to $((skip + count))" >> "$OUT/kernels.log"
    limited $((left - 10)) "$ncu" --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --launch-skip "$skip" \
        --launch-count "$count" "$BIN" "${run[@]}" --gen-len "$gen" > "$OUT/.data/$name.csv" 2>> "$OUT/kernels.log"
}

# Why a kernel reads below the card's rate: Nsight Compute's sections on one decode launch of it
# (speed of light, memory workload, occupancy, warp states with their stall reasons, scheduler and
# launch statistics) into .data/stalls-NAME.txt, where the half has time left. NAME KERNEL BATCH
# SKIP flags...: opt-6.7b at BATCH x 1, the launch after the kernel's first SKIP (past its first
# decode layers; prefill launches neither q4_rows_kernel nor attention_span_kernel).
decode_stalls() {
    local name=$1 kernel=$2 batch=$3 skip=$4 ncu left run
    shift 4
    ncu_ready "$OUT/.data/stalls-$name.txt" || return 0
    decode_run "$batch" "$@"
    local sections=() section
    local -x FLEXGEN_CUDA_GRAPHS=0
    for section in SpeedOfLight MemoryWorkloadAnalysis Occupancy WarpStateStats SchedulerStats LaunchStats; do
        sections+=(--section "$section")
    done
    echo "== ncu sections of $kernel, $batch x 1, launch $skip" >> "$OUT/kernels.log"
    limited $((left - 10)) "$ncu" --kernel-name "$kernel" --launch-skip "$skip" --launch-count 1 \
        "${sections[@]}" "$BIN" "${run[@]}" --gen-len 4 > "$OUT/.data/stalls-$name.txt" 2>> "$OUT/kernels.log"
}

run_half() { # HALF
    local half=$1
    if [ "$half" = check ]; then
        step check build 150 build.log do_build
        step check suites 100 suites.log do_suites
        step check sanitizer 60 sanitizer.log do_sanitizer
        step check kjv 40 kjv.log do_kjv
    else
        [ -x "$BIN" ] || step check build 150 build.log do_build
        local start
        start=$(date +%s)
        if [ "$half" = speed ]; then do_speed >> "$OUT/speed.log" 2>&1
        else do_big >> "$OUT/big.log" 2>&1; fi
        record "$half" table pass $(($(date +%s) - start)) "the rows' own results are in the table"
    fi
}

machine() {
    local gpu cuda commit
    gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
    [ "$DRY" = 0 ] || gpu="the emulated GPU (tests/cuda_emu): --dry, no timing means anything"
    cuda=$({ command -v nvcc || ls /usr/local/cuda/bin/nvcc; } 2>/dev/null | head -n 1)
    [ -n "$cuda" ] && cuda=$("$cuda" --version | grep -m 1 release) || cuda="no nvcc"
    commit=$(git rev-parse --short HEAD 2>/dev/null) || commit=unknown
    [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit, with local changes"
    echo "- GPU: ${gpu:-none} (name, memory, driver, compute capability)"
    echo "- CUDA: $cuda"
    echo "- machine: $(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo) of memory"
    echo "- commit: $commit; halves: $HALVES; $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    [ -z "$BUNDLE" ] || echo "- libraries and FlexGen: the bundle $BUNDLE (make DEPS=$DEPS), offline"
    if [ -n "$BASE" ]; then
        local base_commit
        base_commit=$(git -C "$BASE" rev-parse --short HEAD 2>/dev/null) || base_commit=unknown
        echo "- base: $BASE, commit $base_commit"
    fi
}

export OUT DRY BIN TESTS JOBS PYTHON WEIGHTS OFFLOAD BASE
export -f sm_of_card do_build do_suites do_sanitizer do_kjv
mkdir -p "$OUT/.data" || exit 2
for half in $HALVES; do # a half run again replaces its rows
    touch "$OUT/.data/steps.tsv"
    awk -F '\t' -v h="$half" '$1 != h' "$OUT/.data/steps.tsv" > "$OUT/.data/steps.tsv.tmp"
    mv "$OUT/.data/steps.tsv.tmp" "$OUT/.data/steps.tsv"
    run_half "$half"
done
machine > "$OUT/.data/machine.md"
"$PYTHON" scripts/gpu_check_report.py "$OUT" "$PROMPT" > "$OUT/gpu-check.md.tmp" && mv "$OUT/gpu-check.md.tmp" "$OUT/gpu-check.md" ||
    { echo "gpu_check.sh: cannot write $OUT/gpu-check.md" >&2; exit 1; }
echo "== results: $OUT/gpu-check.md"
exit $failed
