/* app/commands.c: the subcommands: `flexgen policy` (the search's choice and its prediction,
 * §4.3), `flexgen profile` (this machine's constants), `flexgen tokenize` (text to token ids) and
 * `flexgen perplexity` (a text's perplexity through the runtime, perplexity.c, §6.2).
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Each schedule's best policy (block shape) and prediction; null where it was not searched or none
 * fits. */
static cJSON *schedules_json(const fg_search_result *r) {
    cJSON *all = cJSON_CreateObject();
    for (int k = 0; k < FG_SCHEDULES; k++) {
        if (!r->best[k].found) {
            cJSON_AddNullToObject(all, fg_schedule_names[k]);
            continue;
        }
        cJSON *o = cJSON_AddObjectToObject(all, fg_schedule_names[k]);
        cJSON_AddNumberToObject(o, "gpu_batch_size", r->best[k].policy.gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", r->best[k].policy.num_gpu_batches);
        cJSON_AddNumberToObject(o, "predicted_throughput", r->best[k].throughput);
        cJSON_AddNumberToObject(o, "block_latency", r->best[k].block_latency);
    }
    return all;
}

/* The plan's capacities in the JSON report: "capacity" in bytes, "host_memory" (null: none), and
 * whether the gpu and cpu tiers were cut to it. */
static void add_capacities_json(cJSON *o, const double cap[N_TIERS], double host) {
    cJSON *c = cJSON_CreateObject();
    for (int t = 0; t < N_TIERS; t++) cJSON_AddNumberToObject(c, fg_tier_names[t], cap[t]);
    cJSON_AddItemToObject(o, "capacity", c);
    if (host > 0) cJSON_AddNumberToObject(o, "host_memory", host);
    else cJSON_AddNullToObject(o, "host_memory");
    cJSON_AddBoolToObject(o, "cut_to_host_memory",
                          host > 0 && cap[TIER_GPU] + cap[TIER_CPU] > host);
}

/* In the text report, a line where the host's memory cut what the gpu and cpu tiers were given. */
static void print_capacity_cut(const double cap[N_TIERS], double host) {
    if (!(host > 0 && cap[TIER_GPU] + cap[TIER_CPU] > host)) return;
    printf("capacity: gpu %s, cpu %s, disk %s; the gpu and cpu tiers together within %s of host "
           "memory (a "
           "sixteenth of the machine's memory is kept for the system)\n",
           human(cap[TIER_GPU]).s, human(cap[TIER_CPU]).s, human(cap[TIER_DISK]).s, human(host).s);
}

/* flexgen policy: the search's choice, its prediction and the terms that bound it. */
int policy_command(cli_args *a, char *err) {
    model_config cfg;
    fg_search_result r;
    fg_tokenizer *tok = NULL;
    prompt_set prompts = {0};
    int rc = a->ppl_flag ? fg_fail(err, "%s: a flag of `flexgen perplexity`", a->ppl_flag) : 0;
    if (rc == 0 && a->evaluate && a->max_latency > 0)
        rc = fg_fail(err, "--max-latency: bounds the search's block, and --evaluate searches "
                          "nothing; drop one of them");
    if (rc == 0 && !a->evaluate)
        warn_searched(a, "the search chooses the block and the placement (--evaluate predicts the "
                         "given ones)");
    if (rc == 0) rc = resolve_model_config(a->model, &cfg, err);
    if (rc == 0) warn_special_ids(a->model, &cfg);
    if (rc == 0) rc = check_lengths(a, &cfg, err); /* as a run checks them */
    if (rc == 0) rc = open_run_tokenizer(a, &tok, err);
    if (rc == 0) rc = gather_prompts(a, tok, &cfg, &prompts, err); /* given ones bound the block */
    if (rc == 0 && prompts.n)
        rc = check_prompts(&cfg, prompts.n, prompts.ids, prompts.lens, a->gen.gen_len, err);
    fg_hardware hw;
    if (rc == 0) rc = load_hardware(a, &hw, err);
    if (rc == 0 && a->policy.device == FG_DEVICE_AUTO && hw.gpu_is_host)
        a->policy.device = FG_DEVICE_CPU;
    int lengths[2] = {longest_prompt(&prompts), mean_prompt(a, &prompts)};
    if (rc == 0) rc = search_policy(a, &hw, &cfg, prompts.n, lengths, 0, 0, &r, err);
    prompts_free(&prompts);
    if (tok) tokenizer_free(tok);
    if (rc) return -1;
    const fg_policy *p = &r.policy;
    double cap[N_TIERS], host;
    planned_capacities(a, &hw, cap, &host);
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "gpu_batch_size", p->gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", p->num_gpu_batches);
        cJSON_AddItemToObject(o, "percent", percent_json(&p->percent));
        cJSON_AddBoolToObject(o, "cpu_cache_compute", p->cpu_cache_compute);
        cJSON_AddNumberToObject(o, "predicted_throughput", r.throughput);
        cJSON_AddNumberToObject(o, "block_latency", r.block_latency);
        cJSON_AddNumberToObject(o, "t_pre", r.t_pre);
        cJSON_AddNumberToObject(o, "t_gen", r.t_gen);
        cJSON_AddItemToObject(o, "placement", cJSON_CreateDoubleArray(r.x, N_X));
        cJSON_AddNumberToObject(o, "search_seconds", r.seconds);
        cJSON_AddNumberToObject(o, "lps", r.lps);
        cJSON_AddStringToObject(o, "schedule", fg_schedule_names[p->schedule]);
        if (!a->evaluate) cJSON_AddItemToObject(o, "schedules", schedules_json(&r));
        add_capacities_json(o, cap, host);
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        return 0;
    }
    printf("policy: ");
    print_policy_flags(stdout, p);
    printf("\npredicted: %.4g token/s, a block of %d sequences in %.4g s\n", r.throughput,
           p->gpu_batch_size * p->num_gpu_batches, r.block_latency);
    printf("placement (gpu/cpu/disk %%): weights %.0f/%.0f/%.0f  cache %.0f/%.0f/%.0f  "
           "activations %.0f/%.0f/%.0f\n",
           100 * r.x[0], 100 * r.x[1], 100 * r.x[2], 100 * r.x[3], 100 * r.x[4], 100 * r.x[5],
           100 * r.x[6], 100 * r.x[7], 100 * r.x[8]);
    int host_measured = hw.launch_seconds > 0 || hw.wait_seconds > 0; /* a GPU's, profiled */
    int terms_shown = host_measured ? N_TERMS : T_HOST;
    printf("per layer (s)");
    for (int i = 0; i < terms_shown; i++) printf("%11s", fg_cost_term_names[i]);
    printf("   bound\n");
    for (int phase = 0; phase < 2; phase++) {
        const fg_linear *terms = phase ? r.cost.gen : r.cost.pre;
        int arg = 0;
        printf("%-13s", phase ? "decode" : "prefill");
        for (int i = 0; i < terms_shown; i++) {
            double v = fg_linear_eval(&terms[i], r.x);
            printf("%11.4g", v);
            if (v > fg_linear_eval(&terms[arg], r.x)) arg = i;
        }
        printf("   %s\n", fg_cost_term_names[arg]);
    }
    for (int k = 0, shown = 0; k < FG_SCHEDULES && !a->evaluate; k++) /* each one searched that
                                                                         fits */
        if (r.best[k].found)
            printf("%s%s: %.4g token/s, a block of %d x %d",
                   shown++ ? ", " : "schedules: ", fg_schedule_names[k], r.best[k].throughput,
                   r.best[k].policy.gpu_batch_size, r.best[k].policy.num_gpu_batches);
    if (!a->evaluate) printf("\n");
    if (!a->evaluate)
        printf("search: %d LPs, %d plans checked, %.3f s\n", r.lps, r.checks, r.seconds);
    print_capacity_cut(cap, host);
    return 0;
}

