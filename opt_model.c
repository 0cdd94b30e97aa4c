/* opt_model.c: the OPT model and its forward pass on the CPU (paper §3, "Background: LLM
 * Inference").
 *
 *   configs          the nine OPT sizes, HF config.json, FlexGen's size formulas, FlexGen's
 *                    layer list and its split over pipeline stages
 *   weights          the weight table (opt_layout): every tensor's layer, shape and place;
 *                    dummy weights, or an HF checkpoint (safetensors.c)
 *   forward          opt_embed, opt_layer (layer norm, q k v, attention over the KV cache, out
 *                    projection, the MLP), opt_output: one GPU batch at a time
 *   backend          the CPU backend's operation table (fg_cpu_backend), and the same with
 *                    fp16 activations (fg_cpu_fp16_backend)
 *   sampling         greedy, temperature and top-p
 *
 * The forward pass is the generative inference of §3: a prefill over the (left-padded) prompts
 * that fills the KV cache, then decode steps of one token per sequence that read it. Every
 * function below works on one GPU batch, so the schedule in flexgen.c can walk the loop of
 * Fig. 4 (token i, layer j, GPU batch k) and call them in any order it needs.
 */
#define _GNU_SOURCE
#include "flexgen.h"

#include <cblas.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_F16C_PATH 1
#endif

/* ============================================================================================
 * Configs
 * ============================================================================================ */

static const opt_config OPT_SIZES[] = {
    /* name        layers hidden heads ffn   vocab  pos   word  pre_ln */
    {"opt-125m", 12, 768, 12, 3072, 50272, 2048, 768, 1},
    {"opt-350m", 24, 1024, 16, 4096, 50272, 2048, 512, 0},
    {"opt-1.3b", 24, 2048, 32, 8192, 50272, 2048, 2048, 1},
    {"opt-2.7b", 32, 2560, 32, 10240, 50272, 2048, 2560, 1},
    {"opt-6.7b", 32, 4096, 32, 16384, 50272, 2048, 4096, 1},
    {"opt-13b", 40, 5120, 40, 20480, 50272, 2048, 5120, 1},
    {"opt-30b", 48, 7168, 56, 28672, 50272, 2048, 7168, 1},
    {"opt-66b", 64, 9216, 72, 36864, 50272, 2048, 9216, 1},
    {"opt-175b", 96, 12288, 96, 49152, 50272, 2048, 12288, 1},
};

int opt_config_by_name(const char *name, opt_config *cfg, char *err) {
    const char *base = strncmp(name, "facebook/", 9) == 0 ? name + 9 : name;
    for (size_t i = 0; i < sizeof OPT_SIZES / sizeof OPT_SIZES[0]; i++)
        if (strcmp(base, OPT_SIZES[i].name) == 0) { *cfg = OPT_SIZES[i]; return 0; }
    return fg_fail(err, "--model: unknown model '%s' (not a directory; known names: opt-125m, "
                     "opt-350m, opt-1.3b, opt-2.7b, opt-6.7b, opt-13b, opt-30b, opt-66b, opt-175b)",
                name);
}

/* Reads an integer field; absent fields take `def` (def < 0 means required). */
static int json_int(const cJSON *o, const char *key, int def, int *out, const char *path,
                    char *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v) {
        if (def < 0) return fg_fail(err, "%s: missing \"%s\"", path, key);
        *out = def;
        return 0;
    }
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 1 && v->valuedouble <= (1 << 24)) ||
        v->valuedouble != (double)(int)v->valuedouble) /* range first: the cast needs it */
        return fg_fail(err, "%s: \"%s\" must be a positive integer", path, key);
    *out = (int)v->valuedouble;
    return 0;
}

static int config_from_cjson(const cJSON *root, const char *path, opt_config *c, char *err) {
    if (!cJSON_IsObject(root)) return fg_fail(err, "%s: not a JSON object", path);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt) || strcmp(mt->valuestring, "opt") != 0)
        return fg_fail(err, "%s: unknown architecture (model_type %s%s%s; only \"opt\" is supported)",
                    path, cJSON_IsString(mt) ? "\"" : "", cJSON_IsString(mt) ? mt->valuestring
                    : "missing", cJSON_IsString(mt) ? "\"" : "");
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "activation_function");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "relu") != 0))
        return fg_fail(err, "%s: unsupported activation_function (only \"relu\")", path);
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "%s", path);
    if (json_int(root, "num_hidden_layers", -1, &c->n_layers, path, err) ||
        json_int(root, "hidden_size", -1, &c->hidden, path, err) ||
        json_int(root, "num_attention_heads", -1, &c->n_heads, path, err) ||
        json_int(root, "ffn_dim", -1, &c->ffn, path, err) ||
        json_int(root, "vocab_size", -1, &c->vocab, path, err) ||
        json_int(root, "max_position_embeddings", 2048, &c->max_pos, path, err) ||
        json_int(root, "word_embed_proj_dim", c->hidden, &c->word_dim, path, err))
        return -1;
    if (c->hidden % c->n_heads)
        return fg_fail(err, "%s: hidden_size %d is not a multiple of num_attention_heads %d", path,
                    c->hidden, c->n_heads);
    const cJSON *ln = cJSON_GetObjectItemCaseSensitive(root, "do_layer_norm_before");
    c->pre_ln = ln ? cJSON_IsTrue(ln) : 1;
    /* HF keeps the final layer norm exactly when do_layer_norm_before holds, unless this is set. */
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "_remove_final_layer_norm")) && c->pre_ln)
        return fg_fail(err, "%s: _remove_final_layer_norm with do_layer_norm_before is not supported",
                    path);
    return 0;
}

int opt_config_from_json(const char *path, opt_config *cfg, char *err) {
    char *text = fg_read_file(path, NULL, err);
    if (!text) return -1;
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) return fg_fail(err, "%s: malformed JSON", path);
    int rc = config_from_cjson(root, path, cfg, err);
    cJSON_Delete(root);
    return rc;
}

size_t opt_param_count(const opt_config *c) {
    size_t h = c->hidden, f = c->ffn;
    size_t layer = 4 * (h * h + h) + 2 * h * f + f + h + 4 * h;
    size_t n = c->n_layers * layer + (size_t)c->vocab * c->word_dim + (c->max_pos + 2) * h;
    if (c->word_dim != c->hidden) n += 2 * h * c->word_dim;
    if (c->pre_ln) n += 2 * h;
    return n;
}

/* FlexGen's opt_config.py formulas, so reports compare with its logs. */
double opt_model_bytes(const opt_config *c) {
    double h = c->hidden;
    return 2 * (c->n_layers * (h * (3 * h + 1) + h * (h + 1) + h * (4 * h + 1) + h * 4 * (h + 1) +
                               h * 4) +
                c->vocab * (h + 1));
}
double opt_cache_bytes(const opt_config *c, int batch, int seq_len) {
    return 2.0 * batch * seq_len * c->n_layers * c->hidden * 2;
}
double opt_hidden_bytes(const opt_config *c, int batch, int seq_len) {
    return (double)batch * seq_len * c->hidden * 2;
}

/* FlexGen's layer list (0 the input embedding, 1 .. n_layers the decoder layers, n_layers + 1
 * the output embedding) split over n pipeline stages (§4.4). */
void fg_stage_layers(const opt_config *c, int s, int n, int *first, int *end) {
    int L = c->n_layers;
    if (n < 1) n = 1;
    *first = s == 0 ? 0 : 1 + (int)((long)L * s / n);
    *end = s == n - 1 ? L + 2 : 1 + (int)((long)L * (s + 1) / n);
}


