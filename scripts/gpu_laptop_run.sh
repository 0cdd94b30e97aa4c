#!/usr/bin/env bash
# A first run of the CUDA backend on a laptop GPU of 4 to 8 GB (an RTX 3050 or 4060 laptop GPU), in
# a few minutes, before the server run (scripts/gpu_first_run.sh: opt-6.7b and opt-13b). It prints
# the GPU (nvidia-smi: name, memory, compute capability), then runs these steps, each command
# stopped after its own time limit:
#   build   make -j flexgen (and flexgen-emu where FLEXGEN names it)                       [60 s]
#   test    make test SUITE=kernels (each kernel against its CPU reference), then SUITE=gpu
#           (the CUDA backend against the CPU over placements), each natively on the GPU and on
#           the emulated GPU (docs/GPU.md); where nvidia-smi sees a GPU, a native suite that
#           skipped fails the step                                                   [90 s, 45 s]
#   kjv     models/opt-kjv (two prompts, 16 tokens each) and models/llama-kjv (the LLaMA
#           family's kernels: RMSNorm, RoPE, grouped-query attention, SwiGLU; two prompts, 12
#           tokens each), greedy, with --device cuda and --device cpu: both texts are printed and
#           must be identical. At every step of these prompts the CPU's top two logits are at
#           least 2.8% of the largest logit apart, more than twice the 1% of it by which
#           tests/test_cuda.c lets CUDA's logits differ from the CPU's: the margin beyond which
#           that suite too requires the same token                                   [15 s each]
#   models  dummy weights, prompt 128, 32 generated tokens, 2 GPU batches of 4, with policies
#           that fit a 4 GB card: opt-125m all on the GPU (--gpu-mem 4G); opt-1.3b all on the GPU
#           (--gpu-mem 4G: the memory model's plan is 3.21 GiB, 2.45 of them weights) and with its
#           weights split 50/50 between GPU and CPU (--gpu-mem 3G); then a table of throughput
#           and peak GPU memory (the gpu tier's peak, --json's peak_gpu_bytes)         [35 s each]
# The limits add up to 6 minutes. A failed or stopped command does not stop the next; the exit
# status is 1 if any failed, 2 for bad usage. A GPU that this build has no code for (compute
# capability below 7.5: a GTX 10xx is 6.1, a V100 7.0) fails test, kjv and models with flexgen's
# one line naming its capability and the ones built.
#
# Usage: bash scripts/gpu_laptop_run.sh [--help]
# Environment:
#   FLEXGEN  the binary that kjv and models run [./flexgen]; ./flexgen-emu runs them on the
#            emulated GPU, on a machine without one: FLEXGEN=./flexgen-emu STEPS=kjv MODELS=opt-kjv
#   MODELS   [opt-kjv llama-kjv opt-125m opt-1.3b]: opt-kjv and llama-kjv are the kjv step's
#            models; another name (OPT or LLaMA) runs all on the GPU at --gpu-mem 4G in the
#            models step
#   STEPS    the steps to run, separated by spaces or commas [build test kjv models]
#   OUT      the directory of each command's NAME.out, NAME.err and NAME.cmd (the command)
#            [gpu-laptop-run-<UTC time>]
set -uo pipefail
case ${1:-} in
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "gpu_laptop_run.sh: unknown argument '$1'; usage: bash scripts/gpu_laptop_run.sh [--help]" >&2; exit 2 ;;
esac
FLEXGEN=${FLEXGEN:-./flexgen} MODELS=${MODELS:-opt-kjv llama-kjv opt-125m opt-1.3b}
STEPS=${STEPS:-build test kjv models}
STEPS=${STEPS//,/ }
for step in $STEPS; do
    case $step in
        build | test | kjv | models) ;;
        *) echo "gpu_laptop_run.sh: no step '$step'; the steps: build test kjv models" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-gpu-laptop-run-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" || exit 2
fails=0 failed_steps=""

fail() { echo "FAIL $*"; fails=$((fails + 1)); }
run() { # LIMIT NAME command...: stdout in $OUT/NAME.out, stderr in NAME.err, the command in NAME.cmd;
    # 0, or 1 with a line (and in $why) saying how it failed
    local limit=$1 name=$2 rc=0
    shift 2
    printf '%q ' "$@" > "$OUT/$name.cmd"
    timeout -k 5 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err" < /dev/null || rc=$?
    [ "$rc" = 0 ] && return 0
    why=$({ grep -h -m 1 -E 'error:|^flexgen:|^cuda-emu:|^timeout:' "$OUT/$name.err" || tail -n 1 "$OUT/$name.err"; } | head -c 300)
    case $rc in
        124 | 137) why="stopped after $limit s" ;;
        *) why="exit status $rc: ${why:-no output on stderr}" ;;
    esac
    fail "$name: $1 failed ($why); the command is in $OUT/$name.cmd"
    return 1
}

echo "== the GPU"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv 2>&1 || nvidia-smi -L
else
    echo "no nvidia-smi: no NVIDIA driver on this machine"
fi

