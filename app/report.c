/* app/report.c: what a run prints: FlexGen's benchmark report (or one JSON object with --json),
 * the prompts' texts with what was generated, its files (--dump-logits, --trace), and the line
 * of a finished job.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

/* The placement as the JSON report writes it: [wg, wc, cg, cc, hg, hc]. */
cJSON *percent_json(const fg_percent *p) {
    const int v[6] = {p->wg, p->wc, p->cg, p->cc, p->hg, p->hc};
    return cJSON_CreateIntArray(v, 6);
}

/* A run's files, --dump-logits (n logits) and --trace (every stage's events), each written whole
 * and the two together: a run leaves both or neither (fg_outputs_commit). */
int write_run_files(const cli_args *a, const float *logits, size_t n, const char *trace,
                    char *err) {
    if (a->trace && !trace) return fg_fail(err, "--trace %s: out of memory", a->trace);
    fg_output files[2], *open[2];
    int opened = 0;
    if (a->dump_logits) {
        if (fg_output_open(&files[opened], "--dump-logits", a->dump_logits, err)) return -1;
        fwrite(logits, sizeof(float), n, files[opened].f);
        open[opened] = &files[opened];
        opened++;
    }
    if (a->trace) {
        if (fg_output_open(&files[opened], "--trace", a->trace, err)) {
            for (int i = 0; i < opened; i++) fg_output_abort(open[i]);
            return -1;
        }
        fg_trace_write_events(files[opened].f, trace);
        open[opened] = &files[opened];
        opened++;
    }
    return fg_outputs_commit(open, opened, err);
}

/* Writes decoded bytes as text: invalid UTF-8 (a token can end mid-character) becomes U+FFFD,
 * as in HF's tokenizer.decode. */
static void print_utf8(const char *text, size_t len) {
    size_t n;
    char *clean = utf8_replace_invalid(text, len, &n);
    if (clean) fwrite(clean, 1, n, stdout);
    free(clean);
}

/* "[i] prompt + generated text" for each prompt (without its BOS); with --stop-at-eos the text
 * ends before the EOS. */
void print_texts(const fg_tokenizer *tok, const prompt_set *p, const int *tokens,
                 const gen_options *opt) {
    int longest = 0;
    for (int i = 0; i < p->n; i++) longest = p->lens[i] > longest ? p->lens[i] : longest;
    int *ids = malloc((size_t)(longest + opt->gen_len + 1) * sizeof *ids);
    for (int i = 0; ids && i < p->n; i++) {
        int skip = p->ids[i][0] == tokenizer_bos_id(tok), len = p->lens[i] - skip, n = 0;
        const int *gen = tokens + (size_t)i * opt->gen_len;
        while (n < opt->gen_len && !(opt->stop_at_eos && gen_is_eos(opt, gen[n]))) n++;
        memcpy(ids, p->ids[i] + skip, (size_t)len * sizeof *ids);
        memcpy(ids + len, gen, (size_t)n * sizeof *ids);
        size_t text_len;
        char *text = tokenizer_decode(tok, ids, len + n, &text_len);
        printf("[%d] ", i + 1);
        if (text) print_utf8(text, text_len);
        printf("\n");
        free(text);
    }
    free(ids);
}

double peak_rss_bytes(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss * 1024.0;
}

/* The report's per-stage entries (--json): the layers, the policy, peaks, bytes sent, times. */
static cJSON *stages_json(const stage_report *stages, int n) {
    cJSON *list = cJSON_CreateArray();
    for (int r = 0; r < n; r++) {
        const stage_report *s = &stages[r];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "first_layer", s->first_layer);
        cJSON_AddNumberToObject(o, "end_layer", s->end_layer);
        cJSON_AddItemToObject(o, "percent", percent_json(&s->percent));
        for (int i = 0; i < N_TIERS; i++) {
            char key[64];
            snprintf(key, sizeof key, "peak_%s_bytes", fg_tier_names[i]);
            cJSON_AddNumberToObject(o, key, s->st.peak[i]);
        }
        cJSON_AddNumberToObject(o, "bytes_sent", s->sent);
        cJSON_AddNumberToObject(o, "compute_seconds", s->compute);
        cJSON_AddNumberToObject(o, "bubble_seconds", s->bubble);
        cJSON_AddNumberToObject(o, "disk_read_seconds", s->disk_read);
        cJSON_AddNumberToObject(o, "peak_rss_bytes", s->peak_rss);
        cJSON_AddItemToArray(list, o);
    }
    return list;
}

