/* app/profile.c: this machine's constants for the cost model (the paper's §4.3 and Table 8's
 * symbols), measured on the paths the runtime takes: the backend's cpu -> gpu and gpu -> cpu
 * copies, the disk tier's mapped files in the offload dir (written back with msync, read by
 * faulting the pages in after dropping them from the page cache), and the backend's own layer
 * for compute. A layer's time is a sum of terms (weights read, FLOPs of the products, FLOPs of
 * attention), and runs that differ in one of them give its rate (profile_compute).
 * `flexgen profile` writes what fg_profile measures to a hardware file (fg_hardware_read, below),
 * with the OpenBLAS core it measured on.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <cjson/cJSON.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

/* Seconds for fn(ctx): the median of five runs after one to warm up. Not the best: on a busy
 * machine, or beside the runtime's own I/O threads, the typical run is what a prediction needs. */
typedef void (*timed_fn)(void *ctx);
static int cmp_double(const void *a, const void *b) {
    double d = *(const double *)a - *(const double *)b;
    return d < 0 ? -1 : d > 0;
}
static double typical_time(timed_fn fn, void *ctx) {
    double t[5];
    fn(ctx);
    for (int r = 0; r < 5; r++) {
        double t0 = now_seconds();
        fn(ctx);
        t[r] = now_seconds() - t0;
    }
    qsort(t, 5, sizeof *t, cmp_double);
    return t[2];
}

typedef struct {
    const fg_backend *be;
    void *src, *dst, *landing;
    size_t n;
    model_weights *w;
    gpu_batch *gb;
    model_workspace *ws;
} profile_ctx;

/* Each timed operation ends when the device has done it: the backend queues its work. */
static void time_weights_in(void *c) {
    profile_ctx *p = c;
    p->be->weights_in(p->dst, p->src, p->n);
    p->be->copies_done();
}
static void time_copy_out(void *c) {
    profile_ctx *p = c;
    p->be->copy_out(p->dst, p->src, p->n);
    p->be->copies_done();
}
/* 4-bit decompression: the device's widening (its landed bytes to fp16), or where there is none
 * (the CPU, whose products decode the codes as they read them) the same decoding done apart. */
static void time_dequant(void *c) {
    profile_ctx *p = c;
    if (p->be->widen_q4) p->be->widen_q4(p->dst, p->landing, 1, p->n, 1);
    else q4_decompress(p->src, 1, p->n, 1, p->dst);
    p->be->finish();
}
static void time_layer(void *c) {
    profile_ctx *p = c;
    p->be->forward[p->w->cfg.family].layer(p->w, 0, p->gb, p->ws);
    p->be->finish();
}

static void profile_step(int verbose, const char *what) {
    if (verbose) fprintf(stderr, "profile: %s\n", what);
}

/* Copies through the backend (from pinned host memory, as the cpu tier's), and 4-bit
 * decompression. */
static int profile_copies(const fg_backend *be, fg_hardware *hw, char *err) {
    size_t n = (size_t)64 << 20; /* 64 Mi values: 128 MiB of fp16, 256 MiB of fp32 */
    profile_ctx c = {.be = be, .n = n, .src = be->host_alloc(4 * n, 1), .dst = be->alloc(4 * n)};
    void *landing = be->alloc(q4_bytes(1, n, 1));
    int rc = 0;
    if (!c.src || !c.dst || !landing) rc = fg_fail(err, "profile: out of memory");
    else {
        memset(c.src, 0x3c, 4 * n);
        hw->ctog_bdw = 2.0 * n / typical_time(time_weights_in, &c);
        void *device = c.dst;
        c.dst = c.src;
        c.src = device;
        c.n = 4 * n;
        hw->gtoc_bdw_cache = hw->gtoc_bdw_hidden = 4.0 * n / typical_time(time_copy_out, &c);
        c.src = c.dst;
        c.dst = device;
        c.n = n;
        c.landing = landing;
        float *values = malloc(n * sizeof *values);
        if (!values) rc = fg_fail(err, "profile: out of memory");
        for (size_t i = 0; values && i < n; i++) values[i] = (float)(i % 251) * 0.01f;
        if (values) q4_compress(values, 1, n, 1, c.src);
        free(values);
        if (be->widen_q4) be->copy_in(landing, c.src, q4_bytes(1, n, 1));
        if (rc == 0) hw->dequant_bdw = 2.0 * n / typical_time(time_dequant, &c);
    }
    be->host_free(c.src);
    be->free(c.dst);
    be->free(landing);
    return rc;
}

