/* support/cuda_device.h: what flexgen.cu's layers use of the CUDA backend's plumbing
 * (support/cuda_device.cu): each thread's stream and cuBLAS handle, the checks of CUDA and cuBLAS
 * calls, the copies, the workspace and the small tables the kernels read, the CUDA Graph of a
 * decode layer, decode's fp16 products (fp16_product), the counters (§4.1, §4.2; docs/GPU.md).
 * The kernels' device helpers are support/cuda_kernels.h's. CUDA C++, for flexgen.cu, the kernel
 * tests and the emulated GPU alone; the C side sees only fg_cuda_backend (model.h).
 */
#ifndef FG_CUDA_DEVICE_H
#define FG_CUDA_DEVICE_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

/* model.h's kernel bodies (kv_page_row, position_of, q4_bytes, q4_value) are the device's too,
 * with the device's fp16 */
#define FG_HOST_DEVICE __host__ __device__
#define FG_HALF_TO_FLOAT(h) __half2float(__ushort_as_half(h))
extern "C" {
#include "model.h"
#include "support/support.h"
}

/* ---- Counters: what the host asks of the GPU, on every thread (docs/GPU.md, "Where the host
 * waits, and the counters"); cuda_counts reads them (the table's counts). ---- */
extern fg_device_counts counts;
void count(int64_t *counter, int64_t n);
void cuda_counts(fg_device_counts *out);

/* ---- Errors. A failed call ends the process, naming the call, its file and line. ---- */
void cuda_fail(const char *call, const char *file, int line, const char *msg);
#define CUDA_CHECK(call)                                                                     \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) cuda_fail(#call, __FILE__, __LINE__, cudaGetErrorString(e_)); \
    } while (0)
/* After a launch (a kernel's, or a cuBLAS call's, which launches its own): its own error, and
 * with FLEXGEN_CUDA_SYNC=1 (sync_each_kernel) its end too, so that a fault names its kernel or
 * cuBLAS call instead of a later call (launches are asynchronous). Each is counted, as is each
 * wait it adds. */