/* flexgen profile: measures this machine and saves the hardware file. The default file's
 * directory, where the command makes it, goes again if the command fails (nothing left behind). */
int profile_command(int argc, char **argv, char *err) {
    const char *dir = FG_DEFAULT_OFFLOAD_DIR, *out = NULL;
    char path[4200];
    fg_device device = FG_DEVICE_AUTO;
    for (int i = 2; i < argc; i++) {
        if (is_help(argv[i])) {
            usage_command(stdout, "profile");
            return 1;
        }
        if (strcmp(argv[i], "--offload-dir") && strcmp(argv[i], "--out") &&
            strcmp(argv[i], "--device"))
            return fg_fail(err, "%s: unknown option for profile", argv[i]);
        if (i + 1 >= argc) return fg_fail(err, "%s: missing value", argv[i]);
        const char *kind = !strcmp(argv[i], "--out") ? "file" : "directory";
        if (strcmp(argv[i], "--device") && flag_for_path(argv[i], argv[i + 1], kind, err))
            return -1;
        if (!strcmp(argv[i], "--offload-dir")) dir = argv[++i];
        else if (!strcmp(argv[i], "--out")) out = argv[++i];
        else if (!strcmp(argv[i], "--device")) {
            if (parse_device(argv[++i], &device, err)) return -1;
        }
    }
    if (check_dir("--offload-dir", dir, err)) return -1;
    if (!out) {
        if (default_hw_file(path, sizeof path, err)) return -1;
        out = path;
    }
    fg_hardware hw;
    int rc = fg_output_check("--out", out, err); /* before a minute of measuring */
    if (rc == 0) {
        rc = resolve_device(&device, 1, err) || fg_profile(dir, device, &hw, 1, err) ||
             fg_hardware_write(out, &hw, err);
    }
    if (rc) return -1;
    printf("cpu->gpu %.2f GiB/s, gpu->cpu %.2f GiB/s, disk->cpu %.3f GiB/s, cpu->disk %.3f GiB/s\n",
           hw.ctog_bdw / GB, hw.gtoc_bdw_hidden / GB, hw.dtoc_bdw / GB, hw.ctod_bdw_g / GB);
    printf("matrix products %.1f (prefill) %.1f (decode) GFLOP/s, attention %.1f (prefill) %.1f "
           "(decode) GFLOP/s, weights read %.2f GiB/s, 4-bit decompression %.2f GiB/s of fp16\n",
           hw.mm_flops_p / 1e9, hw.mm_flops_g / 1e9, hw.bmm_flops_p / 1e9, hw.bmm_flops_g / 1e9,
           hw.mem_bdw / GB, hw.dequant_bdw / GB);
    if (hw.mm_flops_int8_g > 0)
        printf("4-bit x int8 products %.1f (prefill) %.1f (decode) GFLOP/s\n",
               hw.mm_flops_int8_p / 1e9, hw.mm_flops_int8_g / 1e9);
    if (!hw.gpu_is_host)
        printf("the host: %.2f us to queue a launch, %.1f us to wait for the GPU\n",
               hw.launch_seconds * 1e6, hw.wait_seconds * 1e6);
    printf("saved %s (the products on OpenBLAS's %s core)\n", out, hw.blas_core);
    return 0;
}

