/* app/runtime.c: a run opened and closed, and a model opened on it: the policy's numbers
 * checked, each tier's capacity (the flag's, or what the machine has), the I/O threads started,
 * the checkpoint or dummy weights opened and each tensor given its home (tiers.c's
 * place_weights); and the runtime's verdict on a policy that the search asks for (§4.3). None of
 * it is the schedule's: generate() in flexgen.c runs on what this opened.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

fg_policy fg_default_policy(void) {
    return (fg_policy){.device = FG_DEVICE_CPU,
                       .gpu_batch_size = 16,
                       .num_gpu_batches = 2,
                       .percent = {.wg = 100, .cg = 100, .hg = 100},
                       .overlap = 1,
                       .pin_weight = 1,
                       .attn_sparsity = 1,
                       .n_stages = 1};
}

/* The backend of a device: auto is CUDA when a GPU is there, else the CPU. NULL (and err) when
 * cuda is asked for and there is none. */
const fg_backend *backend_for(fg_device device, char *err) {
    char why[FG_ERR_LEN];
    if (device == FG_DEVICE_CPU_FP16) return fg_cpu_fp16_backend();
    const fg_backend *cuda = device == FG_DEVICE_CPU ? NULL : fg_cuda_backend(why);
    if (cuda) return cuda;
    if (device == FG_DEVICE_CUDA) {
        fg_fail(err, "--device cuda: %s", why);
        return NULL;
    }
    return &fg_cpu_backend;
}

int fg_runtime_open(const fg_policy *p, fg_runtime **out, char *err) {
    *out = NULL;
    const fg_percent *x = &p->percent;
    const int pairs[3][2] = {{x->wg, x->wc}, {x->cg, x->cc}, {x->hg, x->hc}};
    for (int kind = 0; kind < 3; kind++) {
        const int *pc = pairs[kind];
        for (int i = 0; i < 2; i++)
            if (pc[i] < 0 || pc[i] > 100)
                return fg_fail(err, "--percent: %d is outside 0..100", pc[i]);
        if (pc[0] + pc[1] > 100)
            return fg_fail(err, "--percent: %s on gpu and cpu sum to %d%%, above 100",
                           (const char *[]){"weights", "KV cache", "activations"}[kind],
                           pc[0] + pc[1]);
    }
    if (p->gpu_batch_size < 1 || p->num_gpu_batches < 1)
        return fg_fail(err, "--gpu-batch-size and --num-gpu-batches must be at least 1");
    if (!(p->attn_sparsity > 0 && p->attn_sparsity <= 1))
        return fg_fail(err, "--attn-sparsity: %g is outside (0, 1]", p->attn_sparsity);
    const char *offload = p->offload_dir ? p->offload_dir : FG_DEFAULT_OFFLOAD_DIR;
    if (check_dir("--offload-dir", offload, err)) return -1;
    const fg_backend *backend = backend_for(p->device, err);
    if (!backend) return -1;
    fg_runtime *rt = calloc(1, sizeof *rt);
    if (!rt) return fg_fail(err, "out of memory");
    rt->policy = *p;
    rt->backend = backend;
    snprintf(rt->offload_dir, sizeof rt->offload_dir, "%s", offload);
    if (p->weight_dir) snprintf(rt->weight_dir, sizeof rt->weight_dir, "%s", p->weight_dir);
    else default_weight_dir(rt->weight_dir, sizeof rt->weight_dir);
    pthread_mutex_init(&rt->lock, NULL);
    struct statvfs vfs;
    double disk_free = statvfs(offload, &vfs) == 0 ? (double)vfs.f_bavail * vfs.f_frsize : 0;
    double gpu_free = backend->device_memory ? backend->device_memory() : mem_available_bytes();
    double defaults[N_TIERS] = {gpu_free, mem_available_bytes(), disk_free};
    for (int t = 0; t < N_TIERS; t++)
        rt->capacity[t] = p->capacity[t] > 0 ? p->capacity[t] : defaults[t];
    rt->stage = &fg_single_stage;
    rt->keep_int8_columns = keep_int8_columns;
    rt->drop_int8_columns = drop_int8_columns;
    rt->trace.on = p->trace;
    rt->trace.t0 = now_seconds();
    io_start(&rt->io, rt, &rt->trace, p->overlap, backend->join);
    *out = rt;
    return 0;
}