/* ============================================================================================
 * Weights. One table lists every checkpoint tensor of the model: its HF name, its shape, the
 * FlexGen layer it belongs to and where each of its elements lives in that layer's arena.
 * Dummy initialisation, checkpoint loading, the runtime's placement (weights.c) and
 * opt_weight_locate() all walk that table.
 *
 * FlexGen's layer list (§4.1): 0 is the input embedding (embed_tokens, embed_positions,
 * project_in), 1 .. n_layers the decoder layers, n_layers + 1 the output embedding (project_out,
 * the final layer norm, lm_head). A tied lm_head is a tensor of the output layer that shares
 * embed_tokens' values and home, as FlexGen's OutputEmbed loads the embedding weights again.
 *
 * Linear weights are stored transposed, [in][out], so that every product is x[rows][in] times
 * W[in][out]: at decode's small batches OpenBLAS streams that layout 1.2-1.5x faster than the
 * checkpoint's [out][in] (BENCHMARKS.md). q, k and v share one [hidden][3 * hidden] matrix.
 * Embedding tables keep the checkpoint layout (rows are looked up; lm_head reads them as is).
 * ============================================================================================ */

typedef struct {
    char name[96];      /* HF name without the "model." prefix */
    char source[96];    /* the checkpoint tensor its values come from (differs for a tied lm_head) */
    fp16 **slot;        /* the view pointer that records where its stored tensor starts, or NULL */
    int layer;          /* FlexGen layer */
    int64_t rows, cols; /* the checkpoint's shape; cols == 0 for a vector */
    int kind;           /* how dummy weights fill it */
    size_t offset;      /* element [r][c] is at offset + r * row_stride + c * col_stride */
    size_t row_stride, col_stride;
} tensor_spec;

enum { FILL_MATRIX, FILL_EMBED, FILL_BIAS, FILL_LN_W, FILL_LN_B };

typedef struct {
    tensor_spec *s;
    int n, layer;
    size_t next; /* the current layer's arena size so far, in floats */
    size_t *layer_floats;
} spec_list;

static size_t reserve(spec_list *l, size_t floats) {
    size_t at = l->next;
    l->next += (floats + 15) & ~(size_t)15; /* 64-byte aligned */
    return at;
}

static void start_layer(spec_list *l, int layer) {
    if (layer > 0) l->layer_floats[layer - 1] = l->next;
    l->layer = layer;
    l->next = 0;
}

static void add_spec(spec_list *l, fp16 **slot, int64_t rows, int64_t cols, int kind,
                     size_t offset, size_t row_stride, size_t col_stride, const char *fmt, ...) {
    tensor_spec *s = &l->s[l->n++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->name, sizeof s->name, fmt, ap);
    va_end(ap);
    snprintf(s->source, sizeof s->source, "%s", s->name);
    s->slot = slot;
    s->layer = l->layer;
    s->rows = rows;
    s->cols = cols;
    s->kind = kind;
    s->offset = offset;
    s->row_stride = row_stride;
    s->col_stride = col_stride;
}

/* An embedding table or a vector, stored as in the checkpoint. */
#define ADD_PLAIN(l, slot, rows, cols, kind, ...) \
    add_spec(l, slot, rows, cols, kind, reserve(l, (size_t)(rows) * ((cols) ? (cols) : 1)), \
             (cols) ? (size_t)(cols) : 1, 1, __VA_ARGS__)
/* A linear layer's [out][in] weight, stored as [in][out]. */
#define ADD_LINEAR(l, slot, out, in, ...) \
    add_spec(l, slot, out, in, FILL_MATRIX, reserve(l, (size_t)(out) * (in)), 1, (size_t)(out), \
             __VA_ARGS__)

static void layer_specs(spec_list *l, opt_layer_weights *L, const opt_config *c, int i) {
    int64_t h = c->hidden, f = c->ffn;
    const char *p = "decoder.layers";
    /* q, k, v: the columns 0, h and 2h of one [h][3h] matrix; their biases side by side. */
    size_t qkv = reserve(l, 3 * (size_t)h * h);
    const char *names[3] = {"q_proj", "k_proj", "v_proj"};
    for (int j = 0; j < 3; j++)
        add_spec(l, j ? NULL : &L->wqkv, h, h, FILL_MATRIX, qkv + j * h, 1, 3 * h,
                 "%s.%d.self_attn.%s.weight", p, i, names[j]);
    size_t b = reserve(l, 3 * (size_t)h);
    for (int j = 0; j < 3; j++)
        add_spec(l, j ? NULL : &L->bqkv, h, 0, FILL_BIAS, b + j * h, 1, 1,
                 "%s.%d.self_attn.%s.bias", p, i, names[j]);
    ADD_LINEAR(l, &L->wo, h, h, "%s.%d.self_attn.out_proj.weight", p, i);
    ADD_PLAIN(l, &L->bo, h, 0, FILL_BIAS, "%s.%d.self_attn.out_proj.bias", p, i);
    ADD_PLAIN(l, &L->attn_ln_w, h, 0, FILL_LN_W, "%s.%d.self_attn_layer_norm.weight", p, i);
    ADD_PLAIN(l, &L->attn_ln_b, h, 0, FILL_LN_B, "%s.%d.self_attn_layer_norm.bias", p, i);
    ADD_LINEAR(l, &L->fc1_w, f, h, "%s.%d.fc1.weight", p, i);
    ADD_PLAIN(l, &L->fc1_b, f, 0, FILL_BIAS, "%s.%d.fc1.bias", p, i);
    ADD_LINEAR(l, &L->fc2_w, h, f, "%s.%d.fc2.weight", p, i);
    ADD_PLAIN(l, &L->fc2_b, h, 0, FILL_BIAS, "%s.%d.fc2.bias", p, i);
    ADD_PLAIN(l, &L->ffn_ln_w, h, 0, FILL_LN_W, "%s.%d.final_layer_norm.weight", p, i);
    ADD_PLAIN(l, &L->ffn_ln_b, h, 0, FILL_LN_B, "%s.%d.final_layer_norm.bias", p, i);
}

/* Every tensor of the model, layer by layer; l->s holds 9 + 16 * n_layers entries. */
static void model_specs(opt_weights *w, int has_lm_head, spec_list *l) {
    const opt_config *c = &w->cfg;
    int64_t h = c->hidden, n = c->n_layers;
    l->n = 0;
    start_layer(l, 0);
    ADD_PLAIN(l, &w->embed_tokens, c->vocab, c->word_dim, FILL_EMBED, "decoder.embed_tokens.weight");
    ADD_PLAIN(l, &w->embed_positions, c->max_pos + 2, h, FILL_EMBED, "decoder.embed_positions.weight");
    if (c->word_dim != c->hidden) ADD_LINEAR(l, &w->project_in, h, c->word_dim, "decoder.project_in.weight");
    for (int i = 0; i < n; i++) {
        start_layer(l, i + 1);
        layer_specs(l, &w->layers[i], c, i);
    }
    start_layer(l, (int)n + 1);
    if (c->word_dim != c->hidden) ADD_LINEAR(l, &w->project_out, c->word_dim, h, "decoder.project_out.weight");
    if (c->pre_ln) {
        ADD_PLAIN(l, &w->final_ln_w, h, 0, FILL_LN_W, "decoder.final_layer_norm.weight");
        ADD_PLAIN(l, &w->final_ln_b, h, 0, FILL_LN_B, "decoder.final_layer_norm.bias");
    }
    ADD_PLAIN(l, &w->lm_head, c->vocab, c->word_dim, FILL_EMBED, "lm_head.weight");
    if (!has_lm_head) /* tied (docs/DESIGN.md, "Conventions": OPT facts) */
        snprintf(l->s[l->n - 1].source, sizeof l->s[l->n - 1].source, "decoder.embed_tokens.weight");
    start_layer(l, (int)n + 2);
}

