/* app/cpu_backend.c: the CPU backend's operation table (fg_cpu_backend, model.h), the table
 * that the schedule calls and flexgen.cu fills again for CUDA: memory of the gpu tier is host
 * memory, and each family's row is its forward pass on the CPU (opt_model.c, llama_model.c).
 */
#define _GNU_SOURCE /* madvise's MADV_HUGEPAGE */
#include "model.h"
#include "support/support.h"

#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ============================================================================================
 * The CPU backend (docs/DESIGN.md, "The backends' operation table"): the gpu tier is the CPU's
 * working set, so a copy into it is a memcpy. Its products read weights as they are stored
 * (support/matmul.c), so a weight load is a copy too: of fp16 values, or of 4-bit bytes (§5).
 * ============================================================================================ */

/* Memory of 2 MiB and more (the weights, the cache) starts on a 2 MiB boundary, and its whole
 * 2 MiB pages are asked for as the kernel's huge pages (transparent huge pages, where the kernel
 * gives them to a region that asks; the tail stays in small pages, so no memory is added). A
 * decode product reads 32 rows of W at once, each in another 4 KiB page; with huge pages it read
 * 4-bit weights from memory 1.13-1.15x as fast (opt-1.3b's shapes, 2 threads, AVX2). */
enum { HUGE_PAGE = 2 << 20 };

/* glibc serves an aligned block from its heap once its mmap threshold has risen past the block's
 * size (the threshold rises as mapped blocks are freed), and there the alignment's slack stays
 * resident (120 MB more for a 4-bit opt-1.3b from its checkpoint). Held at 2 MiB, every such
 * block is a mapping of its own, its slack never touched. */
static pthread_once_t threshold_once = PTHREAD_ONCE_INIT;
static void hold_mmap_threshold(void) { mallopt(M_MMAP_THRESHOLD, HUGE_PAGE); }

static void *cpu_alloc(size_t bytes) {
    int huge = bytes >= HUGE_PAGE;
    pthread_once(&threshold_once, hold_mmap_threshold);
    void *p = NULL;
    if (posix_memalign(&p, huge ? HUGE_PAGE : 64, (bytes + 63) & ~(size_t)63)) return NULL;
    if (huge) madvise(p, bytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE); /* a hint: none is fine */
    memset(p, 0, bytes);
    return p;
}
static void *cpu_host_alloc(size_t bytes, int pinned) {
    (void)pinned;
    return cpu_alloc(bytes);
}
static void cpu_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
/* Its copies are done when they return, and one thread computes: nothing to wait for or order. */
static void cpu_nothing_to_wait_for(void) {}
static void cpu_nothing_to_order(unsigned links) { (void)links; }
static void cpu_weights_in(void *dst, const fp16 *src, size_t n) { memcpy(dst, src, 2 * n); }
static void cpu_weights_in_q4(void *dst, const void *src, void *landing, size_t outer, size_t len,
                              size_t inner) {
    (void)landing; /* the bytes stay 4-bit: the products decode them as they read them */
    memcpy(dst, src, q4_bytes(outer, len, inner));
}

/* Host memory is the CPU's own. */
static int cpu_reads_in_place(const void *p) {
    (void)p;
    return 1;
}

/* The fields in model.h's order, as flexgen.cu's cuda_backend lists them. */
const fg_backend fg_cpu_backend = {
    .name = "cpu",
    .gpu_is_host = 1,
    .weight_elem = sizeof(fp16),
    .act_elem = FG_CPU_ACT_ELEM, /* sizeof(float) */
    .alloc = cpu_alloc,
    .free = free,
    .host_alloc = cpu_host_alloc,
    .host_free = free,
    .reads_in_place = cpu_reads_in_place,
    .weights_in = cpu_weights_in,
    .weights_in_q4 = cpu_weights_in_q4,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .copy = cpu_copy,
    .copies_done = cpu_nothing_to_wait_for,
    .finish = cpu_nothing_to_wait_for,
    .join = cpu_nothing_to_order,
    .counts = NULL, /* nothing counted */
    .workspace_bytes = model_workspace_bytes,
    .workspace_init = model_workspace_init,
    .workspace_free = model_workspace_free,
    .forward = {[FAMILY_OPT] = {opt_embed, opt_layer, opt_output},
                [FAMILY_LLAMA] = {llama_embed, llama_layer, llama_output}},
    .device_memory = NULL, /* host memory */
    .reads_q4 = 1,
    .device_reserve = 0,
    .host_reserve = 0,
    .delegated_bytes = NULL, /* nothing to delegate to */
};