/* What the host asked of the device (--json's "device_counts"): each counter, summed. */
static cJSON *counts_json(const fg_device_counts *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "host_waits", (double)c->host_waits);
    cJSON_AddNumberToObject(o, "launches", (double)c->launches);
    cJSON_AddNumberToObject(o, "blas_calls", (double)c->blas_calls);
    cJSON_AddNumberToObject(o, "products_timed", (double)c->products_timed);
    cJSON_AddNumberToObject(o, "widened", (double)c->widened);
    cJSON_AddNumberToObject(o, "graph_launches", (double)c->graph_launches);
    cJSON_AddNumberToObject(o, "copies_in", (double)c->copies_in);
    cJSON_AddNumberToObject(o, "copies_out", (double)c->copies_out);
    cJSON_AddNumberToObject(o, "copies_on_device", (double)c->copies_on_device);
    cJSON_AddNumberToObject(o, "pageable_copies", (double)c->pageable_copies);
    cJSON_AddNumberToObject(o, "allocations", (double)c->allocations);
    cJSON_AddNumberToObject(o, "bytes_in", (double)c->bytes_in);
    cJSON_AddNumberToObject(o, "bytes_out", (double)c->bytes_out);
    return o;
}

/* The device's counters of the prefill steps and the decode steps, and the most of each in one
 * decode step (the steady state of a run on the gpu tier). */
static cJSON *device_counts_json(const gen_timing *t) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "prefill", counts_json(&t->prefill_counts));
    cJSON_AddItemToObject(o, "decode", counts_json(&t->decode_counts));
    cJSON_AddNumberToObject(o, "decode_steps", (double)t->decode_steps);
    cJSON_AddItemToObject(o, "decode_step_most", counts_json(&t->decode_step_most));
    return o;
}

/* Whether prefill's products run an opt-in scheme on onednn.c, and the path its last product took
 * ("" without a scheme): gemm_path's, which names what ran, or "none ran" (no prefill ran: every
 * prompt was one token, a step that decode's products take). */
static int prefill_scheme(const fg_policy *p) { return p->int8_activations || p->bf16_prefill; }

static const char *prefill_path(const fg_policy *p) {
    return prefill_scheme(p) ? gemm_path(p->bf16_prefill) : "";
}

/* What the CPU's products ran on, into --json's object: the OpenBLAS core, the path of this
 * program's kernels, and the opt-in schemes' own products. */
static void add_kernels_json(cJSON *o, const fg_policy *p, const fg_blas_info *blas) {
    cJSON_AddStringToObject(o, "blas_library", blas->library);
    cJSON_AddStringToObject(o, "blas_core", blas->core);
    cJSON_AddStringToObject(o, "cpu_kernels", matmul_path());
    if (p->int8_activations) cJSON_AddStringToObject(o, "int8_sums", matmul_int8_path());
    if (prefill_scheme(p)) cJSON_AddStringToObject(o, "prefill_products", prefill_path(p));
}

/* FlexGen's numbers (flexgen/utils.py): sizes for the padded prompt + gen_len, throughputs per
 * generated (decode) or processed (prefill) token; then the tiers' peaks and the links' bytes,
 * the times, and the OpenBLAS core the CPU's products ran on. */
/* The run's sizes and rates, as FlexGen's report gives them. */
typedef struct {
    double model, cache, hidden;            /* bytes: weights, KV cache, hidden states */
    double total;                           /* seconds: prefill + decode */
    double prefill_tp, decode_tp, total_tp; /* token/s */
    double completion;                      /* mean seconds to a completed sequence */
} run_figures;

static run_figures figures_of(const cli_args *a, const model_config *c, const prompt_set *p,
                              const gen_timing *t, int max_prompt) {
    run_figures f;
    int seq = max_prompt + a->gen.gen_len;
    f.model = opt_model_bytes(c);
    f.cache = opt_cache_bytes(c, p->n, seq);
    f.hidden = opt_hidden_bytes(c, p->n, seq);
    f.total = t->prefill_latency + t->decode_latency;
    f.prefill_tp = t->prefill_tokens / fmax(t->prefill_latency, 1e-10);
    f.decode_tp = t->decode_tokens / fmax(t->decode_latency, 1e-10);
    f.total_tp = (double)(p->n + t->decode_tokens) / fmax(f.total, 1e-10); /* a first token each */
    f.completion = t->completion_seconds / (double)(t->completed > 0 ? t->completed : 1);
    return f;
}

