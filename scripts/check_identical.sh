#!/usr/bin/env bash
# check_identical.sh: do two builds of flexgen compute bit-identical results?
#
#     bash scripts/check_identical.sh BASE_BIN NEW_BIN        (from the repository root)
#
# Runs both binaries with the same flags on every model checkpoint in tests/fixtures/
# (opt-tiny, opt-tiny-350m, opt-tiny-bf16, opt-tiny-text) and on opt-125m's dummy weights,
# over a matrix of policies meant to reach every path of the runtime on the CPU backend
# (--device cpu): everything on the gpu tier; weights, KV cache and activations split over
# gpu/cpu/disk by --percent (all on cpu, all on disk, three-way mixes); block shapes 1x1, 2x2,
# 2x3, 3x1 and the default 16x2 against 4 or 5 prompts (partial blocks); --overlap 0;
# --cpu-cache-compute; --compress-weight; --compress-cache; --attn-sparsity 0.5; the portable
# kernels (FLEXGEN_NO_SIMD=1); sampling (--temperature 0.8 --seed N, with and without --top-p);
# --stop-at-eos; synthetic prompts; text prompts through the tokenizer; dummy weights written
# to --path and mapped again; the policy search (`flexgen policy` and --policy auto, with a
# fixed hardware file and fixed capacities); and, where mpirun exists and the binary was built
# with MPI, 2-stage pipelines (`mpirun -np 2`, and mpirun's MPMD form with a different
# --percent per stage).
#
# Each case compares, byte for byte: the exit status, the --dump-logits file, and stdout with
# the report (from its first line, "model size: ...", on; it carries timings) left out, which
# leaves the generated texts "[i] prompt + text" (every fixture runs with opt-tiny-text's
# tokenizer, whose vocabulary holds the others', so token ids come out as text). For `flexgen
# policy` it is the printed choice, without the search's seconds. A case in which either run
# fails counts as a difference.
#
# Prints `same  <case>` or `DIFF  <case>  [what differs]` per case, then `N passed, M failed`;
# exits 1 if any case failed, 2 on bad usage. Scratch files (--offload-dir, --path, logits)
# live in a temporary directory removed on exit. 158 cases, about 1.5 minutes on a 2-core
# machine.

set -u