/* The disk tier: cpu -> disk by writing a mapped file back, disk -> cpu by reading it in. */
static int profile_disk(const char *dir, fg_hardware *hw, char *err) {
    struct statvfs vfs;
    double free_bytes = statvfs(dir, &vfs) == 0 ? (double)vfs.f_bavail * vfs.f_frsize : 0;
    size_t bytes = (size_t)1 << 30;
    if (free_bytes / 4 < bytes) bytes = page_up((size_t)(free_bytes / 4));
    if (bytes < ((size_t)16 << 20))
        return fg_fail(err, "--offload-dir %s: %s free, too little to measure the disk", dir,
                       human(free_bytes).s);
    disk_arena a;
    int fd = unnamed_file(dir, "--offload-dir", err);
    if (fd < 0 || arena_map(&a, fd, bytes, "--offload-dir", dir, err)) return -1;
    double t0 = now_seconds();
    memset(a.base, 0x5a, bytes);
    drop_pages(&a, a.base, bytes, 1);
    double t1 = now_seconds();
    for (size_t at = 0; at < bytes; at += (size_t)64 << 20) /* as disk_fetch: a tensor at a time */
        disk_fetch_pages(&a, at, bytes - at < ((size_t)64 << 20) ? bytes - at : (size_t)64 << 20);
    double t2 = now_seconds();
    arena_close(&a);
    hw->ctod_bdw_cache_p = hw->ctod_bdw_hidden_p = hw->ctod_bdw_g = bytes / (t1 - t0);
    hw->dtoc_bdw = bytes / (t2 - t1);
    return 0;
}

/* Dummy weights of cfg in the backend's working format on its gpu tier (view's pointers); int8:
 * the matrices 4-bit, as the CPU's products read them, multiplied by int8 activations. */
static int device_weights(const fg_backend *be, const model_config *cfg, int int8, opt_layout *l,
                          model_weights *view, char *err) {
    memset(view, 0, sizeof *view);
    if (opt_layout_init(l, view, cfg, 0, err)) return -1;
    view->q4 = int8;
    view->products = int8 ? PRODUCTS_INT8 : PRODUCTS_FP32;
    weight_source src = {NULL, 1};
    for (int i = 0; i < l->n_tensors; i++) {
        const opt_tensor *t = &l->tensors[i];
        if (t->tied_to >= 0) continue;
        int q4 = int8 && t->group_len > 0;
        void *values = malloc(t->count * (q4 ? sizeof(float) : sizeof(fp16)));
        void *working = be->alloc(q4 ? q4_bytes(t->group_outer, t->group_len, t->group_inner)
                                     : t->count * be->weight_elem);
        if (values && working) { /* dummy values: always finite */
            opt_tensor_fill(l, i, &src, q4 ? values : NULL, q4 ? NULL : values, err);
            if (q4) q4_compress(values, t->group_outer, t->group_len, t->group_inner, working);
            else be->weights_in(working, values, t->count);
            *t->slot = working;
        }
        free(values);
        if (!working) return fg_fail(err, "profile: out of memory on the gpu tier");
        if (!values) return fg_fail(err, "profile: out of memory");
    }
    for (int i = 0; i < l->n_tensors; i++)
        if (l->tensors[i].tied_to >= 0)
            *l->tensors[i].slot = *l->tensors[l->tensors[i].tied_to].slot;
    return 0;
}

