#!/usr/bin/env python3
"""check_cuda_bugs.py: plants bugs of the kinds a GPU punishes in a copy of the CUDA backend
(flexgen.cu, its kernels' helpers, support/cuda_kernels.h, and its plumbing, support/cuda_device.cu
and .h), one at a time, and runs the emulated
GPU's suites (build-emu/test_flexgen: emu, kernels, gpu) on each. A bug is caught when the
suites fail: a failed test, or the run ended by the harness's report (a host access to device
memory, a kernel past an allocation) or by the backend's own check of a CUDA or cuBLAS call.
docs/TESTS.md lists the bugs and what caught each.

Usage: python3 scripts/check_cuda_bugs.py [--no-baseline] [N ...]   (from anywhere; N: the bugs
           to plant, 1-based)
       python3 scripts/check_cuda_bugs.py --patterns   (only that each bug's line is still there)
It works in a temporary copy of the tree (the build directories left out), builds with make -j2,
and first runs the suites with no bug planted: they must pass there, or a failure would pass for
a caught bug (--no-baseline skips that run). Then each bug, about 90 s to 4 minutes a bug on two
cores; it prints what failed for each, and ends with 'N passed, N failed' (a bug caught passes: a
failed test, or the run ended by a report; a run cut off by the 900 s limit is not caught); the
exit status is 1 if any bug got through.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 900  # a run of the emulated suites, at most

# (what, the file, the line or lines as that file has them, the same with the bug)
BUGS = [
    ("an off-by-one in a kernel's bound (dequant_kernel: > for >=)",
     "flexgen.cu",
     "    if (e >= n) return;\n    dst[e] = __float2half_rn(q4_value(",
     "    if (e > n) return;\n    dst[e] = __float2half_rn(q4_value("),
    ("a missing __syncthreads (block_reduce's first barrier: block_sum's and block_max's)",
     "support/cuda_kernels.h",
     "    __syncthreads(); /* every thread has read `shared` of the reduction before */\n",
     ""),
    ("a copy on the wrong stream (queue_copy_rows's plain copy on the legacy stream)",
     "support/cuda_device.cu",
     "if (rows == 1) CUDA_CHECK(cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, c->stream));",
     "if (rows == 1) CUDA_CHECK(cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, 0));"),
    ("a missing event wait (cuda_copy_in refills a bounce buffer whose copy has not run)",
     "support/cuda_device.cu",
     "        bounce_free(c, b); /* its last piece has left */\n",
     ""),
    ("a wrong leading dimension (a product's lda: in for out, w_rows)",
     "support/cuda_device.cu",
     "static int w_rows(const product_shape *s) { return s->op_w == CUBLAS_OP_N ? s->m : s->k; }",
     "static int w_rows(const product_shape *s) { return s->k; }"),
    ("a host read of device memory (cuda_layer reads x)",
     "flexgen.cu",
     "    __half *x = (__half *)gb->x;\n    const __half *in = x;",
     "    __half *x = (__half *)gb->x;\n    if (__half_as_ushort(x[0]) == 0x7fff) abort();\n    const __half *in = x;"),
    ("a shared-memory race (attention's barrier before the groups' sums are added)",
     "support/cuda_kernels.h",
     "partial[threadIdx.x * 8 + e] = acc[h][e];\n        __syncthreads();\n",
     "partial[threadIdx.x * 8 + e] = acc[h][e];\n"),
    ("the attention's second pass skipped (attention_merge_kernel merges the first span alone)",
     "flexgen.cu",
     "    int used = (nk + a.span_keys - 1) / a.span_keys;",
     "    int used = nk > 0;"),
    ("a wrong __half rounding (layer_norm_kernel rounds toward zero)",
     "flexgen.cu",
     "yr[i0 + k * threads] = __float2half_rn((v[k] - mean)",
     "yr[i0 + k * threads] = __float2half_rz((v[k] - mean)"),
    ("swapped nibbles (the 4-bit cache store)",
     "flexgen.cu",
     "bytes[p] = (uint8_t)(q[0] << 4 | q[1]);",
     "bytes[p] = (uint8_t)(q[1] << 4 | q[0]);"),
    ("a widening put back in 4-bit decode (linear's product from the codes for no rows)",
     "flexgen.cu",
     "    if (q4 && rows <= Q4_DIRECT_ROWS) q4_product(",
     "    if (q4 && rows <= 0) q4_product("),
    ("the tensor cores' columns crossed (q4_step_multiply widens each byte's halves the other way)",
     "support/cuda_kernels.h",
     "b[0] = q4_pair(now.codes[0], now.codes[1], t / 2, t % 2 == 0,",
     "b[0] = q4_pair(now.codes[0], now.codes[1], t / 2, t % 2 == 1,"),
    ("a missing __syncthreads (q4_sums_out adds the warps' sums before they are written)",
     "support/cuda_kernels.h",
     "    __syncthreads();\n    if (warp > 0) return;",
     "    if (warp > 0) return;"),
    ("a chunk dropped from the 4-bit product's partial sums (q4_chunk_sums)",
     "support/cuda_kernels.h",
     "for (int c = 0; c < chunks; c++) total += __ldcg(",
     "for (int c = 1; c < chunks; c++) total += __ldcg("),
    ("a graph replayed after a shape change without its new arguments (layer_graph_ends never updates)",
     "support/cuda_device.cu",
     "    if (!d->layer_graph || cudaGraphExecUpdate(d->layer_graph, graph, &info) != cudaSuccess) {",
     "    if (!d->layer_graph || (0 && cudaGraphExecUpdate(d->layer_graph, graph, &info))) {"),
    ("a level of a key's shuffles left out (attention_scores adds half of a group's lanes)",
     "support/cuda_kernels.h",
     "                for (int o = lanes / 2; o > 0; o /= 2)",
     "                for (int o = lanes / 4; o > 0; o /= 2)"),
    ("a span read as the longest span (attention_span_kernel takes FG_CUDA_SPAN_KEYS keys)",
     "flexgen.cu",
     "    int n = nk - first < a.span_keys ? nk - first : a.span_keys;",
     "    int n = nk - first < FG_CUDA_SPAN_KEYS ? nk - first : FG_CUDA_SPAN_KEYS;"),
    ("truncation for rounding (the 4-bit cache store)",
     "flexgen.cu",
     "float t = __fadd_rn(__fmul_rn(__fsub_rn(x[e], min), inv), 0.5f);",
     "float t = __fmul_rn(__fsub_rn(x[e], min), inv);"),
    ("a shared copy read before it lands (q4_ring waits for one group of copies too few)",
     "support/cuda_kernels.h",
     "        copy_async_wait<Q4_STAGES - 2>(); /* step i's copies have landed */",
     "        copy_async_wait<Q4_STAGES - 1>(); /* step i's copies have landed */"),
    ("a missing __syncwarp (q4_ring reads the other lanes' copies before they land)",
     "support/cuda_kernels.h",
     "        __syncwarp(); /* every lane's, and every lane is done with step i - 1's stage */\n",
     ""),
    ("a row past the matrix's end left with its stage's old min and scale (q4_stage_copy)",
     "support/cuda_kernels.h",
     "    if (k0 + row >= k_end) {\n        *word = 0;",
     "    if (k0 + row >= k_end) {\n        (void)word;"),
    ("the vocabulary's halves crossed (q4_vocab_multiply gives the high halves to the odd rows of E)",
     "support/cuda_kernels.h",
     "b[h] = q4_values(half == 0 ? spread[h] >> 4 : spread[h], min[h], scale[h]);",
     "b[h] = q4_values(half == 1 ? spread[h] >> 4 : spread[h], min[h], scale[h]);"),
    ("the warps' sums written over a ring another warp still reads (q4_sums_out's first barrier)",
     "support/cuda_kernels.h",
     "    int warps = blockDim.x / 32;\n    __syncthreads();\n    FG_UNROLL",
     "    int warps = blockDim.x / 32;\n    FG_UNROLL"),
    ("the chunks' sums in the order of the last block (q4_chunk_sums starts at its own chunk)",
     "support/cuda_kernels.h",
     "        for (int c = 0; c < chunks; c++) total += __ldcg(partial + c * n + at);",
     "        for (int k = 0; k < chunks; k++)\n"
     "            total += __ldcg(partial + (size_t)((blockIdx.y + k) % chunks) * n + at);"),
    ("a group's count of chunks done not set back to zero (q4_last_chunk)",
     "support/cuda_kernels.h",
     "        if (last) *done = 0;\n",
     ""),
    ("a block's next head's sums written over those still being added (attention_values' barrier "
     "between a block's heads)",
     "support/cuda_kernels.h",
     "        if (h > 0) __syncthreads(); /* every thread done with the last head's partial sums */\n",
     ""),
    ("a K/V head's last block of query heads given a whole block's (block_heads: span_sums and "
     "attend_query take a head of the next group)",
     "support/cuda_kernels.h",
     "    if (HEADS > 1 && (*kvh + 1) * group - head < HEADS) *nh = (*kvh + 1) * group - head;\n",
     ""),
    ("a block's next head's sums written hd floats on, over its own span's (attention_values)",
     "support/cuda_kernels.h",
     "            else sums[h * out_apart + d] = total;",
     "            else sums[h * hd + d] = total;"),
    ("a run's span sums written at the step's rows, not the run's (span_sums)",
     "flexgen.cu",
     "    size_t run_row = (size_t)blockIdx.y * gridDim.z + blockIdx.z;\n    int hd = a.hd;\n"
     "    int first = span * a.span_keys;",
     "    size_t run_row = (size_t)b * a.n_new + t;\n    int hd = a.hd;\n"
     "    int first = span * a.span_keys;"),
    ("a run's sums merged from the step's rows, not the run's (attention_merge_kernel)",
     "flexgen.cu",
     "    size_t run_row = (size_t)blockIdx.y * gridDim.z + blockIdx.z;\n    int hd = a.hd;\n"
     "    if (!a.kc[b]) return; /* delegated */\n    size_t row",
     "    size_t run_row = (size_t)b * a.n_new + t;\n    int hd = a.hd;\n"
     "    if (!a.kc[b]) return; /* delegated */\n    size_t row"),
    ("an adding product's timing runs written into y, not the scratch (fp16_product)",
     "support/cuda_device.cu",
     "        void *out = beta == 0 ? y : timing_scratch(d, s);",
     "        void *out = beta == 0 || timing_scratch(d, s) ? y : NULL;"),
    ("the slowest candidate kept (products_settle)",
     "support/cuda_device.cu",
     "            else if (!s->failed[j] && ms < best) {",
     "            else if (!s->failed[j] && ms > best) {"),
    ("timing runs queued inside a capture (fp16_product)",
     "support/cuda_device.cu",
     "    if (s && s->state == UNTIMED && !c->capturing) {",
     "    if (s && s->state == UNTIMED) {"),
    ("a settled choice not taken (fp16_product runs cuBLAS's default)",
     "support/cuda_device.cu",
     "    BLAS_PRODUCT(run_candidate(s ? s : &here, chosen, W, x, beta, y));",
     "    BLAS_PRODUCT(run_candidate(s ? s : &here, 0 * chosen, W, x, beta, y));"),
    ("the operands' alignments not told to cublasLt's heuristic (lt_candidates)",
     "support/cuda_device.cu",
     "    for (int i = 0; i < 4; i++)\n        BLAS_CHECK(\n"
     "            cublasLtMatmulPreferenceSetAttribute(pref, align_of[i],",
     "    for (int i = 0; i < 0; i++)\n        BLAS_CHECK(\n"
     "            cublasLtMatmulPreferenceSetAttribute(pref, align_of[i],"),
    ("a shape's choice shared by operands of other alignments (shape_of)",
     "support/cuda_device.cu",
     "            s->y_type == want->y_type && s->adds == want->adds && s->align_w == want->align_w &&",
     "            s->y_type == want->y_type && s->adds == want->adds && 1 &&"),
    ("a shape timed into a scratch less aligned than y (time_candidates)",
     "support/cuda_device.cu",
     "    if (!out || alignment_of(out) < s->align_y) {",
     "    if (!out) {"),
    ("the timing runs a capture put off never queued (layer_graph_ends)",
     "support/cuda_device.cu",
     "    note_queued();\n    products_time_deferred(d);\n",
     "    note_queued();\n    (void)products_time_deferred;\n"),
    ("one tie too few kept (keep_largest)",
     "support/cuda_kernels.h",
     "        if (bits > threshold || (bits == threshold && ties_before++ < wanted)) kept[at++] = j;",
     "        if (bits > threshold || (bits == threshold && ++ties_before < wanted)) kept[at++] = j;"),
    ("a radix pass that counts weights outside the threshold's bytes so far (keep_largest)",
     "support/cuda_kernels.h",
     "        found |= 255u << shift;",
     "        found |= 254u << shift;"),
    ("a lane's counts short of one byte (keep_largest walks 7 of its 8)",
     "support/cuda_kernels.h",
     "            for (int i = 0; i < 8; i++) count += selection->bins[top - i];",
     "            for (int i = 0; i < 7; i++) count += selection->bins[top - i];"),
    ("a thread's own count in its place in the list (block_prefix_sum's sum through it, not before)",
     "support/cuda_kernels.h",
     "    return before + through - v;",
     "    return before + through;"),
    ("the new token's value left out of top-K (attend_query lists the key before it)",
     "flexgen.cu",
     "        if (threadIdx.x == 0) kept[keep] = nk - 1;",
     "        if (threadIdx.x == 0) kept[keep] = nk - 2;"),
    ("a grouped-query block's later heads weighted by its first's (attend_query)",
     "flexgen.cu",
     "        attention_values<Q4, 1>(weights, 0, top_k ? kept : NULL, 1, &values, 0, keep + 1, partial,",
     "        attention_values<Q4, 1>(scores, 0, top_k ? kept : NULL, 1, &values, 0, keep + 1, partial,"),
    ("V rows read at K's distance from the table's pointers (kv_head_of adds shift[0] to V's)",
     "flexgen.cu",
     "    kv_head h = {.cache = (const char *)(kv ? a->vc[b] : a->kc[b]) + a->shift[kv],",
     "    kv_head h = {.cache = (const char *)(kv ? a->vc[b] : a->kc[b]) + a->shift[0],"),
    ("V rows stored at K's distance from the table's pointers (store_kv_kernel adds shift[0])",
     "flexgen.cu",
     "    cache += a.shift[kv];",
     "    cache += a.shift[0];"),
    ("the new token's V row left out of the rows top-K reads (count_v_rows)",
     "support/cuda_device.cu",
     "rows = (int)floorf(gb->attn_sparsity * (float)(nk - 1)) + 1;",
     "rows = (int)floorf(gb->attn_sparsity * (float)(nk - 1));"),
    ("top-K's span scores written at the query's first key, not the span's (span_sums)",
     "flexgen.cu",
     "        scores = a.partials + (run_row * a.heads + head) * a.scores_apart + first;",
     "        scores = a.partials + (run_row * a.heads + head) * a.scores_apart;"),
    ("top-K scoring the keys again after the split's spans have (queue_attention_kernel)",
     "flexgen.cu",
     "        a.scores_ready = 1;\n",
     ""),
    ("a query row's blocks counted at twice GQA_HEADS query heads a block, so a K/V head's last "
     "heads go unattended (row_head_blocks)",
     "support/cuda_kernels.h",
     "    return kv_heads * head_blocks(heads / kv_heads, GQA_HEADS);",
     "    return kv_heads * head_blocks(heads / kv_heads, 2 * GQA_HEADS);"),
]

# The harness's own suite prints these on purpose (it tries each misuse).
EXPECTED_LINES = ("kernel write_at", "lda 1 < 2", "32 bytes from", "types A 2", "cudaMalloc(33554432")


def copy_tree(dst):
    skip = {".git", "build", "build-san", "build-san-emu", "build-fuzz"}
    shutil.copytree(ROOT, dst, ignore=lambda d, names: [n for n in names if d == ROOT and n in skip])


def failures(stdout):
    """The failed tests, as 'suite: test', and each one's first failure line (or how it ended its
    process)."""
    suite = test = None
    found = []
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        ended = re.match(r"-- ([^:]+): '(.+)' ended its process \((.*)\)", line)
        if ended:  # a test ended by a signal or a report (tests/test_main.c's line)
            found.append((f"{ended.group(1)}: {ended.group(2)}", f"ended its process ({ended.group(3)})"))
        if line.startswith("Suite: "):
            suite = line[7:].strip()
        if "Test: " in line:
            test = line.split("Test: ", 1)[1].split(" ...")[0]
        if re.search(r"FAILED( \([0-9.]+ s\))?$", line.rstrip()) and test:
            first = next((m.strip() for m in lines[i + 1:i + 4] if m.strip()[:1].isdigit()), "")
            found.append((f"{suite}: {test}", first))
    return found


def build_and_run(work):
    """The emulated suites built and run in work: (the build's failure or None, the run)."""
    build = subprocess.run("make -j2 flexgen-emu build-emu/test_flexgen", shell=True, cwd=work,
                           capture_output=True, text=True)
    if build.returncode:
        return build.stderr[-1500:], None
    env = dict(os.environ, GOMP_SPINCOUNT="1000", FLEXGEN_BIN="./flexgen-emu")
    return None, subprocess.run(f"timeout {LIMIT_S} ./build-emu/test_flexgen", shell=True,
                                cwd=work, capture_output=True, text=True, env=env)


def baseline(work):
    """The suites with no bug planted: True where they pass."""
    copy_tree(work)
    broken, run = build_and_run(work)
    if broken:
        print(f"no bug planted: the build failed\n{broken}")
        return False
    if run.returncode:
        print(f"no bug planted: the suites fail (exit {run.returncode}); a planted bug would pass "
              "for caught. Fix these first:")
        for test, first in failures(run.stdout):
            print(f"    failed {test}\n        {first[:240]}")
        return False
    print("no bug planted: the suites pass")
    return True


def plant(n, what, where, old, new, work):
    copy_tree(work)
    path = os.path.join(work, where)
    src = open(path).read()
    if src.count(old) != 1:
        print(f"#{n} {what}: {where} no longer has the line this bug changes; update BUGS")
        return False
    open(path, "w").write(src.replace(old, new))
    broken, run = build_and_run(work)
    if broken:
        print(f"#{n} {what}: the build failed\n{broken}")
        return False
    reports = [l for l in run.stderr.splitlines() if l.startswith(("cuda-emu: ", "flexgen: CUDA"))
               and not any(e in l for e in EXPECTED_LINES)]
    failed = failures(run.stdout)
    timed_out = run.returncode == 124  # timeout(1)'s status: cut off, not a test's verdict
    caught = run.returncode != 0 and not timed_out
    verdict = "caught" if caught else f"NOT CAUGHT{' (cut off at %d s)' % LIMIT_S if timed_out else ''}"
    print(f"#{n} {what}: {verdict} (exit {run.returncode})")
    for test, first in failed:
        print(f"    failed {test}\n        {first[:240]}")
    if run.returncode not in (0, 1):
        for line in reports[-2:]:
            print(f"    {line[:300]}")
    return caught


def patterns_apply():
    """--patterns: each bug's line is in its file exactly once (make test checks this, fast)."""
    stale = [(n, what, where) for n, (what, where, old, new) in enumerate(BUGS, 1)
             if open(os.path.join(ROOT, where)).read().count(old) != 1]
    for n, what, where in stale:
        print(f"check_cuda_bugs.py: #{n} {what}: {where} no longer has the line this bug changes;"
              " update BUGS")
    return 1 if stale else 0


def usage():
    """The Usage lines of the docstring."""
    doc = __doc__.split("\n")
    start = next(i for i, l in enumerate(doc) if l.startswith("Usage:"))
    end = next(i for i, l in enumerate(doc) if l.startswith("It works in"))
    return "\n".join(doc[start:end])


def main():
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:
        print(usage())
        return 0
    if "--patterns" in args:
        if args != ["--patterns"]:
            print(f"check_cuda_bugs.py: --patterns takes no other argument\n{usage()}", file=sys.stderr)
            return 2
        return patterns_apply()
    check_baseline = "--no-baseline" not in args
    which = []
    for a in args:
        if a == "--no-baseline":
            continue
        if not re.fullmatch(r"[0-9]+", a) or not 1 <= int(a) <= len(BUGS):
            print(f"check_cuda_bugs.py: '{a}' is neither a bug number (1 to {len(BUGS)}) nor a flag\n{usage()}",
                  file=sys.stderr)
            return 2
        which.append(int(a))
    which = which or range(1, len(BUGS) + 1)
    caught = missed = 0
    with tempfile.TemporaryDirectory(prefix="flexgen-bugs-") as tmp:
        if check_baseline and not baseline(os.path.join(tmp, "baseline")):
            return 1
        for n in which:
            work = os.path.join(tmp, f"bug{n}")
            if plant(n, *BUGS[n - 1], work):
                caught += 1
            else:
                missed += 1
            shutil.rmtree(work, ignore_errors=True)
    print(f"{caught} passed, {missed} failed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