static int is_tied(const tensor_spec *s) { return strcmp(s->name, s->source) != 0; }

int opt_layout_init(opt_layout *l, opt_weights *view, const opt_config *cfg, int has_lm_head,
                    char *err) {
    memset(l, 0, sizeof *l);
    memset(view, 0, sizeof *view);
    view->cfg = *cfg;
    l->view = view;
    int n_specs = 9 + 16 * cfg->n_layers;
    view->layers = calloc((size_t)cfg->n_layers, sizeof *view->layers);
    spec_list sl = {calloc((size_t)n_specs, sizeof *sl.s), 0, 0, 0,
                    calloc((size_t)cfg->n_layers + 2, sizeof(size_t))};
    l->tensors = calloc((size_t)n_specs, sizeof *l->tensors);
    l->specs = sl.s;
    l->layer_floats = sl.layer_floats;
    if (!view->layers || !sl.s || !sl.layer_floats || !l->tensors) {
        opt_layout_free(l);
        return fg_fail(err, "out of memory for the weight table");
    }
    model_specs(view, has_lm_head, &sl);
    l->n_specs = sl.n;
    /* A stored tensor starts at each spec with a slot; k and v pieces belong to q's. */
    for (int i = 0; i < sl.n; i++) {
        const tensor_spec *s = &sl.s[i];
        if (!s->slot) { l->tensors[l->n_tensors - 1].n_specs++; continue; }
        opt_tensor *t = &l->tensors[l->n_tensors++];
        snprintf(t->name, sizeof t->name, "%s", s->name);
        t->layer = s->layer;
        t->offset = s->offset;
        t->slot = s->slot;
        t->first_spec = i;
        t->n_specs = 1;
        t->tied_to = -1;
        for (int j = 0; j < l->n_tensors - 1 && is_tied(s); j++)
            if (!strcmp(sl.s[l->tensors[j].first_spec].name, s->source)) t->tied_to = j;
    }
    for (int i = 0; i < l->n_tensors; i++) { /* a tensor runs up to the next one or its layer's end */
        opt_tensor *t = &l->tensors[i];
        size_t end = i + 1 < l->n_tensors && l->tensors[i + 1].layer == t->layer
                         ? l->tensors[i + 1].offset : l->layer_floats[t->layer];
        t->count = end - t->offset;
        const tensor_spec *s = &sl.s[t->first_spec]; /* §5: matrices group along dim 0 of [out, in] */
        if (s->kind == FILL_MATRIX) /* stored [in][out]: out is contiguous */
            t->group_outer = (size_t)s->cols, t->group_len = (size_t)s->rows * t->n_specs, t->group_inner = 1;
        else if (s->kind == FILL_EMBED)
            t->group_outer = 1, t->group_len = (size_t)s->rows, t->group_inner = (size_t)s->cols;
    }
    return 0;
}

void opt_layout_free(opt_layout *l) {
    if (l->view) free(l->view->layers), l->view->layers = NULL;
    free(l->specs);
    free(l->tensors);
    free(l->layer_floats);
    memset(l, 0, sizeof *l);
}

