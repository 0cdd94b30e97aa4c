/* tests/cuda_emu/cuda_runtime.h: the CUDA runtime as flexgen.cu uses it, for the CPU execution
 * harness (docs/GPU.md, "The emulated GPU"). g++ compiles flexgen.cu against this header, after
 * one preprocessing step (the Makefile's EMU_SED) that turns `k<<<grid, block, shared, stream>>>(
 * args)` into `CUDA_EMU_LAUNCH(k, grid, block, shared, stream)(args)` and `extern __shared__ T
 * x[];` into a pointer to the block's dynamic shared memory; nothing else in flexgen.cu changes.
 *
 * A launch converts its arguments to the kernel's parameter types, as CUDA does, checks that each
 * pointer argument is device memory (or pinned, or NULL), and queues the kernel on its stream.
 * tests/cuda_emu/emu.cpp runs it when the host waits: each block's threads as fibers, a barrier
 * at __syncthreads, lanes of 32 meeting at each warp shuffle.
 */
#ifndef CUDA_EMU_RUNTIME_H
#define CUDA_EMU_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_emu.h"

#define CUDART_VERSION 12080
#ifndef __CUDA_ARCH_LIST__ /* the Makefile passes nvcc's list; this is its default */
#define __CUDA_ARCH_LIST__ 750,800,860,890,900
#endif
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
/* Static shared memory: one copy per host thread, and a block runs on one host thread. */
#define __shared__ static thread_local

struct uint3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
/* The built-in variables: the emulator sets them before it runs each thread. */
extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;
enum { warpSize = 32 };

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidPitchValue = 12,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorNoKernelImageForDevice = 209,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchFailure = 719,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorGraphExecUpdateFailure = 910,
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
} cudaMemcpyKind;

typedef enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3,
} cudaMemoryType;

struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer, *hostPointer;
};

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor, multiProcessorCount, warpSize, maxThreadsPerBlock;
    size_t sharedMemPerBlock;
};

struct cudaFuncAttributes {
    size_t sharedSizeBytes;
    int maxThreadsPerBlock, ptxVersion, binaryVersion;
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
};

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;

enum {
    cudaStreamDefault = 0, cudaStreamNonBlocking = 1,
    cudaEventDefault = 0, cudaEventBlockingSync = 1, cudaEventDisableTiming = 2,
    cudaHostAllocDefault = 0, cudaHostAllocPortable = 1, cudaHostAllocMapped = 2,
};

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p);
template <typename T> cudaError_t cudaMalloc(T **p, size_t bytes) { return cudaMalloc((void **)p, bytes); }
template <typename T> cudaError_t cudaHostAlloc(T **p, size_t bytes, unsigned flags) {
    return cudaHostAlloc((void **)p, bytes, flags);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                              size_t height, cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemset(void *p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s = 0);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* ---- Graphs: a stream's work captured instead of run, then launched as a whole, as often as
 * wanted; an update gives a graph of the same operations (kernels by name) new arguments ---- */
typedef struct cuda_emu_graph *cudaGraph_t;
typedef struct cuda_emu_graph *cudaGraphExec_t;
typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
} cudaStreamCaptureMode;
typedef struct { int result; void *errorNode, *errorFromNode; } cudaGraphExecUpdateResultInfo;
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags = 0);
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t e, cudaGraph_t g,
                                cudaGraphExecUpdateResultInfo *info);
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e);

