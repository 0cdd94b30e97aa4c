/* support/checkpoint.c: where a model's numbers come from: the nine OPT configs and HF's
 * config.json, FlexGen's size formulas and pipeline split, the weight table (every checkpoint
 * tensor's layer, shape and place in its layer's arena), dummy weights, and HF checkpoints
 * (through safetensors.c). The runtime (tiers.c) places and loads the tensors this table lists.
 */
#define _GNU_SOURCE
#include "support/support.h"
#include "support/tools.h"

#include <cjson/cJSON.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ============================================================================================
 * Configs
 * ============================================================================================ */

static const model_config OPT_SIZES[] = {
    /* name        layers hidden heads ffn   vocab  pos   word  pre_ln */
    OPT_SHAPE("opt-125m", 12, 768, 12, 3072, 50272, 2048, 768, 1),
    OPT_SHAPE("opt-350m", 24, 1024, 16, 4096, 50272, 2048, 512, 0),
    OPT_SHAPE("opt-1.3b", 24, 2048, 32, 8192, 50272, 2048, 2048, 1),
    OPT_SHAPE("opt-2.7b", 32, 2560, 32, 10240, 50272, 2048, 2560, 1),
    OPT_SHAPE("opt-6.7b", 32, 4096, 32, 16384, 50272, 2048, 4096, 1),
    OPT_SHAPE("opt-13b", 40, 5120, 40, 20480, 50272, 2048, 5120, 1),
    OPT_SHAPE("opt-30b", 48, 7168, 56, 28672, 50272, 2048, 7168, 1),
    OPT_SHAPE("opt-66b", 64, 9216, 72, 36864, 50272, 2048, 9216, 1),
    OPT_SHAPE("opt-175b", 96, 12288, 96, 49152, 50272, 2048, 12288, 1),
};