/* A stateless hash of (seed, tensor, element): the same weights whatever the thread count. */
static uint64_t mix64(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t hash_name(const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ULL;
    return h;
}

/* Where a tensor's values come from: a checkpoint tensor, or the dummy-weight hash. */
typedef struct {
    const st_tensor *tensor; /* NULL: dummy */
    uint64_t base;
    float scale, center;
} value_source;

/* Dummy values are uniform in [-1, 1) around `center`. Matrices get std about 1/sqrt(3 * in):
 * each product keeps its input's scale, and layer norms keep the residual stream bounded. */
static value_source dummy_source(const tensor_spec *s, uint64_t seed) {
    value_source v = {NULL, mix64(seed ^ mix64(hash_name(s->source))), 0.05f, 0};
    switch (s->kind) {
    case FILL_MATRIX: v.scale = 1.0f / sqrtf((float)s->cols); break;
    case FILL_EMBED: v.scale = 0.5f; break;
    case FILL_BIAS: v.scale = 0.02f; break;
    case FILL_LN_W: v.scale = 0.1f, v.center = 1.0f; break;
    default: break;
    }
    return v;
}

/* Element i (in checkpoint order), rounded to fp16 whatever the source dtype. */
static fp16 source_value(const value_source *v, size_t i) {
    float x;
    if (!v->tensor) {
        x = v->center + v->scale * ((float)(mix64(v->base + i) >> 40) * (2.0f / 16777216.0f) - 1.0f);
    } else if (v->tensor->dtype == ST_F16) {
        fp16 h;
        memcpy(&h, (const char *)v->tensor->data + 2 * i, 2);
        return h;
    } else if (v->tensor->dtype == ST_BF16) {
        uint16_t b;
        memcpy(&b, (const char *)v->tensor->data + 2 * i, 2);
        x = bf16_to_fp32(b);
    } else {
        memcpy(&x, (const char *)v->tensor->data + 4 * i, 4); /* may be unaligned in the file */
    }
    return fp32_to_fp16(x);
}

/* Writes every element of s from v at dst (fp32 or fp16), in 32 x 32 tiles so that both the
 * checkpoint's rows and the transposed layout's rows are touched a cache line at a time. */
static void store_tensor(const tensor_spec *s, float *dst32, fp16 *dst16, const value_source *v) {
    int64_t rows = s->rows, cols = s->cols ? s->cols : 1;
#pragma omp parallel for schedule(dynamic)
    for (int64_t r0 = 0; r0 < rows; r0 += 32)
        for (int64_t c0 = 0; c0 < cols; c0 += 32)
            for (int64_t c = c0; c < c0 + 32 && c < cols; c++)
                for (int64_t r = r0; r < r0 + 32 && r < rows; r++) {
                    size_t at = r * s->row_stride + c * s->col_stride;
                    fp16 x = source_value(v, (size_t)(r * cols + c));
                    if (dst16) dst16[at] = x;
                    else dst32[at] = fp16_to_fp32(x);
                }
}

/* Checkpoint names come with "model." (OPTForCausalLM) or without it (OPTModel). */
static const char *strip_prefix(const char *name) {
    return strncmp(name, "model.", 6) == 0 ? name + 6 : name;
}

static const st_tensor *find_spec_tensor(const st_archive *a, const char *spec_name) {
    for (int i = 0; i < a->n_tensors; i++)
        if (strcmp(strip_prefix(a->tensors[i].name), spec_name) == 0) return &a->tensors[i];
    return NULL;
}

void opt_tensor_fill(const opt_layout *l, int t, const weight_source *src, float *dst32,
                     fp16 *dst16) {
    const opt_tensor *ten = &l->tensors[t];
    const tensor_spec *specs = l->specs;
    if (dst16) memset(dst16, 0, ten->count * sizeof *dst16); /* the 64-byte padding too */
    else memset(dst32, 0, ten->count * sizeof *dst32);
    for (int i = ten->first_spec; i < ten->first_spec + ten->n_specs; i++) {
        const tensor_spec *s = &specs[i];
        value_source v = src->archive ? (value_source){find_spec_tensor(src->archive, s->source), 0, 0, 0}
                                      : dummy_source(s, src->seed);
        size_t at = s->offset - ten->offset;
        store_tensor(s, dst32 ? dst32 + at : NULL, dst16 ? dst16 + at : NULL, &v);
        if (!src->archive) continue;
        /* The copy is what the runtime uses: drop the file's pages (§4.1). */
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = ((uintptr_t)v.tensor->data + page - 1) & ~(page - 1);
        uintptr_t hi = ((uintptr_t)v.tensor->data + v.tensor->nbytes) & ~(page - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    }
}

static int check_shape(const st_tensor *t, const tensor_spec *s, const char *dir, char *err) {
    int want_ndim = s->cols ? 2 : 1;
    char want[64], got[96] = "";
    if (s->cols) snprintf(want, sizeof want, "[%lld, %lld]", (long long)s->rows, (long long)s->cols);
    else snprintf(want, sizeof want, "[%lld]", (long long)s->rows);
    int ok = t->ndim == want_ndim && t->shape[0] == s->rows && (!s->cols || t->shape[1] == s->cols);
    if (ok) return 0;
    for (int i = 0; i < t->ndim; i++) {
        size_t len = strlen(got);
        snprintf(got + len, sizeof got - len, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    }
    return fg_fail(err, "%s: tensor %s has shape [%s], expected %s", dir, t->name, got, want);
}

int opt_layout_check_archive(const opt_layout *l, const st_archive *a, const char *dir, char *err) {
    const tensor_spec *s = l->specs;
    for (int i = 0; i < l->n_specs; i++) {
        if (is_tied(&s[i])) continue;
        const st_tensor *t = find_spec_tensor(a, s[i].name);
        if (!t) return fg_fail(err, "%s: missing tensor model.%s", dir, s[i].name);
        if (check_shape(t, &s[i], dir, err)) return -1;
    }
    for (int i = 0; i < a->n_tensors; i++) { /* anything the model does not use is an error */
        const char *name = strip_prefix(a->tensors[i].name);
        int known = 0;
        for (int j = 0; j < l->n_specs && !known; j++) known = !is_tied(&s[j]) && !strcmp(s[j].name, name);
        if (!known) return fg_fail(err, "%s: unexpected tensor %s", dir, a->tensors[i].name);
    }
    return 0;
}

/* The config against the tensor table before anything is sized from the config: the decoder
 * layers that the tensors name must be those num_hidden_layers says. */
static int check_layer_count(const opt_config *cfg, const st_archive *a, const char *path, char *err) {
    long layers = 0;
    for (int i = 0; i < a->n_tensors; i++) {
        const char *s = strstr(a->tensors[i].name, "decoder.layers.");
        long j = s ? strtol(s + strlen("decoder.layers."), NULL, 10) : -1;
        if (j >= layers) layers = j + 1;
    }
    if (layers != cfg->n_layers)
        return fg_fail(err, "%s: num_hidden_layers is %d, but the checkpoint holds %ld decoder layers",
                       path, cfg->n_layers, layers);
    return 0;
}

int opt_checkpoint_open(const char *dir, opt_config *cfg, st_archive *a, char *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (opt_config_from_json(path, cfg, err)) return -1;
    snprintf(cfg->name, sizeof cfg->name, "%s", dir);
    if (st_open_dir(dir, a, err)) return -1;
    if (check_layer_count(cfg, a, path, err)) {
        st_close(a);
        return -1;
    }
    return 0;
}

/* All weights in one fp16 arena: every tensor on the compute device (tests and tools). */
static int weights_all_fp16(opt_weights *w, const opt_config *cfg, int has_lm_head,
                            const weight_source *src, const char *dir, char *err) {
    opt_layout l;
    if (opt_layout_init(&l, w, cfg, has_lm_head, err)) return -1;
    if (src->archive && opt_layout_check_archive(&l, src->archive, dir, err)) {
        opt_layout_free(&l);
        return -1;
    }
    size_t total = 0, *base = malloc((cfg->n_layers + 2) * sizeof *base);
    for (int j = 0; base && j < cfg->n_layers + 2; j++) base[j] = total, total += l.layer_floats[j];
    w->storage = base ? aligned_alloc(64, (total * sizeof(fp16) + 63) & ~(size_t)63) : NULL;
    w->storage_values = total;
    int rc = 0;
    if (w->storage) memset(w->storage, 0, total * sizeof(fp16)); /* a tied lm_head's slot too */
    if (!w->storage) {
        rc = fg_fail(err, "gpu tier: cannot allocate %.2f GB for the fp16 weights of %s",
                     total * 2.0 / 1e9, cfg->name);
    } else {
        for (int i = 0; i < l.n_tensors; i++) {
            opt_tensor *t = &l.tensors[i];
            if (t->tied_to >= 0) continue;
            *t->slot = w->storage + base[t->layer] + t->offset;
            opt_tensor_fill(&l, i, src, NULL, *t->slot);
        }
        for (int i = 0; i < l.n_tensors; i++)
            if (l.tensors[i].tied_to >= 0) *l.tensors[i].slot = *l.tensors[l.tensors[i].tied_to].slot;
    }
    free(base);
    w->layers = l.view->layers; /* the view is w itself; keep its layers, free the table */
    l.view = NULL;
    opt_layout_free(&l);
    if (rc) opt_weights_free(w);
    return rc;
}

void opt_weights_free(opt_weights *w) {
    free(w->storage);
    free(w->layers);
    memset(w, 0, sizeof *w);
}

int opt_weights_dummy(const opt_config *cfg, uint64_t seed, opt_weights *w, char *err) {
    weight_source src = {NULL, seed};
    return weights_all_fp16(w, cfg, 0, &src, NULL, err);
}

int opt_weights_load(const char *dir, opt_weights *w, char *err) {
    opt_config cfg;
    st_archive a;
    memset(w, 0, sizeof *w);
    if (opt_checkpoint_open(dir, &cfg, &a, err)) return -1;
    weight_source src = {&a, 0};
    int rc = weights_all_fp16(w, &cfg, st_find(&a, "lm_head.weight") != NULL, &src, dir, err);
    st_close(&a);
    return rc;
}

int opt_weight_locate(const opt_weights *w, const char *name, const fp16 **first,
                      size_t *row_stride, size_t *col_stride) {
    opt_weights shadow; /* the table records slots into a view: give it a copy of w */
    opt_layout l;
    if (opt_layout_init(&l, &shadow, &w->cfg, w->lm_head != w->embed_tokens, NULL)) return -1;
    opt_layer_weights *layers = shadow.layers;
    shadow = *w;
    shadow.layers = layers;
    memcpy(layers, w->layers, (size_t)w->cfg.n_layers * sizeof *layers);
    if (strncmp(name, "model.", 6) == 0) name += 6;
    int found = -1;
    for (int i = 0; i < l.n_tensors && found < 0; i++) {
        const opt_tensor *t = &l.tensors[i];
        for (int s = t->first_spec; s < t->first_spec + t->n_specs; s++) {
            const tensor_spec *sp = &((const tensor_spec *)l.specs)[s];
            if (strcmp(sp->name, name) || is_tied(sp)) continue;
            *first = *t->slot + (sp->offset - t->offset);
            *row_stride = sp->row_stride;
            *col_stride = sp->col_stride;
            found = 0;
        }
    }
    opt_layout_free(&l);
    return found;
}

/* ============================================================================================
 * GPU batch state and workspace
 * ============================================================================================ */

static void *alloc_floats(size_t n) { return aligned_alloc(64, (n * 4 + 63) & ~(size_t)63); }

int gpu_batch_init(gpu_batch *gb, int batch, int max_len, int max_new, char *err) {
    memset(gb, 0, sizeof *gb);
    gb->batch = batch;
    gb->max_len = max_len;
    gb->pad = calloc((size_t)batch, sizeof *gb->pad);
    gb->tokens = calloc((size_t)batch * max_new, sizeof *gb->tokens);
    gb->k = calloc((size_t)batch, sizeof *gb->k);
    gb->v = calloc((size_t)batch, sizeof *gb->v);
    gb->v_rows_read = calloc((size_t)batch, sizeof *gb->v_rows_read);
    gb->attn_sparsity = 1;
    if (!gb->pad || !gb->tokens || !gb->k || !gb->v || !gb->v_rows_read) {
        gpu_batch_free(gb);
        return fg_fail(err, "out of memory for a GPU batch of %d", batch);
    }
    return 0;
}

void gpu_batch_free(gpu_batch *gb) {
    free(gb->pad);
    free(gb->tokens);
    free(gb->k);
    free(gb->v);
    free(gb->v_rows_read);
    memset(gb, 0, sizeof *gb);
}

/* Per-thread scratch of attention: K and V slices and the scores of one (sequence, head), and
 * what decode needs besides (opt_attend_decode's scratch); or a block of rows of the
 * embedding table (matmul_embed_t's scratch). */
static size_t thread_floats(const opt_config *cfg, int max_len) {
    size_t hd = cfg->hidden / cfg->n_heads, n = (size_t)max_len;
    size_t attention = 2 * n * hd + n * n + 3 * n + hd, row = (size_t)MATMUL_EMBED_BLOCK * cfg->word_dim;
    return ((attention > row ? attention : row) + 15) & ~(size_t)15;
}

/* matmul_weights' scratch, when the workspace serves products of more rows than decode's: the
 * most any of the model's weight matrices [in][out] asks for. */
static size_t wide_floats(const opt_config *cfg, size_t rows) {
    if (rows <= MATMUL_DECODE_ROWS) return 0;
    int h = cfg->hidden, f = cfg->ffn, wd = cfg->word_dim;
    const int shapes[][2] = {{h, 3 * h}, {h, h}, {h, f}, {f, h}, {wd, h}, {h, wd}};
    size_t most = 0;
    for (int i = 0; i < 6; i++) {
        size_t n = matmul_scratch_floats(shapes[i][0], shapes[i][1]);
        most = n > most ? n : most;
    }
    return most;
}

/* The widest vector of a layer (a bias, or a norm's weight and bias side by side). */
static size_t vec_floats(const opt_config *cfg) {
    size_t h = cfg->hidden, n = 3 * h > (size_t)cfg->ffn ? 3 * h : (size_t)cfg->ffn;
    return 2 * (n > (size_t)cfg->word_dim ? n : (size_t)cfg->word_dim);
}

size_t opt_workspace_bytes(const opt_config *cfg, size_t rows, int max_len) {
    size_t h = cfg->hidden, wide = h > (size_t)cfg->ffn ? h : (size_t)cfg->ffn;
    return 4 * (rows * (5 * h + wide) + thread_floats(cfg, max_len) * omp_get_max_threads() +
                wide_floats(cfg, rows) + vec_floats(cfg));
}

int opt_workspace_init(opt_workspace *ws, const opt_config *cfg, size_t rows, int max_len,
                       char *err) {
    memset(ws, 0, sizeof *ws);
    size_t h = cfg->hidden, wide = h > (size_t)cfg->ffn ? h : (size_t)cfg->ffn;
    ws->rows = rows;
    ws->max_len = max_len;
    ws->n_threads = omp_get_max_threads();
    ws->thread_floats = thread_floats(cfg, max_len);
    ws->h = alloc_floats(rows * h);
    ws->qkv = alloc_floats(rows * 3 * h);
    ws->attn = alloc_floats(rows * h);
    ws->ffn = alloc_floats(rows * wide);
    ws->thread_scratch = alloc_floats(ws->thread_floats * ws->n_threads);
    ws->wide = wide_floats(cfg, rows) ? alloc_floats(wide_floats(cfg, rows)) : NULL;
    ws->vec = alloc_floats(vec_floats(cfg));
    if (!ws->h || !ws->qkv || !ws->attn || !ws->ffn || !ws->thread_scratch || !ws->vec ||
        (wide_floats(cfg, rows) && !ws->wide)) {
        opt_workspace_free(ws);
        return fg_fail(err, "gpu tier: cannot allocate the workspace for %zu token rows", rows);
    }
    return 0;
}

void opt_workspace_free(opt_workspace *ws) {
    free(ws->h);
    free(ws->qkv);
    free(ws->attn);
    free(ws->ffn);
    free(ws->thread_scratch);
    free(ws->wide);
    free(ws->vec);
    free(ws->x32);
    memset(ws, 0, sizeof *ws);
}

/* ============================================================================================
 * Forward pass
 * ============================================================================================ */

/* What a linear layer does with its output y. */
enum { OUT_SET, OUT_ADD, OUT_RELU }; /* y = xW + b;  y += xW + b (residual);  y = relu(xW + b) */

/* x[rows][in] times W[in][out] (weights are stored transposed, fp16 or 4-bit: matmul.c), then
 * the bias (widened once into ws->vec), and ReLU, in one pass over y. */
static void linear(const float *x, int rows, int in, const fp16 *W, const fp16 *b, int out,
                   float *y, int mode, int q4, opt_workspace *ws) {
    matmul_weights(x, rows, in, W, q4, out, y, mode == OUT_ADD, ws->wide);
    if (!b) return;
    float *bias = ws->vec;
    fp16_to_fp32_n(b, bias, (size_t)out);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *yr = y + (size_t)r * out;
        if (mode == OUT_RELU)
            for (int i = 0; i < out; i++) yr[i] = yr[i] + bias[i] > 0 ? yr[i] + bias[i] : 0;
        else
            for (int i = 0; i < out; i++) yr[i] += bias[i];
    }
}

/* y = (x - mean) / sqrt(var + 1e-5) * w + b, row by row; y may alias x. */
static void layer_norm(const float *x, int rows, int dim, const fp16 *w16, const fp16 *b16, float *y,
                       opt_workspace *ws) {
    float *w = ws->vec, *b = ws->vec + dim; /* widened once */
    fp16_to_fp32_n(w16, w, (size_t)dim);
    fp16_to_fp32_n(b16, b, (size_t)dim);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        float mean = 0, var = 0;
        for (int i = 0; i < dim; i++) mean += xr[i];
        mean /= dim;
        for (int i = 0; i < dim; i++) var += (xr[i] - mean) * (xr[i] - mean);
        float inv = 1.0f / sqrtf(var / dim + 1e-5f);
        for (int i = 0; i < dim; i++) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
    }
}

/* The position id of cache slot `slot` of sequence b (HF: cumsum(mask) * mask - 1 + 2). Pad
 * slots get position 1, as in HF; they are masked out of every attention anyway. */
static int position_of(const gpu_batch *gb, int b, int slot) {
    return slot < gb->pad[b] ? OPT_POS_OFFSET - 1 : slot - gb->pad[b] + OPT_POS_OFFSET;
}

/* x = embed_tokens[token] (through project_in for 350m) + embed_positions[position]. */
void opt_embed(const opt_weights *w, gpu_batch *gb, opt_workspace *ws) {
    const opt_config *c = &w->cfg;
    int rows = gb->batch * gb->n_new, wd = c->word_dim, h = c->hidden;
    float *x = gb->x, *words = w->project_in ? ws->h : x;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        matmul_embed_row(w->embed_tokens, w->q4, c->vocab, wd, gb->tokens[r], words + (size_t)r * wd);
    if (w->project_in) linear(ws->h, rows, wd, w->project_in, NULL, h, x, OUT_SET, w->q4, ws);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        int b = r / gb->n_new, slot = gb->len + r % gb->n_new;
        float *pos = ws->attn + (size_t)r * h, *xr = x + (size_t)r * h;
        matmul_embed_row(w->embed_positions, w->q4, c->max_pos + 2, h, position_of(gb, b, slot), pos);
        for (int i = 0; i < h; i++) xr[i] += pos[i];
    }
}