static void device_weights_free(const fg_backend *be, opt_layout *l) {
    for (int i = 0; i < l->n_tensors; i++)
        if (l->tensors[i].tied_to < 0) be->free(*l->tensors[i].slot);
    opt_layout_free(l);
}

/* One decoder layer of opt-1.3b's width, timed in four decode runs and two prefills:
 *   decode, 8 and 64 sequences over 32 cached tokens: t = W / mem_bdw + gbs mm / mm_flops_g
 *     (W: the layer's working weights, read once per GPU batch; mm: FLOPs of a token), with
 *     attention negligible at this length; both within the CPU's decode kernel (up to
 *     MATMUL_DECODE_ROWS rows), whose rate this is
 *   decode, 32 sequences over 32 and over 1024 cached tokens: the difference is attention over
 *     992 more tokens, 4 gbs 992 h1 FLOPs at bmm_flops_g
 *   prefill of one sequence of 1024 tokens and of 4 of 256: the same 1024 rows through the
 *     products (t = 1024 mm / mm_flops_p + attention), attention over 4 s^2 h1 FLOPs a sequence
 *     of s, at bmm_flops_p; their difference is attention's alone (two lengths of one sequence
 *     would also move the products' rate, whose shape changes with the rows)
 * A difference is taken as at least 1% of the longer run, against noise (profile_decode_line,
 * app.h, for the weights' read). Delegated attention (cpu_flops) is the CPU backend's decode
 * attention. */
/* The layer timed: hidden 2048. A sanitizer's build (test-san) times nothing a plan can use, and
 * runs the same code on a layer of 512, in a sixteenth of the time. */
#if defined(__SANITIZE_ADDRESS__)
enum { PROFILE_HIDDEN = 512 };
#else
enum { PROFILE_HIDDEN = 2048 };
#endif
enum { PREFILL_SPLIT = 4 }; /* prefill's second run: the long one's rows as this many sequences */

/* Bytes of a sequence's K (or V) of `past` cached tokens and the new one, rows of `row` bytes. */
static size_t seq_rows(size_t row, int past) { return row * (size_t)(past + 1); }

/* A decode step of `batch` sequences over `past` cached tokens, their K and V one after another
 * in `cache`, `seq` bytes each. */
static void decode_batch(gpu_batch *gb, int batch, int past, char *cache, size_t seq) {
    gb->batch = batch;
    gb->n_new = 1;
    for (int b = 0; b < batch; b++) {
        gb->k[b] = cache + 2 * b * seq;
        gb->v[b] = cache + (2 * b + 1) * seq;
        gb->pad[b] = 0;
        gb->past[b] = past;
    }
}

/* A GPU's host (a backend that counts its launches): the seconds to queue one launch (a kernel,
 * a cuBLAS product or a copy: a decode layer of `batch` sequences queued HOST_LAYERS times with
 * no wait, over what the counters saw queued) and those of one wait for the GPU (a small copy
 * queued and waited for, less a launch). */
enum { HOST_LAYERS = 20, HOST_WAITS = 200 };
static void profile_host(const fg_backend *be, profile_ctx *c, int batch, char *cache, size_t seq,
                         fg_hardware *hw) {
    fg_device_counts before, after;
    decode_batch(c->gb, batch, 32, cache, seq);
    be->finish();
    be->counts(&before);
    double t0 = now_seconds();
    for (int i = 0; i < HOST_LAYERS; i++)
        be->forward[c->w->cfg.family].layer(c->w, 0, c->gb, c->ws);
    double queueing = now_seconds() - t0;
    be->counts(&after);
    be->finish();
    double launches = (double)(after.launches - before.launches + after.blas_calls -
                               before.blas_calls + after.copies_in - before.copies_in +
                               after.copies_on_device - before.copies_on_device);
    hw->launch_seconds = queueing / fmax(launches, 1);
    t0 = now_seconds();
    for (int i = 0; i < HOST_WAITS; i++) {
        be->copy(cache + 64, cache, 64);
        be->finish();
    }
    hw->wait_seconds = fmax((now_seconds() - t0) / HOST_WAITS - hw->launch_seconds, 0);
}

