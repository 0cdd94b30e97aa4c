#!/usr/bin/env bash
# The first run of the CUDA backend on a GPU machine, in one command. It prints the GPU
# (nvidia-smi), then runs these steps in order, each stopped after its own time limit:
#   build     make -j                                                                   [120 s]
#   test      make test SUITE=gpu, then make test: every suite                          [240 s]
#   test-gpu  make test-gpu: the GPU suite under compute-sanitizer's memcheck           [120 s]
#   test-san  make test-san: every suite under ASan and UBSan (the Makefile's
#             protect_shadow_gap=0 and tests/lsan-cuda.supp let the GPU suite run there) [330 s]
#   bench     scripts/bench_gpu.sh at --gpu-mem 16G (a T4 on a larger card): the profile, then
#             each model with its fixed policy and with --policy auto, beside the cost model's
#             bound                                                                     [270 s]
#   flexgen   FlexGen's Python implementation (PyPI's flexgen 0.1.8, module flexgen; a module
#             flexllmgen is used where flexgen is not found) on the same machine with the same
#             fixed policies, dummy weights, prompt length 512, gen length 32; where it does not
#             import or torch has no CUDA, one line saying so. FlexGen reads the tokenizer of
#             facebook/opt-30b (the Hugging Face cache, or the network) even with dummy weights.
#             A policy that needs more CPU memory than is available, by this project's memory
#             model, is not run.                                                        [210 s]
# The limits add up to 21.5 minutes, so that the whole run with the defaults (MODELS: opt-6.7b
# and opt-13b) fits in 25 minutes on a machine with 16 cores, and the steps fall in three groups
# of at most 8 minutes each, build,test,test-gpu (480 s), test-san (330 s) and bench,flexgen
# (480 s), so that each group can be a command of its own (below). A failed or stopped step
# does not stop the next. Where a GPU is present, a test step in which the GPU suite
# skipped fails; without one, the steps that need it are recorded as skipped with the reason.
#
# Without a network: `--bundle DIR` (a directory that scripts/gpu_bundle.sh wrote) unpacks its
# Debian packages into a private prefix (BUNDLE_PREFIX; no system-wide install) for every make
# (DEPS=prefix), its wheels into prefix/python (on PYTHONPATH), and points HF_HOME at a copy of
# its Hugging Face cache with HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1; nothing is fetched.
#
# Results: $OUT/gpu-first-run.md: the GPU and build, each step's result (pass, fail, skip), its
# seconds and a note, the GPU suite's CUnit failure lines verbatim, bench_gpu.sh's table, and
# this project beside FlexGen model by model (throughput, peak GPU memory, the bound). Each step's
# output is in $OUT/STEP.log, bench_gpu.sh's files in $OUT/bench, FlexGen's in $OUT/flexgen. The
# exit status is 1 if any step of this command failed, 2 for bad usage.
# Run again with the same OUT, it adds to the same file (a step run again replaces its row), so
# the steps can run one command at a time.
#
# Usage: bash scripts/gpu_first_run.sh [--bundle DIR | --bundle=DIR]
# Environment:
#   STEPS         the steps to run, separated by spaces or commas
#                 [build test test-gpu test-san bench flexgen]
#   QUICK=1       bench and flexgen run opt-6.7b only
#   MODELS        the models of bench and flexgen [opt-6.7b opt-13b]; opt-30b (FlexGen's
#                 published policy for a 16 GB T4) needs more time: run it as a command of its
#                 own, with MODELS=opt-30b STEP_TIMEOUT=570 RUN_TIMEOUT=240
#   OUT           the results directory [gpu-first-run-<UTC time>]
#   STEP_TIMEOUT  seconds that every step may run before it is stopped and recorded as failed
#                 [each step's own limit, above]
#   RUN_TIMEOUT   seconds for each benchmark run, ours and FlexGen's [180]
#   PYTHON        the Python with a CUDA build of torch, for FlexGen [python3]
#   BUNDLE_PREFIX where --bundle unpacks [/tmp/flexgen-bundle-<the bundle's MANIFEST hash>]
#   WEIGHTS, OFFLOAD, HW, MAX_LATENCY  as in scripts/bench_gpu.sh; FlexGen offloads under
#                 OFFLOAD [/var/tmp] too
# For example, without a network, in four commands of at most 10 minutes each:
#   export OUT=first-run
#   STEPS=build,test,test-gpu bash scripts/gpu_first_run.sh --bundle bundle
#   STEPS=test-san bash scripts/gpu_first_run.sh --bundle bundle
#   STEPS=bench,flexgen bash scripts/gpu_first_run.sh --bundle bundle
#   MODELS=opt-30b STEP_TIMEOUT=570 RUN_TIMEOUT=240 STEPS=bench bash scripts/gpu_first_run.sh --bundle bundle
# shellcheck disable=SC2317 # the step functions are called by name, "step_$STEP"
set -uo pipefail