usage() {
    echo "usage: bash scripts/check_identical.sh BASE_BIN NEW_BIN" >&2
    exit 2
}
[ $# -eq 2 ] || usage
for b in "$1" "$2"; do
    if ! [ -f "$b" ] || ! [ -x "$b" ]; then
        echo "check_identical.sh: $b: not an executable file" >&2
        exit 2
    fi
done
BASE=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
NEW=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FIX=$ROOT/tests/fixtures
[ -d "$FIX/opt-tiny" ] || { echo "check_identical.sh: no $FIX/opt-tiny" >&2; exit 2; }

# Idle OpenMP threads sleep instead of spinning: the same results, but on a machine whose cores
# are busy with other work a run is then not many times slower.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/check_identical.XXXXXX") || exit 2
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM
for tag in base new; do mkdir -p "$TMP/$tag/off" "$TMP/$tag/weights"; done

# The policy search's hardware constants, fixed so that both binaries search the same problem.
HW=$TMP/hw.json
cat >"$HW" <<'EOF'
{"ctog_bdw": 6e9, "gtoc_bdw_cache": 1.2e10, "gtoc_bdw_hidden": 1.2e10, "dtoc_bdw": 1.4e9,
 "ctod_bdw_cache_p": 2.5e8, "ctod_bdw_hidden_p": 2.5e8, "ctod_bdw_g": 2.5e8,
 "mm_flops_p": 1.3e11, "mm_flops_g": 1.7e11, "bmm_flops_p": 1e11, "bmm_flops_g": 4e10,
 "cpu_flops": 4e10, "dequant_bdw": 5e9, "mem_bdw": 8e9, "gpu_is_host": true}
EOF
TOKENIZER=(--vocab "$FIX/opt-tiny-text/vocab.json" --merges "$FIX/opt-tiny-text/merges.txt")
# opt-tiny-text's prompts (tests/fixtures/opt-tiny-text/texts.json) as text, for --prompt-file
TEXT_PROMPTS=$TMP/text-prompts.txt
printf '%s\n' "Hello world" "The café is open, isn't it?" "日本語" $'  spaces\tand tabs' >"$TEXT_PROMPTS"

passed=0 failed=0

# Pipelines: mpirun present and both binaries built with MPI (one with, one without: a difference).
with_mpi() { "$1" --help 2>/dev/null | grep -q 'this build: with MPI'; }
MPI=0 MPI_NOTE=
if ! command -v mpirun >/dev/null 2>&1; then
    MPI_NOTE="no mpirun"
elif with_mpi "$BASE" && with_mpi "$NEW"; then
    MPI=1
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 # Open MPI refuses root otherwise
elif with_mpi "$BASE" || with_mpi "$NEW"; then
    failed=$((failed + 1))
    echo "DIFF  MPI support  [only one of the binaries was built with MPI]"
else
    MPI_NOTE="neither binary was built with MPI"
fi

# run TAG BIN KIND ARGS...: one run of BIN into $TMP/TAG/{out,err,rc}; its logits go to
# $TMP/TAG/logits.bin. KIND: gen (one process), policy (`flexgen policy`), mpi (2 stages;
# ARGS may hold "::" STAGE1_ARGS "::" STAGE2_ARGS after the common ones for the MPMD form).
# Leading VAR=value words of ARGS are environment for the binary.
run() {
    local tag=$1 bin=$2 kind=$3
    shift 3
    local dir=$TMP/$tag envs=() common=() s1=() s2=() part=0
    while [ $# -gt 0 ] && [[ $1 =~ ^[A-Z_]+= ]]; do envs+=("$1"); shift; done
    for a in "$@"; do
        if [ "$a" = "::" ]; then part=$((part + 1)); continue; fi
        case $part in 0) common+=("$a") ;; 1) s1+=("$a") ;; *) s2+=("$a") ;; esac
    done
    rm -f "$dir/logits.bin"
    local scratch=(--offload-dir "$dir/off" --path "$dir/weights")
    case $kind in
    gen)
        env ${envs[@]+"${envs[@]}"} "$bin" "${common[@]}" "${scratch[@]}" --device cpu --quiet \
            --dump-logits "$dir/logits.bin" >"$dir/out" 2>"$dir/err" ;;
    policy)
        env ${envs[@]+"${envs[@]}"} "$bin" policy "${common[@]}" "${scratch[@]}" --device cpu \
            >"$dir/out" 2>"$dir/err" ;;
    mpi)
        local x=(-np 1 -x OMP_NUM_THREADS=1)
        for e in ${envs[@]+"${envs[@]}"}; do x+=(-x "$e"); done
        local args=("${common[@]}" "${scratch[@]}" --device cpu --quiet --dump-logits "$dir/logits.bin")
        mpirun --oversubscribe --bind-to none --timeout 120 "${x[@]}" "$bin" "${args[@]}" \
            ${s1[@]+"${s1[@]}"} : "${x[@]}" "$bin" "${args[@]}" ${s2[@]+"${s2[@]}"} \
            >"$dir/out" 2>"$dir/err" </dev/null ;;
    esac
    echo $? >"$dir/rc"
    if [ "$kind" = policy ]; then # "search: N LPs, M plans checked, T s": T is a timing
        sed -E '/^search: /s/, [^,]* s$//' "$dir/out" >"$dir/cmp"
    else # the texts: every line before the report's first
        sed '/^model size: /,$d' "$dir/out" >"$dir/cmp"
    fi
}

# The line of stderr FILE that says why a run failed: flexgen's own, else the last.
first_error() {
    grep -m1 '^flexgen: ' "$1" || tail -n1 "$1"
}

