/* weights.c: the weights on the tiers (the paper's §4.2, "Search Space": weight placement).
 *
 *   place_weights             each tensor's home tier: within a layer, the tier in which the
 *                             midpoint of its cumulative size falls (FlexGen's init_weight_list)
 *   load_weights_into_homes   the values written into their homes (fp16, or 4-bit with §5)
 *   weight file               dummy weights for a disk home: written once, reused after
 *   read, load, bind          Fig. 4's "load weight": a layer's disk pages read ahead, its
 *                             stored values converted into a staging arena of the gpu tier, and
 *                             compute pointed at them as the layer starts
 *
 * The gpu tier holds fp16 working copies, or the 4-bit bytes where the backend's products read
 * them (the CPU's; CUDA decompresses them into staging at each use); cpu and disk homes hold
 * fp16 (or 4-bit), loaded into one of two staging arenas while the previous layer computes.
 */
#define _GNU_SOURCE
#include "runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static void count_existing_weight_file(fg_model *m);

static int in_stage(const fg_model *m, int i) {
    int j = m->layout.tensors[i].layer;
    return j >= m->first_layer && j < m->end_layer;
}
/* The tensor whose home tensor i shares: its tie (lm_head to embed_tokens) when both are in this
 * stage, else -1 (the last stage of a pipeline keeps lm_head's own copy). */
static int tied_here(const fg_model *m, int i) {
    int t = m->layout.tensors[i].tied_to;
    return t >= 0 && in_stage(m, t) ? t : -1;
}

/* Tensor i is kept 4-bit (§5), and the bytes it is stored in (off the gpu tier, or 4-bit). */
static int is_q4(const fg_model *m, int i) {
    return m->rt->policy.compress_weight && m->layout.tensors[i].group_len > 0;
}
static size_t stored_bytes(const fg_model *m, int i) {
    const opt_tensor *t = &m->layout.tensors[i];
    return is_q4(m, i) ? q4_bytes(t->group_outer, t->group_len, t->group_inner) : 2 * t->count;
}

/* Compute reads a staging arena for this tensor: it lives off the gpu tier, or is compressed and
 * the backend's products cannot read it as it is (CUDA decompresses it into staging). */
static int is_staged(const fg_model *m, const weight_home *h) {
    return h->tier != TIER_GPU || (h->q4 && !m->rt->backend->reads_q4);
}

/* FlexGen's placement rule (init_weight_list), for tensors [first, end) of one of FlexGen's
 * layers: in order, each goes to the tier in which the midpoint of its cumulative size (in
 * elements, as a percentage of the layer's) falls, the tiers taking the percentages in the order
 * disk, cpu, gpu: [0, wn) disk, [wn, wn + wc) cpu, the rest gpu. A tied tensor (lm_head) has no
 * home of its own here. */
static void place_tensors(fg_model *m, int first, int end) {
    const fg_percent *pc = &m->rt->policy.percent;
    double disk_end = 100 - pc->wg - pc->wc, cpu_end = disk_end + pc->wc;
    const opt_layout *l = &m->layout;
    double total = 0, before = 0;
    for (int i = first; i < end; i++)
        if (tied_here(m, i) < 0) total += (double)l->tensors[i].count;
    for (int i = first; i < end; i++) {
        const opt_tensor *t = &l->tensors[i];
        if (tied_here(m, i) >= 0) continue;
        double mid = 100 * (before + t->count / 2.0) / total;
        before += (double)t->count;
        m->homes[i].tier = mid < disk_end ? TIER_DISK : mid < cpu_end ? TIER_CPU : TIER_GPU;
    }
}

/* Layer j's tensors. FlexGen's list has a decoder layer as two layers, its attention (q, k, v,
 * out_proj, their layer norm) and its MLP (fc1, fc2, their layer norm), each placed on its own:
 * at --percent 20 80 the out_proj of every layer goes to the gpu, fc2 does not. */