/* ---- Device code ---- */
void __syncthreads(void);
void __syncwarp(unsigned mask = 0xffffffffu);
namespace cuda_emu {
enum shuffle_kind { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR };
uint64_t shuffle(unsigned mask, uint64_t bits, shuffle_kind kind, int arg, int width);
template <typename T> T shuffle_as(unsigned mask, T v, shuffle_kind kind, int arg, int width) {
    static_assert(sizeof(T) <= 8, "a shuffled value has at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    bits = shuffle(mask, bits, kind, arg, width);
    memcpy(&v, &bits, sizeof v);
    return v;
}
}
template <typename T> T __shfl_sync(unsigned mask, T v, int lane, int width = 32) {
    return cuda_emu::shuffle_as(mask, v, cuda_emu::SHFL_IDX, lane, width);
}
template <typename T> T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cuda_emu::shuffle_as(mask, v, cuda_emu::SHFL_UP, (int)delta, width);
}
template <typename T> T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cuda_emu::shuffle_as(mask, v, cuda_emu::SHFL_DOWN, (int)delta, width);
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return cuda_emu::shuffle_as(mask, v, cuda_emu::SHFL_XOR, lane_mask, width);
}
/* Byte b of the result is byte (s >> 4 b) & 7 of y:x (x bytes 0-3, y bytes 4-7). */
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t both = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int b = 0; b < 4; b++) r |= (unsigned)(both >> 8 * (s >> 4 * b & 7) & 0xff) << 8 * b;
    return r;
}
namespace cuda_emu {
/* The warp's tensor-core product of support/cuda_kernels.h's mma_16x8x16: its 32 lanes meet (a
 * __syncwarp), each reads the fragments it needs from the others, and all meet again. */
void mma_16x8x16(float d[4], const uint32_t a[4], const uint32_t b[2]);
/* support/cuda_kernels.h's asynchronous copies to shared memory (PTX's cp.async): a copy poisons
 * its destination when it is issued and lands when a wait covers its group, so that shared
 * memory read before the wait (or before the other lanes' __syncwarp) reads the poison. */
void copy_async(void *shared, const void *global, int bytes);
void copy_async_commit(void);
void copy_async_wait(int pending);
/* Bytes of the KV cache that a kernel says it loads (support/cuda_kernels.h's kv_load and kv_at),
 * added to the statistics' kv_load_bytes. */
void count_kv_load(int bytes);
}
/* Blocks run one at a time, each to its end: a fence orders nothing more, and a load past L1 is a
 * load. */
static inline void __threadfence(void) {}
template <typename T> T __ldcg(const T *p) { return *p; }
/* Threads run one at a time and switch only at barriers, so a read-modify-write is atomic. */
template <typename T> T atomicAdd(T *p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> T atomicMax(T *p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <typename T> T atomicMin(T *p, T v) { T old = *p; *p = old < v ? old : v; return old; }
/* The rounding intrinsics: one IEEE operation each, never contracted (the harness builds with
 * -ffp-contract=off; nvcc contracts a b + c into an FMA unless these are used). */
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
/* A float with these bits. */
static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}
/* The bits of a float. */
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
static inline float __saturatef(float a) { return a < 0 ? 0 : a > 1 ? 1 : a; }

/* ---- Launches ---- */
namespace cuda_emu {
struct launch_config {
    const char *name, *file;
    int line;
    dim3 grid, block;
    size_t shared;
    cudaStream_t stream;
};
/* 0, or 1 after recording the launch's error: argument `index` is a pointer the GPU cannot reach. */
int check_pointer_argument(const launch_config &c, int index, const void *p);
/* Checks the configuration and queues the grid (the launch's error, if any, for cudaGetLastError). */
void enqueue_kernel(const launch_config &c, std::function<void()> thread_body);
/* The block's dynamic shared memory (extern __shared__). */
void *dynamic_shared(void);

template <typename T> int check_argument(const launch_config &c, int index, const T &v) {
    if constexpr (std::is_pointer<T>::value) return check_pointer_argument(c, index, (const void *)v);
    else return 0;
}

template <typename... P> struct launcher {
    void (*kernel)(P...);
    launch_config c;
    template <typename... A> void operator()(A &&...a) const {
        static_assert(sizeof...(A) == sizeof...(P), "a kernel launch with the wrong number of arguments");
        std::tuple<typename std::decay<P>::type...> args(std::forward<A>(a)...);
        int bad = 0, index = 0;
        std::apply([&](const auto &...v) { ((bad |= check_argument(c, index++, v)), ...); }, args);
        if (bad) return;
        auto k = kernel;
        enqueue_kernel(c, [k, args]() { std::apply(k, args); });
    }
};

template <typename... P>
launcher<P...> launch(void (*kernel)(P...), const char *name, const char *file, int line, dim3 grid,
                      dim3 block, size_t shared = 0, cudaStream_t stream = 0) {
    return launcher<P...>{kernel, launch_config{name, file, line, grid, block, shared, stream}};
}
}
#define CUDA_EMU_LAUNCH(kernel, ...) cuda_emu::launch(kernel, #kernel, __FILE__, __LINE__, __VA_ARGS__)

/* Is there code for the device in this build (cudaErrorNoKernelImageForDevice if not)? */
cudaError_t cuda_emu_func_attributes(cudaFuncAttributes *a);
template <typename T> cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, T *entry) {
    (void)entry;
    return cuda_emu_func_attributes(a);
}

#endif