# check LABEL KIND ARGS...: both binaries, one line of verdict.
check() {
    local label=$1 kind=$2
    shift 2
    run base "$BASE" "$kind" "$@"
    run new "$NEW" "$kind" "$@"
    local why=() rb rn
    rb=$(cat "$TMP/base/rc") rn=$(cat "$TMP/new/rc")
    [ "$rb" = 0 ] || why+=("base exit $rb: $(first_error "$TMP/base/err")")
    [ "$rn" = 0 ] || why+=("new exit $rn: $(first_error "$TMP/new/err")")
    cmp -s "$TMP/base/cmp" "$TMP/new/cmp" || why+=(stdout)
    if [ "$kind" != policy ]; then
        if [ -f "$TMP/base/logits.bin" ] && [ -f "$TMP/new/logits.bin" ]; then
            cmp -s "$TMP/base/logits.bin" "$TMP/new/logits.bin" || why+=(logits)
        else
            why+=("no logits file")
        fi
    fi
    if [ ${#why[@]} -eq 0 ]; then
        passed=$((passed + 1))
        echo "same  $label"
    else
        failed=$((failed + 1))
        local what=${why[0]} w
        for w in "${why[@]:1}"; do what+="; $w"; done
        echo "DIFF  $label  [$what]"
    fi
}

# The policy matrix, on each fixture: the flags after --model, the prompts and the tokenizer.
POLICIES=(
    ""
    "--gpu-batch-size 1 --num-gpu-batches 1"
    "--gpu-batch-size 2 --num-gpu-batches 2"
    "--gpu-batch-size 2 --num-gpu-batches 3"
    "--gpu-batch-size 3 --num-gpu-batches 1"
    "--percent 0 100 0 100 0 100 --gpu-batch-size 2 --num-gpu-batches 2"
    "--percent 0 0 0 0 0 0 --gpu-batch-size 2 --num-gpu-batches 2"
    "--percent 0 0 0 0 0 0 --gpu-batch-size 1 --num-gpu-batches 1"
    "--percent 30 30 40 30 50 25 --gpu-batch-size 4 --num-gpu-batches 2"
    "--percent 50 0 0 50 0 100 --gpu-batch-size 2 --num-gpu-batches 3"
    "--percent 0 0 0 0 0 0 --gpu-batch-size 2 --num-gpu-batches 2 --overlap 0"
    "--percent 30 30 40 30 50 25 --gpu-batch-size 2 --num-gpu-batches 3 --overlap 0"
    "--percent 100 0 0 100 100 0 --gpu-batch-size 2 --num-gpu-batches 2 --cpu-cache-compute"
    "--percent 0 50 0 50 0 50 --gpu-batch-size 2 --num-gpu-batches 3 --cpu-cache-compute"
    "--percent 30 30 40 30 50 25 --gpu-batch-size 2 --num-gpu-batches 2 --cpu-cache-compute --overlap 0"
    "--compress-weight"
    "--compress-weight --percent 0 50 100 0 100 0 --gpu-batch-size 2 --num-gpu-batches 2"
    "--compress-cache"
    "--compress-cache --percent 100 0 0 50 100 0 --gpu-batch-size 2 --num-gpu-batches 2"
    "--compress-cache --percent 100 0 0 50 100 0 --gpu-batch-size 2 --num-gpu-batches 2 --cpu-cache-compute"
    "--attn-sparsity 0.5"
    "--attn-sparsity 0.5 --percent 100 0 0 100 100 0 --gpu-batch-size 2 --num-gpu-batches 2"
    "--attn-sparsity 0.5 --percent 100 0 0 0 100 0 --gpu-batch-size 2 --num-gpu-batches 2 --cpu-cache-compute"
    "--compress-weight --compress-cache --attn-sparsity 0.5 --percent 20 40 30 30 50 25 --gpu-batch-size 2 --num-gpu-batches 2"
    "FLEXGEN_NO_SIMD=1 --compress-weight --compress-cache --attn-sparsity 0.5 --gpu-batch-size 2 --num-gpu-batches 2"
    "FLEXGEN_NO_SIMD=1 --percent 30 30 40 30 50 25 --gpu-batch-size 2 --num-gpu-batches 2 --cpu-cache-compute"
    "--temperature 0.8 --seed 5"
    "--temperature 0.8 --top-p 0.9 --seed 11 --percent 30 30 40 30 50 25 --gpu-batch-size 1 --num-gpu-batches 1"
    "--temperature 0.8 --seed 7 --compress-weight --compress-cache --attn-sparsity 0.5 --gpu-batch-size 2 --num-gpu-batches 3"
    "--stop-at-eos"
    "--stop-at-eos --temperature 0.8 --seed 3 --percent 0 0 0 0 0 0 --gpu-batch-size 2 --num-gpu-batches 2"
)
# 2-stage pipelines: common flags [:: stage 1's :: stage 2's]
PIPELINES=(
    "--gpu-batch-size 2 --num-gpu-batches 1"
    "--percent 30 30 40 30 50 25 --gpu-batch-size 2 --num-gpu-batches 2 --temperature 0.8 --seed 9 --stop-at-eos"
    "--compress-cache --attn-sparsity 0.5 --gpu-batch-size 1 --num-gpu-batches 2 :: --percent 0 0 0 0 0 0 :: --percent 0 100 0 100 0 100 --cpu-cache-compute"
)

for model in opt-tiny opt-tiny-350m opt-tiny-bf16 opt-tiny-text; do
    m=$FIX/$model
    ids=(--model "$m" --prompt-ids "$m/prompts.txt" --gen-len 8 "${TOKENIZER[@]}")
    for p in "${POLICIES[@]}"; do
        # shellcheck disable=SC2206 # the policy strings are words
        words=($p)
        envs=() flags=()
        for w in ${words[@]+"${words[@]}"}; do
            if [[ $w =~ ^[A-Z_]+= ]]; then envs+=("$w"); else flags+=("$w"); fi
        done
        check "$model ${p:-(defaults)}" gen ${envs[@]+"${envs[@]}"} "${ids[@]}" ${flags[@]+"${flags[@]}"}
    done
    # synthetic prompts (from --seed), two blocks
    check "$model --prompt-len 6 --seed 4 --gpu-batch-size 2 --num-gpu-batches 1 --percent 50 25 50 25 50 25" gen \
        --model "$m" --prompt-len 6 --seed 4 --gen-len 4 "${TOKENIZER[@]}" --gpu-batch-size 2 \
        --num-gpu-batches 1 --percent 50 25 50 25 50 25
    # the policy search: capacities that make it offload
    case $model in
    opt-tiny) gmem=600K cmem=256K ;;
    opt-tiny-text) gmem=800K cmem=512K ;;
    *) gmem=400K cmem=256K ;;
    esac
    caps=(--hw "$HW" --gpu-mem "$gmem" --cpu-mem "$cmem" --disk-mem 1G)
    check "$model policy --gpu-mem $gmem --cpu-mem $cmem" policy "${ids[@]}" "${caps[@]}"
    check "$model policy --evaluate --percent 30 30 40 30 50 25 --gpu-batch-size 2 --num-gpu-batches 2" policy \
        --evaluate "${ids[@]}" --hw "$HW" --disk-mem 1G --gpu-mem 1G --cpu-mem 1G \
        --percent 30 30 40 30 50 25 --gpu-batch-size 2 --num-gpu-batches 2
    check "$model --policy auto --gpu-mem $gmem --cpu-mem $cmem" gen "${ids[@]}" --policy auto "${caps[@]}"
    if [ "$MPI" = 1 ]; then
        for p in "${PIPELINES[@]}"; do
            # shellcheck disable=SC2206
            words=($p)
            check "$model mpirun -np 2 $p" mpi "${ids[@]}" "${words[@]}"
        done
    fi