static void place_layer(fg_model *m, int j) {
    int first = m->layer_first[j], end = m->layer_first[j + 1], mlp = first;
    const opt_config *c = &m->view.cfg;
    if (j >= 1 && j <= c->n_layers)
        while (mlp < end && m->layout.tensors[mlp].slot != &m->view.layers[j - 1].fc1_w) mlp++;
    place_tensors(m, first, mlp);
    place_tensors(m, mlp, end);
}

/* Every tensor's home, its stored form, and the staging arenas' size. */
static void place_weights(fg_model *m) {
    const opt_layout *l = &m->layout;
    for (int j = m->first_layer; j < m->end_layer; j++) place_layer(m, j);
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer]; i++) {
        weight_home *h = &m->homes[i];
        if (tied_here(m, i) >= 0) h->tier = m->homes[tied_here(m, i)].tier;
        h->q4 = is_q4(m, i);
        h->bytes = stored_bytes(m, i);
    }
    /* an arena holds the largest staged layer's working weights and, on a device that cannot
     * decompress host memory, the largest compressed tensor's bytes (one at a time: they land
     * and are decompressed in order on one stream) */
    const fg_backend *be = m->rt->backend;
    size_t working = 0, landing = 0;
    for (int j = m->first_layer; j < m->end_layer; j++)
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            const weight_home *h = &m->homes[i];
            if (!is_staged(m, h)) continue;
            if (l->layer_floats[j] * be->weight_elem > working) working = l->layer_floats[j] * be->weight_elem;
            if (!be->gpu_is_host && h->q4 && h->tier != TIER_GPU && h->bytes > landing) landing = h->bytes;
        }
    m->landing_at = working;
    m->staging_bytes = working + landing;
}

/* What a home takes of its tier. */
static double home_bytes(const fg_model *m, const weight_home *h, size_t count) {
    if (h->tier == TIER_GPU && !h->q4) return (double)m->rt->backend->weight_elem * count;
    return h->tier == TIER_DISK ? (double)page_up(h->bytes) : (double)h->bytes;
}

/* Bytes of the weights' homes per tier, and the largest disk share of one layer. */
void weight_bytes(const fg_model *m, double bytes[N_TIERS], double *max_layer_disk) {
    memset(bytes, 0, N_TIERS * sizeof *bytes);
    *max_layer_disk = 0;
    for (int j = m->first_layer; j < m->end_layer; j++) {
        double layer_disk = 0;
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            const weight_home *h = &m->homes[i];
            double b = home_bytes(m, h, m->layout.tensors[i].count);
            if (tied_here(m, i) < 0) bytes[h->tier] += b;
            if (h->tier == TIER_DISK) layer_disk += b;
        }
        if (layer_disk > *max_layer_disk) *max_layer_disk = layer_disk;
    }
}

void weight_stored_bytes(const fg_model *m, double stored[N_TIERS]) {
    memset(stored, 0, N_TIERS * sizeof *stored);
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer]; i++)
        if (tied_here(m, i) < 0) stored[m->homes[i].tier] += (double)m->homes[i].bytes;
}

/* The table, the placement and nothing else: the weights move into their homes on first use. */
static int model_init(fg_model *m, const opt_config *cfg, int has_lm_head, const char *dir,
                      char *err) {
    m->disk.fd = -1;
    m->staged[0] = m->staged[1] = m->reads[0].g = m->reads[1].g = -1;
    if (opt_layout_init(&m->layout, &m->view, cfg, has_lm_head, err)) return -1;
    m->view.q4 = m->rt->policy.compress_weight && m->rt->backend->reads_q4;
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
    count_existing_weight_file(m);
    return 0;
}

int fg_model_open_dummy(fg_runtime *rt, const opt_config *cfg, uint64_t seed, fg_model **out,
                        char *err) {
    fg_model *m = calloc(1, sizeof *m);
    *out = NULL;
    if (!m) return fg_fail(err, "out of memory");
    m->rt = rt;
    m->seed = seed;
    if (model_init(m, cfg, 0, NULL, err)) {
        fg_model_close(m);
        return -1;
    }
    *out = m;
    return 0;
}