ALL_STEPS="build test test-gpu test-san bench flexgen"
step_limit() { # STEP: its time limit in seconds (the top comment's table), or STEP_TIMEOUT
    if [ -n "${STEP_TIMEOUT:-}" ]; then
        echo "$STEP_TIMEOUT"
        return
    fi
    case $1 in
        build | test-gpu) echo 120 ;;
        test) echo 240 ;;
        test-san) echo 330 ;;
        bench) echo 270 ;;
        flexgen) echo 210 ;;
    esac
}

if [ "${1:-}" != __step ]; then
    usage="usage: bash scripts/gpu_first_run.sh [--bundle DIR | --bundle=DIR]"
    BUNDLE=
    while [ $# -gt 0 ]; do
        case $1 in
            --bundle) [ $# -ge 2 ] || { echo "gpu_first_run.sh: --bundle needs a directory; $usage" >&2; exit 2; }
                BUNDLE=$2; shift 2 ;;
            --bundle=*) BUNDLE=${1#--bundle=}; shift ;;
            -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | grep -v '^# shellcheck' | sed 's/^# \{0,1\}//'; exit 0 ;;
            *) echo "gpu_first_run.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
        esac
    done
    if [ -n "$BUNDLE" ]; then
        if [ ! -f "$BUNDLE/MANIFEST" ] || [ ! -d "$BUNDLE/debs" ] || [ ! -d "$BUNDLE/hf/hub" ]; then
            echo "gpu_first_run.sh: $BUNDLE is not a bundle of scripts/gpu_bundle.sh (no MANIFEST, debs/ or hf/hub/)" >&2
            exit 2
        fi
        BUNDLE=$(cd "$BUNDLE" && pwd)
    fi
    STEPS=${STEPS:-$ALL_STEPS}
    STEPS=${STEPS//,/ }
    for step in $STEPS; do
        case " $ALL_STEPS " in
            *" $step "*) ;;
            *) echo "gpu_first_run.sh: no step '$step'; the steps: $ALL_STEPS" >&2; exit 2 ;;
        esac
    done