/* flexgen tokenize: a tokenizer from --vocab and --merges, --tokenizer FILE.json, or --model
 * DIR. */
static fg_tokenizer *tokenize_tokenizer(const char *vocab, const char *merges, const char *json,
                                        const char *model, char *err) {
    int ways = (vocab || merges) + !!json + !!model;
    if (ways > 1) {
        fg_fail(err, "tokenize: %s%s%s: give only one of them",
                vocab || merges ? "--vocab/--merges and " : "", json ? "--tokenizer" : "",
                model ? (json ? " and --model" : "--model") : "");
        return NULL;
    }
    if (!ways) {
        fg_fail(err,
                "tokenize: give --vocab and --merges, or --tokenizer FILE.json, or --model DIR");
        return NULL;
    }
    if (!vocab != !merges) {
        fg_fail(err, "tokenize: --vocab and --merges go together");
        return NULL;
    }
    if (vocab) return tokenizer_load(vocab, merges, err);
    if (json) return tokenizer_load_json(json, err);
    fg_tokenizer *t = tokenizer_load_dir(model, err);
    if (!t && !err[0])
        fg_fail(err, "--model %s: no tokenizer.json, and no vocab.json and merges.txt", model);
    return t;
}

int tokenize_command(int argc, char **argv, char *err) {
    static const char *const flags[] = {"--vocab", "--merges", "--tokenizer", "--model"};
    const char *value[4] = {0};
    for (int i = 2; i < argc; i++) {
        if (is_help(argv[i])) {
            usage_command(stdout, "tokenize");
            return 0;
        }
        int k = 0;
        while (k < 4 && strcmp(argv[i], flags[k])) k++;
        if (k == 4) return fg_fail(err, "%s: unknown option for tokenize", argv[i]);
        if (i + 1 >= argc) return fg_fail(err, "%s: missing value", argv[i]);
        const char *kind = k == 3 ? "directory" : "file";
        if (!argv[i + 1][0]) return fg_fail(err, "%s: an empty path; give a %s", argv[i], kind);
        if (flag_for_path(argv[i], argv[i + 1], kind, err)) return -1;
        value[k] = argv[++i];
    }
    fg_tokenizer *tok = tokenize_tokenizer(value[0], value[1], value[2], value[3], err);
    if (!tok) return -1;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = 0, line_no = 0;
    while (rc == 0 && (len = getline(&line, &cap, stdin)) >= 0) {
        line_no++; /* a line as --prompt-file takes it: its CR LF ending dropped, no NUL */
        if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
        if (len > 0 && line[len - 1] == '\r') line[--len] = 0;
        if (memchr(line, 0, (size_t)len)) {
            rc = fg_fail(err, "standard input line %d: a NUL byte inside the line", line_no);
            break;
        }
        int *ids, n;
        rc = tokenizer_encode(tok, line, (size_t)len, &ids, &n, err);
        for (int i = 0; rc == 0 && i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        if (rc == 0) {
            printf("\n");
            free(ids);
        }
    }
    if (rc == 0 && ferror(stdin)) /* a directory, a closed descriptor, an I/O error */
        rc = fg_fail(err, "standard input: read failed: %s", strerror(errno));
    free(line);
    tokenizer_free(tok);
    return rc;
}

/* ---- flexgen perplexity (perplexity.c) ---- */

/* BOS + the tokens of the text file at path. Its bytes are tokenized as they are; where they are
 * not UTF-8, a note says so: HF's tokenizers take decoded text, and Python's decoding replaces
 * such bytes (errors="replace") or refuses them, so ids and perplexity differ from theirs there. */
static int read_text_ids(const fg_tokenizer *tok, const char *path, int **ids, int *n, char *err) {
    size_t size;
    char *text = fg_read_file(path, &size, err);
    if (!text) return fg_fail_flag(err, "--text");
    if (memchr(text, 0, size)) { /* refused before the note below: one line */
        free(text);
        return fg_fail(err, "--text %s: a NUL byte: not a text file", path);
    }
    size_t invalid = utf8_first_invalid(text, size);
    if (invalid < size)
        fprintf(stderr,
                "flexgen: note: --text %s: not UTF-8 at byte %zu; its bytes are scored as they "
                "are (the tokenizer's byte tokens), where HF's tokenizers take decoded text\n",
                path, invalid);
    prompt_set p = {0};
    int rc = add_text_prompt(&p, tok, text, size, NULL, err);
    free(text);
    if (rc == 0) { /* the rest is freed */
        *ids = p.ids[0];
        *n = p.lens[0];
        p.ids[0] = NULL;
    }
    prompts_free(&p);
    return rc;
}

/* Another run's --predictions: one token id a line, as many as the text has scored tokens. */
static int read_predictions(const char *path, int scored, int vocab, int *ref, char *err) {
    size_t size;
    char *text = fg_read_file(path, &size, err);
    if (!text) return fg_fail_flag(err, "--compare");
    int n = 0, line_no = 0, rc = 0;
    for (char *line = text, *end; rc == 0 && line < text + size; line = end + 1) {
        end = memchr(line, '\n', (size_t)(text + size - line));
        if (!end) end = text + size;
        char *after;
        errno = 0;
        long v = strtol(line, &after, 10);
        after += strspn(after, " \t\r");
        line_no++;
        if (after == line || after != end || errno || v < 0 || v >= vocab)
            rc = fg_fail(err, "--compare %s line %d: expected one token id in [0, %d)", path,
                         line_no, vocab);
        else if (n < scored) ref[n++] = (int)v;
        else n++;
    }
    free(text);
    if (rc == 0 && n != scored)
        rc = fg_fail(err, "--compare %s: %d predictions, but the text has %d scored tokens", path,
                     n, scored);
    return rc;
}

static int write_predictions(const char *path, const int *top1, int n, char *err) {
    fg_output o;
    if (fg_output_open(&o, "--predictions", path, err)) return -1;
    for (int i = 0; i < n; i++) fprintf(o.f, "%d\n", top1[i]);
    return fg_output_commit(&o, err);
}

static void report_perplexity(const cli_args *a, const ppl_result *r, int agree,
                              const char *device) {
    const char *mode = a->ppl.decode ? "decode" : "prefill";
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "perplexity", r->perplexity);
        cJSON_AddNumberToObject(o, "nll_per_token", r->nll / (double)r->scored);
        cJSON_AddNumberToObject(o, "scored_tokens", (double)r->scored);
        cJSON_AddNumberToObject(o, "windows", r->windows);
        cJSON_AddNumberToObject(o, "window", r->window);
        cJSON_AddNumberToObject(o, "stride", r->stride);
        cJSON_AddStringToObject(o, "mode", mode);
        cJSON_AddStringToObject(o, "device", device);
        cJSON_AddNumberToObject(o, "seconds", r->seconds);
        if (a->compare)
            cJSON_AddNumberToObject(o, "top1_agreement", (double)agree / (double)r->scored);
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        return;
    }
    printf("perplexity: %.4f over %ld tokens (%.5f nats each)\n", r->perplexity, r->scored,
           r->nll / (double)r->scored);
    printf("windows: %d of up to %d tokens advancing %d, scored in %s on %s, %.2f s\n", r->windows,
           r->window, r->stride, mode, device, r->seconds);
    if (a->compare)
        printf("top-1 agreement with %s: %.4f (%d of %ld)\n", a->compare,
               (double)agree / (double)r->scored, agree, r->scored);
}