int fg_model_open(fg_runtime *rt, const char *model, uint64_t seed, fg_model **out, char *err) {
    *out = NULL;
    if (!is_dir(model)) {
        opt_config cfg;
        if (opt_config_by_name(model, &cfg, err)) return -1;
        return fg_model_open_dummy(rt, &cfg, seed, out, err);
    }
    fg_model *m = calloc(1, sizeof *m);
    if (!m) return fg_fail(err, "out of memory");
    m->rt = rt;
    m->disk.fd = -1;
    opt_config cfg;
    int rc = opt_checkpoint_open(model, &cfg, &m->archive, err);
    m->has_archive = rc == 0;
    if (rc == 0) rc = model_init(m, &cfg, st_find(&m->archive, "lm_head.weight") != NULL, model, err);
    if (rc) {
        fg_model_close(m);
        return -1;
    }
    *out = m;
    return 0;
}

const opt_config *fg_model_config(const fg_model *m) { return &m->view.cfg; }

void fg_model_close(fg_model *m) {
    if (!m) return;
    for (int i = 0; m->homes && i < m->layout.n_tensors; i++) {
        const weight_home *h = &m->homes[i];
        size_t bytes = (size_t)home_bytes(m, h, m->layout.tensors[i].count);
        if (!in_stage(m, i) || tied_here(m, i) >= 0) continue;
        if (h->tier == TIER_GPU) tier_free(m->rt, TIER_GPU, h->q4 ? h->stored : h->gpu, bytes);
        if (h->tier == TIER_CPU) tier_free(m->rt, TIER_CPU, h->stored, bytes);
    }
    for (int b = 0; b < 2; b++) tier_free(m->rt, TIER_GPU, m->staging[b], m->staging_bytes);
    if (m->disk.base) tier_add(m->rt, TIER_DISK, -m->disk_bytes);
    m->rt->capacity[TIER_DISK] -= m->reused_disk_bytes;
    arena_close(&m->disk);
    if (m->has_archive) st_close(&m->archive);
    opt_layout_free(&m->layout);
    free(m->homes);
    free(m->layer_first);
    free(m);
}

/* ---- dummy weights on disk: written once to a file in the weight dir, reused after ----
 * The file: a header naming the model, seed and size; a checksum of each layer's stored bytes;
 * then every tensor, page-aligned. A file that is reused is checked whole as it is opened: one
 * sequential read, the same as one decode step reads when the weights live on disk, and the
 * only way to catch damage before a single value is used (the runtime's reads have no path to
 * fail on). A damaged file is written again, as a missing one is. */

typedef struct {
    char magic[16];
    opt_config cfg;
    uint64_t seed, bytes;
} weight_file_header;

/* Where the layer checksums start; they are followed by the tensors. */
static size_t sums_at(void) { return sizeof(weight_file_header); }

/* A 64-bit checksum of bytes, continued from h (FNV-1a's prime over 8-byte words, with a shift
 * that carries high bits down): fast enough to run at memory speed, and any change of a word
 * changes it but for a 2^-64 chance. */
static uint64_t checksum(const void *bytes, size_t n, uint64_t h) {
    const unsigned char *s = bytes;
    for (; n >= 8; n -= 8, s += 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    for (; n; n--, s++) h = (h ^ *s) * 0x100000001b3ULL;
    return h;
}

/* The checksum of layer j's tensors as the file stores them (from its base). */
static uint64_t layer_checksum(const fg_model *m, const char *base, const size_t *offsets, int j) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        if (m->layout.tensors[i].tied_to < 0) h = checksum(base + offsets[i], stored_bytes(m, i), h);
    return h;
}

/* Where each tensor sits in the dummy-weight file: all tensors, whatever the policy, so that
 * one file serves every placement. Returns the file's size. */
