/* tests/cuda_emu/test_emu.cu: the emulated GPU's own checks (suite "emu"; built only against
 * tests/cuda_emu). The harness is what the GPU suite and the kernel tests stand on, so each
 * promise of emu.cpp's top comment is tried here: __half against the CPU's F16C instructions and
 * a correctly rounded reference; a host access to device memory, a kernel past an allocation's
 * end, a host pointer given to a kernel, a copy in the wrong direction; work that runs only when
 * the host waits, in stream and event order; a race on shared memory that the thread orders show,
 * and a reduction they do not change; asynchronous copies that land only at their wait; the
 * device's size and capability; cuBLAS's checks. A check that must end the process runs in a
 * child and reads its last words.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "tests/tests.h"
}

#include <immintrin.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- __half ---- */

__attribute__((target("f16c"))) static unsigned short f16c_from_float(float f) { return (unsigned short)_cvtss_sh(f, 0); }
__attribute__((target("f16c"))) static float f16c_to_float(unsigned short h) { return _cvtsh_ss(h); }
static unsigned bits_of(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static float float_of(unsigned u) { float f; memcpy(&f, &u, 4); return f; }

/* half -> float for all 65,536 halves, and float -> half at every half, every midpoint between
 * neighbours and one float ulp either side of it, and a sweep of 2^32 / 65,521 floats: the same
 * bits as F16C, but for NaN, which CUDA makes the canonical 0x7fff. */
static void test_half_conversions(void) {
    if (!__builtin_cpu_supports("f16c")) {
        printf("\n  no F16C on this CPU: the conversions are not compared");
        return;
    }
    int wrong = 0;
    for (unsigned h = 0; h < 65536; h++)
        wrong += bits_of(cuda_emu_half_to_float((unsigned short)h)) != bits_of(f16c_to_float((unsigned short)h));
    EXPECT(wrong == 0, "half -> float: %d of 65536 differ from F16C", wrong);
    long checked = 0;
    wrong = 0;
    auto check = [&](float f) {
        unsigned short mine = cuda_emu_float_to_half(f), theirs = f16c_from_float(f);
        wrong += isnan(f) ? mine != 0x7fff : mine != theirs;
        checked++;
    };
    for (unsigned h = 0; h < 0x7c00; h++) { /* each finite half and the midpoint above it, both signs */
        float lo = cuda_emu_half_to_float((unsigned short)h), hi = cuda_emu_half_to_float((unsigned short)(h + 1));
        float mid = (float)(((double)lo + hi) / 2);
        for (float f : {lo, mid, nextafterf(mid, 0), nextafterf(mid, INFINITY)}) check(f), check(-f);
    }
    for (unsigned long u = 0; u < (1ul << 32); u += 65521) check(float_of((unsigned)u));
    check(INFINITY), check(-INFINITY), check(NAN), check(65520.0f), check(65519.996f);
    EXPECT(wrong == 0, "float -> half: %d of %ld differ from F16C (or NaN not 0x7fff)", wrong, checked);
}

/* x rounded to the nearest half (even on a tie), in double: the reference for one operation. */
static double round_to_half(double x) {
    if (fabs(x) >= 65520) return copysign(INFINITY, x);
    int e = x == 0 ? -14 : ilogb(x);
    double unit = ldexp(1, (e < -14 ? -14 : e) - 10);
    return nearbyint(x / unit) * unit;
}

/* +, - and * of a million pairs of halves: the correctly rounded result of the exact one (exact in
 * double: 11-bit operands within 2^-24 .. 2^16). */
static void test_half_arithmetic(void) {
    uint64_t seed = 7;
    int wrong = 0;
    for (int i = 0; i < 1000000; i++) {
        __half a = __ushort_as_half((unsigned short)(test_uniform(&seed) * 0x7c00)),
               b = __ushort_as_half((unsigned short)(test_uniform(&seed) * 0x7c00));
        if (i & 1) a = __hneg(a);
        double x = __half2float(a), y = __half2float(b);
        wrong += __half2float(__hadd(a, b)) != (float)round_to_half(x + y);
        wrong += __half2float(__hsub(a, b)) != (float)round_to_half(x - y);
        wrong += __half2float(__hmul(a, b)) != (float)round_to_half(x * y);
    }
    EXPECT(wrong == 0, "half arithmetic: %d of 3,000,000 results not correctly rounded", wrong);
}

/* ---- Faults: in a child, whose end and last line on stderr are what is checked ---- */

/* Runs fn in a child with stderr captured; checks it died of SIGABRT saying `words`. */
static void expect_death(void (*fn)(void), const char *words, const char *what) {
    int fds[2];
    if (pipe(fds)) abort();
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        fn();
        _exit(0);
    }
    close(fds[1]);
    char out[4096] = "";
    size_t n = 0;
    ssize_t got;
    while (n < sizeof out - 1 && (got = read(fds[0], out + n, sizeof out - 1 - n)) > 0) n += (size_t)got;
    close(fds[0]);
    int status;
    waitpid(pid, &status, 0);
    EXPECT(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT && strstr(out, words), "%s: expected an abort "
           "saying \"%s\", got status %#x and: %.300s", what, words, status, out);
}