void fg_runtime_close(fg_runtime *rt) {
    if (!rt) return;
    io_stop(&rt->io);
    trace_free(&rt->trace);
    pthread_mutex_destroy(&rt->lock);
    free(rt);
}

const fg_backend *fg_runtime_backend(const fg_runtime *rt) { return rt->backend; }

void fg_runtime_trace_restart(fg_runtime *rt) { trace_restart(&rt->trace, now_seconds()); }

void fg_runtime_stats(const fg_runtime *rt, fg_stats *s) {
    pthread_mutex_lock((pthread_mutex_t *)&rt->lock);
    for (int t = 0; t < N_TIERS; t++) {
        s->capacity[t] = rt->capacity[t];
        s->peak[t] = rt->peak[t];
        s->current[t] = rt->current[t];
    }
    for (int l = 0; l < N_LINKS; l++) s->link_bytes[l] = rt->link_bytes[l];
    pthread_mutex_unlock((pthread_mutex_t *)&rt->lock);
    s->host_memory = rt->backend->gpu_is_host ? host_memory_for_plans() : 0;
}

/* The device of the file system that holds dir, or its nearest existing parent where dir is not
 * made yet (--path is made as the weights are written); 0 where none is found. */
static dev_t file_system_of(const char *dir) {
    char path[FG_PATH_LEN];
    snprintf(path, sizeof path, "%s", dir);
    struct stat st;
    while (stat(path, &st) != 0) {
        if (!strcmp(path, "/") || !strcmp(path, ".")) return 0;
        char up[FG_PATH_LEN];
        path_folder(path, up, sizeof up);
        snprintf(path, sizeof path, "%s", up);
    }
    return st.st_dev;
}

/* Dummy weights placed on disk live in a file in --path (support/weight_file.c), while the disk
 * tier's default capacity is --offload-dir's free space. A file that an earlier run wrote takes
 * no new space, and a new one on another file system than the offload dir's takes none of its
 * space (a --path without room for it is refused as it is written: weight_file.c's create). Either
 * way its bytes count on top of the offload dir's free space (given back by fg_model_close). With
 * --disk-mem the user's number stands. */
static void count_weight_file(fg_model *m) {
    double bytes[N_TIERS], max_layer_disk;
    weight_bytes(m, bytes, &max_layer_disk);
    fg_runtime *rt = m->rt;
    if (m->has_archive || rt->policy.capacity[TIER_DISK] > 0 || bytes[TIER_DISK] == 0) return;
    weight_file f = weight_file_of(m);
    m->weight_file_found = weight_file_exists(&f);
    dev_t weights = file_system_of(rt->weight_dir), offload = file_system_of(rt->offload_dir);
    if (!m->weight_file_found && (!weights || weights == offload)) return;
    m->disk_weights_elsewhere = bytes[TIER_DISK];
    rt->capacity[TIER_DISK] += m->disk_weights_elsewhere;
}

/* The table, the placement and nothing else: the weights move into their homes on first use. */
static int model_init(fg_model *m, const model_config *cfg, int has_lm_head, const char *dir,
                      char *err) {
    m->disk.fd = -1;
    m->staged[0] = m->staged[1] = m->reads[0].n = m->reads[1].n = -1;
    const fg_backend *be = m->rt->backend;
    if (!be->forward[cfg->family].layer)
        return fg_fail(
            err, "--device: %s models do not run on the %s backend yet (--device cpu runs them)",
            model_family_names[cfg->family], be->name);
    if (opt_layout_init(&m->layout, &m->view, cfg, has_lm_head, err)) return -1;
    m->view.q4 = m->rt->policy.compress_weight && m->rt->backend->reads_q4;
    m->view.products = PRODUCTS_FP32;
    if (m->view.q4 && m->rt->policy.int8_activations) m->view.products = PRODUCTS_INT8;
    if (m->rt->policy.bf16_prefill) m->view.products = PRODUCTS_BF16_PREFILL;
    if (m->has_archive && opt_layout_check_archive(&m->layout, &m->archive, dir, err)) return -1;
    int L = n_flexgen_layers(cfg);
    m->homes = calloc((size_t)m->layout.n_tensors, sizeof *m->homes);
    m->layer_first = calloc((size_t)L + 1, sizeof *m->layer_first);
    if (!m->homes || !m->layer_first) return fg_fail(err, "out of memory");
    for (int i = 0, j = 0; j <= L; j++) {
        while (i < m->layout.n_tensors && m->layout.tensors[i].layer < j) i++;
        m->layer_first[j] = i;
    }
    const fg_policy *p = &m->rt->policy;
    fg_stage_layers(cfg, p->stage, p->n_stages, &m->first_layer, &m->end_layer);
    if (m->end_layer <= m->first_layer)
        return fg_fail(err, "%s has %d decoder layers: too few for %d pipeline stages", cfg->name,
                       cfg->n_layers, p->n_stages);
    m->first_decoder = m->first_layer > 0 ? m->first_layer - 1 : 0;
    int last_decoder = m->end_layer <= cfg->n_layers + 1 ? m->end_layer - 1 : cfg->n_layers;
    m->n_decoder = last_decoder - m->first_decoder;
    place_weights(m);
    count_weight_file(m);
    return 0;
}

