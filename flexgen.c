/* flexgen.c: the runtime and the command line (paper §4.1, Fig. 4).
 *
 *   generate()      prompts in blocks of gpu_batch_size x num_gpu_batches sequences; each block
 *                   walks token i, layer j, GPU batch k in the order of Fig. 4, so a layer's
 *                   weights are used by every GPU batch of the block before the next layer's
 *   plan check      the whole plan (weights, KV cache, workspace) against the memory there is,
 *                   refused before any compute when it does not fit
 *   report          FlexGen's benchmark lines, or one JSON object with --json
 *   CLI             flexgen [run flags] | flexgen tokenize --vocab F --merges F
 *
 * Everything that can fail on user input returns an error line; main prints it and exits 2.
 */
#define _GNU_SOURCE
#include "flexgen.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ============================================================================================
 * The block schedule (§4.1, Fig. 4)
 * ============================================================================================ */

/* A block in flight: its GPU batches, the workspace they share, this step's logits. */
typedef struct {
    const opt_weights *w;
    gpu_batch *gpu_batches;
    int num_gpu_batches;
    opt_workspace ws;
    float *logits; /* [block][vocab] */
} block_state;

/* FlexGen's layer list: input embedding, the decoder layers, output embedding. */
static int num_layers(const opt_weights *w) { return w->cfg.n_layers + 2; }

static void compute_layer(block_state *st, int j, int k) {
    gpu_batch *gb = &st->gpu_batches[k];
    if (j == 0) {
        opt_embed(st->w, gb, &st->ws);
    } else if (j <= st->w->cfg.n_layers) {
        opt_layer(st->w, j - 1, gb, &st->ws);
    } else {
        size_t first_row = 0;
        for (int i = 0; i < k; i++) first_row += st->gpu_batches[i].batch;
        opt_output(st->w, gb, &st->ws, st->logits + first_row * st->w->cfg.vocab);
    }
}

/* One generated token for the whole block: the two inner loops of Fig. 4. Weights of layer j
 * are read once for all GPU batches; the I/O overlap comes with the tiers (issue 3). */
static void generation_step(block_state *st) {
    for (int j = 0; j < num_layers(st->w); j++)
        for (int k = 0; k < st->num_gpu_batches; k++) compute_layer(st, j, k);
}

/* Loads a block's prompts, left-padded to the longest, as the prefill step's input. */
static void start_block(block_state *st, int *const *prompts, const int *lens, int first,
                        int count, int gpu_batch_size) {
    int padded = 0;
    for (int i = 0; i < count; i++) padded = lens[first + i] > padded ? lens[first + i] : padded;
    st->num_gpu_batches = (count + gpu_batch_size - 1) / gpu_batch_size;
    for (int k = 0; k < st->num_gpu_batches; k++) {
        gpu_batch *gb = &st->gpu_batches[k];
        int base = first + k * gpu_batch_size;
        gb->batch = count - k * gpu_batch_size < gpu_batch_size ? count - k * gpu_batch_size
                                                                : gpu_batch_size;
        gb->len = 0;
        gb->n_new = padded;
        for (int b = 0; b < gb->batch; b++) {
            int n = lens[base + b], *row = gb->tokens + (size_t)b * padded;
            gb->pad[b] = padded - n;
            for (int t = 0; t < padded - n; t++) row[t] = OPT_PAD_ID;
            memcpy(row + padded - n, prompts[base + b], (size_t)n * sizeof(int));
        }
    }
}

/* Chooses each sequence's next token and makes it the next step's input. Returns how many
 * sequences are still running. */
static int choose_tokens(block_state *st, const gen_options *opt, int step, int first, int count,
                         int *out_tokens, float *logits_out, char *done, fg_rng *rng,
                         float *scratch) {
    int vocab = st->w->cfg.vocab, running = 0;
    for (int s = 0; s < count; s++) {
        const float *row = st->logits + (size_t)s * vocab;
        int p = first + s;
        if (logits_out && !done[s])
            memcpy(logits_out + ((size_t)p * opt->gen_len + step) * vocab, row, vocab * sizeof(float));
        int tok = sample_token(row, vocab, opt->temperature, opt->top_p, rng, scratch);
        out_tokens[(size_t)p * opt->gen_len + step] = done[s] ? OPT_PAD_ID : tok;
        if (opt->stop_at_eos && tok == OPT_EOS_ID) done[s] = 1;
        running += !done[s];
        st->gpu_batches[s / opt->gpu_batch_size].tokens[s % opt->gpu_batch_size] = tok;
    }
    for (int k = 0; k < st->num_gpu_batches; k++) st->gpu_batches[k].n_new = 1;
    return running;
}