/* --json: the report as one object on stdout. */
static void report_json(const cli_args *a, const model_config *c, const prompt_set *p,
                        const gen_timing *t, const fg_stats *st, int max_prompt, const char *device,
                        const stage_report *stages, int n_stages, const run_figures *f,
                        const fg_blas_info *blas) {
    static const char *const link_keys[N_LINKS] = {"disk_to_cpu_bytes", "cpu_to_gpu_bytes",
                                                   "gpu_to_cpu_bytes", "cpu_to_disk_bytes"};
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "model", c->name);
    cJSON_AddStringToObject(o, "device", device);
    cJSON_AddNumberToObject(o, "num_prompts", p->n);
    cJSON_AddNumberToObject(o, "prompt_len", max_prompt);
    cJSON_AddNumberToObject(o, "gen_len", a->gen.gen_len);
    cJSON_AddNumberToObject(o, "gpu_batch_size", a->policy.gpu_batch_size);
    cJSON_AddNumberToObject(o, "num_gpu_batches", a->policy.num_gpu_batches);
    cJSON_AddStringToObject(o, "schedule", fg_schedule_names[a->policy.schedule]);
    cJSON_AddItemToObject(o, "percent", percent_json(&a->policy.percent));
    cJSON_AddBoolToObject(o, "overlap", a->policy.overlap);
    cJSON_AddBoolToObject(o, "cpu_cache_compute", a->policy.cpu_cache_compute);
    cJSON_AddBoolToObject(o, "compress_weight", a->policy.compress_weight);
    cJSON_AddBoolToObject(o, "int8_activations", a->policy.int8_activations);
    cJSON_AddBoolToObject(o, "bf16_prefill", a->policy.bf16_prefill);
    cJSON_AddBoolToObject(o, "compress_cache", a->policy.compress_cache);
    cJSON_AddNumberToObject(o, "attn_sparsity", a->policy.attn_sparsity);
    cJSON_AddNumberToObject(o, "model_size_bytes", f->model);
    cJSON_AddNumberToObject(o, "cache_size_bytes", f->cache);
    cJSON_AddNumberToObject(o, "hidden_size_bytes", f->hidden);
    cJSON_AddNumberToObject(o, "peak_rss_bytes", peak_rss_bytes());
    for (int i = 0; i < N_TIERS; i++) {
        char key[64];
        snprintf(key, sizeof key, "peak_%s_bytes", fg_tier_names[i]);
        cJSON_AddNumberToObject(o, key, st->peak[i]);
        snprintf(key, sizeof key, "capacity_%s_bytes", fg_tier_names[i]);
        cJSON_AddNumberToObject(o, key, st->capacity[i]);
    }
    for (int i = 0; i < N_LINKS; i++) cJSON_AddNumberToObject(o, link_keys[i], st->link_bytes[i]);
    cJSON_AddNumberToObject(o, "compute_seconds", t->compute_seconds);
    cJSON_AddNumberToObject(o, "disk_read_seconds", t->disk_read_seconds);
    cJSON_AddNumberToObject(o, "prefill_latency", t->prefill_latency);
    cJSON_AddNumberToObject(o, "prefill_throughput", f->prefill_tp);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)prompt_tokens(p));
    cJSON_AddNumberToObject(o, "prefill_tokens", (double)t->prefill_tokens);
    cJSON_AddNumberToObject(o, "rows_computed", (double)t->rows); /* padding and ended ones too */
    cJSON_AddNumberToObject(o, "kv_cache_rows", (double)t->cache_rows); /* each sequence's pages at
                                                                           its end */
    cJSON_AddNumberToObject(o, "kv_cache_tokens", (double)t->cache_tokens); /* the tokens in them */
    cJSON_AddNumberToObject(o, "decode_latency", t->decode_latency);
    cJSON_AddNumberToObject(o, "decode_throughput", f->decode_tp);
    cJSON_AddNumberToObject(o, "total_latency", f->total);
    cJSON_AddNumberToObject(o, "total_throughput", f->total_tp);
    cJSON_AddNumberToObject(o, "mean_completion_seconds", f->completion);
    if (a->cold_seconds >= 0) {
        cJSON_AddNumberToObject(o, "warmup_latency", a->cold_seconds);
        cJSON_AddNumberToObject(o, "warmup_prefill_latency", a->cold_prefill);
        cJSON_AddNumberToObject(o, "warmup_decode_latency", a->cold_decode);
    }
    add_kernels_json(o, &a->policy, blas);
    if (t->device_counted) cJSON_AddItemToObject(o, "device_counts", device_counts_json(t));
    if (n_stages > 1) cJSON_AddItemToObject(o, "stages", stages_json(stages, n_stages));
    char *s = cJSON_PrintUnformatted(o);
    printf("%s\n", s);
    free(s);
    cJSON_Delete(o);
}