/* Rounds this step's K and V to fp16 into the cache (slots len .. len + n_new - 1). */
size_t opt_kv_row_bytes(const opt_config *c, int q4) {
    int hd = c->hidden / c->n_heads;
    return q4 ? q4_bytes((size_t)c->n_heads, (size_t)hd, 1) : 2 * (size_t)c->hidden;
}

/* Rounds x to fp16 values (what an fp16 cache would hold), in place. */
static void round_to_fp16(float *x, size_t n) {
    fp16 tmp[256];
    for (size_t i = 0; i < n; i += 256) {
        size_t m = n - i < 256 ? n - i : 256;
        fp32_to_fp16_n(x + i, tmp, m);
        fp16_to_fp32_n(tmp, x + i, m);
    }
}

/* This step's K and V into the cache: fp16, or 4-bit grouped along each head's dimension (§5).
 * With a 4-bit cache the step's own K and V stay in qkv, rounded to fp16: as in FlexGen, the
 * tokens being computed attend with their fp16 K and V, and only the past is read back from
 * the compressed cache. */
static void store_kv(const opt_config *c, gpu_batch *gb, opt_workspace *ws) {
    int h = c->hidden, hd = h / c->n_heads;
    size_t row = opt_kv_row_bytes(c, gb->kv_q4);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < gb->batch * gb->n_new; r++) {
        int b = r / gb->n_new, slot = gb->len + r % gb->n_new;
        float *qkv = ws->qkv + (size_t)r * 3 * h;
        char *k = (char *)gb->k[b] + (size_t)slot * row, *v = (char *)gb->v[b] + (size_t)slot * row;
        if (!gb->kv_q4) {
            fp32_to_fp16_n(qkv + h, (fp16 *)k, (size_t)h);
            fp32_to_fp16_n(qkv + 2 * h, (fp16 *)v, (size_t)h);
            continue;
        }
        round_to_fp16(qkv + h, 2 * (size_t)h);
        q4_compress(qkv + h, (size_t)c->n_heads, (size_t)hd, 1, (uint8_t *)k);
        q4_compress(qkv + 2 * h, (size_t)c->n_heads, (size_t)hd, 1, (uint8_t *)v);
    }
}