static int check_prompts(const opt_config *c, int n, int *const *prompts, const int *lens,
                         int gen_len, char *err) {
    for (int p = 0; p < n; p++) {
        if (lens[p] < 1) return fg_fail(err, "prompt %d is empty", p + 1);
        if (lens[p] + gen_len > c->max_pos)
            return fg_fail(err, "prompt %d: %d tokens + --gen-len %d exceed the model's %d positions",
                        p + 1, lens[p], gen_len, c->max_pos);
        for (int t = 0; t < lens[p]; t++)
            if (prompts[p][t] < 0 || prompts[p][t] >= c->vocab)
                return fg_fail(err, "prompt %d: token id %d out of range [0, %d)", p + 1,
                            prompts[p][t], c->vocab);
    }
    return 0;
}

static void free_block(block_state *st, int n_batches) {
    for (int k = 0; k < n_batches; k++) gpu_batch_free(&st->gpu_batches[k]);
    free(st->gpu_batches);
    opt_workspace_free(&st->ws);
    free(st->logits);
}

static int alloc_block(block_state *st, const opt_weights *w, const gen_options *opt,
                       int max_prompt, char *err) {
    memset(st, 0, sizeof *st);
    st->w = w;
    int gbs = opt->gpu_batch_size, ngb = opt->num_gpu_batches, max_len = max_prompt + opt->gen_len;
    st->gpu_batches = calloc((size_t)ngb, sizeof *st->gpu_batches);
    st->logits = malloc((size_t)gbs * ngb * w->cfg.vocab * sizeof(float));
    if (!st->gpu_batches || !st->logits) {
        free_block(st, 0);
        return fg_fail(err, "out of memory for a block of %d sequences", gbs * ngb);
    }
    for (int k = 0; k < ngb; k++)
        if (gpu_batch_init(&st->gpu_batches[k], &w->cfg, gbs, max_len, max_prompt, err)) {
            free_block(st, k);
            return -1;
        }
    if (opt_workspace_init(&st->ws, &w->cfg, (size_t)gbs * max_prompt, max_len, err)) {
        free_block(st, ngb);
        return -1;
    }
    return 0;
}

int generate(const opt_weights *w, const gen_options *opt, int n_prompts, int *const *prompts,
             const int *prompt_lens, int *out_tokens, float *logits, gen_timing *timing,
             char *err) {
    const opt_config *c = &w->cfg;
    if (check_prompts(c, n_prompts, prompts, prompt_lens, opt->gen_len, err)) return -1;
    int max_prompt = 1, block = opt->gpu_batch_size * opt->num_gpu_batches;
    for (int p = 0; p < n_prompts; p++) max_prompt = prompt_lens[p] > max_prompt ? prompt_lens[p] : max_prompt;
    block_state st;
    if (alloc_block(&st, w, opt, max_prompt, err)) return -1;
    float *scratch = malloc((size_t)2 * c->vocab * sizeof(float));
    char *done = calloc((size_t)block, 1);
    if (!scratch || !done) {
        free(scratch);
        free(done);
        free_block(&st, opt->num_gpu_batches);
        return fg_fail(err, "out of memory");
    }
    if (logits) memset(logits, 0, (size_t)n_prompts * opt->gen_len * c->vocab * sizeof(float));
    for (size_t i = 0; i < (size_t)n_prompts * opt->gen_len; i++) out_tokens[i] = OPT_PAD_ID;
    memset(timing, 0, sizeof *timing);
    fg_rng rng;
    rng_seed(&rng, opt->seed);
    int n_blocks = (n_prompts + block - 1) / block;
    for (int first = 0, blk = 0; first < n_prompts; first += block, blk++) {
        int count = n_prompts - first < block ? n_prompts - first : block;
        start_block(&st, prompts, prompt_lens, first, count, opt->gpu_batch_size);
        memset(done, 0, (size_t)block);
        timing->prefill_tokens += (int64_t)count * st.gpu_batches[0].n_new;
        for (int i = 0; i < opt->gen_len; i++) { /* i == 0 is the prefill */
            double t0 = now_seconds();
            generation_step(&st);
            int running = choose_tokens(&st, opt, i, first, count, out_tokens, logits, done, &rng,
                                        scratch);
            double dt = now_seconds() - t0;
            if (i == 0) timing->prefill_latency += dt;
            else timing->decode_latency += dt, timing->decode_tokens += count;
            if (opt->verbose)
                fprintf(stderr, "\rblock %d/%d: token %d/%d", blk + 1, n_blocks, i + 1, opt->gen_len);
            if (running == 0) break;
        }
    }
    if (opt->verbose) fprintf(stderr, "\n");
    free(scratch);
    free(done);
    free_block(&st, opt->num_gpu_batches);
    return 0;
}