extern int sync_each_kernel;
void launched(const char *kernel, const char *file, int line);
#define LAUNCHED(kernel) launched(kernel "<<<>>>", __FILE__, __LINE__)
#define BLAS_CHECK(call)                                                     \
    do {                                                                     \
        cublasStatus_t s_ = (call);                                          \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                     \
            cuda_fail(#call, __FILE__, __LINE__, cublasGetStatusString(s_)); \
    } while (0)
/* A cuBLAS product: counted, and with FLEXGEN_CUDA_SYNC=1 waited for. */
#define BLAS_PRODUCT(call)                   \
    do {                                     \
        count(&counts.blas_calls, 1);        \
        BLAS_CHECK(call);                    \
        note_queued();                       \
        if (sync_each_kernel) wait_stream(); \
    } while (0)

/* ---- Threads and streams ---- */

/* What one runtime thread uses: its stream, its cuBLAS handle, its bounce buffers, and the events
 * by which the host and the other threads' streams wait for its work. `queued` numbers the work
 * it puts on its stream and `finished` says how much of it the host has seen end, so that a host
 * buffer whose copy is known to have run is written again without a wait. */
typedef struct {
    cudaStream_t stream;
    cublasHandle_t blas;
    char *bounce[2];
    cudaEvent_t moved[2];    /* recorded after the copy that last used each bounce buffer */
    uint64_t moved_at[2];    /* the work each of those events stands for */
    int link;                /* the I/O link whose thread this is (io_links.c), or -1 */
    cudaEvent_t host_copied; /* recorded after each copy from or to host memory */
    uint64_t host_copied_at; /* the work that event stands for, 0: none since the host waited */
    cudaEvent_t mark;        /* recorded by join: the work another stream must wait for */
    uint64_t queued, finished;
    int capturing; /* its stream's work goes into a CUDA Graph (layer_graph_begins) */
    struct product_choices *products; /* fp16_product's algorithm a shape, made with blas */
} thread_ctx;

thread_ctx *ctx(void);      /* the calling thread's, made on its first call */
cublasHandle_t blas(void);  /* its cuBLAS handle, on its stream */
void wait_stream(void);     /* the host waits for all this thread queued */
uint64_t note_queued(void); /* numbers a piece of work just put on this thread's stream */

/* ---- Memory and copies, queued on the calling thread's stream (the table's alloc .. join) ---- */
enum { TO_DEVICE, TO_HOST, ON_DEVICE };

/* Bytes of each pinned bounce buffer. Three threads copy (compute, and the I/O threads of
 * weights and of the cache and activations), two buffers each: the plan counts them on the cpu
 * tier (FG_CUDA_HOST_RESERVE). */
enum { BOUNCE = 8 << 20 };
static_assert(FG_CUDA_HOST_RESERVE == 3 * 2 * (double)BOUNCE,
              "the cpu tier's count of bounce buffers");

void queue_copy_rows(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                     size_t rows, int direction);
void queue_copy(void *dst, const void *src, size_t bytes, int direction);
void cuda_copies_done(void);
void cuda_finish(void);
void cuda_join(unsigned links);
void *cuda_alloc(size_t bytes);
void cuda_free(void *p);
void *cuda_host_alloc(size_t bytes, int pinned);
void cuda_host_free(void *p);
int cuda_reads_in_place(const void *p);
void cuda_copy_in(void *dst, const void *src, size_t bytes);
void cuda_copy_out(void *dst, const void *src, size_t bytes);
void cuda_copy(void *dst, const void *src, size_t bytes);
void cuda_weights_in(void *dst, const fp16 *src, size_t n);
void cuda_weights_in_q4(void *dst, const void *src, void *landing, size_t outer, size_t len,
                        size_t inner);

/* ---- The workspace and the kernels' tables ---- */

/* A small table the kernels read: a step's rows and tokens (the input embedding's), or a layer's
 * rows, cache pointers and page tables. Its content lies in pinned memory, the source of its
 * upload, and on the device. A slot that already holds a table is not uploaded again: a decode
 * step's layers share their rows and pages, so only the first layer's table moves. */
typedef struct {
    char *host, *device;
    size_t bytes;         /* of the content; 0: empty */
    uint64_t uploaded_at; /* the compute thread's work up to the upload, which `uploaded` marks */
    cudaEvent_t uploaded;
    uint64_t last_used;
} table_slot;

/* The workspace: fp16 hidden states and products, as FlexGen keeps them, and the tables the
 * kernels read (fg_cuda_workspace_parts, support/workspace.c, lays it out). */
typedef struct {
    char *block;         /* the one device allocation */
    __half *h;           /* [rows][max(hidden, word_dim)]: a layer norm's output, the embedding */
    __half *qkv, *attn;  /* [rows][q + 2 kv width] (qkv_layout_of), [rows][q width]; then ffn takes
                            their space */
    __half *ffn;         /* [rows][ffn] (LLaMA: [2][rows][ffn], gate then up) */
    float *scores;       /* [heads][max_prompt][max_prompt]: one sequence's prefill, fp32 */
    __half *probs;       /* the same, softmaxed, fp16 */
    float *partials;     /* [span_slots][head_dim + 2]: decode attention's spans (queue_attention),
                            over scores and probs, which attention after cached tokens leaves */
    size_t span_slots;   /* fg_cuda_span_slots: up to 256 rows x heads x spans of max_len keys */
    int multiprocessors; /* the GPU's, which decode attention's spans are sized to fill */
    cudaGraphExec_t layer_graph; /* a decode layer's kernels, updated for each layer and step */
    int graphs;          /* decode layers go through layer_graph (FLEXGEN_CUDA_GRAPHS=0: not) */
    float *q4_scratch;   /* 4-bit products: decode's partial sums, or a slice widened to fp16,
                            over scores, probs and parts[4] too */
    size_t widen_values; /* the values of a widened slice that q4_scratch holds */
    unsigned *q4_done;   /* 4-bit products: a group's chunks done (fg_cuda_q4_groups), zeros
                            between products */
    size_t rows;         /* token rows the workspace holds */
    table_slot token_tables[FG_CUDA_TOKEN_TABLES], cache_tables[FG_CUDA_CACHE_TABLES];
    int max_pages;      /* entries of a sequence's page table in a cache table */
    char *grown_tables; /* the cache tables' own allocation once a run's pages outnumber the part */
    char *table;        /* host: the table being built, as large as a cache table */
    uint64_t clock;     /* counts table lookups (which slot was used last) */
    model_workspace host; /* delegated attention: the CPU backend's workspace, host_rows rows */
    /* [host_rows][q + 2 kv width], pinned: q, k, v rows out, attention rows in */
    fp16 *host16;
    size_t host_rows;
} cuda_ws;

int cuda_workspace_init(model_workspace *ws, const model_config *cfg, size_t rows, int max_prompt,
                        int max_len, char *err);
void cuda_workspace_free(model_workspace *ws);
/* The host rows of delegated attention, for `rows` token rows (host, host16). */
void host_rows_ready(cuda_ws *d, const model_config *c, size_t rows, int max_len);

/* A step's rows and tokens as the input embedding reads them. */
typedef struct {
    const int *pad, *past, *tokens;
} token_table;

/* A layer's rows, cache pointers and page tables as its kernels read them: each sequence's K and
 * V rows (NULL where they are in host memory and attention is delegated) lie shift[0] bytes from
 * k[b] and shift[1] from v[b]; its page tables are pages[K, V][batch][max_pages] (in order where
 * staged). */
typedef struct {
    const int *pad, *past;
    void *const *k, *const *v;
    const int *pages;
    int max_pages;
    long long shift[2]; /* K's, V's */
    int on_device;      /* sequences whose cache is device memory */
} cache_table;

token_table upload_tokens(cuda_ws *d, const gpu_batch *gb);
cache_table upload_cache(cuda_ws *d, const gpu_batch *gb);
void count_v_rows(gpu_batch *gb, int heads);

/* ---- The fp16 products of decode's rows: cuBLAS's default, or a cublasLt algorithm timed once
 * a shape (FLEXGEN_CUDA_PRODUCTS: timed, the default; cublas; cublaslt, its first untimed) ---- */
enum { PRODUCTS_TIMED, PRODUCTS_CUBLAS, PRODUCTS_CUBLASLT };
/* y [n][m] = x [n][k] op(W) + beta y, column-major as cuBLAS sees them: W m x k (op N, ld m) or
 * k x m (op T, ld k), x k x n (ld k), y m x n (ld m) of fp16 or fp32 (y_type); fp32 sums. */
void fp16_product(cuda_ws *d, cublasOperation_t op_w, int m, int n, int k, const void *W,
                  const void *x, float beta, void *y, cudaDataType y_type);
void products_settle(void);    /* keeps each shape's fastest whose timing runs are done */
void products_reset(int mode); /* forgets this thread's choices; the mode for the next ones */
int products_mode(char *err);  /* FLEXGEN_CUDA_PRODUCTS's mode, or -1 and err */

/* ---- A decode layer as one CUDA Graph: begins says whether this layer is captured ---- */
int layer_graph_begins(cuda_ws *d, const gpu_batch *gb, const cache_table *t);
void layer_graph_ends(cuda_ws *d, int captured);

/* ---- The device ---- */
double cuda_device_memory(void);
/* Finds this process's GPU once (under mpirun, its stage's), and whether this build has code for
 * it: 0, or -1 with err saying why not. */
int cuda_device_open(char *err);
/* FLEXGEN_CUDA_SYNC, FLEXGEN_CUDA_GRAPHS (0 or 1) and FLEXGEN_CUDA_PRODUCTS readable: 0, or -1
 * with err naming the one that is not. */
int cuda_settings(char *err);

#endif