fi
[ "${QUICK:-0}" = 1 ] && MODELS=opt-6.7b
export MODELS=${MODELS:-opt-6.7b opt-13b}
OUT=${OUT:-gpu-first-run-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
export OUT
export RUN_TIMEOUT=${RUN_TIMEOUT:-180} PYTHON=${PYTHON:-python3}
export OFFLOAD=${OFFLOAD:-/var/tmp}
cd "$(dirname "$0")/.." || exit 2
SELF=scripts/gpu_first_run.sh
JOBS=$(nproc)

have_gpu() { nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }

no_gpu() { # why there is no GPU, in one line
    if ! command -v nvidia-smi > /dev/null; then
        echo "no GPU: nvidia-smi not found"
    else
        echo "no GPU: nvidia-smi -L says: $(nvidia-smi -L 2>&1 | head -n 1)"
    fi
}

# ---- the steps: each runs in its own process (`$SELF __step NAME`, under timeout), appends its
# output to $LOG and one-line notes to $OUT/NAME.note, and returns 0 (pass), 1 (fail) or 3 (skip)

note() { printf '%s\n' "$*" >> "$OUT/$STEP.note"; }

run_logged() { # command...: its output on the terminal and in $LOG; its exit status
    "$@" 2>&1 | tee -a "$LOG"
    return "${PIPESTATUS[0]}"
}

first_error() { # the first line of $LOG that names an error, else its last line
    { grep -m 1 -E 'error:|Error:|No such file|not found|^flexgen:|Segmentation|Abort' "$LOG" ||
        tail -n 1 "$LOG"; } | head -c 300
}

suite_summary() { # CUnit's count of tests, its first failure and the suites' skip lines, as notes
    local line
    line=$(awk '$1 == "tests" && NF == 6 { t = "tests: " $3 " ran, " $5 " failed" } END { if (t) print t }' "$LOG")
    note "${line:-no CUnit summary: $(first_error)}"
    line=$(grep -m 1 -E '^ +[0-9]+\. tests/' "$LOG") && note "first failure: $line"
    grep -o 'pipeline suite skipped: .*' "$LOG" | head -n 1 | while read -r line; do note "$line"; done
}

gpu_suite_ran() { # 1 where a GPU is present and the GPU suite skipped all the same
    local why
    why=$(grep -o 'GPU suite skipped: .*' "$LOG" | head -n 1)
    [ -n "$why" ] || return 0
    if have_gpu; then
        note "$why, on a machine with a GPU"
        return 1
    fi
    note "$why"
}

step_build() {
    run_logged make -j"$JOBS" || { note "make failed: $(first_error)"; return 1; }
    [ -z "${DEPS:-}" ] || note "against DEPS=$DEPS"
    if make -s print-cflags | grep -q -- -DFLEXGEN_CUDA; then
        local nvcc
        nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
        note "with CUDA: $("$nvcc" --version | grep -m 1 release)"
    elif have_gpu; then
        note "built without CUDA (no nvcc; NVCC= names one): the GPU cannot be used"
        return 1
    else
        note "built without CUDA (no nvcc)"
    fi
}

step_test() {
    local rc=0
    # the GPU suite first (it comes near the end of all of them), so that its result is in the
    # log even where the step is stopped at its limit
    run_logged make -j"$JOBS" test SUITE=gpu || rc=1
    run_logged make -j"$JOBS" test || rc=1
    suite_summary
    gpu_suite_ran || rc=1
    return "$rc"
}

step_test_gpu() {
    have_gpu || { note "$(no_gpu)"; return 3; }
    local rc=0 line
    run_logged make -j"$JOBS" test-gpu || rc=1
    suite_summary
    line=$(grep -m 1 -o 'ERROR SUMMARY: .*' "$LOG") && note "compute-sanitizer: $line"
    gpu_suite_ran || rc=1
    return "$rc"
}

step_test_san() {
    local rc=0 line
    run_logged make -j"$JOBS" test-san || rc=1
    suite_summary
    line=$(grep -m 1 -E 'ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:' "$LOG") && note "$line"
    gpu_suite_ran || rc=1
    return "$rc"
}

step_bench() {
    have_gpu || { note "$(no_gpu)"; return 3; }
    [ -x ./flexgen ] || { note "no ./flexgen: run the build step first"; return 1; }
    local rc=0
    run_logged env OUT="$OUT/bench" bash scripts/bench_gpu.sh || rc=1
    local runs refused bad
    runs=$(grep -c -E '^\| opt-[^ ]+-(fixed|auto) \|' "$LOG")
    refused=$(grep -c -E '^\| [^|]+ \| [^|]+ \| refused:' "$LOG")
    bad=$(grep -c -E '^\| [^|]+ \| [^|]+ \| (failed|timed out|ran, but no prediction)' "$LOG")
    note "$runs runs: $((runs - refused - bad)) measured, $refused refused (the plan does not fit), $bad failed or timed out"
    [ "$rc" = 0 ] || note "bench_gpu.sh stopped: $(first_error)"
    [ "$bad" = 0 ] || rc=1
    return "$rc"
}

stop_flexgen() { # the trap of step_flexgen's run: ends the run, removes its offload directory
    trap '' TERM INT HUP
    if [ -n "$run" ]; then
        kill -TERM -- "-$run" 2>/dev/null || kill -TERM "$run" 2>/dev/null
        wait "$run" 2>/dev/null
    fi
    rm -rf "$dir"
    exit 1
}

step_flexgen() {
    have_gpu || { note "$(no_gpu)"; return 3; }
    local mod="" m err why=""
    for m in flexgen flexllmgen; do
        if err=$("$PYTHON" -c "import $m.flex_opt" 2>&1); then
            mod=$m
            break
        fi
        echo "$err" >> "$LOG"
        # the reason of the first module that is there but does not import (torch missing, ...)
        case $err in
            *"No module named '$m'"*) ;;
            *) [ -n "$why" ] || why="$m: $(echo "$err" | tail -n 1 | head -c 200)" ;;
        esac
    done
    if [ -z "$mod" ]; then
        note "FlexGen cannot be imported by $PYTHON (pip install flexgen==0.1.8, or --bundle DIR): ${why:-no module flexgen or flexllmgen}"
        return 3
    fi
    if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >> "$LOG" 2>&1; then
        note "FlexGen ($mod) imports, but torch.cuda.is_available() is false in $PYTHON"
        return 3
    fi
    mkdir -p "$OUT/flexgen"
    local model policy rc failed=0
    for model in $MODELS; do
        if ! policy=$(bash scripts/bench_gpu.sh policy "$model" 2>&1); then
            note "$policy"
            failed=1
            continue
        fi
        # a policy that needs more CPU memory than is available, by this project's memory model
        # (the same placement of fp16 weights and cache), is not run: FlexGen would be killed
        # for memory, or take the machine's memory from everything else. --device cpu with the
        # T4's GPU file: a plan for another machine, held to these capacities alone
        if [ -x ./flexgen ]; then
            local avail fits
            avail=$(awk '/MemAvailable/ { print int($2 / 1024) "M" }' /proc/meminfo)
            # shellcheck disable=SC2086
            if ! fits=$(./flexgen policy --evaluate --device cpu --hw hardware/t4-flexgen.json --gpu-mem 1T --cpu-mem "$avail" \
                --disk-mem 1T --prompt-len 512 --gen-len 32 --model "$model" $policy 2>&1 > /dev/null); then
                echo "not run: this project's plan of the same policy: ${fits#flexgen: } (the available memory)" |
                    tee "$OUT/flexgen/$model.status" | tee -a "$LOG"
                note "$model: $(cat "$OUT/flexgen/$model.status")"
                continue
            fi
        fi
        dir=$(mktemp -d "$OFFLOAD/flexgen-offload.XXXXXX") || { note "cannot make a directory in $OFFLOAD"; return 1; }
        rm -f "$OUT/flexgen/$model.log"
        echo "== $mod.flex_opt, $model: $policy" | tee -a "$LOG"
        rc=0
        # The run goes in the background and the step waits for it, so that the TERM that ends a
        # step at its limit runs the trap at once: it ends the run (timeout leads a process group
        # of its own, which the step's TERM does not reach) and removes the offload directory.
        run=""
        trap 'stop_flexgen' TERM INT HUP
        # shellcheck disable=SC2086
        timeout -k 10 "$RUN_TIMEOUT" "$PYTHON" -m "$mod.flex_opt" --model "facebook/$model" --path _DUMMY_ \
            --offload-dir "$dir" --prompt-len 512 --gen-len 32 $policy --log-file "$OUT/flexgen/$model.log" \
            > "$OUT/flexgen/$model.out" 2>&1 &
        run=$!
        wait "$run" || rc=$?
        trap - TERM INT HUP
        run=""
        rm -rf "$dir"
        tail -n 8 "$OUT/flexgen/$model.out" | tee -a "$LOG"
        if [ "$rc" = 0 ]; then
            echo ok > "$OUT/flexgen/$model.status"
        else
            failed=1
            if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
                echo "timed out after $RUN_TIMEOUT s" > "$OUT/flexgen/$model.status"
            else
                echo "failed (exit status $rc): $(tail -n 1 "$OUT/flexgen/$model.out" | head -c 200)" > "$OUT/flexgen/$model.status"
            fi
            note "$model: $(cat "$OUT/flexgen/$model.status")"
        fi
    done
    note "FlexGen as $mod: $MODELS"
    return "$failed"
}