/* ============================================================================================
 * Plan check: everything the run allocates, against the memory there is, before any compute.
 * ============================================================================================ */

static double mem_available_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    double kb = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
    if (f) fclose(f);
    if (kb > 0) return kb * 1024;
    return (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
}

static int check_plan(const opt_config *c, const gen_options *opt, int max_prompt, char *err) {
    double h = c->hidden, rows = (double)opt->gpu_batch_size * max_prompt;
    double block = (double)opt->gpu_batch_size * opt->num_gpu_batches;
    double weights = 4.0 * opt_param_count(c);
    double kv = 2.0 * 2 * c->n_layers * block * (max_prompt + opt->gen_len) * h;
    double ws = 4.0 * rows * (5 * h + (c->ffn > h ? c->ffn : h)) + 4.0 * block * (c->vocab + h);
    double need = weights + kv + ws, have = mem_available_bytes();
    if (need > have)
        return fg_fail(err, "gpu tier: the plan needs %.2f GB (fp32 weights %.2f, KV cache %.2f, "
                         "workspace %.2f), %.2f GB available", need / 1e9, weights / 1e9, kv / 1e9,
                    ws / 1e9, have / 1e9);
    return 0;
}

/* ============================================================================================
 * Command line
 * ============================================================================================ */

typedef struct {
    const char *model, *prompt_file, *prompt_ids, *dump_logits, *vocab, *merges;
    const char **prompts;
    int n_prompt_texts, prompt_len, json;
    gen_options gen;
} cli_args;

static void usage(FILE *out) {
    fprintf(out,
"usage: flexgen [options]\n"
"       flexgen tokenize --vocab FILE --merges FILE   (stdin lines -> token ids, no BOS)\n"
"\n"
"Generates text with an OPT model on the CPU, walking blocks of GPU batches in the order of\n"
"the FlexGen paper's Fig. 4, and prints FlexGen's benchmark report.\n"
"\n"
"model\n"
"  --model NAME|DIR        opt-125m ... opt-175b with dummy weights, or an HF checkpoint\n"
"                          directory (config.json + model.safetensors or its shard index)\n"
"                          [opt-125m]\n"
"  --vocab F, --merges F   tokenizer files (default: vocab.json, merges.txt in DIR)\n"
"prompts (synthetic ones of --prompt-len tokens when none are given)\n"
"  --prompt TEXT           a prompt (repeatable); needs a tokenizer; BOS is prepended\n"
"  --prompt-file F         one prompt a line; needs a tokenizer; BOS is prepended\n"
"  --prompt-ids F          one prompt a line, space-separated token ids, used as given\n"
"  --prompt-len N          length of synthetic prompts [512]\n"
"generation\n"
"  --gen-len N             tokens to generate per prompt [32]\n"
"  --gpu-batch-size N      sequences per GPU batch [16]\n"
"  --num-gpu-batches N     GPU batches per block; a block is their product, and prompts are\n"
"                          processed a block at a time (the last may be partial) [2]\n"
"  --temperature T         0 is greedy; > 0 samples from softmax(logits / T) [0]\n"
"  --top-p P               nucleus sampling mass, in (0, 1] [1]\n"
"  --seed N                seed of dummy weights, synthetic prompts and sampling [0]\n"
"  --stop-at-eos           stop a sequence after it generates </s>\n"
"output\n"
"  --dump-logits F         float32 [num_prompts][gen_len][vocab]: the logits each generated\n"
"                          token was chosen from, in prompt order\n"
"  --json                  one JSON object on stdout instead of the report lines\n"
"  --quiet                 no progress on stderr\n"
"  --help                  this text\n"
"\n"
"Threads: OMP_NUM_THREADS (default: all cores). Bad input exits with status 2.\n");
}