static size_t weight_file_offsets(const fg_model *m, size_t *offsets) {
    size_t at = page_up(sums_at() + (size_t)n_flexgen_layers(&m->view.cfg) * sizeof(uint64_t));
    for (int i = 0; i < m->layout.n_tensors; i++) {
        int tie = m->layout.tensors[i].tied_to;
        if (offsets) offsets[i] = tie >= 0 ? offsets[tie] : at; /* the same values, stored alike */
        if (tie < 0) at += page_up(stored_bytes(m, i));
    }
    return at;
}

static void progress(const fg_model *m, const char *what, int done, int total) {
    if (m->rt->policy.verbose) fprintf(stderr, "\r%s: layer %d/%d", what, done, total);
    if (m->rt->policy.verbose && done == total) fprintf(stderr, "\n");
}

/* Writes tensor i's values as its home stores them (fp16, or compressed once here, §5). */
static int fill_stored(const fg_model *m, int i, const weight_source *src, void *dst, char *err) {
    const opt_tensor *t = &m->layout.tensors[i];
    if (!m->homes[i].q4) {
        opt_tensor_fill(&m->layout, i, src, NULL, dst);
        return 0;
    }
    float *values = malloc(t->count * sizeof *values);
    if (!values) return fg_fail(err, "out of memory compressing %s", t->name);
    opt_tensor_fill(&m->layout, i, src, values, NULL);
    q4_compress(values, t->group_outer, t->group_len, t->group_inner, dst);
    free(values);
    return 0;
}

/* A home on the gpu tier: the stored form made in host memory, then through the backend, into
 * the working format (uncompressed) or as it is (4-bit, decompressed at each use). */
static int fill_gpu_home(const fg_model *m, int i, const weight_source *src, void *home, char *err) {
    const fg_backend *be = m->rt->backend;
    const weight_home *h = &m->homes[i];
    void *stored = malloc(h->bytes);
    if (!stored) return fg_fail(err, "out of memory loading %s", m->layout.tensors[i].name);
    int rc = fill_stored(m, i, src, stored, err);
    if (rc == 0 && h->q4) be->copy_in(home, stored, h->bytes);
    else if (rc == 0) be->weights_in(home, stored, m->layout.tensors[i].count);
    free(stored);
    return rc;
}

/* The dummy-weight file of this model in --path: its name and the header it starts with. */
static void weight_file_id(const fg_model *m, size_t size, char *path, size_t n, weight_file_header *want) {
    int q4 = m->rt->policy.compress_weight;
    snprintf(path, n, "%s/%s-seed%llu%s.fgw", m->rt->weight_dir, m->view.cfg.name,
             (unsigned long long)m->seed, q4 ? "-q4" : "");
    memset(want, 0, sizeof *want);
    snprintf(want->magic, sizeof want->magic, q4 ? "flexgen-q4-2" : "flexgen-wt-2");
    want->cfg = m->view.cfg;
    want->seed = m->seed;
    want->bytes = size;
}

/* Whether every layer of the file open as fd matches its checksum; a note names the first that
 * does not. */
static int weight_file_intact(const fg_model *m, int fd, size_t size, const char *path) {
    int L = n_flexgen_layers(&m->view.cfg), bad = -1;
    size_t *offsets = malloc((size_t)m->layout.n_tensors * sizeof *offsets);
    const char *base = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (!offsets || base == MAP_FAILED) {
        free(offsets);
        return 0;
    }
    fg_watch_mapping(base, size, path);
    madvise((void *)base, size, MADV_SEQUENTIAL);
    weight_file_offsets(m, offsets);
    const uint64_t *sums = (const uint64_t *)(base + sums_at());
    for (int j = 0; j < L && bad < 0; j++) {
        if (layer_checksum(m, base, offsets, j) != sums[j]) bad = j;
        progress(m, "checking dummy weights", j + 1, L);
    }
    fg_unwatch_mapping(base);
    munmap((void *)base, size);
    free(offsets);
    if (bad >= 0)
        fprintf(stderr, "flexgen: note: %s: layer %d does not match its checksum (the file was "
                        "changed); writing the dummy weights again\n", path, bad);
    return bad < 0;
}