/* Bytes a second that this machine's threads read from memory: a sum over 256 MiB (past any
 * cache; 32 MiB in a sanitizer's build), the best of 5 passes. */
static double host_read_rate(void) {
#if defined(__SANITIZE_ADDRESS__)
    size_t n = (32u << 20) / sizeof(uint64_t);
#else
    size_t n = (256u << 20) / sizeof(uint64_t);
#endif
    uint64_t *words = malloc(n * sizeof *words);
    if (!words) return 0;
    for (size_t i = 0; i < n; i++) words[i] = i;
    double best = 0;
    volatile uint64_t kept = 0; /* the sums are used: the reads are not optimized away */
    for (int pass = 0; pass < 5; pass++) {
        uint64_t sum = 0;
        double t0 = now_seconds();
#pragma omp parallel for reduction(+ : sum)
        for (size_t i = 0; i < n; i++) sum += words[i];
        double seconds = now_seconds() - t0;
        kept = kept + sum;
        if (seconds > 0) best = fmax(best, (double)(n * sizeof *words) / seconds);
    }
    free(words);
    return best;
}

void profile_decode_line(const decode_runs *r, double *mem_bdw, double *mm_flops_g) {
    double per_seq = fmax((r->t[1] - r->t[0]) / (r->gbs[1] - r->gbs[0]), 1e-12);
    double fixed = fmax(r->t[0] - r->gbs[0] * per_seq, 0.01 * r->t[0]);
    if (r->read_rate > 0) fixed = fmax(fixed, r->working / r->read_rate);
    *mm_flops_g = r->mm_token / per_seq;
    *mem_bdw = r->working / fixed;
}