/* The LLaMA family's sizes, from their config.json files: dummy weights of the same shapes. */
typedef struct {
    const char *name;
    int layers, hidden, heads, kv_heads, ffn, vocab, max_pos, untied, qkv_bias;
    float eps, theta;
    int llama3_rope, bos, eos;
} llama_size;
static const llama_size LLAMA_SIZES[] = {
    /* name, layers, hidden, heads, kv heads, ffn, vocab, max_pos, untied, qkv bias, eps, theta,
     * llama3 RoPE, bos, eos */
    {"llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 1, 0, 1e-5f, 1e4f, 0, 1, 2},
    {"llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, 1, 0, 1e-5f, 1e4f, 0, 1, 2},
    {"llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 1, 0, 1e-5f, 1e4f, 0, 1, 2},
    {"llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 1, 0, 1e-5f, 5e5f, 0, 128000, 128001},
    {"llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, 131072, 0, 0, 1e-5f, 5e5f, 1, 128000, 128001},
    {"tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, 2048, 1, 0, 1e-5f, 1e4f, 0, 1, 2},
    {"mistral-7b", 32, 4096, 32, 8, 14336, 32768, 32768, 1, 0, 1e-5f, 1e6f, 0, 1, 2},
    {"qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, 32768, 0, 1, 1e-6f, 1e6f, 0, 151643, 151643},
};

static model_config llama_sized(const llama_size *z) {
    model_config c = {.n_layers = z->layers,
                      .hidden = z->hidden,
                      .n_heads = z->heads,
                      .ffn = z->ffn,
                      .vocab = z->vocab,
                      .max_pos = z->max_pos,
                      .word_dim = z->hidden,
                      .pre_ln = 1,
                      .family = FAMILY_LLAMA,
                      .n_kv_heads = z->kv_heads,
                      .head_dim = z->hidden / z->heads,
                      .qkv_bias = z->qkv_bias,
                      .rms_eps = z->eps,
                      .bos_id = z->bos,
                      .n_eos = 1,
                      .eos_ids = {z->eos},
                      .untied = z->untied};
    c.rope.theta = z->theta;
    c.rope.factor = 1;
    if (z->llama3_rope) { /* LLaMA 3.1 and 3.2's rope_scaling */
        c.rope.kind = ROPE_LLAMA3;
        c.rope.factor = 32;
        c.rope.low_freq = 1;
        c.rope.high_freq = 4;
        c.rope.original_max_pos = 8192;
    }
    snprintf(c.name, sizeof c.name, "%s", z->name);
    return c;
}

int model_config_by_name(const char *name, model_config *cfg, char *err) {
    const char *slash = strrchr(name, '/');
    const char *base = slash ? slash + 1 : name; /* facebook/opt-1.3b */
    for (size_t i = 0; i < sizeof OPT_SIZES / sizeof OPT_SIZES[0]; i++)
        if (strcasecmp(base, OPT_SIZES[i].name) == 0) {
            *cfg = OPT_SIZES[i];
            return 0;
        }
    for (size_t i = 0; i < sizeof LLAMA_SIZES / sizeof LLAMA_SIZES[0]; i++)
        if (strcasecmp(base, LLAMA_SIZES[i].name) == 0) {
            *cfg = llama_sized(&LLAMA_SIZES[i]);
            return 0;
        }
    return fg_fail(
        err,
        "--model: unknown model '%s' (not a directory; known names: opt-125m, "
        "opt-350m, opt-1.3b, opt-2.7b, opt-6.7b, opt-13b, opt-30b, opt-66b, opt-175b, "
        "llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, llama-3.2-1b, tinyllama-1.1b, "
        "mistral-7b, qwen2.5-0.5b)",
        name);
}

const char *const model_family_names[N_FAMILIES] = {"opt", "llama"};

/* Reads an integer field; absent fields take `def` (def < 0 means required). */
static int json_int(const cJSON *o, const char *key, int def, int *out, const char *path,
                    char *err) {
    const cJSON *v = fg_json_get(o, key);
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

/* A flag HF tests with `if`: true, false, or a number (0 false, any other true, as in Python);
 * absent: def. Any other value is refused naming the key and the value. */
static int json_flag(const cJSON *o, const char *key, int def, int *out, const char *path,
                     char *err) {
    const cJSON *v = fg_json_get(o, key);
    *out = !v ? def : cJSON_IsNumber(v) ? v->valuedouble != 0 : cJSON_IsTrue(v);
    if (!v || cJSON_IsBool(v) || cJSON_IsNumber(v)) return 0;
    char *text = cJSON_PrintUnformatted(v);
    int long_text = text && strlen(text) > 40;
    fg_fail(err, "%s: \"%s\" is %.40s%s, not true or false", path, key,
            text ? text : "not printable", long_text ? "..." : "");
    free(text);
    return -1;
}

/* The value of a field this project does not implement, in one line naming the field. A number
 * past a double's range (1e999), which cJSON reads as infinity and prints as null, is said so. */
static int refuse_value(const cJSON *v, const char *field, const char *path, const char *why,
                        char *err) {
    int huge = cJSON_IsNumber(v) && !isfinite(v->valuedouble);
    char *text = huge ? strdup("a number past a double's range")
                 : v  ? cJSON_PrintUnformatted(v)
                      : NULL;
    int long_text = text && strlen(text) > 60;
    fg_fail(err, "%s: %s is %.60s%s; %s", path, field, text ? text : "missing",
            long_text ? "..." : "", why);
    free(text);
    return -1;
}

/* A token id (absent or null: def, -1 for none), or for eos_token_id a list of them. */
static int json_ids(const cJSON *o, const char *key, int def, int *ids, int *n, int max,
                    const char *path, char *err) {
    const cJSON *v = fg_json_get(o, key);
    *n = 0;
    if (!v || cJSON_IsNull(v)) {
        if (def >= 0) ids[(*n)++] = def;
        return 0;
    }
    int list = cJSON_IsArray(v), count = list ? cJSON_GetArraySize(v) : 1;
    if (count > max)
        return fg_fail(err, "%s: \"%s\" lists %d ids, more than %d", path, key, count, max);
    for (int i = 0; i < count; i++) {
        const cJSON *e = list ? cJSON_GetArrayItem(v, i) : v;
        if (!cJSON_IsNumber(e) || !(e->valuedouble >= 0 && e->valuedouble < (1 << 24)) ||
            e->valuedouble != (double)(int)e->valuedouble) {
            char field[64];
            snprintf(field, sizeof field, "\"%s\"", key);
            return refuse_value(v, field, path, "expected a token id or a list of them", err);
        }
        ids[(*n)++] = (int)e->valuedouble;
    }
    return 0;
}

/* OPT's fields (OPTConfig; eos_token_id 2 where it is absent). */
static int opt_fields(const cJSON *root, const char *path, model_config *c, int *tie_head,
                      char *err) {
    const cJSON *act = fg_json_get(root, "activation_function");
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
        json_int(root, "word_embed_proj_dim", c->hidden, &c->word_dim, path, err) ||
        json_ids(root, "eos_token_id", OPT_EOS_ID, c->eos_ids, &c->n_eos, FG_MAX_EOS, path, err))
        return -1;
    if (c->hidden % c->n_heads)
        return fg_fail(err, "%s: hidden_size %d is not a multiple of num_attention_heads %d", path,
                       c->hidden, c->n_heads);
    int remove_final_ln, bias, ln_affine;
    if (json_flag(root, "do_layer_norm_before", 1, &c->pre_ln, path, err) ||
        json_flag(root, "_remove_final_layer_norm", 0, &remove_final_ln, path, err) ||
        json_flag(root, "enable_bias", 1, &bias, path, err) ||
        json_flag(root, "layer_norm_elementwise_affine", 1, &ln_affine, path, err) ||
        json_flag(root, "tie_word_embeddings", 1, tie_head, path, err)) /* HF's default: tied */
        return -1;
    /* HF keeps the final layer norm exactly when do_layer_norm_before holds, unless this is set. */
    if (remove_final_ln && c->pre_ln)
        return fg_fail(
            err, "%s: _remove_final_layer_norm with do_layer_norm_before is not supported", path);
    if (!bias)
        return fg_fail(err,
                       "%s: enable_bias false is not supported (the layers' biases are "
                       "expected)",
                       path);
    if (!ln_affine)
        return fg_fail(err,
                       "%s: layer_norm_elementwise_affine false is not supported (the layer "
                       "norms' weights and biases are expected)",
                       path);
    return 0;
}

/* A number field (absent or null: def) that must lie in (lo, hi], lo >= 0, and stay a normal
 * number in fp32, as the model computes with it: 1e-50 would be 0 there (and 1e-40 lose its
 * digits), and a rope_theta or factor of 0 makes every logit NaN. */
static int json_real(const cJSON *o, const char *key, double def, double lo, double hi, float *out,
                     const char *path, char *err) {
    const cJSON *v = fg_json_get(o, key);
    if (!v || cJSON_IsNull(v)) {
        if (def < 0) return fg_fail(err, "%s: missing \"%s\"", path, key);
        *out = (float)def;
        return 0;
    }
    char field[64], why[128];
    snprintf(field, sizeof field, "\"%s\"", key);
    if (!cJSON_IsNumber(v) || !(v->valuedouble > lo && v->valuedouble <= hi)) {
        snprintf(why, sizeof why, "expected a number in (%g, %g]", lo, hi);
        return refuse_value(v, field, path, why, err);
    }
    *out = (float)v->valuedouble;
    if (!isnormal(*out)) {
        snprintf(why, sizeof why, "expected a number in (%g, %g] that fp32 holds (at least %.2g)",
                 lo, hi, (double)FLT_MIN);
        return refuse_value(v, field, path, why, err);
    }
    return 0;
}

/* RoPE's angles, position x frequency, finite in fp32 at every position: each field can be an
 * fp32 number while a frequency is not (a factor of 1e-37 divides 1 into 1e37). No frequency
 * exceeds max(1, 1 / factor): theta^(-2i/d) is at most 1, and rope_frequencies (llama_model.c)
 * divides it by the factor at most once (llama3's blend lies between f and f / factor). So that
 * bound, times the last position, must be a finite fp32. */
static int rope_finite(const model_config *c, const char *path, char *err) {
    float top = c->rope.kind != ROPE_DEFAULT && c->rope.factor < 1 ? 1.0f / c->rope.factor : 1.0f;
    float last = (float)(c->max_pos - 1);
    if (isfinite(top) && isfinite(last * top)) return 0;
    return fg_fail(
        err,
        "%s: \"rope_theta\" %g and \"rope_scaling\" (factor %g) give RoPE a frequency up to %g, "
        "whose angle is not a finite fp32 at position %d",
        path, c->rope.theta, c->rope.factor, (double)top, c->max_pos - 1);
}

/* RoPE's parameters (HF's _compute_*_parameters), as transformers 4 writes them ("rope_scaling",
 * beside a top-level rope_theta) or as transformers 5 does ("rope_parameters", rope_theta inside
 * it), read as transformers 5 reads either: a rope_scaling that is not null or empty first, and a
 * rope_theta inside the object over the top-level one. Types null, "default" (or none given),
 * "linear" and "llama3", whose pretraining length is a top-level original_max_position_embeddings
 * over the object's, else max_position_embeddings (HF's standardize_rope_params); other types,
 * and parameters by layer type, refused. */
static int rope_scaling(const cJSON *root, model_config *c, const char *path, char *err) {
    const char *name = "\"rope_scaling\"";
    const cJSON *rs = fg_json_get(root, "rope_scaling");
    if (!rs || cJSON_IsNull(rs) || (cJSON_IsObject(rs) && !rs->child)) {
        name = "\"rope_parameters\"";
        rs = fg_json_get(root, "rope_parameters");
    }
    c->rope.kind = ROPE_DEFAULT;
    c->rope.factor = 1;
    if (!rs || cJSON_IsNull(rs)) return 0;
    if (!cJSON_IsObject(rs)) return refuse_value(rs, name, path, "expected null or an object", err);
    for (const cJSON *e = rs->child; e; e = e->next)
        if (cJSON_IsObject(e))
            return refuse_value(e, name, path, "parameters by layer type are not implemented", err);
    if (fg_json_get(rs, "rope_theta") &&
        json_real(rs, "rope_theta", -1, 0, 1e12, &c->rope.theta, path, err))
        return -1;
    const cJSON *type = fg_json_get(rs, "rope_type");
    if (!type) type = fg_json_get(rs, "type");
    const char *t = cJSON_IsString(type) ? type->valuestring : !type ? "default" : ""; /* as HF */
    if (!strcmp(t, "default")) return 0;
    if (strcmp(t, "linear") && strcmp(t, "llama3")) {
        char field[40];
        snprintf(field, sizeof field, "%s type", name);
        return refuse_value(type, field, path,
                            "not implemented (null, \"default\", \"linear\" and \"llama3\" are)",
                            err);
    }
    if (json_real(rs, "factor", -1, 0, 1e6, &c->rope.factor, path, err)) return -1;
    if (!strcmp(t, "linear")) {
        c->rope.kind = ROPE_LINEAR;
        return 0;
    }
    c->rope.kind = ROPE_LLAMA3;
    /* the pretraining length: a top-level one over the object's, else max_position_embeddings */
    const cJSON *at = fg_json_get(root, "original_max_position_embeddings") ? root : rs;
    if (json_real(rs, "low_freq_factor", -1, 0, 1e6, &c->rope.low_freq, path, err) ||
        json_real(rs, "high_freq_factor", -1, 0, 1e6, &c->rope.high_freq, path, err) ||
        json_int(at, "original_max_position_embeddings", c->max_pos, &c->rope.original_max_pos,
                 path, err))
        return -1;
    if (c->rope.high_freq <= c->rope.low_freq)
        return fg_fail(err, "%s: %s: high_freq_factor %g is not above low_freq_factor %g", path,
                       name, c->rope.high_freq, c->rope.low_freq);
    return 0;
}

/* Mistral's sliding_window (kept: every sequence must fit in it; absent, MistralConfig's 4096;
 * null, none), Qwen2's use_sliding_window. */
static int sliding_window(const cJSON *root, model_config *c, const char *type, const char *path,
                          char *err) {
    int on = 1;
    if (!strcmp(type, "qwen2") && json_flag(root, "use_sliding_window", 0, &on, path, err))
        return -1;
    if (!strcmp(type, "qwen2") && on)
        return refuse_value(fg_json_get(root, "use_sliding_window"), "\"use_sliding_window\"", path,
                            "sliding-window attention is not implemented", err);
    const cJSON *w = fg_json_get(root, "sliding_window");
    if (strcmp(type, "mistral") || cJSON_IsNull(w)) return 0;
    return json_int(root, "sliding_window", 4096, &c->window, path, err);
}

/* max_position_embeddings where config.json has none: each family's HF default. */
static int default_positions(const char *type) {
    if (!strcmp(type, "mistral")) return 4096 * 32;
    if (!strcmp(type, "qwen2")) return 32768;
    return 2048;
}

/* The LLaMA family's fields (LlamaConfig, MistralConfig, Qwen2Config; docs/USAGE.md lists them). */
static int llama_fields(const cJSON *root, const char *type, const char *path, model_config *c,
                        int *tie_head, char *err) {
    int qwen2 = !strcmp(type, "qwen2"), llama = !strcmp(type, "llama");
    const cJSON *act = fg_json_get(root, "hidden_act");
    if (act && (!cJSON_IsString(act) ||
                (strcmp(act->valuestring, "silu") && strcmp(act->valuestring, "swish"))))
        return refuse_value(act, "\"hidden_act\"", path,
                            "only \"silu\" (or its other name, \"swish\") is implemented", err);
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "%s", path);
    c->family = FAMILY_LLAMA;
    c->pre_ln = 1;
    const cJSON *kv = fg_json_get(root, "num_key_value_heads"), *hd = fg_json_get(root, "head_dim");
    if (json_int(root, "num_hidden_layers", -1, &c->n_layers, path, err) ||
        json_int(root, "hidden_size", -1, &c->hidden, path, err) ||
        json_int(root, "num_attention_heads", -1, &c->n_heads, path, err) ||
        json_int(root, "intermediate_size", -1, &c->ffn, path, err) ||
        json_int(root, "vocab_size", -1, &c->vocab, path, err) ||
        json_int(root, "max_position_embeddings", default_positions(type), &c->max_pos, path,
                 err) ||
        (kv && !cJSON_IsNull(kv) &&
         json_int(root, "num_key_value_heads", -1, &c->n_kv_heads, path, err)) ||
        (hd && !cJSON_IsNull(hd) && json_int(root, "head_dim", -1, &c->head_dim, path, err)))
        return -1;
    c->word_dim = c->hidden;
    if (!c->n_kv_heads) c->n_kv_heads = c->n_heads;
    if (!c->head_dim && c->hidden % c->n_heads)
        return fg_fail(
            err, "%s: hidden_size %d is not a multiple of num_attention_heads %d (and no head_dim)",
            path, c->hidden, c->n_heads);
    if (!c->head_dim) c->head_dim = c->hidden / c->n_heads;
    if (c->n_heads % c->n_kv_heads)
        return fg_fail(err,
                       "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                       path, c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 || c->head_dim > 1024)
        return fg_fail(err, "%s: head_dim %d is not implemented (an even number up to 1024)", path,
                       c->head_dim);
    int attention_bias = 0;
    c->bos_id = -1; /* none, unless the field or the family's default names one */
    if (json_real(root, "rms_norm_eps", 1e-6, 0, 1, &c->rms_eps, path, err) ||
        json_real(root, "rope_theta", 10000, 0, 1e12, &c->rope.theta, path, err) ||
        rope_scaling(root, c, path, err) ||
        json_flag(root, "attention_bias", 0, &attention_bias, path, err) ||
        json_flag(root, "mlp_bias", 0, &c->mlp_bias, path, err) ||
        json_flag(root, "tie_word_embeddings", 0, tie_head, path, err) || /* HF's default here:
                                                                             untied */
        json_ids(root, "bos_token_id", qwen2 ? -1 : 1, &c->bos_id, &(int){0}, 1, path, err) ||
        json_ids(root, "eos_token_id", qwen2 ? -1 : 2, c->eos_ids, &c->n_eos, FG_MAX_EOS, path,
                 err) ||
        sliding_window(root, c, type, path, err) || rope_finite(c, path, err))
        return -1;
    c->qkv_bias = qwen2 || (llama && attention_bias);
    c->o_bias = llama && attention_bias;
    c->mlp_bias = llama && c->mlp_bias;
    return 0;
}

/* What each field's bound leaves open: a row of q (num_attention_heads x head_dim values; K's and
 * V's are no wider) held in an int as each field is, at most 2^24; a depth whose weight table and
 * plan checks stay small (the largest models have about 130 layers); and a vocabulary with a token
 * beyond the special ids 0 to 2 (pad, BOS, EOS: synthetic prompts draw theirs from 3 on). */
enum { MAX_LAYERS = 1024, MAX_WIDTH = 1 << 24 };
static int config_in_range(const model_config *c, const char *path, char *err) {
    long long q = (long long)c->n_heads * cfg_head_dim(c);
    if (c->vocab < 4)
        return fg_fail(err, "%s: vocab_size %d: at least 4 (the ids 0 to 2 are special)", path,
                       c->vocab);
    if (c->n_layers > MAX_LAYERS)
        return fg_fail(err, "%s: num_hidden_layers %d: at most %d", path, c->n_layers, MAX_LAYERS);
    if (q > MAX_WIDTH)
        return fg_fail(err, "%s: num_attention_heads %d x head_dim %d = %lld: at most 2^24", path,
                       c->n_heads, cfg_head_dim(c), q);
    return 0;
}

static int config_from_cjson(const cJSON *root, const char *path, model_config *c, int *tie_head,
                             char *err) {
    if (!cJSON_IsObject(root)) return fg_fail(err, "%s: not a JSON object", path);
    const cJSON *mt = fg_json_get(root, "model_type");
    const char *type = cJSON_IsString(mt) ? mt->valuestring : "";
    int rc;
    if (!strcmp(type, "opt")) rc = opt_fields(root, path, c, tie_head, err);
    else if (!strcmp(type, "llama") || !strcmp(type, "mistral") || !strcmp(type, "qwen2"))
        rc = llama_fields(root, type, path, c, tie_head, err);
    else
        return refuse_value(
            mt, "model_type", path,
            "unknown architecture (known: \"opt\", \"llama\", \"mistral\", \"qwen2\")", err);
    return rc ? rc : config_in_range(c, path, err);
}

/* The ids that end a sequence as HF's generate() takes them: where generation_config.json is
 * beside config.json, its eos_token_id (instruct models list more ids there than config.json
 * does), and a file without one, or null, names none (the id -1); else config.json's. */
static int generation_eos(const char *config_path, model_config *c, char *err) {
    char path[FG_PATH_LEN + 32];
    path_beside(config_path, "generation_config.json", path, sizeof path);
    struct stat link;
    if (lstat(path, &link) != 0) return 0; /* none; a link to nothing is read, and refused */
    cJSON *root = fg_json_read_file(path, err);
    if (!root) return -1;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: malformed JSON (not an object)", path);
    }
    int rc = json_ids(root, "eos_token_id", -1, c->eos_ids, &c->n_eos, FG_MAX_EOS, path, err);
    if (rc == 0 && c->n_eos == 0) {
        c->n_eos = 1;
        c->eos_ids[0] = -1;
    }
    cJSON_Delete(root);
    return rc;
}

/* config.json (and generation_config.json's eos ids), and whether it ties the output layer to the
 * embedding (tie_word_embeddings). */
static int read_config(const char *path, model_config *cfg, int *tie_head, char *err) {
    cJSON *root = fg_json_read_file(path, err);
    if (!root) return -1;
    int rc = config_from_cjson(root, path, cfg, tie_head, err);
    cJSON_Delete(root);
    return rc ? rc : generation_eos(path, cfg, err);
}

int model_config_from_json(const char *path, model_config *cfg, char *err) {
    int tie_head;
    return read_config(path, cfg, &tie_head, err);
}

/* The values of FlexGen's layer j (0 the input embedding, 1 .. n_layers a decoder layer, then the
 * output layer; a tied lm_head shares the embedding's), as the weight table lists them. */
size_t layer_param_count(const model_config *c, int j) {
    size_t h = c->hidden, f = c->ffn, q = (size_t)q_width(c), kv = (size_t)kv_width(c),
           v = c->vocab;
    if (c->family == FAMILY_OPT) {
        size_t wd = c->word_dim, proj = wd != h ? h * wd : 0;
        if (j == 0) return v * wd + (c->max_pos + 2) * h + proj;
        if (j > c->n_layers) return proj + (c->pre_ln ? 2 * h : 0) + (c->untied ? v * wd : 0);
        return 4 * (h * h + h) + 2 * h * f + f + h + 4 * h;
    }
    if (j == 0) return v * h;
    if (j > c->n_layers) return h + (c->untied ? v * h : 0);
    return h * (2 * q + 2 * kv) + 3 * h * f + 2 * h + (c->qkv_bias ? q + 2 * kv : 0) +
           (c->o_bias ? h : 0) + (c->mlp_bias ? 2 * f + h : 0);
}

size_t layer_vector_count(const model_config *c, int j) {
    size_t h = c->hidden, f = c->ffn, q = (size_t)q_width(c), kv = (size_t)kv_width(c);
    if (j == 0) return 0;
    if (c->family == FAMILY_OPT) {
        if (j > c->n_layers) return c->pre_ln ? 2 * h : 0;
        return 4 * h + f + h + 4 * h; /* q, k, v, out_proj, fc1, fc2 biases; two layer norms */
    }
    if (j > c->n_layers) return h;
    return 2 * h + (c->qkv_bias ? q + 2 * kv : 0) + (c->o_bias ? h : 0) +
           (c->mlp_bias ? 2 * f + h : 0);
}

size_t opt_param_count(const model_config *c) {
    size_t n = 0;
    for (int j = 0; j < c->n_layers + 2; j++) n += layer_param_count(c, j);
    return n;
}

/* FlexGen's model_config.py formulas, so reports compare with its logs. */
double opt_model_bytes(const model_config *c) {
    double h = c->hidden;
    if (c->family != FAMILY_OPT)
        return 2.0 * (double)opt_param_count(c); /* LLaMA: its fp16 bytes */
    return 2 * (c->n_layers *
                    (h * (3 * h + 1) + h * (h + 1) + h * (4 * h + 1) + h * 4 * (h + 1) + h * 4) +
                c->vocab * (h + 1));
}
double opt_cache_bytes(const model_config *c, int batch, int seq_len) {
    return 2.0 * batch * seq_len * c->n_layers * kv_width(c) * 2;
}
double opt_hidden_bytes(const model_config *c, int batch, int seq_len) {
    return (double)batch * seq_len * c->hidden * 2;
}

/* FlexGen's layer list (0 the input embedding, 1 .. n_layers the decoder layers, n_layers + 1
 * the output embedding) split over n pipeline stages (§4.4). */
void fg_stage_layers(const model_config *c, int s, int n, int *first, int *end) {
    int L = c->n_layers;
    if (n < 1) n = 1;
    *first = s == 0 ? 0 : 1 + (int)((long)L * s / n);
    *end = s == n - 1 ? L + 2 : 1 + (int)((long)L * (s + 1) / n);
}

/* ============================================================================================
 * Weights. One table lists every checkpoint tensor of the model: its HF name, its shape, the
 * FlexGen layer it belongs to and where each of its elements lives in that layer's arena.
 * Dummy initialisation, checkpoint loading, the runtime's placement (tiers.c) and
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
    char name[96];   /* HF name without the "model." prefix */
    char source[96]; /* the checkpoint tensor its values come from (differs for a tied lm_head) */
    fp16 **slot;     /* the view pointer that records where its stored tensor starts, or NULL */
    int layer;       /* FlexGen layer */
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

static void add_spec(spec_list *l, fp16 **slot, int64_t rows, int64_t cols, int kind, size_t offset,
                     size_t row_stride, size_t col_stride, const char *fmt, ...) {
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
#define ADD_PLAIN(l, slot, rows, cols, kind, ...)                                           \
    add_spec(l, slot, rows, cols, kind, reserve(l, (size_t)(rows) * ((cols) ? (cols) : 1)), \
             (cols) ? (size_t)(cols) : 1, 1, __VA_ARGS__)
/* A linear layer's [out][in] weight, stored as [in][out]. */
#define ADD_LINEAR(l, slot, out, in, ...)                                                       \
    add_spec(l, slot, out, in, FILL_MATRIX, reserve(l, (size_t)(out) * (in)), 1, (size_t)(out), \
             __VA_ARGS__)

static void layer_specs(spec_list *l, layer_weights *L, const model_config *c, int i) {
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

/* A LLaMA linear layer layers.i.NAME: its [out][in] weight stored [in][out], and its bias. */
static void llama_linear(spec_list *l, fp16 **W, fp16 **b, int64_t out, int64_t in, int bias, int i,
                         const char *name) {
    ADD_LINEAR(l, W, out, in, "layers.%d.%s.weight", i, name);
    if (bias) ADD_PLAIN(l, b, out, 0, FILL_BIAS, "layers.%d.%s.bias", i, name);
}

/* A LLaMA decoder layer: q, k and v each a matrix of its own (4-bit groups each on its own,
 * and grouped-query attention's k and v are narrower), the SwiGLU MLP's gate, up and down. */
static void llama_layer_specs(spec_list *l, layer_weights *L, const model_config *c, int i) {
    int64_t h = c->hidden, f = c->ffn, q = q_width(c), kv = kv_width(c);
    ADD_PLAIN(l, &L->attn_ln_w, h, 0, FILL_LN_W, "layers.%d.input_layernorm.weight", i);
    llama_linear(l, &L->wq, &L->bq, q, h, c->qkv_bias, i, "self_attn.q_proj");
    llama_linear(l, &L->wk, &L->bk, kv, h, c->qkv_bias, i, "self_attn.k_proj");
    llama_linear(l, &L->wv, &L->bv, kv, h, c->qkv_bias, i, "self_attn.v_proj");
    llama_linear(l, &L->wo, &L->bo, h, q, c->o_bias, i, "self_attn.o_proj");
    ADD_PLAIN(l, &L->ffn_ln_w, h, 0, FILL_LN_W, "layers.%d.post_attention_layernorm.weight", i);
    llama_linear(l, &L->gate_w, &L->gate_b, f, h, c->mlp_bias, i, "mlp.gate_proj");
    llama_linear(l, &L->up_w, &L->up_b, f, h, c->mlp_bias, i, "mlp.up_proj");
    llama_linear(l, &L->down_w, &L->down_b, h, f, c->mlp_bias, i, "mlp.down_proj");
}

/* LLaMA's layers: the token embedding; the decoder layers; the final RMSNorm and lm_head. */
static void llama_specs(model_weights *w, int has_lm_head, spec_list *l) {
    const model_config *c = &w->cfg;
    int64_t h = c->hidden, n = c->n_layers;
    l->n = 0;
    start_layer(l, 0);
    ADD_PLAIN(l, &w->embed_tokens, c->vocab, h, FILL_EMBED, "embed_tokens.weight");
    for (int i = 0; i < n; i++) {
        start_layer(l, i + 1);
        llama_layer_specs(l, &w->layers[i], c, i);
    }
    start_layer(l, (int)n + 1);
    ADD_PLAIN(l, &w->final_ln_w, h, 0, FILL_LN_W, "norm.weight");
    ADD_PLAIN(l, &w->lm_head, c->vocab, h, FILL_EMBED, "lm_head.weight");
    if (!has_lm_head)
        snprintf(l->s[l->n - 1].source, sizeof l->s[l->n - 1].source, "embed_tokens.weight");
    start_layer(l, (int)n + 2);
}

/* Every tensor of the model, layer by layer; l->s holds 9 + 16 * n_layers entries. */
static void model_specs(model_weights *w, int has_lm_head, spec_list *l) {
    const model_config *c = &w->cfg;
    int64_t h = c->hidden, n = c->n_layers;
    if (c->family == FAMILY_LLAMA) {
        llama_specs(w, has_lm_head, l);
        return;
    }
    l->n = 0;
    start_layer(l, 0);
    ADD_PLAIN(l, &w->embed_tokens, c->vocab, c->word_dim, FILL_EMBED,
              "decoder.embed_tokens.weight");
    ADD_PLAIN(l, &w->embed_positions, c->max_pos + 2, h, FILL_EMBED,
              "decoder.embed_positions.weight");
    if (c->word_dim != c->hidden)
        ADD_LINEAR(l, &w->project_in, h, c->word_dim, "decoder.project_in.weight");
    for (int i = 0; i < n; i++) {
        start_layer(l, i + 1);
        layer_specs(l, &w->layers[i], c, i);
    }
    start_layer(l, (int)n + 1);
    if (c->word_dim != c->hidden)
        ADD_LINEAR(l, &w->project_out, c->word_dim, h, "decoder.project_out.weight");
    if (c->pre_ln) {
        ADD_PLAIN(l, &w->final_ln_w, h, 0, FILL_LN_W, "decoder.final_layer_norm.weight");
        ADD_PLAIN(l, &w->final_ln_b, h, 0, FILL_LN_B, "decoder.final_layer_norm.bias");
    }
    ADD_PLAIN(l, &w->lm_head, c->vocab, c->word_dim, FILL_EMBED, "lm_head.weight");
    if (!has_lm_head) /* tied (docs/DESIGN.md, "Conventions": OPT facts) */
        snprintf(l->s[l->n - 1].source, sizeof l->s[l->n - 1].source,
                 "decoder.embed_tokens.weight");
    start_layer(l, (int)n + 2);
}

static int is_tied(const tensor_spec *s) { return strcmp(s->name, s->source) != 0; }

int opt_layout_init(opt_layout *l, model_weights *view, const model_config *cfg, int has_lm_head,
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
        if (!s->slot) {
            l->tensors[l->n_tensors - 1].n_specs++;
            continue;
        }
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
    for (int i = 0; i < l->n_tensors; i++) { /* a tensor runs up to the next one or its layer's
                                                end */
        opt_tensor *t = &l->tensors[i];
        size_t end = i + 1 < l->n_tensors && l->tensors[i + 1].layer == t->layer
                         ? l->tensors[i + 1].offset
                         : l->layer_floats[t->layer];
        t->count = end - t->offset;
        const tensor_spec *s = &sl.s[t->first_spec]; /* §5: matrices group along dim 0 of [out,
                                                        in] */
        if (s->kind == FILL_MATRIX) { /* stored [in][out]: out is contiguous; q|k|v, [in][3][h] */
            t->group_outer = (size_t)s->cols * t->n_specs;
            t->group_len = (size_t)s->rows;
            t->group_inner = 1;
        } else if (s->kind == FILL_EMBED) {
            t->group_outer = 1;
            t->group_len = (size_t)s->rows;
            t->group_inner = (size_t)s->cols;
        }
    }
    return 0;
}

void opt_layout_free(opt_layout *l) {
    if (l->view) {
        free(l->view->layers);
        l->view->layers = NULL;
    }
    free(l->specs);
    free(l->tensors);
    free(l->layer_floats);
    memset(l, 0, sizeof *l);
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
    value_source v = {NULL, fg_mix64(seed ^ fg_mix64(fg_fnv64(s->source, strlen(s->source)))),
                      0.05f, 0};
    switch (s->kind) {
    case FILL_MATRIX: v.scale = 1.0f / sqrtf((float)s->cols); break;
    case FILL_EMBED: v.scale = 0.5f; break;
    case FILL_BIAS: v.scale = 0.02f; break;
    case FILL_LN_W:
        v.scale = 0.1f;
        v.center = 1.0f;
        break;
    default: break;
    }
    return v;
}

/* Dummy element i (in checkpoint order): uniform in center +- scale, from 24 bits of its hash. */
static inline float dummy_value(const value_source *v, size_t i) {
    float u = (float)(fg_mix64(v->base + i) >> 40) * (2.0f / 16777216.0f);
    return v->center + v->scale * (u - 1.0f);
}

/* Element i (in checkpoint order) as the file holds it (or the dummy value), as fp32. */
static float file_value(const value_source *v, size_t i) {
    float x;
    uint16_t b;
    if (!v->tensor) return dummy_value(v, i);
    if (v->tensor->dtype == ST_F32) {
        memcpy(&x, (const char *)v->tensor->data + 4 * i, 4); /* may be unaligned in the file */
        return x;
    }
    memcpy(&b, (const char *)v->tensor->data + 2 * i, 2);
    return v->tensor->dtype == ST_BF16 ? bf16_to_fp32(b) : fp16_to_fp32(b);
}

/* Element i rounded to fp16 whatever the source dtype (fp16 as it is, NaN payloads too). */
static fp16 source_value(const value_source *v, size_t i) {
    fp16 h;
    if (!v->tensor || v->tensor->dtype != ST_F16) return fp32_to_fp16(file_value(v, i));
    memcpy(&h, (const char *)v->tensor->data + 2 * i, 2);
    return h;
}

/* Dummy values (file_value's, bit for bit) of a 32 x 32 tile: hashed and widened in a row of
 * fp32, then rounded to fp16 together (F16C where the CPU has it), so that a large model's dummy
 * weights are made at close to the speed of the memory written. */
static void store_dummy_tile(const tensor_spec *s, int64_t r0, int64_t c0, float *dst32,
                             fp16 *dst16, const value_source *v) {
    int64_t rows = s->rows, cols = s->cols ? s->cols : 1;
    int64_t r_end = r0 + 32 < rows ? r0 + 32 : rows, c_end = c0 + 32 < cols ? c0 + 32 : cols;
    int64_t height = r_end - r0, n = (c_end - c0) * height;
    float values[32 * 32] = {0}; /* (all written below: the compiler cannot tell) */
    fp16 halves[32 * 32];
    for (int64_t c = c0; c < c_end; c++)
        for (int64_t r = r0; r < r_end; r++)
            values[(c - c0) * height + (r - r0)] = file_value(v, (size_t)(r * cols + c));
    fp32_to_fp16_n(values, halves, (size_t)n);
    for (int64_t c = c0; c < c_end; c++)
        for (int64_t r = r0; r < r_end; r++) {
            size_t at = r * s->row_stride + c * s->col_stride;
            fp16 x = halves[(c - c0) * height + (r - r0)];
            if (dst16) dst16[at] = x;
            else dst32[at] = fp16_to_fp32(x);
        }
}

/* Writes every element of s from v at dst (fp32 or fp16), in 32 x 32 tiles so that both the
 * checkpoint's rows and the transposed layout's rows are touched a cache line at a time.
 * Returns the first element (in checkpoint order) that is NaN or Inf in fp16, or -1. Checking
 * here costs no read of its own: every value of a checkpoint passes through once, at load. */
static int64_t store_tensor(const tensor_spec *s, float *dst32, fp16 *dst16,
                            const value_source *v) {
    int64_t rows = s->rows, cols = s->cols ? s->cols : 1, first_bad = INT64_MAX;
    if (!v->tensor) { /* dummy values: all finite */
#pragma omp parallel for schedule(dynamic)
        for (int64_t r0 = 0; r0 < rows; r0 += 32)
            for (int64_t c0 = 0; c0 < cols; c0 += 32) store_dummy_tile(s, r0, c0, dst32, dst16, v);
        return -1;
    }
#pragma omp parallel for schedule(dynamic) reduction(min : first_bad)
    for (int64_t r0 = 0; r0 < rows; r0 += 32)
        for (int64_t c0 = 0; c0 < cols; c0 += 32)
            for (int64_t c = c0; c < c0 + 32 && c < cols; c++)
                for (int64_t r = r0; r < r0 + 32 && r < rows; r++) {
                    size_t at = r * s->row_stride + c * s->col_stride;
                    fp16 x = source_value(v, (size_t)(r * cols + c));
                    if ((x & 0x7c00) == 0x7c00 && r * cols + c < first_bad)
                        first_bad = r * cols + c;
                    if (dst16) dst16[at] = x;
                    else dst32[at] = fp16_to_fp32(x);
                }
    return first_bad == INT64_MAX ? -1 : first_bad;
}

/* n dummy values, `apart` apart in checkpoint order from value `first`, rounded to fp16 as
 * opt_tensor_fill rounds them, as fp32 (`halves`: room for n). */
static void dummy_values(const value_source *v, size_t first, size_t apart, size_t n, float *out,
                         fp16 *halves) {
    const fg_simd *simd = fg_simd_kernels();
    size_t done = 0; /* support/simd.c's twin, 8 at a time */
    if (simd->dummy_values)
        done = simd->dummy_values(v->base, first, apart, n, v->center, v->scale, out);
    for (size_t j = done; j < n; j++) out[j] = dummy_value(v, first + j * apart);
    fp32_to_fp16_n(out + done, halves, n - done);
    fp16_to_fp32_n(halves, out + done, n - done);
}

void opt_tensor_dummy_values(const opt_layout *l, int t, int part, uint64_t seed, size_t first,
                             size_t apart, size_t n, float *out, fp16 *halves) {
    const tensor_spec *specs = l->specs;
    value_source v = dummy_source(&specs[l->tensors[t].first_spec + part], seed);
    dummy_values(&v, first, apart, n, out, halves);
}

/* The line naming a tensor's first value that is not a finite fp16: NaN, Inf, or beyond fp16. */
static int bad_value(const st_archive *a, const tensor_spec *s, const value_source *v, int64_t i,
                     char *err) {
    float x = file_value(v, (size_t)i);
    char where[48], what[64];
    if (s->cols)
        snprintf(where, sizeof where, "[%lld, %lld]", (long long)(i / s->cols),
                 (long long)(i % s->cols));
    else snprintf(where, sizeof where, "[%lld]", (long long)i);
    if (isnan(x) || isinf(x))
        snprintf(what, sizeof what, "%s", isnan(x) ? "NaN" : x > 0 ? "Inf" : "-Inf");
    else snprintf(what, sizeof what, "%g, beyond fp16's largest value (65504)", x);
    return fg_fail(err, "%s: tensor %s: element %s is %s; the weights must be finite in fp16",
                   a->paths[v->tensor->file], v->tensor->name, where, what);
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

int opt_tensor_fill(const opt_layout *l, int t, const weight_source *src, float *dst32, fp16 *dst16,
                    char *err) {
    const opt_tensor *ten = &l->tensors[t];
    const tensor_spec *specs = l->specs;
    if (dst16) memset(dst16, 0, ten->count * sizeof *dst16); /* the 64-byte padding too */
    else memset(dst32, 0, ten->count * sizeof *dst32);
    for (int i = ten->first_spec; i < ten->first_spec + ten->n_specs; i++) {
        const tensor_spec *s = &specs[i];
        value_source v = src->archive
                             ? (value_source){find_spec_tensor(src->archive, s->source), 0, 0, 0}
                             : dummy_source(s, src->seed);
        size_t at = s->offset - ten->offset;
        int64_t bad = store_tensor(s, dst32 ? dst32 + at : NULL, dst16 ? dst16 + at : NULL, &v);
        if (!src->archive) continue;
        if (bad >= 0) return bad_value(src->archive, s, &v, bad, err);
        /* The copy is what the runtime uses: drop the file's pages (§4.1). */
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = ((uintptr_t)v.tensor->data + page - 1) & ~(page - 1);
        uintptr_t hi = ((uintptr_t)v.tensor->data + v.tensor->nbytes) & ~(page - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    }
    return 0;
}

static int check_shape(const st_tensor *t, const tensor_spec *s, const char *dir, char *err) {
    int want_ndim = s->cols ? 2 : 1;
    char want[64], got[96] = "";
    if (s->cols)
        snprintf(want, sizeof want, "[%lld, %lld]", (long long)s->rows, (long long)s->cols);
    else snprintf(want, sizeof want, "[%lld]", (long long)s->rows);
    int ok = t->ndim == want_ndim && t->shape[0] == s->rows && (!s->cols || t->shape[1] == s->cols);
    if (ok) return 0;
    for (int i = 0; i < t->ndim; i++) {
        size_t len = strlen(got);
        snprintf(got + len, sizeof got - len, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    }
    return fg_fail(err, "%s: tensor %s has shape [%s], expected %s", dir, t->name, got, want);
}

/* A layer's RoPE frequencies, which older LLaMA checkpoints saved and HF skips as it loads: this
 * program computes them from the config, as HF does. */
static int is_rope_buffer(const char *name) {
    const char *suffix = ".self_attn.rotary_emb.inv_freq";
    size_t len = strlen(name), n = strlen(suffix);
    return len > n && !strcmp(name + len - n, suffix);
}

int opt_layout_check_archive(const opt_layout *l, const st_archive *a, const char *dir, char *err) {
    const tensor_spec *s = l->specs;
    for (int i = 0; i < l->n_specs; i++) {
        if (is_tied(&s[i])) continue;
        const st_tensor *t = find_spec_tensor(a, s[i].name);
        if (!t) return fg_fail(err, "%s: missing tensor model.%s", dir, s[i].name);
        for (const st_tensor *u = t + 1; u < a->tensors + a->n_tensors; u++)
            if (!strcmp(strip_prefix(u->name), s[i].name)) /* with and without "model.", or twice */
                return fg_fail(err, "%s: tensors %s and %s are one weight; keep one of them", dir,
                               t->name, u->name);
        if (check_shape(t, &s[i], dir, err)) return -1;
    }
    for (int i = 0; i < a->n_tensors; i++) { /* anything the model does not use is an error */
        const char *name = strip_prefix(a->tensors[i].name);
        int known = is_rope_buffer(name);
        for (int j = 0; j < l->n_specs && !known; j++)
            known = !is_tied(&s[j]) && !strcmp(s[j].name, name);
        if (!known) return fg_fail(err, "%s: unexpected tensor %s", dir, a->tensors[i].name);
    }
    return 0;
}

/* The config against the tensor table before anything is sized from the config: the decoder
 * layers that the tensors name must be those num_hidden_layers says. */
static int check_layer_count(const model_config *cfg, const st_archive *a, const char *path,
                             char *err) {
    long layers = 0;
    const char *prefix = cfg->family == FAMILY_OPT ? "decoder.layers." : "layers.";
    for (int i = 0; i < a->n_tensors; i++) {
        const char *name = strip_prefix(a->tensors[i].name);
        long j =
            !strncmp(name, prefix, strlen(prefix)) ? strtol(name + strlen(prefix), NULL, 10) : -1;
        if (j >= MAX_LAYERS) /* past any config's count (and strtol's clamp) */
            return fg_fail(err, "%s: unexpected tensor %s (num_hidden_layers is %d)", path,
                           a->tensors[i].name, cfg->n_layers);
        if (j >= layers) layers = j + 1;
    }
    if (layers != cfg->n_layers)
        return fg_fail(err,
                       "%s: num_hidden_layers is %d, but the checkpoint holds %ld decoder layers",
                       path, cfg->n_layers, layers);
    return 0;
}

/* Do a and b hold the same tensor: the same shape and, element by element, the same values?
 * Byte for byte where the dtypes agree; otherwise as fp32 numbers, which fp16, bf16 and fp32
 * all convert to exactly. */
static int same_tensor(const st_tensor *a, const st_tensor *b) {
    size_t n = 1;
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++) {
        if (a->shape[i] != b->shape[i]) return 0;
        n *= (size_t)a->shape[i];
    }
    if (a->dtype == b->dtype) return memcmp(a->data, b->data, a->nbytes) == 0;
    value_source va = {a, 0, 0, 0}, vb = {b, 0, 0, 0};
    for (size_t i = 0; i < n; i++)
        if (file_value(&va, i) != file_value(&vb, i)) return 0;
    return 1;
}

/* The output layer as HF builds it: tied to the embedding when the config says so (the
 * default); untied, it is lm_head.weight, which must be there. Tied, HF uses one tensor for both
 * ends, so a lm_head.weight in the file must hold the embedding's values (same shape, and the same
 * bytes, or values where the dtypes differ): it is then not read (it leaves the table). One that
 * differs is refused, since which of the two the output layer should use is ambiguous. */
static int choose_head(st_archive *a, const model_config *cfg, int tie_head, const char *path,
                       char *err) {
    const st_tensor *head = st_find(a, "lm_head.weight");
    if (!tie_head && !head)
        return fg_fail(
            err, "%s: \"tie_word_embeddings\" is false, but the checkpoint has no lm_head.weight",
            path);
    if (!tie_head || !head) return 0;
    const st_tensor *embed = find_spec_tensor(
        a, cfg->family == FAMILY_OPT ? "decoder.embed_tokens.weight" : "embed_tokens.weight");
    if (embed && !same_tensor(head, embed))
        return fg_fail(
            err,
            "%s: \"tie_word_embeddings\" is true or absent, but lm_head.weight differs from %s; "
            "which one the output layer uses is ambiguous (set \"tie_word_embeddings\" to "
            "false to use lm_head.weight)",
            path, embed->name);
    size_t at = (size_t)(head - a->tensors);
    memmove(&a->tensors[at], &a->tensors[at + 1], (a->n_tensors - at - 1) * sizeof *a->tensors);
    a->n_tensors--;
    return 0;
}

int opt_checkpoint_open(const char *dir, model_config *cfg, st_archive *a, char *err) {
    char path[4096];
    int tie_head;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (read_config(path, cfg, &tie_head, err)) return -1;
    snprintf(cfg->name, sizeof cfg->name, "%s", dir);
    if (st_open_dir(dir, a, err)) return -1;
    if (a->n_tensors == 0) { /* not a count of layers that config.json gets wrong */
        st_close(a);
        return fg_fail(err, "%s: the checkpoint holds no tensors", dir);
    }
    if (check_layer_count(cfg, a, path, err) || choose_head(a, cfg, tie_head, path, err)) {
        st_close(a);
        return -1;
    }
    cfg->untied = st_find(a, "lm_head.weight") != NULL;
    return 0;
}

/* All weights in one fp16 arena: every tensor on the compute device (tests and tools). */
static int weights_all_fp16(model_weights *w, const model_config *cfg, int has_lm_head,
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
        for (int i = 0; rc == 0 && i < l.n_tensors; i++) {
            opt_tensor *t = &l.tensors[i];
            if (t->tied_to >= 0) continue;
            *t->slot = w->storage + base[t->layer] + t->offset;
            rc = opt_tensor_fill(&l, i, src, NULL, *t->slot, err);
        }
        for (int i = 0; i < l.n_tensors; i++)
            if (l.tensors[i].tied_to >= 0)
                *l.tensors[i].slot = *l.tensors[l.tensors[i].tied_to].slot;
    }
    free(base);
    w->layers = l.view->layers; /* the view is w itself; keep its layers, free the table */
    l.view = NULL;
    opt_layout_free(&l);
    if (rc) model_weights_free(w);
    return rc;
}

void model_weights_free(model_weights *w) {
    free(w->storage);
    free(w->layers);
    memset(w, 0, sizeof *w);
}

int model_weights_load(const char *dir, model_weights *w, char *err) {
    model_config cfg;
    st_archive a;
    memset(w, 0, sizeof *w);
    if (opt_checkpoint_open(dir, &cfg, &a, err)) return -1;
    weight_source src = {&a, 0};
    int rc = weights_all_fp16(w, &cfg, st_find(&a, "lm_head.weight") != NULL, &src, dir, err);
    st_close(&a);
    return rc;
}

int opt_weight_locate(const model_weights *w, const char *name, const fp16 **first,
                      size_t *row_stride, size_t *col_stride) {
    model_weights shadow; /* the table records slots into a view: give it a copy of w */
    opt_layout l;
    if (opt_layout_init(&l, &shadow, &w->cfg, w->lm_head != w->embed_tokens, NULL)) return -1;
    layer_weights *layers = shadow.layers;
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