int fg_model_open_dummy(fg_runtime *rt, const model_config *cfg, uint64_t seed, fg_model **out,
                        char *err) {
    fg_model *m = calloc(1, sizeof *m);
    *out = NULL;
    if (!m) return fg_fail(err, "out of memory");
    m->rt = rt;
    m->seed = seed;
    if (model_init(m, cfg, cfg->untied, NULL, err)) {
        fg_model_close(m);
        return -1;
    }
    *out = m;
    return 0;
}

int fg_model_open(fg_runtime *rt, const char *model, uint64_t seed, fg_model **out, char *err) {
    *out = NULL;
    if (!is_dir(model)) {
        model_config cfg;
        if (model_config_by_name(model, &cfg, err)) return -1;
        return fg_model_open_dummy(rt, &cfg, seed, out, err);
    }
    fg_model *m = calloc(1, sizeof *m);
    if (!m) return fg_fail(err, "out of memory");
    m->rt = rt;
    m->disk.fd = -1;
    model_config cfg;
    int rc = opt_checkpoint_open(model, &cfg, &m->archive, err);
    m->has_archive = rc == 0;
    if (rc == 0)
        rc = model_init(m, &cfg, st_find(&m->archive, "lm_head.weight") != NULL, model, err);
    if (rc) {
        fg_model_close(m);
        return -1;
    }
    *out = m;
    return 0;
}

const model_config *fg_model_config(const fg_model *m) { return &m->view.cfg; }

void fg_model_close(fg_model *m) {
    if (!m) return;
    drop_int8_columns(m);
    free_weight_homes(m);
    if (m->has_archive) st_close(&m->archive);
    opt_layout_free(&m->layout);
    free(m->homes);
    free(m->layer_first);
    free(m);
}

int fg_model_load(fg_model *m, char *err) {
    return m->loaded ? 0 : load_weights_into_homes(m, err);
}

void fg_plan_placement(const fg_model *m, int n_prompts, double x[N_X]) {
    double stored[N_TIERS];
    weight_stored_bytes(m, stored);
    double total = stored[TIER_GPU] + stored[TIER_CPU] + stored[TIER_DISK];
    /* the rows of a full GPU batch (max_prompt and gen_len do not change the split) */
    block_shape s = shape_block(m, n_prompts, NULL, 1, 1);
    for (int t = 0; t < N_TIERS; t++) {
        x[X_WG + t] = stored[t] / total;
        x[X_CG + t] = (double)s.cache.rows[t] / s.gbs;
        x[X_HG + t] = (double)s.act.rows[t] / s.gbs;
    }
}

int fg_runtime_check(const model_config *model, uint64_t seed, const fg_policy *p, int sequences,
                     int s, int n, int check, double x[N_X], fg_stats *st, char *err) {
    fg_policy q = *p;
    q.overlap = q.trace = q.verbose = 0;
    fg_runtime *rt;
    fg_model *m = NULL;
    if (fg_runtime_open(&q, &rt, err)) return -1;
    int rc = fg_model_open_dummy(rt, model, seed, &m, err);
    if (rc == 0 && sequences > 0 && check) rc = fg_check_plan(m, sequences, NULL, s, n, err);
    if (rc == 0 && x) fg_plan_placement(m, sequences, x);
    if (st) fg_runtime_stats(rt, st);
    fg_model_close(m);
    fg_runtime_close(rt);
    return rc;
}