static int parse_int(const char *flag, const char *s, int min, int *out, char *err) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || *s == 0 || *end || v < min || v > INT_MAX)
        return fg_fail(err, "%s: expected an integer >= %d, got '%s'", flag, min, s ? s : "");
    *out = (int)v;
    return 0;
}

static int parse_float(const char *flag, const char *s, double lo, double hi, float *out,
                       char *err) {
    char *end;
    errno = 0;
    double v = s ? strtod(s, &end) : 0;
    if (!s || errno || *s == 0 || *end || !(v >= lo && v <= hi))
        return fg_fail(err, "%s: expected a number in [%g, %g], got '%s'", flag, lo, hi, s ? s : "");
    *out = (float)v;
    return 0;
}

static int is_value_flag(const char *f) {
    static const char *const flags[] = {"--model", "--prompt", "--prompt-file", "--prompt-ids",
        "--dump-logits", "--vocab", "--merges", "--prompt-len", "--gen-len", "--gpu-batch-size",
        "--num-gpu-batches", "--temperature", "--top-p", "--seed"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (!strcmp(f, flags[i])) return 1;
    return 0;
}

static int parse_args(int argc, char **argv, cli_args *a, char *err) {
    memset(a, 0, sizeof *a);
    a->model = "opt-125m";
    a->prompt_len = 512;
    a->gen = (gen_options){.gpu_batch_size = 16, .num_gpu_batches = 2, .gen_len = 32,
                           .temperature = 0, .top_p = 1, .seed = 0, .verbose = isatty(2)};
    a->prompts = calloc((size_t)argc, sizeof *a->prompts);
    if (!a->prompts) return fg_fail(err, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes_value = 1, rc = 0, seed;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) return 1;
        else if (!strcmp(f, "--json")) a->json = 1, takes_value = 0;
        else if (!strcmp(f, "--stop-at-eos")) a->gen.stop_at_eos = 1, takes_value = 0;
        else if (!strcmp(f, "--quiet")) a->gen.verbose = 0, takes_value = 0;
        else if (!is_value_flag(f)) return fg_fail(err, "%s: unknown option (see --help)", f);
        else if (!v) return fg_fail(err, "%s: missing value", f);
        else if (!strcmp(f, "--model")) a->model = v;
        else if (!strcmp(f, "--prompt")) a->prompts[a->n_prompt_texts++] = v;
        else if (!strcmp(f, "--prompt-file")) a->prompt_file = v;
        else if (!strcmp(f, "--prompt-ids")) a->prompt_ids = v;
        else if (!strcmp(f, "--dump-logits")) a->dump_logits = v;
        else if (!strcmp(f, "--vocab")) a->vocab = v;
        else if (!strcmp(f, "--merges")) a->merges = v;
        else if (!strcmp(f, "--prompt-len")) rc = parse_int(f, v, 1, &a->prompt_len, err);
        else if (!strcmp(f, "--gen-len")) rc = parse_int(f, v, 1, &a->gen.gen_len, err);
        else if (!strcmp(f, "--gpu-batch-size")) rc = parse_int(f, v, 1, &a->gen.gpu_batch_size, err);
        else if (!strcmp(f, "--num-gpu-batches")) rc = parse_int(f, v, 1, &a->gen.num_gpu_batches, err);
        else if (!strcmp(f, "--temperature")) rc = parse_float(f, v, 0, 1e6, &a->gen.temperature, err);
        else if (!strcmp(f, "--top-p")) rc = parse_float(f, v, 1e-9, 1, &a->gen.top_p, err);
        else if (!strcmp(f, "--seed")) { rc = parse_int(f, v, 0, &seed, err); a->gen.seed = (uint64_t)seed; }
        if (rc) return -1;
        i += takes_value;
    }
    if ((a->prompt_file != NULL) + (a->prompt_ids != NULL) + (a->n_prompt_texts > 0) > 1)
        return fg_fail(err, "--prompt, --prompt-file and --prompt-ids: give only one of them");
    if ((long)a->gen.gpu_batch_size * a->gen.num_gpu_batches > 1 << 20)
        return fg_fail(err, "--gpu-batch-size x --num-gpu-batches: block of %ld sequences is too large",
                    (long)a->gen.gpu_batch_size * a->gen.num_gpu_batches);
    return 0;
}