done

# text prompts through the tokenizer
t=$FIX/opt-tiny-text
check "opt-tiny-text --prompt-file (text)" gen --model "$t" --prompt-file "$TEXT_PROMPTS" --gen-len 8
check "opt-tiny-text --prompt-file (text) --percent 0 0 0 0 0 0 --gpu-batch-size 3 --num-gpu-batches 1 --temperature 0.8 --seed 2" gen \
    --model "$t" --prompt-file "$TEXT_PROMPTS" --gen-len 8 --percent 0 0 0 0 0 0 \
    --gpu-batch-size 3 --num-gpu-batches 1 --temperature 0.8 --seed 2
check "opt-tiny-text --prompt ... --compress-weight --compress-cache --attn-sparsity 0.5" gen \
    --model "$t" --prompt "Hello world" --prompt "日本語" --gen-len 8 \
    --compress-weight --compress-cache --attn-sparsity 0.5

# opt-125m's dummy weights: written to --path on first use (fp16, then 4-bit), mapped after
d125=(--model opt-125m --prompt-len 6 --gen-len 4 --gpu-batch-size 2 --num-gpu-batches 2)
check "opt-125m (dummy) --percent 0 0 0 0 0 0" gen "${d125[@]}" --percent 0 0 0 0 0 0
check "opt-125m (dummy) --compress-weight --percent 20 30 50 50 100 0 --cpu-cache-compute" gen \
    "${d125[@]}" --compress-weight --percent 20 30 50 50 100 0 --cpu-cache-compute
check "opt-125m (dummy, weights mapped again) --percent 30 30 100 0 100 0 --temperature 0.8 --seed 0" gen \
    "${d125[@]}" --percent 30 30 100 0 100 0 --temperature 0.8 --seed 0

[ -z "$MPI_NOTE" ] || echo "(no pipeline cases: $MPI_NOTE)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