/* flexgen perplexity: a text's perplexity under the model with the run's policy. */
int perplexity_command(cli_args *a, char *err) {
    fg_tokenizer *tok = NULL;
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    int *ids = NULL, *top1 = NULL, *ref = NULL, n = 0, agree = 0;
    model_config cfg;
    ppl_result r;
    int rc = 0;
    if (!a->text) rc = fg_fail(err, "perplexity: --text FILE is required");
    if (rc == 0 && a->predictions) rc = fg_output_check("--predictions", a->predictions, err);
    if (rc == 0) rc = resolve_model_config(a->model, &cfg, err);
    if (rc == 0) warn_special_ids(a->model, &cfg);
    if (rc == 0) rc = open_run_tokenizer(a, &tok, err);
    if (rc == 0 && !tok) rc = fg_fail(err, "perplexity needs a tokenizer: " TOKENIZER_WAYS);
    if (rc == 0) rc = read_text_ids(tok, a->text, &ids, &n, err);
    if (rc == 0) {
        char origin[FG_PATH_LEN + 64], name[FG_PATH_LEN + 16];
        tokenizer_origin(a, origin, sizeof origin);
        snprintf(name, sizeof name, "--text %s", a->text);
        rc = check_tokenized_ids(origin, name, ids, n, cfg.vocab, err);
    }
    if (rc == 0 && a->compare && !(ref = malloc((size_t)n * sizeof *ref)))
        rc = fg_fail(err, "out of memory");
    if (rc == 0 && a->compare) rc = read_predictions(a->compare, n - 1, cfg.vocab, ref, err);
    if (rc == 0 && !(top1 = malloc((size_t)n * sizeof *top1))) rc = fg_fail(err, "out of memory");
    if (rc == 0) rc = resolve_device(&a->policy.device, a->gen.verbose, err);
    if (rc == 0) rc = open_runtime(&a->policy, &rt, err);
    if (rc == 0) rc = fg_model_open(rt, a->model, a->gen.seed, &m, err);
    a->ppl.verbose = a->gen.verbose;
    if (rc == 0) rc = fg_perplexity(m, ids, n, &a->ppl, top1, &r, err);
    if (rc == 0 && a->predictions) rc = write_predictions(a->predictions, top1, n - 1, err);
    for (int i = 0; rc == 0 && ref && i < n - 1; i++) agree += ref[i] == top1[i];
    if (rc == 0) report_perplexity(a, &r, agree, fg_runtime_backend(rt)->name);
    fg_model_close(m);
    fg_runtime_close(rt);
    if (tok) tokenizer_free(tok);
    free(ids);
    free(top1);
    free(ref);
    return rc;
}