static int profile_compute(const fg_backend *be, int int8, fg_hardware *hw, int verbose,
                           char *err) {
    model_config c = OPT_SHAPE("profile", 1, PROFILE_HIDDEN, PROFILE_HIDDEN / 64,
                               4 * PROFILE_HIDDEN, 64, 2048, PROFILE_HIDDEN, 1);
    enum { LONG = 1024, MAX_GBS = MATMUL_DECODE_ROWS, LONG_GBS = 32 };
    model_weights w;
    opt_layout layout = {0};
    double h = c.hidden, mm_token = 8 * h * h + 4 * h * c.ffn; /* FLOPs of the products a token */
    double working = be->weight_elem * (4 * h * h + 2 * h * c.ffn); /* bytes of the products */
    gpu_batch gb = {0};
    model_workspace ws = {0};
    size_t n_x = (size_t)LONG * c.hidden, x_bytes = n_x * be->act_elem; /* LONG >= MAX_GBS rows */
    size_t row = 2 * (size_t)c.hidden, rows = (size_t)2 * LONG_GBS * (LONG + 1);
    void *x = be->alloc(x_bytes), *x_host = malloc(x_bytes);
    char *cache = be->alloc(rows * row); /* K and V of 32 sequences of LONG + 1 slots, or of
                                            more sequences of fewer slots */
    int rc = device_weights(be, &c, int8, &layout, &w, err), has_ws = 0;
    if (rc == 0) rc = gpu_batch_init(&gb, MAX_GBS, LONG + 1, LONG, err);
    if (rc == 0) {
        rc = be->workspace_init(&ws, &c, LONG, LONG, LONG + 1, err);
        has_ws = rc == 0;
    }
    if (rc == 0 && (!x || !x_host || !cache)) rc = fg_fail(err, "profile: out of memory");
    if (rc == 0) {
        for (size_t i = 0; i < n_x; i++) { /* in the backend's activation format */
            float v = 0.01f * (float)((i * 7919) % 201) - 1;
            if (be->act_elem == sizeof(fp16)) ((fp16 *)x_host)[i] = fp32_to_fp16(v);
            else ((float *)x_host)[i] = v;
        }
        gb.x = x;
        gb.attn_sparsity = 1;
        profile_ctx ctx = {.be = be, .w = &w, .gb = &gb, .ws = &ws};
        profile_step(verbose, "matrix products and attention, decode");
        static const int runs[4][2] = {{8, 32}, {MAX_GBS, 32}, {LONG_GBS, 32}, {LONG_GBS, LONG}};
        double t[4]; /* runs: gbs, cached tokens */
        for (int i = 0; i < 4; i++) {
            be->copy_in(x, x_host, x_bytes); /* each run from the same activations */
            decode_batch(&gb, runs[i][0], runs[i][1], cache, seq_rows(row, runs[i][1]));
            t[i] = typical_time(time_layer, &ctx);
        }
        if (be->counts)
            profile_host(be, &ctx, runs[0][0], (char *)cache, seq_rows(row, runs[0][1]), hw);
        decode_runs line = {.t = {t[0], t[1]},
                            .gbs = {runs[0][0], runs[1][0]},
                            .working = working,
                            .mm_token = mm_token,
                            .read_rate = be->gpu_is_host ? host_read_rate() : 0};
        profile_decode_line(&line, &hw->mem_bdw, &hw->mm_flops_g);
        double att = fmax(t[3] - t[2], 0.01 * t[3]);
        hw->bmm_flops_g = 4.0 * LONG_GBS * (runs[3][1] - runs[2][1]) * h / att;
        profile_step(verbose, "matrix products and attention, prefill");
        static const int prefills[2][2] = {{1, LONG}, {PREFILL_SPLIT, LONG / PREFILL_SPLIT}};
        double tp[2], att_flops[2]; /* prefills: sequences, tokens each */
        for (int i = 0; i < 2; i++) {
            be->copy_in(x, x_host, x_bytes);
            decode_batch(&gb, prefills[i][0], 0, cache, seq_rows(row, LONG));
            gb.n_new = prefills[i][1];
            att_flops[i] = 4.0 * h * prefills[i][0] * prefills[i][1] * prefills[i][1];
            tp[i] = typical_time(time_layer, &ctx);
        }
        /* the same LONG rows through the products; attention's FLOPs differ */
        double att_more = fmax(tp[0] - tp[1], 0.01 * tp[0]);
        hw->bmm_flops_p = (att_flops[0] - att_flops[1]) / att_more;
        double products = fmax(tp[0] - att_flops[0] / hw->bmm_flops_p, 0.01 * tp[0]);
        hw->mm_flops_p = LONG * mm_token / products;
    }
    gpu_batch_free(&gb);
    if (has_ws) be->workspace_free(&ws);
    device_weights_free(be, &layout);
    be->free(x);
    be->free(cache);
    free(x_host);
    return rc;
}

int fg_profile(const char *offload_dir, fg_device device, fg_hardware *hw, int verbose, char *err) {
    const fg_backend *be = backend_for(device, err);
    if (!be) return -1;
    memset(hw, 0, sizeof *hw);
    hw->gpu_is_host = be->gpu_is_host;
    fg_blas_info blas; /* the CPU's rates are OpenBLAS's on this core */
    fg_blas_info_get(&blas);
    snprintf(hw->blas_core, sizeof hw->blas_core, "%.*s", (int)sizeof hw->blas_core - 1, blas.core);
    if (check_dir("--offload-dir", offload_dir, err)) return -1;
    profile_step(verbose, "cpu -> gpu and gpu -> cpu copies, 4-bit decompression");
    if (profile_copies(be, hw, err)) return -1;
    profile_step(verbose, "disk write and read in the offload dir (1 GiB, or a quarter of its free "
                          "space)");
    if (profile_disk(offload_dir, hw, err)) return -1;
    if (profile_compute(be, 0, hw, verbose, err)) return -1;
    hw->cpu_flops = hw->bmm_flops_g;
    fg_hardware cpu;
    if (be == &fg_cpu_backend) { /* --int8-activations' products: the CPU backend's alone */
        profile_step(verbose, "4-bit weights times int8 activations, for --int8-activations");
        if (profile_compute(be, 1, &cpu, 0, err)) return -1;
        hw->mm_flops_int8_p = cpu.mm_flops_p;
        hw->mm_flops_int8_g = cpu.mm_flops_g;
    }
    if (be->gpu_is_host) return 0;
    profile_step(verbose, "the CPU's attention, for --cpu-cache-compute"); /* delegated attention */
    if (profile_compute(&fg_cpu_backend, 0, &cpu, 0, err)) return -1;
    hw->cpu_flops = cpu.bmm_flops_g;
    return 0;
}