/* softmax over scores[0..n), in place. */
static void softmax(float *s, int n) {
    float m = s[0], sum = 0;
    for (int i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
    for (int i = 0; i < n; i++) sum += s[i] = expf(s[i] - m);
    for (int i = 0; i < n; i++) s[i] /= sum;
}

/* One query over nk cached keys (fp16, rows `stride` apart): out = softmax(scale q.K^T) V.
 * Decode attention is pure memory traffic over the cache, so it reads fp16 directly. */
static void attend_one_scalar(const float *q, const fp16 *K, const fp16 *V, size_t stride, int nk,
                              int hd, float scale, float *scores, float *out) {
    for (int j = 0; j < nk; j++) {
        float dot = 0;
        for (int d = 0; d < hd; d++) dot += q[d] * fp16_to_fp32(K[j * stride + d]);
        scores[j] = dot * scale;
    }
    softmax(scores, nk);
    memset(out, 0, hd * sizeof *out);
    for (int j = 0; j < nk; j++)
        for (int d = 0; d < hd; d++) out[d] += scores[j] * fp16_to_fp32(V[j * stride + d]);
}

#ifdef HAVE_F16C_PATH
__attribute__((target("avx2,fma,f16c"))) static void attend_one_avx2(
    const float *q, const fp16 *K, const fp16 *V, size_t stride, int nk, int hd, float scale,
    float *scores, float *out) {
    for (int j = 0; j < nk; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            __m256 k = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(K + j * stride + d)));
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), k, acc);
        }
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        scores[j] = _mm_cvtss_f32(s4) * scale;
    }
    softmax(scores, nk);
    memset(out, 0, hd * sizeof *out);
    for (int j = 0; j < nk; j++) {
        __m256 p = _mm256_set1_ps(scores[j]);
        for (int d = 0; d < hd; d += 8) {
            __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(V + j * stride + d)));
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(p, v, _mm256_loadu_ps(out + d)));
        }
    }
}

#endif


static void attend_one(const float *q, const fp16 *K, const fp16 *V, size_t stride, int nk,
                       int hd, float scale, float *scores, float *out) {
#ifdef HAVE_F16C_PATH
    if (hd % 8 == 0 && fg_cpu_has_avx2()) {
        attend_one_avx2(q, K, V, stride, nk, hd, scale, scores, out);
        return;
    }
#endif
    attend_one_scalar(q, K, V, stride, nk, hd, scale, scores, out);
}

/* Key (or value) j of one head as fp32: this step's own row from qkv, or a cache row decoded. */
static const float *kv_row(const opt_kv_rows *r, int j, float *buf) {
    if (j >= r->first_fresh) return r->fresh + (size_t)(j - r->first_fresh) * r->fresh_stride;
    const char *row = r->rows + (size_t)j * r->stride;
    if (r->q4) {
        size_t head_bytes = q4_bytes(1, (size_t)r->head_dim, 1);
        q4_decompress((const uint8_t *)row + r->head * head_bytes, 1, (size_t)r->head_dim, 1, buf);
    } else {
        fp16_to_fp32_n((const fp16 *)row + (size_t)r->head * r->head_dim, buf, (size_t)r->head_dim);
    }
    return buf;
}

int opt_attend_decode(const float *q, const opt_kv_rows *K, const opt_kv_rows *V, int nk,
                      float scale, float sparsity, float *scratch, float *out) {
    int hd = K->head_dim;
    float *scores = scratch, *spare = scores + nk, *buf = spare + nk;
    int *keep = (int *)(buf + hd);
    for (int j = 0; j < nk; j++) {
        const float *k = kv_row(K, j, buf);
        float dot = 0;
        for (int d = 0; d < hd; d++) dot += q[d] * k[d];
        scores[j] = dot * scale;
    }
    softmax(scores, nk);
    int n_keep = nk;
    if (sparsity < 1) {
        n_keep = topk_keep(scores, nk - 1, (int)floorf(sparsity * (float)(nk - 1)), keep, spare);
        keep[n_keep++] = nk - 1; /* the new token always attends to itself */
    }
    memset(out, 0, hd * sizeof *out);
    for (int i = 0; i < n_keep; i++) {
        int j = sparsity < 1 ? keep[i] : i;
        const float *v = kv_row(V, j, buf);
        for (int d = 0; d < hd; d++) out[d] += scores[j] * v[d];
    }
    return n_keep;
}

/* One head of sequence b's cache, keys [start, end): its rows in the cache, and with a 4-bit
 * cache this step's rows from qkv (kv 0: K, 1: V). */
static opt_kv_rows head_rows(const opt_config *c, const gpu_batch *gb, const opt_workspace *ws,
                             int b, int head, int kv, int start) {
    int h = c->hidden, hd = h / c->n_heads;
    size_t row = opt_kv_row_bytes(c, gb->kv_q4);
    opt_kv_rows r = {(const char *)(kv ? gb->v[b] : gb->k[b]) + (size_t)start * row, row,
                     gb->kv_q4, head, hd, INT_MAX, NULL, 0};
    if (gb->kv_q4) {
        r.first_fresh = gb->len - start;
        r.fresh = ws->qkv + (size_t)b * gb->n_new * 3 * h + (size_t)(kv + 1) * h + (size_t)head * hd;
        r.fresh_stride = 3 * (size_t)h;
    }
    return r;
}