static void host_reads_device(void) {
    float *p;
    cudaMalloc(&p, 64 * sizeof(float));
    printf("%g\n", *(volatile float *)(p + 3));
}

__global__ void write_at(float *p, int i) { p[i] = 1; }

static void kernel_past_guard(void) { /* 4096 bytes end at the guard page */
    float *p;
    cudaMalloc(&p, 4096);
    write_at<<<1, 1, 0, 0>>>(p, 1024);
    cudaDeviceSynchronize();
}

static void kernel_past_end(void) { /* 100 bytes: the overrun lands in the rounding to 256 */
    float *p;
    cudaMalloc(&p, 100);
    write_at<<<1, 1, 0, 0>>>(p, 25);
    cudaDeviceSynchronize();
}

__global__ void read_shared_at(float *out, int i) {
    extern __shared__ float cells[];
    cells[threadIdx.x] = 1;
    __syncthreads();
    out[0] = cells[i];
}

static void kernel_past_shared(void) { /* 16 bytes of dynamic shared memory, the 5th float read */
    float *p;
    cudaMalloc(&p, 4);
    read_shared_at<<<1, 4, 16, 0>>>(p, 4);
    cudaDeviceSynchronize();
}

static void kernel_shared_not_whole_groups(void) {
    float *p;
    cudaMalloc(&p, 4);
    read_shared_at<<<1, 4, 20, 0>>>(p, 0);
    cudaDeviceSynchronize();
}

static void test_faults(void) {
    expect_death(host_reads_device, "host code touched device memory: byte 12 of device allocation", "a host read");
    expect_death(kernel_past_guard, "kernel write_at", "a kernel past the guard page");
    expect_death(kernel_past_guard, "accessed byte 0 past the end", "a kernel past the guard page");
    expect_death(kernel_past_end, "wrote 1 bytes past the end of device allocation", "a kernel into the rounding");
    expect_death(kernel_past_shared, "read_shared_at (launched at tests/cuda_emu/test_emu.cu", "a kernel past its shared memory");
    expect_death(kernel_past_shared, "accessed byte 0 past the end of its dynamic shared memory (16 bytes)",
                 "a kernel past its shared memory");
    expect_death(kernel_shared_not_whole_groups, "20 bytes of dynamic shared memory, not whole 16-byte groups",
                 "dynamic shared memory of 20 bytes");
}