/* That file, open, when it is there and complete (and, with check, intact); else -1. */
static int existing_weight_file(const fg_model *m, size_t size, int check) {
    char path[4300];
    weight_file_header want, have;
    weight_file_id(m, size, path, sizeof path, &want);
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size == size &&
        pread(fd, &have, sizeof have, 0) == (ssize_t)sizeof have && !memcmp(&have, &want, sizeof have) &&
        (!check || weight_file_intact(m, fd, size, path)))
        return fd;
    if (fd >= 0) close(fd);
    return -1;
}

/* Dummy weights that an earlier run wrote to --path take no new space. The default capacity of
 * the disk tier is the offload dir's free space, so there they count on top of it (given back
 * by fg_model_close). With --disk-mem the user's number stands. */
static void count_existing_weight_file(fg_model *m) {
    double bytes[N_TIERS], max_layer_disk;
    weight_bytes(m, bytes, &max_layer_disk);
    if (m->has_archive || m->rt->policy.capacity[TIER_DISK] > 0 || bytes[TIER_DISK] == 0) return;
    int fd = existing_weight_file(m, weight_file_offsets(m, NULL), 0);
    if (fd < 0) return;
    close(fd);
    m->reused_disk_bytes = bytes[TIER_DISK];
    m->rt->capacity[TIER_DISK] += m->reused_disk_bytes;
}

static int open_weight_file(fg_model *m, size_t *offsets, char *err) {
    const opt_config *c = &m->view.cfg;
    size_t size = weight_file_offsets(m, offsets);
    char path[4300];
    weight_file_header want;
    weight_file_id(m, size, path, sizeof path, &want);
    int fd = existing_weight_file(m, size, 1);
    if (fd >= 0) {
        if (arena_map(&m->disk, fd, size, "--path", m->rt->weight_dir, err)) return -1;
        fg_watch_mapping(m->disk.base, m->disk.size, path);
        return 0;
    }
    if (mkdir_p(m->rt->weight_dir))
        return fg_fail(err, "--path %s: cannot create it: %s", m->rt->weight_dir, strerror(errno));
    fd = unnamed_file(m->rt->weight_dir, "--path", err);
    if (fd < 0 || arena_map(&m->disk, fd, size, "--path", m->rt->weight_dir, err)) return -1;
    weight_source src = {NULL, m->seed};
    int L = n_flexgen_layers(c);
    uint64_t *sums = (uint64_t *)(m->disk.base + sums_at());
    for (int j = 0; j < L; j++) {
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
            if (m->layout.tensors[i].tied_to < 0 && fill_stored(m, i, &src, m->disk.base + offsets[i], err))
                return -1;
        sums[j] = layer_checksum(m, m->disk.base, offsets, j);
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) /* memory to the policy */
            if (m->layout.tensors[i].tied_to < 0) drop_pages(&m->disk, m->disk.base + offsets[i], stored_bytes(m, i), 1);
        progress(m, "writing dummy weights", j + 1, L);
    }
    memcpy(m->disk.base, &want, sizeof want);
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", m->disk.fd);
    unlink(path); /* a stale file of the same name */
    if (msync(m->disk.base, m->disk.size, MS_SYNC) ||
        linkat(AT_FDCWD, self, AT_FDCWD, path, AT_SYMLINK_FOLLOW))
        fprintf(stderr, "flexgen: note: could not keep the dummy weights as %s (%s); they are "
                        "written again next run\n", path, strerror(errno));
    return 0;
}