/* Multi-head attention of this step's queries over the cache (fp16 or 4-bit), causal, with the
 * left padding masked out: query slot s of sequence b sees keys in [pad[b], s]. Decode with
 * gb->attn_sparsity < 1 is §5's top-K sparse attention. */
static void attention(const opt_config *c, gpu_batch *gb, opt_workspace *ws) {
    int h = c->hidden, hd = h / c->n_heads, n_new = gb->n_new, end = gb->len + n_new;
    float scale = 1.0f / sqrtf((float)hd);
    int fast = !gb->kv_q4 && gb->attn_sparsity >= 1; /* decode straight from the fp16 cache */
#pragma omp parallel for schedule(dynamic)
    for (int bh = 0; bh < gb->batch * c->n_heads; bh++) {
        int b = bh / c->n_heads, head = bh % c->n_heads, start = gb->pad[b], nk = end - start;
        float *kf = ws->thread_scratch + ws->thread_floats * omp_get_thread_num();
        float *vf = kf + (size_t)ws->max_len * hd, *scores = vf + (size_t)ws->max_len * hd;
        float *out = ws->attn + (size_t)b * n_new * h + head * hd;
        const float *q = ws->qkv + (size_t)b * n_new * 3 * h + head * hd; /* rows of [q|k|v] */
        int t0 = start > gb->len ? start - gb->len : 0; /* first query that is not padding */
        for (int t = 0; t < t0; t++) memset(out + (size_t)t * h, 0, hd * sizeof(float));
        if (t0 >= n_new) continue;
        if (n_new == 1 && fast) {
            size_t at = (size_t)start * h + head * hd;
            const fp16 *K = gb->k[b], *V = gb->v[b];
            attend_one(q, K + at, V + at, (size_t)h, nk, hd, scale, scores, out);
            continue;
        }
        opt_kv_rows K = head_rows(c, gb, ws, b, head, 0, start), V = head_rows(c, gb, ws, b, head, 1, start);
        if (n_new == 1) {
            int read = opt_attend_decode(q, &K, &V, nk, scale, gb->attn_sparsity, scores, out);
#pragma omp atomic
            gb->v_rows_read[b] += read;
            continue;
        }
        /* prefill: many queries, so convert the slice once and use two matrix products */
        for (int j = 0; j < nk; j++) {
            const float *k = kv_row(&K, j, kf + (size_t)j * hd), *v = kv_row(&V, j, vf + (size_t)j * hd);
            if (k != kf + (size_t)j * hd) memcpy(kf + (size_t)j * hd, k, hd * sizeof *k);
            if (v != vf + (size_t)j * hd) memcpy(vf + (size_t)j * hd, v, hd * sizeof *v);
        }
        int nq = n_new - t0;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, hd, scale,
                    q + (size_t)t0 * 3 * h, 3 * h, kf, hd, 0.0f, scores, nk);
        for (int t = 0; t < nq; t++) {
            int visible = gb->len + t0 + t - start + 1; /* causal: keys up to this query's slot */
            float *row = scores + (size_t)t * nk;
            softmax(row, visible);
            for (int j = visible; j < nk; j++) row[j] = 0;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, hd, nk, 1.0f, scores, nk, vf,
                    hd, 0.0f, out + (size_t)t0 * h, h);
    }
}

void opt_cache_attention(const opt_config *c, gpu_batch *gb, opt_workspace *ws) {
    store_kv(c, gb, ws);
    attention(c, gb, ws);
}

/* One decoder layer for one GPU batch (HF's OPTDecoderLayer):
 *   pre-LN:  x += out_proj(attn(LN(x)));  x += fc2(relu(fc1(LN(x))))
 *   post-LN: x = LN(x + out_proj(attn(x))); x = LN(x + fc2(relu(fc1(x))))   (opt-350m)
 * K and V are rounded to fp16 into the cache before attention reads them. */
void opt_layer(const opt_weights *w, int layer, gpu_batch *gb, opt_workspace *ws) {
    const opt_config *c = &w->cfg;
    const opt_layer_weights *L = &w->layers[layer];
    int rows = gb->batch * gb->n_new, h = c->hidden, f = c->ffn;
    float *x = gb->x;
    const float *in = x;
    if (c->pre_ln) {
        layer_norm(x, rows, h, L->attn_ln_w, L->attn_ln_b, ws->h, ws);
        in = ws->h;
    }
    linear(in, rows, h, L->wqkv, L->bqkv, 3 * h, ws->qkv, OUT_SET, w->q4, ws);
    opt_cache_attention(c, gb, ws);
    linear(ws->attn, rows, h, L->wo, L->bo, h, x, OUT_ADD, w->q4, ws);
    if (c->pre_ln) {
        layer_norm(x, rows, h, L->ffn_ln_w, L->ffn_ln_b, ws->h, ws);
    } else {
        layer_norm(x, rows, h, L->attn_ln_w, L->attn_ln_b, x, ws);
    }
    linear(c->pre_ln ? ws->h : x, rows, h, L->fc1_w, L->fc1_b, f, ws->ffn, OUT_RELU, w->q4, ws);
    linear(ws->ffn, rows, f, L->fc2_w, L->fc2_b, h, x, OUT_ADD, w->q4, ws);
    if (!c->pre_ln) layer_norm(x, rows, h, L->ffn_ln_w, L->ffn_ln_b, x, ws);
}

/* logits[b] = lm_head(project_out(final_LN(x of b's last token))); with all_rows, the same for
 * every row of x. */
void opt_output(const opt_weights *w, gpu_batch *gb, opt_workspace *ws, float *logits) {
    const opt_config *c = &w->cfg;
    int h = c->hidden, rows = gb->all_rows ? gb->batch * gb->n_new : gb->batch;
    for (int r = 0; r < rows; r++) {
        size_t from = gb->all_rows ? (size_t)r : (size_t)r * gb->n_new + gb->n_new - 1;
        memcpy(ws->h + (size_t)r * h, (const float *)gb->x + from * h, h * sizeof(float));
    }
    if (w->final_ln_w) layer_norm(ws->h, rows, h, w->final_ln_w, w->final_ln_b, ws->h, ws);
    const float *last = ws->h;
    if (w->project_out) {
        linear(ws->h, rows, h, w->project_out, NULL, c->word_dim, ws->qkv, OUT_SET, w->q4, ws);
        last = ws->qkv;
    }
    /* lm_head is the embedding table itself, [vocab][word_dim]: a product with its transpose */
    matmul_embed_t(last, rows, c->word_dim, w->lm_head, w->q4, c->vocab, logits, ws->thread_scratch,
                   ws->thread_floats);
}

/* ============================================================================================
 * The CPU backend (docs/DESIGN.md, "The backends' operation table"): the gpu tier is the CPU's
 * working set, so a copy into it is a memcpy. Its products read weights as they are stored
 * (matmul.c), so a weight load is a copy too: of fp16 values, or of 4-bit bytes (§5).
 * ============================================================================================ */

static void *cpu_alloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (p) memset(p, 0, bytes);
    return p;
}
static void *cpu_host_alloc(size_t bytes, int pinned) { (void)pinned; return cpu_alloc(bytes); }
static void cpu_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void cpu_weights_in(void *dst, const fp16 *src, size_t n) { memcpy(dst, src, 2 * n); }
static void cpu_weights_in_q4(void *dst, const void *src, void *landing, size_t outer, size_t len,
                              size_t inner) {
    (void)landing; /* the bytes stay 4-bit: the products decode them as they read them */
    memcpy(dst, src, q4_bytes(outer, len, inner));
}