for step in $STEPS; do
    start=$(date +%s) fails_before=$fails skip=0
    echo "== $step"
    case $step in
    build)
        targets=flexgen
        [ "${FLEXGEN#./}" = flexgen-emu ] && targets="flexgen flexgen-emu"
        # shellcheck disable=SC2086
        if run 60 build make -j"$(nproc)" $targets && ! make -s print-cflags | grep -q -- -DFLEXGEN_CUDA; then
            fail "build: without CUDA (no nvcc on the PATH or in /usr/local/cuda/bin; NVCC= names one)"
        fi ;;
    test)
        for suite in kernels gpu; do
            limit=90 && [ $suite = gpu ] && limit=45
            echo "make test SUITE=$suite:"
            run $limit "test-$suite" make -j"$(nproc)" test SUITE=$suite
            # CUnit's summary of each binary (native, then emulated), the first failures, the skips
            awk '$1 == "tests" && NF == 6 { print "  " (++n == 1 ? "native" : "emulated") ": " $3 " tests ran, " $5 " failed" }
                / suite (skipped|on the emulated)/ || (/^ +[0-9]+\. tests\// && failures++ < 3)' "$OUT/test-$suite.out"
            skipped=$(grep -h -m 1 -o '\(GPU\|kernel\) suite skipped: .*' "$OUT/test-$suite.out")
            if [ -n "$skipped" ] && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
                fail "test-$suite: a GPU is present, but the native suite skipped: ${skipped#* skipped: }"
            fi
        done ;;
    kjv)
        kjv_ran=0
        for model in opt-kjv llama-kjv; do
            case " $MODELS " in *" $model "*) ;; *) continue ;; esac
            kjv_ran=1 ran=0
            if [ $model = opt-kjv ]; then
                prompts=(--prompt "In the beginning God" --prompt "And the LORD spake unto Moses, saying," --gen-len 16)
            else
                prompts=(--prompt "Speak unto the children of" --prompt "And they shall make an" --gen-len 12)
            fi
            for device in cuda cpu; do
                run 15 "$model-$device" "$FLEXGEN" --quiet --model "models/$model" --device "$device" "${prompts[@]}" || break
                ran=$((ran + 1))
                # the generated text: what comes before the report
                sed '/^model size: /,$d' "$OUT/$model-$device.out" > "$OUT/$model-$device.txt"
                echo "$model, --device $device (the report's $(grep -o 'device: .*' "$OUT/$model-$device.out")):"
                cat "$OUT/$model-$device.txt"
            done
            if [ $ran = 2 ] && cmp -s "$OUT/$model-cuda.txt" "$OUT/$model-cpu.txt"; then
                echo "identical"
            elif [ $ran = 2 ]; then
                fail "kjv: $model: --device cuda and --device cpu generated different text"
            fi
        done
        [ $kjv_ran = 1 ] || { skip=1 && echo "skipped: neither opt-kjv nor llama-kjv is in MODELS"; } ;;
    models)
        common=(--device cuda --quiet --json --prompt-len 128 --gen-len 32 --gpu-batch-size 4 --num-gpu-batches 2)
        rows=()
        for model in $MODELS; do
            case $model in
                opt-kjv | llama-kjv) continue ;;
                opt-1.3b) policies=("gpu --gpu-mem 4G --percent 100 0 100 0 100 0"
                                    "split --gpu-mem 3G --percent 50 50 100 0 100 0") ;;
                *) policies=("gpu --gpu-mem 4G --percent 100 0 100 0 100 0") ;;
            esac
            for policy in "${policies[@]}"; do
                name=${model//\//_}-${policy%% *} policy=${policy#* }
                # shellcheck disable=SC2086
                if run 35 "$name" "$FLEXGEN" --model "$model" "${common[@]}" $policy; then
                    rows+=("$(awk -v n="$name" -v p="$policy" -F '[:,]' '{
                        for (i = 1; i < NF; i++) v[$i] = $(i + 1)
                        printf "| %s | `%s` | %.1f | %.1f | %.2f |", n, p, v["\"total_throughput\""],
                            v["\"decode_throughput\""], v["\"peak_gpu_bytes\""] / 2^30 }' "$OUT/$name.out")")
                else
                    rows+=("| $name | \`$policy\` | failed (${why//|//}) | | |")
                fi
            done
        done
        if [ ${#rows[@]} = 0 ]; then
            skip=1 && echo "skipped: no model but the kjv step's in MODELS"
        else
            echo "prompt 128, gen 32, --gpu-batch-size 4 --num-gpu-batches 2, dummy weights, --device cuda:"
            echo "| run | policy | total token/s | decode token/s | peak GPU GiB |"
            echo "|---|---|---|---|---|"
            printf '%s\n' "${rows[@]}"
        fi ;;
    esac
    result=pass && [ $skip = 1 ] && result=skip
    [ $fails != "$fails_before" ] && result=FAIL failed_steps+=" $step"
    echo "== $step: $result in $(($(date +%s) - start)) s"
done
if [ $fails = 0 ]; then
    echo "== passed; each command's output is in $OUT"
else
    echo "== FAILED:$failed_steps; each command's output is in $OUT"
fi
[ $fails = 0 ]