/* Writes every tensor into its home (§4.2) and points the view at those on the gpu tier. */
int load_weights_into_homes(fg_model *m, char *err) {
    fg_runtime *rt = m->rt;
    const opt_layout *l = &m->layout;
    double bytes[N_TIERS], max_layer_disk;
    weight_bytes(m, bytes, &max_layer_disk);
    size_t *offsets = calloc((size_t)l->n_tensors, sizeof *offsets);
    if (!offsets) return fg_fail(err, "out of memory");
    int from_file = 0, rc = 0;
    if (bytes[TIER_DISK] > 0) {
        rc = tier_take(rt, TIER_DISK, bytes[TIER_DISK], "the weights", err);
        if (rc == 0) {
            m->disk_bytes = bytes[TIER_DISK];
            if (!m->has_archive) {
                rc = open_weight_file(m, offsets, err);
                from_file = 1;
            } else {
                int fd = unnamed_file(rt->offload_dir, "--offload-dir", err);
                rc = fd < 0 ? -1 : arena_map(&m->disk, fd, (size_t)bytes[TIER_DISK], "--offload-dir",
                                             rt->offload_dir, err);
            }
            if (rc) tier_add(rt, TIER_DISK, -m->disk_bytes), m->disk_bytes = 0;
        }
    }
    weight_source src = {m->has_archive ? &m->archive : NULL, m->seed};
    for (int j = m->first_layer; j < m->end_layer && rc == 0; j++) {
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1] && rc == 0; i++) {
            const opt_tensor *t = &l->tensors[i];
            weight_home *h = &m->homes[i];
            if (tied_here(m, i) >= 0) continue;
            if (h->tier == TIER_GPU) {
                void **home = h->q4 ? &h->stored : (void **)&h->gpu;
                *home = tier_alloc(rt, TIER_GPU, (size_t)home_bytes(m, h, t->count), "the weights", err);
                rc = *home ? fill_gpu_home(m, i, &src, *home, err) : -1;
            } else if (h->tier == TIER_CPU) {
                h->stored = tier_alloc_pinned(rt, TIER_CPU, h->bytes, "the weights", rt->policy.pin_weight, err);
                rc = h->stored ? fill_stored(m, i, &src, h->stored, err) : -1;
            } else if (from_file) {
                h->stored = m->disk.base + offsets[i];
            } else {
                h->stored = arena_take(&m->disk, h->bytes);
                rc = fill_stored(m, i, &src, h->stored, err);
                tier_add(rt, TIER_CPU, (double)h->bytes); /* written pages, until released */
                disk_release(rt, &m->disk, h->stored, h->bytes, 0);
            }
        }
        if (m->has_archive) progress(m, "placing weights", j + 1 - m->first_layer, stage_layers(m));
    }
    free(offsets);
    for (int i = m->layer_first[m->first_layer]; i < m->layer_first[m->end_layer] && rc == 0; i++) {
        if (tied_here(m, i) >= 0) m->homes[i] = m->homes[tied_here(m, i)];
        if (!is_staged(m, &m->homes[i])) *l->tensors[i].slot = m->homes[i].q4 ? m->homes[i].stored : m->homes[i].gpu;
    }
    for (int b = 0; b < 2 && rc == 0 && m->staging_bytes; b++)
        if (!(m->staging[b] = tier_alloc(rt, TIER_GPU, m->staging_bytes, "weight staging", err))) rc = -1;
    if (m->has_archive) { /* every value is in its home now */
        st_close(&m->archive);
        m->has_archive = 0;
    }
    m->loaded = rc == 0;
    return rc;
}

int fg_model_load(fg_model *m, char *err) { return m->loaded ? 0 : load_weights_into_homes(m, err); }

/* ---- loading a layer's weights: disk -> cpu, then cpu -> gpu (Fig. 4, "load weight") ----
 * Layer g (step g / L, layer g % L) is read from disk one layer earlier than Fig. 4 asks, while
 * layer g - 2 computes, so that the disk link reads back to back instead of waiting for each
 * conversion into the gpu tier; the plan counts those two layers of pages in the cpu tier. */

static void weights_fetch_task(fg_runtime *rt, const io_task *task) {
    fg_model *m = task->ctx;
    for (int i = m->layer_first[task->layer]; i < m->layer_first[task->layer + 1]; i++)
        if (m->homes[i].tier == TIER_DISK)
            disk_fetch(rt, &m->disk, m->homes[i].stored, m->homes[i].bytes);
}