/* ---- prompts ---- */

typedef struct {
    int n, cap;
    int **ids;
    int *lens;
} prompt_set;

static void prompts_free(prompt_set *p) {
    for (int i = 0; i < p->n; i++) free(p->ids[i]);
    free(p->ids);
    free(p->lens);
    memset(p, 0, sizeof *p);
}

static int prompts_add(prompt_set *p, int *ids, int len, char *err) {
    if (p->n == p->cap) {
        int cap = p->cap * 2 + 8;
        int **ni = realloc(p->ids, (size_t)cap * sizeof *ni);
        if (ni) p->ids = ni;
        int *nl = ni ? realloc(p->lens, (size_t)cap * sizeof *nl) : NULL;
        if (!nl) { free(ids); return fg_fail(err, "out of memory"); }
        p->lens = nl;
        p->cap = cap;
    }
    p->ids[p->n] = ids;
    p->lens[p->n++] = len;
    return 0;
}

/* BOS + the text's tokens. */
static int add_text_prompt(prompt_set *p, const fg_tokenizer *tok, const char *text, size_t len,
                           char *err) {
    int *ids, n;
    if (tokenizer_encode(tok, text, len, &ids, &n, err)) return -1;
    int *with_bos = malloc((size_t)(n + 1) * sizeof *with_bos);
    if (!with_bos) { free(ids); return fg_fail(err, "out of memory"); }
    with_bos[0] = OPT_BOS_ID;
    memcpy(with_bos + 1, ids, (size_t)n * sizeof *ids);
    free(ids);
    return prompts_add(p, with_bos, n + 1, err);
}

static int parse_id_line(const char *path, int line_no, char *line, int vocab, int **out, int *n,
                         char *err) {
    int cap = 16, count = 0, *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return fg_fail(err, "out of memory");
    for (char *s = line, *end;; s = end) {
        while (*s == ' ' || *s == '\t' || *s == '\r') s++;
        if (!*s) break;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || (*end && *end != ' ' && *end != '\t' && *end != '\r')) {
            free(ids);
            return fg_fail(err, "%s line %d: not a token id: '%.20s'", path, line_no, s);
        }
        if (v < 0 || v >= vocab) {
            free(ids);
            return fg_fail(err, "%s line %d: token id %ld out of range [0, %d)", path, line_no, v, vocab);
        }
        if (count == cap) {
            int *grown = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!grown) { free(ids); return fg_fail(err, "out of memory"); }
            ids = grown;
        }
        ids[count++] = (int)v;
    }
    if (count == 0) {
        free(ids);
        return fg_fail(err, "%s line %d: empty prompt", path, line_no);
    }
    *out = ids;
    *n = count;
    return 0;
}