/* A host pointer given to a kernel, a copy whose direction or size is wrong: the call's error. */
static void test_argument_checks(void) {
    float host[4], *dev;
    CU_ASSERT_EQUAL_FATAL(cudaMalloc(&dev, sizeof host), cudaSuccess);
    write_at<<<1, 1, 0, 0>>>(host, 0);
    CU_ASSERT_EQUAL(cudaGetLastError(), cudaErrorInvalidValue);
    CU_ASSERT_EQUAL(cudaGetLastError(), cudaSuccess); /* read once */
    CU_ASSERT_EQUAL(cudaMemcpy(dev, host, sizeof host, cudaMemcpyDeviceToHost), cudaErrorInvalidMemcpyDirection);
    CU_ASSERT_EQUAL(cudaMemcpy(host, dev, sizeof host, cudaMemcpyHostToDevice), cudaErrorInvalidMemcpyDirection);
    CU_ASSERT_EQUAL(cudaMemcpy(dev, host, 2 * sizeof host, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    CU_ASSERT_EQUAL(cudaMemcpy(dev, host, sizeof host, cudaMemcpyHostToDevice), cudaSuccess);
    write_at<<<1, 2000, 0, 0>>>(dev, 0); /* more threads than a block has */
    CU_ASSERT_EQUAL(cudaGetLastError(), cudaErrorInvalidConfiguration);
    cudaGetLastError();
    cudaFree(dev);
}

/* ---- Streams and events ---- */

__global__ void add_one(float *p, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += 1;
}
__global__ void copy_from(const float *src, float *dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

/* A copy to pinned memory is not there until the host waits; a second stream that waits on an
 * event sees the first stream's work up to the event, and not after it. */
static void test_stream_order(void) {
    enum { N = 300 };
    cudaStream_t a, b;
    cudaEvent_t done_a;
    float *x, *y, *pinned;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&done_a, cudaEventDisableTiming);
    cudaMalloc(&x, N * sizeof(float));
    cudaMalloc(&y, N * sizeof(float));
    cudaHostAlloc(&pinned, N * sizeof(float), cudaHostAllocPortable);
    cudaMemsetAsync(x, 0, N * sizeof(float), a);
    add_one<<<(N + 127) / 128, 128, 0, a>>>(x, N);
    cudaEventRecord(done_a, a);
    add_one<<<(N + 127) / 128, 128, 0, a>>>(x, N); /* after the event: b must not see it */
    cudaStreamWaitEvent(b, done_a, 0);
    copy_from<<<(N + 127) / 128, 128, 0, b>>>(x, y, N);
    pinned[0] = -7;
    cudaMemcpyAsync(pinned, y, N * sizeof(float), cudaMemcpyDeviceToHost, b);
    EXPECT(pinned[0] == -7, "a copy to pinned memory ran before the host waited: %g", pinned[0]);
    cudaStreamSynchronize(b);
    int wrong = 0;
    for (int i = 0; i < N; i++) wrong += pinned[i] != 1;
    EXPECT(wrong == 0, "stream b saw stream a's work after the event, or not before it: %d wrong, [0] = %g", wrong, pinned[0]);
    cudaStreamSynchronize(a);
    cudaMemcpy(pinned, x, N * sizeof(float), cudaMemcpyDeviceToHost);
    EXPECT(pinned[N - 1] == 2, "stream a's second kernel: %g, expected 2", pinned[N - 1]);
    cudaFreeHost(pinned);
    cudaFree(x);
    cudaFree(y);
    cudaEventDestroy(done_a);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
}

/* ---- Graphs ---- */

__global__ void set_to(float *p, float value) { p[threadIdx.x] = value; }

/* Captures set_to(p, value), or add_one(p) where `other`, from s into a graph. */
static cudaGraph_t captured(cudaStream_t s, float *p, float value, int other) {
    cudaGraph_t g = NULL;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    if (other) add_one<<<1, 4, 0, s>>>(p, 4);
    else set_to<<<1, 4, 0, s>>>(p, value);
    cudaStreamEndCapture(s, &g);
    return g;
}

static float value_after(cudaGraphExec_t e, cudaStream_t s, float *p) {
    float host[4] = {0};
    cudaGraphLaunch(e, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(host, p, sizeof host, cudaMemcpyDeviceToHost);
    return host[3];
}

/* Captured work does not run until the graph is launched, and runs at each launch; an update from
 * a capture of the same kernel gives the launch its new argument (the one queued before keeps its
 * old one); a capture of another kernel is refused as an update; a host wait inside a capture
 * breaks it, and so does making or freeing device memory or a cuBLAS handle. */
static void test_graphs(void) {
    cudaStream_t s;
    float *p;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMalloc(&p, 4 * sizeof(float));
    cudaMemset(p, 0, 4 * sizeof(float));
    cudaGraph_t one = captured(s, p, 1, 0);
    cudaGraph_t two = captured(s, p, 2, 0);
    cudaGraph_t other = captured(s, p, 0, 1);
    cudaGraphExec_t e;
    float host[4] = {-1, -1, -1, -1};
    cudaStreamSynchronize(s);
    cudaMemcpy(host, p, sizeof host, cudaMemcpyDeviceToHost);
    EXPECT(host[3] == 0, "captured work ran before its graph was launched: %g", host[3]);
    CU_ASSERT_EQUAL_FATAL(cudaGraphInstantiate(&e, one, 0), cudaSuccess);
    float first = value_after(e, s, p);
    EXPECT(first == 1, "the graph of set_to(1) set %g", first);
    cudaGraphLaunch(e, s); /* queued before the update: keeps 1 */
    cudaGraphExecUpdateResultInfo info;
    CU_ASSERT_EQUAL(cudaGraphExecUpdate(e, two, &info), cudaSuccess);
    add_one<<<1, 4, 0, s>>>(p, 4);
    cudaStreamSynchronize(s);
    cudaMemcpy(host, p, sizeof host, cudaMemcpyDeviceToHost);
    EXPECT(host[3] == 2, "a launch queued before an update, then add_one: expected 2, got %g",
           host[3]);
    float updated = value_after(e, s, p);
    EXPECT(updated == 2, "after the update to set_to(2), a launch set %g", updated);
    EXPECT(cudaGraphExecUpdate(e, other, &info) == cudaErrorGraphExecUpdateFailure && info.result != 0,
           "an update from another kernel's capture: expected it refused");
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    EXPECT(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported, "a host wait inside a capture: expected it refused");
    cudaGraph_t broken = NULL;
    EXPECT(cudaStreamEndCapture(s, &broken) != cudaSuccess && broken == NULL,
           "a capture with a host wait in it: expected no graph");
    cudaGetLastError();
    void *made = NULL;
    cublasHandle_t handle = NULL;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    EXPECT(cudaMalloc(&made, 64) == cudaErrorStreamCaptureUnsupported && made == NULL,
           "cudaMalloc inside a capture: expected it refused");
    EXPECT(cudaFree(p) == cudaErrorStreamCaptureUnsupported,
           "cudaFree inside a capture: expected it refused");
    EXPECT(cublasCreate(&handle) == CUBLAS_STATUS_NOT_INITIALIZED,
           "cublasCreate inside a capture: expected it refused, as cuBLAS's own cudaFree is");
    EXPECT(cudaStreamEndCapture(s, &broken) != cudaSuccess && broken == NULL,
           "a capture with cudaMalloc in it: expected no graph");
    cudaGetLastError();
    cudaGraphExecDestroy(e);
    cudaGraphDestroy(one);
    cudaGraphDestroy(two);
    cudaGraphDestroy(other);
    cudaFree(p);
    cudaStreamDestroy(s);
}

/* ---- Thread order ---- */

/* Each thread writes its slot and reads its neighbour's: without the barrier, which value it
 * reads depends on which thread ran first. */
__global__ void neighbour(float *out, int sync) {
    __shared__ float slot[64];
    slot[threadIdx.x] = (float)threadIdx.x;
    if (sync) __syncthreads();
    out[threadIdx.x] = slot[(threadIdx.x + 1) % blockDim.x];
}

/* A block sum with warp shuffles and a barrier, as flexgen.cu's block_sum. */
__global__ void block_total(const float *x, float *out) {
    __shared__ float partial[32];
    float v = x[threadIdx.x];
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0;
        for (unsigned w = 0; w < blockDim.x / 32; w++) s += partial[w];
        *out = s;
    }
}

static void run_neighbour(int sync, float *host) {
    float *out;
    cudaMalloc(&out, 64 * sizeof(float));
    neighbour<<<1, 64, 0, 0>>>(out, sync);
    cudaMemcpy(host, out, 64 * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(out);
}

static void test_thread_orders(void) {
    float forward[64], reverse[64], synced_f[64], synced_r[64], sums[3];
    int order_before;
    unsigned seed_before;
    cuda_emu_get_order(&order_before, &seed_before);
    cuda_emu_set_order(CUDA_EMU_FORWARD, 0);
    run_neighbour(0, forward), run_neighbour(1, synced_f);
    cuda_emu_set_order(CUDA_EMU_REVERSE, 0);
    run_neighbour(0, reverse), run_neighbour(1, synced_r);
    CU_ASSERT(memcmp(forward, reverse, sizeof forward) != 0); /* the race shows */
    CU_ASSERT(memcmp(synced_f, synced_r, sizeof synced_f) == 0);
    CU_ASSERT_EQUAL(synced_r[63], 0);
    float x[256], *dx, *dsum;
    uint64_t seed = 3;
    double exact = 0;
    for (int i = 0; i < 256; i++) exact += x[i] = test_uniform(&seed);
    cudaMalloc(&dx, sizeof x);
    cudaMalloc(&dsum, sizeof(float));
    cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice);
    const int orders[3] = {CUDA_EMU_FORWARD, CUDA_EMU_REVERSE, CUDA_EMU_SHUFFLE};
    for (int i = 0; i < 3; i++) {
        cuda_emu_set_order(orders[i], 11);
        block_total<<<1, 256, 0, 0>>>(dx, dsum);
        cudaMemcpy(&sums[i], dsum, sizeof(float), cudaMemcpyDeviceToHost);
    }
    cuda_emu_set_order(order_before, seed_before);
    CU_ASSERT(sums[0] == sums[1] && sums[1] == sums[2]);
    EXPECT(fabs(sums[0] - exact) < 1e-4, "block sum %g, expected %g", sums[0], exact);
    cudaFree(dx);
    cudaFree(dsum);
}

/* ---- Asynchronous copies ---- */

/* Thread 0 copies src[0..3] (16 bytes, group 0) and src[4] (4 bytes, group 1) into shared memory
 * and reads both slots before any wait, after waiting down to one group in flight, and after
 * waiting for all: out[3 i], out[3 i + 1] are the two slots at read i (their first floats), and
 * thread 1 reads thread 0's first slot after its wait and a __syncwarp (out[9]). */
__global__ void copies_in_groups(const float *src, float *out) {
    __shared__ float slots[8] __attribute__((aligned(16)));
    if (threadIdx.x == 0) {
        cuda_emu::copy_async(slots, src, 16);
        cuda_emu::copy_async_commit();
        cuda_emu::copy_async(slots + 4, src + 4, 4);
        cuda_emu::copy_async_commit();
        out[0] = slots[0], out[1] = slots[4];
        cuda_emu::copy_async_wait(1);
        out[3] = slots[0], out[4] = slots[4];
        cuda_emu::copy_async_wait(0);
        out[6] = slots[0], out[7] = slots[4];
    }
    __syncwarp();
    if (threadIdx.x == 1) out[9] = slots[0];
}

__global__ void misaligned_copy(const float *src) {
    __shared__ float slots[8] __attribute__((aligned(16)));
    cuda_emu::copy_async(slots, src + 1, 16);
}

static void copy_misaligned(void) {
    float *p;
    cudaMalloc(&p, 64);
    misaligned_copy<<<1, 1, 0, 0>>>(p);
    cudaDeviceSynchronize();
}

/* A copy's destination reads as NaN until a wait covers its group, then as its source; a copy
 * whose ends do not lie on its size ends the run. */
static void test_async_copies(void) {
    const float src[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    float out[10] = {0}, *dsrc, *dout;
    cudaMalloc(&dsrc, sizeof src);
    cudaMalloc(&dout, sizeof out);
    cudaMemcpy(dsrc, src, sizeof src, cudaMemcpyHostToDevice);
    cudaMemset(dout, 0, sizeof out);
    copies_in_groups<<<1, 32, 0, 0>>>(dsrc, dout);
    cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost);
    EXPECT(isnan(out[0]) && isnan(out[1]), "before a wait: %g, %g, expected NaN", out[0], out[1]);
    EXPECT(out[3] == 1 && isnan(out[4]), "one group in flight: %g, %g, expected 1, NaN", out[3], out[4]);
    EXPECT(out[6] == 1 && out[7] == 5, "after the last wait: %g, %g, expected 1, 5", out[6], out[7]);
    EXPECT(out[9] == 1, "another lane after __syncwarp: %g, expected 1", out[9]);
    cudaFree(dsrc);
    cudaFree(dout);
    expect_death(copy_misaligned, "an asynchronous copy of 16 bytes", "a copy not on 16 bytes");
}

/* ---- The device ---- */

static void test_device(void) {
    size_t free_bytes, total;
    cuda_emu_set_device_memory(64 << 20);
    cudaMemGetInfo(&free_bytes, &total);
    CU_ASSERT_EQUAL(total, (size_t)64 << 20);
    void *p = NULL, *q = NULL;
    CU_ASSERT_EQUAL(cudaMalloc(&p, 48 << 20), cudaSuccess);
    CU_ASSERT_EQUAL(cudaMalloc(&q, 32 << 20), cudaErrorMemoryAllocation);
    cudaGetLastError();
    cudaFree(p);
    cuda_emu_set_device_memory((size_t)8 << 30);
    cudaFuncAttributes attr;
    static const struct { int major, minor; cudaError_t expected; } caps[] = {
        {6, 1, cudaErrorNoKernelImageForDevice}, {7, 0, cudaErrorNoKernelImageForDevice}, {7, 5, cudaSuccess},
        {8, 7, cudaSuccess}, {9, 0, cudaSuccess}, {12, 0, cudaSuccess}};
    for (auto c : caps) {
        cuda_emu_set_capability(c.major, c.minor);
        EXPECT(cudaFuncGetAttributes(&attr, write_at) == c.expected, "compute capability %d.%d", c.major, c.minor);
    }
    cuda_emu_set_capability(8, 6);
}

/* The products' operands: A 2 x 3, B 3 x 2 and A B, column-major. */
static const float PRODUCT_A[6] = {1, 2, 3, 4, 5, 6}, PRODUCT_B[6] = {1, 0, 2, 1, 0, 3};
static const float PRODUCT_AB[4] = {1 + 10, 2 + 12, 1 + 15, 2 + 18}; /* column by column */

/* cuBLAS: a leading dimension under its rows is refused; a product is right. */
static void test_cublas(void) {
    cublasHandle_t h;
    cublasCreate(&h);
    float c[4], *da, *db, *dc, one = 1, zero = 0;
    cudaMalloc(&da, sizeof PRODUCT_A), cudaMalloc(&db, sizeof PRODUCT_B), cudaMalloc(&dc, sizeof c);
    cudaMemcpy(da, PRODUCT_A, sizeof PRODUCT_A, cudaMemcpyHostToDevice);
    cudaMemcpy(db, PRODUCT_B, sizeof PRODUCT_B, cudaMemcpyHostToDevice);
    /* A is 2 x 3, B 3 x 2, column-major */
    CU_ASSERT_EQUAL(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, da, CUDA_R_32F, 1, db, CUDA_R_32F, 3,
                                 &zero, dc, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_INVALID_VALUE);
    CU_ASSERT_EQUAL(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, da, CUDA_R_32F, 2, db, CUDA_R_32F, 3,
                                 &zero, dc, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_SUCCESS);
    CU_ASSERT_EQUAL(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 4, &one, da, CUDA_R_32F, 2, db, CUDA_R_32F, 4,
                                 &zero, dc, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_EXECUTION_FAILED);
    CU_ASSERT_EQUAL(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, da, CUDA_R_16F, 2, db, CUDA_R_32F, 3,
                                 &zero, dc, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), CUBLAS_STATUS_NOT_SUPPORTED);
    cudaMemcpy(c, dc, sizeof c, cudaMemcpyDeviceToHost);
    CU_ASSERT(memcmp(c, PRODUCT_AB, sizeof c) == 0);
    cudaFree(da), cudaFree(db), cudaFree(dc);
    cublasDestroy(h);
}

/* The product of cublasLt's first algorithm for A 2 x 3 at byte `shift` of its allocation, B 3 x 2
 * and D 2 x 2 (fp32, column-major), chosen with A's alignment preference `told` (0: none, 256 by
 * cublasLt's default), into c. */
static void lt_product(size_t shift, uint32_t told, float c[4]) {
    float one = 1, zero = 0;
    char *base;
    float *db, *dc;
    cudaMalloc(&base, sizeof PRODUCT_A + shift), cudaMalloc(&db, sizeof PRODUCT_B), cudaMalloc(&dc, sizeof PRODUCT_AB);
    float *da = (float *)(base + shift);
    cudaMemcpy(da, PRODUCT_A, sizeof PRODUCT_A, cudaMemcpyHostToDevice);
    cudaMemcpy(db, PRODUCT_B, sizeof PRODUCT_B, cudaMemcpyHostToDevice);
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t found;
    int n = 0;
    CU_ASSERT_EQUAL(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, 2, 3, 2);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, 3, 2, 3);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 2, 2, 2);
    cublasLtMatmulPreferenceCreate(&pref);
    if (told)
        CU_ASSERT_EQUAL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &told,
                                                             sizeof told), CUBLAS_STATUS_SUCCESS);
    CU_ASSERT_EQUAL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &found, &n),
                    CUBLAS_STATUS_SUCCESS);
    CU_ASSERT_EQUAL_FATAL(n, 1);
    CU_ASSERT_EQUAL(cublasLtMatmul(lt, desc, &one, da, la, db, lb, &zero, dc, lc, dc, lc, &found.algo, NULL, 0, 0),
                    CUBLAS_STATUS_SUCCESS);
    cudaMemcpy(c, dc, sizeof PRODUCT_AB, cudaMemcpyDeviceToHost);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(lt);
    cudaFree(base), cudaFree(db), cudaFree(dc);
}