/* FlexGen's benchmark lines, then the tiers, the links, the times, the kernels, the stages. */
static void report_text(const cli_args *a, const gen_timing *t, const fg_stats *st,
                        const char *device, const stage_report *stages, int n_stages,
                        const run_figures *f, const fg_blas_info *blas) {
    printf("model size: %.3f GB\tcache size: %.3f GB\thidden size (p): %.3f GB\n", f->model / GB,
           f->cache / GB, f->hidden / GB);
    printf("peak gpu mem: %.3f GB\tprojected: False\n", st->peak[TIER_GPU] / GB);
    printf("prefill latency: %.3f s\tprefill throughput: %.3f token/s\n", t->prefill_latency,
           f->prefill_tp);
    printf("decode latency: %.3f s\tdecode throughput: %.3f token/s\n", t->decode_latency,
           f->decode_tp);
    printf("total latency: %.3f s\ttotal throughput: %.3f token/s\n", f->total, f->total_tp);
    printf("mean time to a completed sequence: %.3f s\n", f->completion);
    if (a->cold_seconds >= 0)
        printf("cold first run (--warmup, not in the figures above): %.3f s\n", a->cold_seconds);
    printf("peak tiers: gpu %.3f GB\tcpu %.3f GB\tdisk %.3f GB\n", st->peak[TIER_GPU] / GB,
           st->peak[TIER_CPU] / GB, st->peak[TIER_DISK] / GB);
    printf("moved: disk->cpu %.3f GB\tcpu->gpu %.3f GB\tgpu->cpu %.3f GB\tcpu->disk %.3f GB\n",
           st->link_bytes[LINK_DISK_TO_CPU] / GB, st->link_bytes[LINK_CPU_TO_GPU] / GB,
           st->link_bytes[LINK_GPU_TO_CPU] / GB, st->link_bytes[LINK_CPU_TO_DISK] / GB);
    printf("compute: %.3f s\tdisk reads: %.3f s\tdevice: %s\n", t->compute_seconds,
           t->disk_read_seconds, device);
    printf("blas: %s, core %s (%s)\tcpu kernels: %s%s%s%s%s\n", blas->library, blas->core,
           blas->why, matmul_path(), a->policy.int8_activations ? ", int8 sums " : "",
           a->policy.int8_activations ? matmul_int8_path() : "",
           prefill_scheme(&a->policy) ? ", prefill products " : "", prefill_path(&a->policy));
    for (int r = 0; n_stages > 1 && r < n_stages; r++) {
        const stage_report *s = &stages[r];
        printf("stage %d/%d (layers %d-%d): peak gpu %.3f GB\tcpu %.3f GB\tdisk %.3f GB\t"
               "sent %.3f GB\tcompute %.3f s\tbubble %.3f s\n",
               r + 1, n_stages, s->first_layer, s->end_layer - 1, s->st.peak[TIER_GPU] / GB,
               s->st.peak[TIER_CPU] / GB, s->st.peak[TIER_DISK] / GB, s->sent / GB, s->compute,
               s->bubble);
    }
}

void report_run(const cli_args *a, const model_config *c, const prompt_set *p, const gen_timing *t,
                const fg_stats *st, int max_prompt, const char *device, const stage_report *stages,
                int n_stages) {
    run_figures f = figures_of(a, c, p, t, max_prompt);
    fg_blas_info blas; /* the CPU's products and attention, on either device */
    fg_blas_info_get(&blas);
    if (a->stage_cores[0]) { /* a pipeline whose stages run other cores */
        snprintf(blas.core, sizeof blas.core, "%s", a->stage_cores);
        snprintf(blas.why, sizeof blas.why, "the stages' own, stage by stage");
    }
    if (a->json) report_json(a, c, p, t, st, max_prompt, device, stages, n_stages, &f, &blas);
    else report_text(a, t, st, device, stages, n_stages, &f, &blas);
}

/* --json for a --resume that finds nothing left to do. */
void report_finished_job(const char *output, int records) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "output", output);
    cJSON_AddNumberToObject(o, "records", records);
    cJSON_AddBoolToObject(o, "finished", 1);
    char *text = cJSON_PrintUnformatted(o);
    if (text) printf("%s\n", text);
    free(text);
    cJSON_Delete(o);
}