/* Reads one prompt a line from path: token ids (tok == NULL) or text. */
static int read_prompt_lines(prompt_set *p, const char *path, const fg_tokenizer *tok, int vocab,
                             char *err) {
    FILE *f = fopen(path, "r");
    if (!f) return fg_fail(err, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int line_no = 0, rc = 0;
    while (rc == 0 && (len = getline(&line, &cap, f)) >= 0) {
        line_no++;
        if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
        if (tok) {
            rc = add_text_prompt(p, tok, line, (size_t)len, err);
        } else {
            int *ids = NULL, n = 0;
            rc = parse_id_line(path, line_no, line, vocab, &ids, &n, err);
            if (rc == 0) rc = prompts_add(p, ids, n, err);
        }
    }
    free(line);
    fclose(f);
    if (rc == 0 && p->n == 0) rc = fg_fail(err, "%s: no prompts in the file", path);
    return rc;
}

/* FlexGen's benchmark prompts: BOS and prompt_len - 1 pseudo-random ids, one block's worth. */
static int synthetic_prompts(prompt_set *p, const cli_args *a, int vocab, char *err) {
    fg_rng rng;
    rng_seed(&rng, a->gen.seed ^ 0x5eedULL);
    int n = a->gen.gpu_batch_size * a->gen.num_gpu_batches;
    for (int i = 0; i < n; i++) {
        int *ids = malloc((size_t)a->prompt_len * sizeof *ids);
        if (!ids) return fg_fail(err, "out of memory");
        ids[0] = OPT_BOS_ID;
        for (int t = 1; t < a->prompt_len; t++) ids[t] = 3 + (int)(rng_next(&rng) % (uint64_t)(vocab - 3));
        if (prompts_add(p, ids, a->prompt_len, err)) return -1;
    }
    return 0;
}

static int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

/* The tokenizer from --vocab/--merges or the model directory; NULL (no error) when there is
 * none and none is needed. */
static int open_tokenizer(const cli_args *a, fg_tokenizer **tok, char *err) {
    char vocab[4096], merges[4096];
    *tok = NULL;
    if (!a->vocab != !a->merges) return fg_fail(err, "--vocab and --merges go together");
    if (a->vocab) {
        snprintf(vocab, sizeof vocab, "%s", a->vocab);
        snprintf(merges, sizeof merges, "%s", a->merges);
    } else {
        if (!is_dir(a->model)) return 0;
        snprintf(vocab, sizeof vocab, "%s/vocab.json", a->model);
        snprintf(merges, sizeof merges, "%s/merges.txt", a->model);
        if (!file_exists(vocab) || !file_exists(merges)) return 0;
    }
    *tok = tokenizer_load(vocab, merges, err);
    return *tok ? 0 : -1;
}

static int gather_prompts(const cli_args *a, const fg_tokenizer *tok, int vocab, prompt_set *p,
                          char *err) {
    if ((a->n_prompt_texts || a->prompt_file) && !tok)
        return fg_fail(err, "%s needs a tokenizer: give --vocab and --merges, or a model directory "
                         "holding vocab.json and merges.txt", a->prompt_file ? "--prompt-file" : "--prompt");
    if (a->prompt_ids) return read_prompt_lines(p, a->prompt_ids, NULL, vocab, err);
    if (a->prompt_file) return read_prompt_lines(p, a->prompt_file, tok, vocab, err);
    for (int i = 0; i < a->n_prompt_texts; i++)
        if (add_text_prompt(p, tok, a->prompts[i], strlen(a->prompts[i]), err)) return -1;
    if (p->n == 0) return synthetic_prompts(p, a, vocab, err);
    return 0;
}

/* ---- output ---- */

/* Writes to a temporary name and renames, so a failed run never leaves a partial file. */
static int dump_logits(const char *path, const float *logits, size_t n, char *err) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp-XXXXXX", path);
    int fd = mkstemp(tmp);
    if (fd < 0) return fg_fail(err, "--dump-logits %s: %s", path, strerror(errno));
    FILE *f = fdopen(fd, "wb");
    int ok = f && fwrite(logits, sizeof(float), n, f) == n;
    ok = (f ? fclose(f) == 0 : (close(fd), 0)) && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return fg_fail(err, "--dump-logits %s: write failed: %s", path, strerror(e));
    }
    return 0;
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if it is not one (Unicode's "maximal
 * subpart" rule, which Python's errors="replace" follows: *bad is how many bytes one U+FFFD
 * replaces). */
static int utf8_sequence(const unsigned char *s, size_t n, int *bad) {
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    int need = c >= 0xc2 && c <= 0xdf ? 1 : c >= 0xe0 && c <= 0xef ? 2 : c >= 0xf0 && c <= 0xf4 ? 3 : 0;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
    int k = 0;
    while (k < need && (size_t)k + 1 < n && s[k + 1] >= (k ? 0x80 : lo) && s[k + 1] <= (k ? 0xbf : hi)) k++;
    *bad = k + 1;
    return need && k == need ? need + 1 : 0;
}

/* Writes decoded bytes as text: invalid UTF-8 (a token can end mid-character) becomes U+FFFD,
 * as in HF's tokenizer.decode. */
static void print_utf8(const char *text, size_t len) {
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        int bad, ok = s[i] < 0x80 ? 1 : utf8_sequence(s + i, len - i, &bad);
        if (ok) fwrite(s + i, 1, (size_t)ok, stdout), i += (size_t)ok;
        else fputs("\xef\xbf\xbd", stdout), i += (size_t)bad;
    }
}