/* cublasLt: an algorithm holds the alignments its heuristic was told (256 unless set); given A less
 * aligned than that, D is NaN, as a GPU's kernel gives wrong sums; told A's alignment, the product
 * is right; an alignment that is not a power of two is refused. */
static void test_cublaslt_alignment(void) {
    float c[4];
    lt_product(0, 0, c);
    CU_ASSERT(memcmp(c, PRODUCT_AB, sizeof c) == 0);
    lt_product(64, 0, c);
    CU_ASSERT(isnan(c[0]) && isnan(c[3]));
    lt_product(64, 64, c);
    CU_ASSERT(memcmp(c, PRODUCT_AB, sizeof c) == 0);
    cublasLtMatmulPreference_t pref;
    uint32_t bad = 48;
    cublasLtMatmulPreferenceCreate(&pref);
    CU_ASSERT_EQUAL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &bad,
                                                         sizeof bad), CUBLAS_STATUS_INVALID_VALUE);
    cublasLtMatmulPreferenceDestroy(pref);
}

extern "C" void add_emu_tests(void) {
    CU_pSuite s = CU_add_suite("emu", NULL, NULL);
    CU_add_test(s, "__half conversions: F16C's bits, NaN canonical", test_half_conversions);
    CU_add_test(s, "__half +, -, *: correctly rounded", test_half_arithmetic);
    CU_add_test(s,
                "a host read of device memory, a kernel past an allocation or its shared memory: "
                "reported",
                test_faults);
    CU_add_test(s, "a host pointer to a kernel, a copy's wrong direction or size: refused",
                test_argument_checks);
    CU_add_test(s, "streams run when the host waits, in event order", test_stream_order);
    CU_add_test(s,
                "graphs: captured, launched, updated; another kernel, a wait, an allocation "
                "refused",
                test_graphs);
    CU_add_test(s, "thread orders: a shared-memory race shows, a reduction does not move",
                test_thread_orders);
    CU_add_test(s, "asynchronous copies: poison until a wait covers their group; misaligned, refused",
                test_async_copies);
    CU_add_test(s, "the device's size and compute capability", test_device);
    CU_add_test(s, "cuBLAS: its argument checks and a product", test_cublas);
    CU_add_test(s, "cublasLt: an algorithm given a matrix less aligned than it was chosen for writes NaN",
                test_cublaslt_alignment);
}