/* Drops layer j's pages that came from disk (after their conversion, or unused). */
static void weights_release(fg_runtime *rt, fg_model *m, int j) {
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        if (m->homes[i].tier == TIER_DISK)
            disk_release(rt, &m->disk, m->homes[i].stored, m->homes[i].bytes, 0);
}

static void weights_in_task(fg_runtime *rt, const io_task *task) {
    fg_model *m = task->ctx;
    const fg_backend *be = rt->backend;
    char *staging = m->staging[task->arena], *landing = staging + m->landing_at;
    for (int i = m->layer_first[task->layer]; i < m->layer_first[task->layer + 1]; i++) {
        const weight_home *h = &m->homes[i];
        const opt_tensor *t = &m->layout.tensors[i];
        char *working = staging + t->offset * be->weight_elem;
        if (!is_staged(m, h)) continue;
        if (h->q4)
            be->weights_in_q4(working, h->stored, h->tier == TIER_GPU ? NULL : landing,
                              t->group_outer, t->group_len, t->group_inner);
        else
            be->weights_in(working, h->stored, t->count);
        if (h->tier != TIER_GPU) link_add(rt, LINK_CPU_TO_GPU, (double)h->bytes);
    }
    weights_release(rt, m, task->layer);
}

static void forget_read(fg_model *m, weight_read *r);

/* Starts reading the disk part of layer g into the cpu tier, unless it is read or has none. */
void read_weights(fg_model *m, long g) {
    int j = m->first_layer + (int)(g % stage_layers(m)), on_disk = 0;
    weight_read *r = &m->reads[g % 2];
    if (r->g == g) return;
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) on_disk |= m->homes[i].tier == TIER_DISK;
    if (!on_disk) return;
    forget_read(m, r); /* a layer read ahead for a unit that did not come */
    *r = (weight_read){g, io_submit(m->rt, IO_WEIGHT_DISK, (io_task){.fn = weights_fetch_task, .name = "read weights", .ctx = m, .layer = j}), 0};
}

/* Starts loading layer g into staging arena g % 2 (reading it first if that has not begun). */
void load_weights(fg_model *m, long g) {
    int j = m->first_layer + (int)(g % stage_layers(m)), buf = (int)(g % 2), staged = 0;
    if (m->staged[buf] == g) return;
    m->staged[buf] = g;
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) staged |= is_staged(m, &m->homes[i]);
    if (!staged) return;
    read_weights(m, g);
    weight_read *r = &m->reads[g % 2];
    uint64_t read = r->g == g ? r->seq : 0;
    if (r->g == g) r->used = 1;
    io_submit(m->rt, IO_WEIGHT_HOST, (io_task){.fn = weights_in_task, .name = "load weights", .after_link = IO_WEIGHT_DISK,
                                             .after_seq = read, .ctx = m, .layer = j, .arena = buf});
}

/* Points compute at layer g's staged weights (arena g % 2), as it starts: with one layer on a
 * pipeline stage, the arena the next layer loads into is this layer's other one. */
void bind_weights(fg_model *m, long g) {
    int j = m->first_layer + (int)(g % stage_layers(m));
    for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++)
        if (is_staged(m, &m->homes[i]))
            *m->layout.tensors[i].slot = (fp16 *)(m->staging[g % 2] + m->layout.tensors[i].offset * m->rt->backend->weight_elem);
}

/* At the end of a block: layers read ahead for steps that did not come (every sequence
 * stopped) give their pages back. */
static void forget_read(fg_model *m, weight_read *r) {
    if (r->g >= 0 && !r->used) {
        io_wait(m->rt, IO_WEIGHT_DISK, r->seq);
        weights_release(m->rt, m, m->first_layer + (int)(r->g % stage_layers(m)));
    }
    r->g = -1;
}

void forget_reads(fg_model *m) {
    for (int b = 0; b < 2; b++) forget_read(m, &m->reads[b]);
}

