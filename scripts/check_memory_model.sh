#!/usr/bin/env bash
# The memory model against measured peaks, on the named sizes that fit this machine's memory
# (dummy weights, the CPU backend, where the gpu and cpu tiers are both host memory).
#
# For each size and placement, three numbers:
#   model     what the plan check counts for each tier before anything is allocated (the memory
#             model the policy search plans with): read from the line a run given 1 KiB of that
#             tier prints ("gpu tier: the plan needs 1.01 GiB ...", so to that line's precision)
#   counted   the tier's peak as the runtime counted its allocations (the report's "peak tiers")
#   rss       the process's peak resident set (/usr/bin/time), which also holds the program,
#             OpenBLAS's buffers, the threads' stacks and the prompts
# The model should equal the counted peak or exceed it by little (it plans for the largest layer
# and a full block), and rss should exceed model by the fixed overhead alone. Each row is checked
# so: model >= counted - 0.01 GiB (the printed precision) and model <= 1.05 counted + 0.01 GiB on
# each tier, and rss - (gpu + cpu counted) <= OVERHEAD GiB [0.5]; a value that cannot be read (a
# refusal worded otherwise, a report without its peaks) is an error too. The table is printed
# whole, then every row that failed, and the exit status is 1 if any did.
#
# Usage (from anywhere):
#   bash scripts/check_memory_model.sh [SIZE ...]   [qwen2.5-0.5b llama-3.2-1b tinyllama-1.1b]
#   BATCH=8 PROMPT=128 GEN=8 bash scripts/check_memory_model.sh llama-2-7b
# Environment: FLEXGEN_BIN [./flexgen], BATCH [8], PROMPT [128], GEN [8], OVERHEAD [0.5].
set -euo pipefail
for a in "$@"; do
    case "$a" in
        -h|--help) sed -n '/^# Usage/,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "check_memory_model: unknown option '$a' (try --help)" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.."
FLEXGEN=${FLEXGEN_BIN:-./flexgen}
BATCH=${BATCH:-8}
PROMPT=${PROMPT:-128}
GEN=${GEN:-8}
OVERHEAD=${OVERHEAD:-0.5}
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(qwen2.5-0.5b llama-3.2-1b tinyllama-1.1b)
[ -x /usr/bin/time ] || { echo "check_memory_model: /usr/bin/time is missing (apt-get install time)" >&2; exit 2; }
[ -x "$FLEXGEN" ] || { echo "check_memory_model: $FLEXGEN is missing (make)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0

# The GiB a plan needs on tier $1 ("gpu" or "cpu"), from the refusal at 1 KiB; 0 when the run
# fits there (the plan puts nothing on that tier); an error for any other failure.
model_need() {
    local tier=$1; shift
    local line rc=0
    line=$("$FLEXGEN" "$@" --"$tier"-mem 1K 2>&1 >/dev/null) || rc=$?
    if [ "$rc" -eq 0 ]; then echo 0; return 0; fi
    case $line in
        *"$tier tier: the plan needs "*)
            echo "$line" | sed -E "s/.*$tier tier: the plan needs ([0-9.]+) (KiB|MiB|GiB).*/\1 \2/" |
                awk '{ v = $1; if ($2 == "KiB") v /= 1048576; if ($2 == "MiB") v /= 1024; printf "%.3f", v }' ;;
        *) echo "check_memory_model: --$tier-mem 1K: expected the plan's refusal with what it needs, got: $line" >&2
           return 1 ;;
    esac
}

# Whether the model ($2) and the counted peak ($3) of tier $1 agree; a line on stderr if not.
agree() {
    awk -v m="$2" -v c="$3" 'BEGIN { exit !(m + 0.01 >= c && m <= 1.05 * c + 0.01) }' && return 0
    echo "check_memory_model: $size, $name: the $1 tier's model $2 GiB against $3 counted" >&2
    return 1
}

printf '%s, %s threads; batch %s, prompt %s, gen %s; GiB\n' "$(lscpu | sed -n 's/^Model name: *//p')" \
    "$(nproc)" "$BATCH" "$PROMPT" "$GEN"
printf '| %-15s | %-26s | %-17s | %-17s | %-9s |\n' size placement "gpu model/counted" "cpu model/counted" "rss"
printf '| --- | --- | --- | --- | --- |\n'
for size in "${sizes[@]}"; do
    for placement in "100 0 100 0 100 0" "50 50 0 100 100 0" "compress"; do
        args=(--model "$size" --device cpu --prompt-len "$PROMPT" --gen-len "$GEN" --gpu-batch-size "$BATCH"
              --num-gpu-batches 1 --offload-dir "$work" --path "$work")
        if [ "$placement" = compress ]; then
            args+=(--compress-weight); name="gpu, 4-bit weights"
        else
            # shellcheck disable=SC2206
            args+=(--percent $placement); name="--percent $placement"
        fi
        gpu=$(model_need gpu "${args[@]}")
        cpu=$(model_need cpu "${args[@]}")
        out=$(/usr/bin/time -f 'rss_kib %M' "$FLEXGEN" "${args[@]}" 2>&1) ||
            { echo "check_memory_model: $size, $name: $(echo "$out" | grep flexgen: | head -1)" >&2; exit 1; }
        read -r counted_gpu counted_cpu < <(echo "$out" | sed -n 's/^peak tiers: gpu \([0-9.]*\) GB.*cpu \([0-9.]*\) GB.*/\1 \2/p') || true
        rss=$(echo "$out" | awk '/^rss_kib/ { printf "%.3f", $2 / 1048576 }')
        printf '| %-15s | %-26s | %7s / %-7s | %7s / %-7s | %-9s |\n' "$size" "$name" "$gpu" "$counted_gpu" \
            "$cpu" "$counted_cpu" "$rss"
        if [ -z "${counted_gpu:-}" ] || [ -z "${counted_cpu:-}" ] || [ -z "$rss" ]; then
            echo "check_memory_model: $size, $name: no 'peak tiers:' line or no peak RSS in the run's output" \
                >>"$work/failures"
            failed=1
            continue
        fi
        agree gpu "$gpu" "$counted_gpu" 2>>"$work/failures" || failed=1
        agree cpu "$cpu" "$counted_cpu" 2>>"$work/failures" || failed=1
        awk -v r="$rss" -v g="$counted_gpu" -v c="$counted_cpu" -v o="$OVERHEAD" 'BEGIN { exit !(r - g - c <= o) }' ||
            { echo "check_memory_model: $size, $name: peak RSS $rss GiB is more than $OVERHEAD GiB past the tiers" \
                  "($counted_gpu + $counted_cpu)" >>"$work/failures"; failed=1; }
    done
done
[ -s "$work/failures" ] && cat "$work/failures" >&2
exit "$failed"