if [ "${1:-}" = __step ]; then
    STEP=$2
    LOG=$OUT/$STEP.log
    "step_${STEP//-/_}"
    exit
fi

# ---- the results file

keep_bench_rows() { # bench.log's table rows into bench/rows.md, replacing those of the same runs
    # from earlier commands; after the step, so that the rows of a step stopped at its limit stay
    [ -f "$OUT/bench.log" ] || return 0
    mkdir -p "$OUT/bench"
    { grep '^|' "$OUT/bench.log"; [ ! -f "$OUT/bench/rows.md" ] || cat "$OUT/bench/rows.md"; } | awk -F '|' '!seen[$2]++' \
        > "$OUT/bench/rows.md.tmp" && mv "$OUT/bench/rows.md.tmp" "$OUT/bench/rows.md"
}

machine() { # what ran where, as markdown list items
    local gpu cuda commit
    if have_gpu; then
        gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)
        gpu="$gpu (name, memory, driver)"
    else
        gpu=$(no_gpu)
    fi
    cuda=$({ command -v nvcc || ls /usr/local/cuda/bin/nvcc; } 2>/dev/null | head -n 1)
    [ -n "$cuda" ] && cuda=$("$cuda" --version | grep -m 1 release) || cuda="no nvcc"
    commit=$(git rev-parse --short HEAD 2>/dev/null) || commit=unknown
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit, with local changes"
    echo "- GPU: $gpu"
    echo "- CUDA: $cuda"
    echo "- machine: $(uname -n), $(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo) of memory"
    echo "- commit: $commit"
    if [ -n "$BUNDLE" ]; then
        echo "- libraries and FlexGen: the bundle $BUNDLE, unpacked in $DEPS (make DEPS=), offline"
    fi
    echo "- last command: $(date -u +%Y-%m-%dT%H:%M:%SZ), STEPS=\"$STEPS\", MODELS=\"$MODELS\""
}