#define CPU_BACKEND_OPS                                                                         \
    .gpu_is_host = 1, .weight_elem = sizeof(fp16), .reads_q4 = 1, .alloc = cpu_alloc,          \
    .free = free, .host_alloc = cpu_host_alloc, .host_free = free,                              \
    .weights_in = cpu_weights_in, .weights_in_q4 = cpu_weights_in_q4, .copy_in = cpu_copy,     \
    .copy_out = cpu_copy, .copy = cpu_copy

const fg_backend fg_cpu_backend = {
    CPU_BACKEND_OPS,
    .name = "cpu",
    .act_elem = sizeof(float),
    .workspace_bytes = opt_workspace_bytes,
    .workspace_init = opt_workspace_init,
    .workspace_free = opt_workspace_free,
    .embed = opt_embed,
    .layer = opt_layer,
    .output = opt_output,
};

/* ---- fp16 activations (--device cpu-fp16) ----
 * The runtime holds and moves 2-byte activations as it does for CUDA; each operation widens the
 * GPU batch's x into ws->x32, runs the fp32 operation above on it, and rounds its output back to
 * fp16. Results differ from the fp32 backend's by that rounding of the hidden states between
 * layers alone (tests/test_runtime.c bounds it). */

static size_t fp16_workspace_bytes(const opt_config *cfg, size_t rows, int max_len) {
    return opt_workspace_bytes(cfg, rows, max_len) + 4 * rows * cfg->hidden;
}

static int fp16_workspace_init(opt_workspace *ws, const opt_config *cfg, size_t rows, int max_len,
                               char *err) {
    if (opt_workspace_init(ws, cfg, rows, max_len, err)) return -1;
    if (!(ws->x32 = alloc_floats(rows * cfg->hidden))) {
        opt_workspace_free(ws);
        return fg_fail(err, "gpu tier: cannot allocate the workspace for %zu token rows", rows);
    }
    return 0;
}

/* The GPU batch with x widened into ws->x32 (n rows of it; 0: none, x is only written). */
static gpu_batch widened(const gpu_batch *gb, const opt_config *c, opt_workspace *ws, size_t n) {
    gpu_batch wide = *gb;
    fp16_to_fp32_n(gb->x, ws->x32, n * c->hidden);
    wide.x = ws->x32;
    return wide;
}

static void fp16_embed(const opt_weights *w, gpu_batch *gb, opt_workspace *ws) {
    size_t n = (size_t)gb->batch * gb->n_new * w->cfg.hidden;
    gpu_batch wide = widened(gb, &w->cfg, ws, 0);
    opt_embed(w, &wide, ws);
    fp32_to_fp16_n(ws->x32, gb->x, n);
}

static void fp16_layer(const opt_weights *w, int layer, gpu_batch *gb, opt_workspace *ws) {
    size_t rows = (size_t)gb->batch * gb->n_new;
    gpu_batch wide = widened(gb, &w->cfg, ws, rows);
    opt_layer(w, layer, &wide, ws);
    fp32_to_fp16_n(ws->x32, gb->x, rows * w->cfg.hidden);
}

static void fp16_output(const opt_weights *w, gpu_batch *gb, opt_workspace *ws, float *logits) {
    gpu_batch wide = widened(gb, &w->cfg, ws, (size_t)gb->batch * gb->n_new);
    opt_output(w, &wide, ws, logits);
}

const fg_backend fg_cpu_fp16_backend = {
    CPU_BACKEND_OPS,
    .name = "cpu-fp16",
    .act_elem = sizeof(fp16),
    .workspace_bytes = fp16_workspace_bytes,
    .workspace_init = fp16_workspace_init,
    .workspace_free = opt_workspace_free,
    .embed = fp16_embed,
    .layer = fp16_layer,
    .output = fp16_output,
};

/* The CUDA backend's workspace (flexgen.cu), fp16 but for prefill's scores: h [rows][max(hidden,
 * word_dim)]; qkv and attn, whose space ffn takes after them, [rows][max(4 hidden, ffn)]; one
 * sequence's prefill scores (fp32) and probabilities (fp16), [heads][max_len][max_len]; per
 * row a pad, a token and two cache pointers. Here so that the cost model has it without CUDA. */
size_t fg_cuda_workspace_parts(const opt_config *cfg, size_t rows, int max_len, size_t *sizes) {
    size_t h = cfg->hidden, wd = cfg->word_dim, f = cfg->ffn, M = (size_t)max_len, H = cfg->n_heads;
    size_t mixed = 4 * h > f ? 4 * h : f;
    size_t parts[FG_CUDA_WS_PARTS] = {2 * rows * (h > wd ? h : wd), 2 * rows * mixed, 4 * H * M * M,
                                      2 * H * M * M, 4 * rows, 4 * rows, 8 * rows, 8 * rows};
    size_t total = 0;
    for (int i = 0; i < FG_CUDA_WS_PARTS; i++) {
        parts[i] = (parts[i] + 63) & ~(size_t)63;
        total += parts[i];
        if (sizes) sizes[i] = parts[i];
    }
    return total;
}

size_t fg_cuda_workspace_bytes(const opt_config *cfg, size_t rows, int max_len) {
    return fg_cuda_workspace_parts(cfg, rows, max_len, NULL);
}

size_t fg_cuda_delegated_bytes(const opt_config *cfg, size_t rows, int max_len) {
    return opt_workspace_bytes(cfg, rows, max_len) + 2 * rows * 3 * (size_t)cfg->hidden;
}

/* ============================================================================================
 * Sampling
 * ============================================================================================ */

void rng_seed(fg_rng *r, uint64_t seed) {
    r->s[0] = mix64(seed + 0x9e3779b97f4a7c15ULL);
    r->s[1] = mix64(r->s[0] ^ 0x2545f4914f6cdd1dULL) | 1;
}

uint64_t rng_next(fg_rng *r) { /* xorshift128+ */
    uint64_t s1 = r->s[0];
    const uint64_t s0 = r->s[1];
    r->s[0] = s0;
    s1 ^= s1 << 23;
    r->s[1] = s1 ^ s0 ^ (s1 >> 17) ^ (s0 >> 26);
    return r->s[1] + s0;
}

float rng_uniform(fg_rng *r) { return (float)(rng_next(r) >> 40) / 16777216.0f; }

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int cmp_prob_desc(const void *a, const void *b) {
    float x = ((const float *)a)[0], y = ((const float *)b)[0];
    return (x < y) - (x > y);
}

int sample_token(const float *logits, int n, float temperature, float top_p, fg_rng *rng,
                 float *scratch) {
    if (temperature <= 0) return argmax(logits, n);
    /* scratch holds (probability, id) pairs, sorted by probability for the nucleus. */
    float m = logits[argmax(logits, n)], sum = 0;
    for (int i = 0; i < n; i++) {
        scratch[2 * i] = expf((logits[i] - m) / temperature);
        memcpy(&scratch[2 * i + 1], &i, sizeof i);
        sum += scratch[2 * i];
    }
    int keep = n;
    if (top_p < 1.0f) {
        qsort(scratch, (size_t)n, 2 * sizeof(float), cmp_prob_desc);
        float cum = 0;
        for (keep = 0; keep < n && cum < top_p * sum; keep++) cum += scratch[2 * keep];
        sum = cum;
    }
    float u = rng_uniform(rng) * sum, acc = 0;
    int id = 0;
    for (int i = 0; i < keep; i++) {
        memcpy(&id, &scratch[2 * i + 1], sizeof id);
        acc += scratch[2 * i];
        if (acc > u) break;
    }
    return id;
}