/* ============================================================================================
 * The hardware file: the constants above as JSON, keys named as fg_hardware's fields
 * ============================================================================================ */

static const char *const HW_KEYS[] = {"ctog_bdw",    "gtoc_bdw_cache",   "gtoc_bdw_hidden",
                                      "dtoc_bdw",    "ctod_bdw_cache_p", "ctod_bdw_hidden_p",
                                      "ctod_bdw_g",  "mm_flops_p",       "mm_flops_g",
                                      "bmm_flops_p", "bmm_flops_g",      "cpu_flops"};
enum { N_HW = sizeof HW_KEYS / sizeof HW_KEYS[0] };

/* The fields of fg_hardware, in HW_KEYS' order. */
static double *hw_field(fg_hardware *hw, int i) {
    double *const fields[N_HW] = {&hw->ctog_bdw,    &hw->gtoc_bdw_cache,   &hw->gtoc_bdw_hidden,
                                  &hw->dtoc_bdw,    &hw->ctod_bdw_cache_p, &hw->ctod_bdw_hidden_p,
                                  &hw->ctod_bdw_g,  &hw->mm_flops_p,       &hw->mm_flops_g,
                                  &hw->bmm_flops_p, &hw->bmm_flops_g,      &hw->cpu_flops};
    return fields[i];
}

/* A rate (bytes or FLOPs a second) outside [HW_MIN, HW_MAX] is no machine's: a bound keeps every
 * term bytes / rate of the cost model finite, so the LP gets finite coefficients. */
#define HW_MIN 1.0
#define HW_MAX 1e18

