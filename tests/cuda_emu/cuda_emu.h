/* tests/cuda_emu/cuda_emu.h: the controls of the CPU execution harness for flexgen.cu (C and
 * C++). A build against tests/cuda_emu (FLEXGEN_CUDA_EMU) has them; a native build does not.
 * Each has an environment variable too, read at the first CUDA call, for ./flexgen-emu:
 *   FLEXGEN_EMU_ORDER    forward | reverse | shuffle[:SEED]: the order in which a block's warps,
 *                        each warp's threads and a grid's blocks run between barriers; forward by
 *                        default
 *   FLEXGEN_EMU_MEMORY   the device's size in bytes (K, M, G suffixes); 8G by default
 *   FLEXGEN_EMU_CC       the device's compute capability, e.g. 6.1; 8.6 by default
 *   FLEXGEN_EMU_DEVICES  0: report no GPU; 1 by default
 *   FLEXGEN_EMU_STATS    a file to which the statistics below are appended at exit, one line
 */
#ifndef CUDA_EMU_H
#define CUDA_EMU_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { CUDA_EMU_FORWARD, CUDA_EMU_REVERSE, CUDA_EMU_SHUFFLE };
void cuda_emu_set_order(int order, unsigned seed);
void cuda_emu_get_order(int *order, unsigned *seed);
const char *cuda_emu_order_name(void); /* "forward", "reverse", "shuffle:SEED" */
void cuda_emu_set_device_memory(size_t bytes);
void cuda_emu_set_capability(int major, int minor);

typedef struct {
    long long kernels, blocks, threads, switches; /* launched and run */
    long long gemms, copies, host_waits, graph_launches;
    long long opened;                              /* allocations opened to a kernel or copy */
    long long async_bytes;                         /* read by asynchronous copies (cp.async) */
    long long kv_load_bytes;                       /* of K and V rows loaded by attention */
    long long lt_matmuls[3];                       /* cublasLtMatmul calls, by algorithm */
} cuda_emu_stats;
void cuda_emu_get_stats(cuda_emu_stats *s);

#ifdef __cplusplus
}
#endif
#endif