/* "[i] prompt + generated text" for each prompt; with --stop-at-eos the text ends before </s>. */
static void print_texts(const fg_tokenizer *tok, const prompt_set *p, const int *tokens,
                        const gen_options *opt) {
    for (int i = 0; i < p->n; i++) {
        int skip = p->ids[i][0] == OPT_BOS_ID, n = 0;
        const int *gen = tokens + (size_t)i * opt->gen_len;
        while (n < opt->gen_len && !(opt->stop_at_eos && gen[n] == OPT_EOS_ID)) n++;
        size_t prompt_len, text_len;
        char *prompt = tokenizer_decode(tok, p->ids[i] + skip, p->lens[i] - skip, &prompt_len);
        char *text = tokenizer_decode(tok, gen, n, &text_len);
        printf("[%d] ", i + 1);
        if (prompt) print_utf8(prompt, prompt_len);
        if (text) print_utf8(text, text_len);
        printf("\n");
        free(prompt);
        free(text);
    }
}

static double peak_rss_bytes(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss * 1024.0;
}

/* FlexGen's numbers (flexgen/utils.py): sizes for the padded prompt + gen_len, throughputs per
 * generated (decode) or processed (prefill) token. */
static void report(const cli_args *a, const opt_config *c, const prompt_set *p,
                   const gen_timing *t, int max_prompt) {
    const double GB = 1 << 30;
    int seq = max_prompt + a->gen.gen_len;
    double model = opt_model_bytes(c), cache = opt_cache_bytes(c, p->n, seq);
    double hidden = opt_hidden_bytes(c, p->n, seq), total = t->prefill_latency + t->decode_latency;
    double prefill_tp = t->prefill_tokens / fmax(t->prefill_latency, 1e-10);
    double decode_tp = t->decode_tokens / fmax(t->decode_latency, 1e-10);
    double total_tp = (double)p->n * a->gen.gen_len / fmax(total, 1e-10);
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", c->name);
        cJSON_AddNumberToObject(o, "num_prompts", p->n);
        cJSON_AddNumberToObject(o, "prompt_len", max_prompt);
        cJSON_AddNumberToObject(o, "gen_len", a->gen.gen_len);
        cJSON_AddNumberToObject(o, "gpu_batch_size", a->gen.gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", a->gen.num_gpu_batches);
        cJSON_AddNumberToObject(o, "model_size_bytes", model);
        cJSON_AddNumberToObject(o, "cache_size_bytes", cache);
        cJSON_AddNumberToObject(o, "hidden_size_bytes", hidden);
        cJSON_AddNumberToObject(o, "peak_rss_bytes", peak_rss_bytes());
        cJSON_AddNumberToObject(o, "prefill_latency", t->prefill_latency);
        cJSON_AddNumberToObject(o, "prefill_throughput", prefill_tp);
        cJSON_AddNumberToObject(o, "decode_latency", t->decode_latency);
        cJSON_AddNumberToObject(o, "decode_throughput", decode_tp);
        cJSON_AddNumberToObject(o, "total_latency", total);
        cJSON_AddNumberToObject(o, "total_throughput", total_tp);
        char *s = cJSON_PrintUnformatted(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
        return;
    }
    printf("model size: %.3f GB\tcache size: %.3f GB\thidden size (p): %.3f GB\n", model / GB,
           cache / GB, hidden / GB);
    printf("peak gpu mem: %.3f GB\tprojected: False\n", peak_rss_bytes() / GB);
    printf("prefill latency: %.3f s\tprefill throughput: %.3f token/s\n", t->prefill_latency, prefill_tp);
    printf("decode latency: %.3f s\tdecode throughput: %.3f token/s\n", t->decode_latency, decode_tp);
    printf("total latency: %.3f s\ttotal throughput: %.3f token/s\n", total, total_tp);
}

/* ---- the two commands ---- */

static int load_model(const cli_args *a, opt_weights *w, char *err) {
    if (is_dir(a->model)) {
        if (a->gen.verbose) fprintf(stderr, "loading %s\n", a->model);
        return opt_weights_load(a->model, w, err);
    }
    opt_config cfg;
    if (opt_config_by_name(a->model, &cfg, err)) return -1;
    if (a->gen.verbose) fprintf(stderr, "generating dummy weights for %s\n", cfg.name);
    return opt_weights_dummy(&cfg, a->gen.seed, w, err);
}

static int model_config(const cli_args *a, opt_config *cfg, char *err) {
    if (is_dir(a->model)) {
        char path[4096];
        snprintf(path, sizeof path, "%s/config.json", a->model);
        return opt_config_from_json(path, cfg, err);
    }
    return opt_config_by_name(a->model, cfg, err);
}

static int run(const cli_args *a, char *err) {
    opt_config cfg;
    fg_tokenizer *tok = NULL;
    prompt_set p = {0};
    opt_weights w = {0};
    int *tokens = NULL, rc = -1, max_prompt = 0;
    float *logits = NULL;
    gen_timing t;
    if (model_config(a, &cfg, err) || open_tokenizer(a, &tok, err) ||
        gather_prompts(a, tok, cfg.vocab, &p, err) ||
        check_prompts(&cfg, p.n, p.ids, p.lens, a->gen.gen_len, err))
        goto out;
    for (int i = 0; i < p.n; i++) max_prompt = p.lens[i] > max_prompt ? p.lens[i] : max_prompt;
    if (check_plan(&cfg, &a->gen, max_prompt, err)) goto out;
    tokens = malloc((size_t)p.n * a->gen.gen_len * sizeof *tokens);
    if (a->dump_logits)
        logits = malloc((size_t)p.n * a->gen.gen_len * cfg.vocab * sizeof *logits);
    if (!tokens || (a->dump_logits && !logits)) { fg_fail(err, "out of memory"); goto out; }
    if (load_model(a, &w, err) || generate(&w, &a->gen, p.n, p.ids, p.lens, tokens, logits, &t, err))
        goto out;
    if (a->dump_logits &&
        dump_logits(a->dump_logits, logits, (size_t)p.n * a->gen.gen_len * cfg.vocab, err))
        goto out;
    if (tok && !a->json) print_texts(tok, &p, tokens, &a->gen);
    report(a, &w.cfg, &p, &t, max_prompt);
    rc = 0;
out:
    opt_weights_free(&w);
    prompts_free(&p);
    if (tok) tokenizer_free(tok);
    free(tokens);
    free(logits);
    return rc;
}

static int tokenize_command(int argc, char **argv, char *err) {
    const char *vocab = NULL, *merges = NULL;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        if (i + 1 >= argc) return fg_fail(err, "%s: missing value", argv[i]);
        if (!strcmp(argv[i], "--vocab")) vocab = argv[++i];
        else if (!strcmp(argv[i], "--merges")) merges = argv[++i];
        else return fg_fail(err, "%s: unknown option for tokenize", argv[i]);
    }
    if (!vocab || !merges) return fg_fail(err, "tokenize: --vocab and --merges are required");
    fg_tokenizer *tok = tokenizer_load(vocab, merges, err);
    if (!tok) return -1;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = 0;
    while (rc == 0 && (len = getline(&line, &cap, stdin)) >= 0) {
        if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
        int *ids, n;
        rc = tokenizer_encode(tok, line, (size_t)len, &ids, &n, err);
        for (int i = 0; rc == 0 && i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        if (rc == 0) { printf("\n"); free(ids); }
    }
    free(line);
    tokenizer_free(tok);
    return rc;
}

int flexgen_main(int argc, char **argv) {
    char err[FG_ERR_LEN] = "";
    int rc;
    if (argc > 1 && !strcmp(argv[1], "tokenize")) {
        rc = tokenize_command(argc, argv, err);
    } else {
        cli_args a;
        rc = parse_args(argc, argv, &a, err);
        if (rc == 1) usage(stdout);
        else if (rc == 0) rc = run(&a, err);
        free(a.prompts);
        if (rc == 1) return 0;
    }
    if (rc) {
        fprintf(stderr, "flexgen: %s\n", err);
        return 2;
    }
    return fflush(stdout) == 0 ? 0 : 1;
}

#ifndef FLEXGEN_NO_MAIN
int main(int argc, char **argv) { return flexgen_main(argc, argv); }
#endif