int fg_hardware_read(const char *path, fg_hardware *hw, char *err) {
    cJSON *root = fg_json_read_file(path, err);
    if (!root) return -1;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: not a JSON object", path);
    }
    memset(hw, 0, sizeof *hw);
    int rc = 0;
    for (int i = 0; i < N_HW && rc == 0; i++) {
        const cJSON *v = fg_json_get(root, HW_KEYS[i]);
        if (!cJSON_IsNumber(v))
            rc = fg_fail(err, "%s: \"%s\" is missing or not a number", path, HW_KEYS[i]);
        else if (!(v->valuedouble >= HW_MIN && v->valuedouble <= HW_MAX))
            rc = fg_fail(err, "%s: \"%s\" must be a rate in [%g, %g], got %g", path, HW_KEYS[i],
                         HW_MIN, HW_MAX, v->valuedouble);
        else *hw_field(hw, i) = v->valuedouble;
    }
    static const char *const OPTIONAL[] = {"dequant_bdw", "mem_bdw", "mm_flops_int8_p",
                                           "mm_flops_int8_g"};
    double *const optional[] = {&hw->dequant_bdw, &hw->mem_bdw, &hw->mm_flops_int8_p,
                                &hw->mm_flops_int8_g};
    static const char *const SECONDS[] = {"launch_seconds", "wait_seconds"}; /* optional: older
                                                                                files have none */
    double *const seconds[] = {&hw->launch_seconds, &hw->wait_seconds};
    for (int i = 0; i < 2 && rc == 0; i++) {
        const cJSON *v = fg_json_get(root, SECONDS[i]);
        if (v && (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= 1)))
            rc = fg_fail(err, "%s: \"%s\" must be seconds in [0, 1]", path, SECONDS[i]);
        else if (v) *seconds[i] = v->valuedouble;
    }
    for (int i = 0; i < 4 && rc == 0; i++) {
        const cJSON *v = fg_json_get(root, OPTIONAL[i]);
        if (v && (!cJSON_IsNumber(v) ||
                  !(v->valuedouble == 0 || (v->valuedouble >= HW_MIN && v->valuedouble <= HW_MAX))))
            rc = fg_fail(err, "%s: \"%s\" must be 0 or a rate in [%g, %g]", path, OPTIONAL[i],
                         HW_MIN, HW_MAX);
        else if (v) *optional[i] = v->valuedouble;
    }
    /* --int8-activations' products in prefill and in decode: the cost model takes both rates or
     * neither (0 and absent are none) */
    if (rc == 0 && (hw->mm_flops_int8_p > 0) != (hw->mm_flops_int8_g > 0))
        rc = fg_fail(
            err,
            "%s: \"mm_flops_int8_p\" and \"mm_flops_int8_g\" go together (4-bit x int8 products in "
            "prefill and decode): give both or neither; \"%s\" is missing or 0",
            path, hw->mm_flops_int8_p > 0 ? "mm_flops_int8_g" : "mm_flops_int8_p");
    const cJSON *host = fg_json_get(root, "gpu_is_host");
    if (rc == 0 && host && !cJSON_IsBool(host))
        rc = fg_fail(err, "%s: \"gpu_is_host\" must be true or false", path);
    hw->gpu_is_host = cJSON_IsTrue(host);
    const cJSON *core = fg_json_get(root, "blas_core"); /* optional: older files have none */
    if (rc == 0 && core &&
        !(cJSON_IsString(core) && strlen(core->valuestring) < sizeof hw->blas_core))
        rc = fg_fail(err, "%s: \"blas_core\" must be an OpenBLAS core's name", path);
    else if (rc == 0 && core)
        snprintf(hw->blas_core, sizeof hw->blas_core, "%s", core->valuestring);
    cJSON_Delete(root);
    return rc;
}

/* Written through fg_output: a temporary beside path renamed over it, so an interrupted or failed
 * write leaves the previous file as it was. */
int fg_hardware_write(const char *path, const fg_hardware *hw, char *err) {
    cJSON *o = cJSON_CreateObject();
    for (int i = 0; i < N_HW; i++)
        cJSON_AddNumberToObject(o, HW_KEYS[i], *hw_field((fg_hardware *)hw, i));
    cJSON_AddNumberToObject(o, "dequant_bdw", hw->dequant_bdw);
    cJSON_AddNumberToObject(o, "mem_bdw", hw->mem_bdw);
    cJSON_AddNumberToObject(o, "mm_flops_int8_p", hw->mm_flops_int8_p);
    cJSON_AddNumberToObject(o, "mm_flops_int8_g", hw->mm_flops_int8_g);
    cJSON_AddNumberToObject(o, "launch_seconds", hw->launch_seconds);
    cJSON_AddNumberToObject(o, "wait_seconds", hw->wait_seconds);
    cJSON_AddBoolToObject(o, "gpu_is_host", hw->gpu_is_host);
    if (hw->blas_core[0]) cJSON_AddStringToObject(o, "blas_core", hw->blas_core);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    if (!text) return fg_fail(err, "%s: out of memory", path);
    fg_output out;
    int rc = fg_output_open(&out, "hardware file", path, err);
    if (rc == 0) {
        fprintf(out.f, "%s\n", text);
        rc = fg_output_commit(&out, err);
    }
    free(text);
    return rc;
}