render() { # $OUT/gpu-first-run.md from the files of $OUT
    python3 - "$OUT" "$MODELS" "$ALL_STEPS" > "$OUT/gpu-first-run.md.tmp" <<'PY' && mv "$OUT/gpu-first-run.md.tmp" "$OUT/gpu-first-run.md"
import json, os, re, sys

out, shown, order = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
models = shown
G = 2 ** 30


def read(name):
    try:
        with open(os.path.join(out, name)) as f:
            return f.read()
    except OSError:
        return ""


def load(name):
    try:
        return json.loads(read(name))
    except ValueError:
        return None


def cell(s):
    return " ".join(s.split()).replace("|", "/")


print("# First run on a GPU\n")
print("Written by `scripts/gpu_first_run.sh`; each step's output is in `STEP.log` beside this file.\n")
print(read("machine.md"))
print("## Steps\n")
print("| step | result | seconds | note |")
print("|---|---|---|---|")
steps = {}
for row in read("steps.tsv").splitlines():
    step, result, secs, note = (row.split("\t") + [""] * 4)[:4]
    steps[step] = (result, secs, note)
for step in sorted(steps, key=lambda s: order.index(s) if s in order else len(order)):
    result, secs, note = steps[step]
    print(f"| {step} | {result} | {secs} | {cell(note)} |")

# The GPU suite's failures, verbatim: CUnit's lines between "Suite: gpu" and the suite's line of
# counts ("-- gpu: N passed, ...") that name a failed test or a failed assertion ("    1. FILE:LINE  - ...").
print("\n## The GPU suite's failures\n")
print("CUnit's failure lines of the `gpu` suite, verbatim, from the log of each step that ran it.\n")
if not any(step in steps for step in ("test", "test-gpu", "test-san")):
    print("No step that runs it (test, test-gpu, test-san) has run.")
for step in ("test", "test-gpu", "test-san"):
    if step not in steps:
        continue
    if steps[step][0] == "skip":
        print(f"- {step}: skipped: {cell(steps[step][2])}")
        continue
    text = read(f"{step}.log")
    block = re.search(r"^Suite: gpu$(.*?)(?=^Suite: |^-- \S*gpu: \d+ passed|^Run Summary|\Z)", text, re.M | re.S)
    if block is None:
        why = "stopped before" if "stopped after" in steps[step][2] else "did not run"
        print(f"- {step}: the gpu suite {why} (no \"Suite: gpu\" in {step}.log)")
        continue
    lines, test = [], ""
    for l in block.group(1).splitlines():
        if l.startswith("  Test: "):
            test = l.rstrip()
        if "FAILED" in l:
            if not l.startswith("  Test: "):  # the test printed between its name and FAILED
                lines.append(test)
            lines.append(l.rstrip())
        elif re.match(r"\s+\d+\. \S+:\d+ ", l):
            lines.append(l.rstrip())
    skipped = re.search(r"GPU suite skipped: (.*)", block.group(1))
    if lines:
        print(f"- {step}: {sum(1 for l in lines if 'FAILED' in l)} tests failed:\n")
        print("```\n" + "\n".join(lines) + "\n```\n")
    elif skipped:
        print(f"- {step}: none; the suite skipped: {cell(skipped.group(1))}")
    else:
        print(f"- {step}: none")

models = list(dict.fromkeys(["opt-6.7b", "opt-13b", "opt-30b"] + models))
rows = read("bench/rows.md").splitlines()
head = [l for l in rows if not l.startswith("| opt-")]
table = [l for l in rows if l.startswith("| opt-")]
rank = {f"{m}-{k}": 2 * i + j for i, m in enumerate(models) for j, k in enumerate(("fixed", "auto"))}
table.sort(key=lambda l: rank.get(l.split("|")[1].strip(), len(rank)))
print("\n## This project: scripts/bench_gpu.sh (--gpu-mem 16G, prompt 512, gen 32, dummy weights)\n")
print("\n".join(head + table) if table else "Not run.")

policies = dict(l.split("\t", 1) for l in read("policies.tsv").splitlines() if "\t" in l)


def ours(name):
    """(tok/s, peak GiB, bound tok/s, policy) of one bench_gpu.sh run, or a word on why not."""
    m = load(f"bench/{name}.json")
    if m is None:
        row = next((l for l in table if l.startswith(f"| {name} |")), None)
        if row is None:
            return "not run"
        why = re.search(r"\| (refused|failed \(exit status \d+\)|timed out after \d+ s):", row)
        return why.group(1) if why else "failed"
    p = load(f"bench/{name}.predicted.json")
    policy = "--gpu-batch-size %d --num-gpu-batches %d --percent %s%s" % (
        m["gpu_batch_size"], m["num_gpu_batches"], " ".join(map(str, m["percent"])),
        " --cpu-cache-compute" if m["cpu_cache_compute"] else "")
    bound = f"{p['predicted_throughput']:.2f}" if p else "no prediction"
    return f"{m['total_throughput']:.2f}", f"{m['peak_gpu_bytes'] / G:.2f}", bound, policy


def flexgen(model):
    """(tok/s, peak GiB) of FlexGen's run of one model, or a word on why not."""
    status = read(f"flexgen/{model}.status").strip()
    if not status:
        return "not run"
    if status != "ok":
        return cell(status)
    text = read(f"flexgen/{model}.log") or read(f"flexgen/{model}.out")
    tput = re.findall(r"total throughput: ([0-9.]+) token/s", text)
    peak = re.findall(r"peak gpu mem: ([0-9.]+) GB", text)
    if not tput:
        return "printed no throughput"
    return tput[-1], peak[-1] if peak else "?"


print("\n## Side by side with FlexGen (this machine, same fixed policies, prompt 512, gen 32, dummy weights)\n")
print("Throughput: generated tokens / (prefill + decode), token/s, each program's own report. Peak GPU")
print("memory, GiB: this project's gpu tier (capped by --gpu-mem 16G) and FlexGen's")
print("torch.cuda.max_memory_allocated (FlexGen has no cap). Bound: the cost model's prediction for")
print("the policy that ran, with this machine's profiled constants. FlexGen has no policy search, so")
print("the auto rows are this project's alone.\n")
print("| model | policy | this: token/s | this: peak GPU GiB | bound token/s | FlexGen: token/s | FlexGen: peak GPU GiB |")
print("|---|---|---|---|---|---|---|")
for model in models:
    if ours(f"{model}-fixed") == ours(f"{model}-auto") == flexgen(model) == "not run" and model not in shown:
        continue
    for kind in ("fixed", "auto"):
        r = ours(f"{model}-{kind}")
        f = flexgen(model) if kind == "fixed" else ("-", "-")
        if isinstance(f, str):
            f = (f, "-")
        if isinstance(r, str):
            policy = policies.get(model, "") if kind == "fixed" else "--policy auto"
            r = (r, "-", "-", policy)
        print(f"| {model} | {kind}: `{r[3]}` | {r[0]} | {r[1]} | {r[2]} | {f[0]} | {f[1]} |")
if "flexgen" in steps and steps["flexgen"][0] == "skip":
    print(f"\nFlexGen was not run: {cell(steps['flexgen'][2])}")
PY
}

# ---- the run

if [ -n "$BUNDLE" ]; then
    echo "== the bundle $BUNDLE"
    DEPS=$(bash scripts/gpu_bundle.sh prefix "$BUNDLE") || exit 2
    echo "unpacked in $DEPS"
    export DEPS PYTHONPATH=$DEPS/python${PYTHONPATH:+:$PYTHONPATH}
    export HF_HOME=$DEPS/hf HF_HUB_CACHE=$DEPS/hf/hub HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi

echo "== the GPU"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
fi
have_gpu || no_gpu
machine > "$OUT/machine.md"
for model in $MODELS; do
    printf '%s\t%s\n' "$model" "$(bash scripts/bench_gpu.sh policy "$model" 2>/dev/null)"
done > "$OUT/policies.tsv"

failed=0
for step in $STEPS; do
    limit=$(step_limit "$step")
    echo "== $step (at most $limit s)"
    rm -f "$OUT/$step.log" "$OUT/$step.note"
    start=$(date +%s)
    rc=0
    timeout -k 30 "$limit" bash "$SELF" __step "$step" < /dev/null || rc=$?
    secs=$(($(date +%s) - start))
    case $rc in
        0) result=pass ;;
        3) result=skip ;;
        124 | 137)
            result=fail
            echo "stopped after $limit s (STEP_TIMEOUT)" >> "$OUT/$step.note"
            echo ;;
        *) result=fail ;;
    esac
    [ "$result" = fail ] && failed=1
    [ "$step" = bench ] && keep_bench_rows
    note=$(awk '{ printf "%s%s", (NR > 1 ? "; " : ""), $0 }' "$OUT/$step.note" 2>/dev/null)
    { awk -F '\t' -v s="$step" '$1 != s' "$OUT/steps.tsv" 2>/dev/null
      printf '%s\t%s\t%s\t%s\n' "$step" "$result" "$secs" "$note"; } > "$OUT/steps.tsv.tmp" &&
        mv "$OUT/steps.tsv.tmp" "$OUT/steps.tsv"
    echo "== $step: $result in $secs s${note:+: $note}"
    render
done
render
echo "== results: $OUT/gpu-first-run.md"
exit $failed
