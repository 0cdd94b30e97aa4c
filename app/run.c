/* app/run.c: a run of `flexgen`: in one process, or under mpirun as one stage of a pipeline
 * (§4.4), whose flags must agree with rank 0's, which reads the prompts, writes the outputs and
 * prints the report. The steps: the prompts (and --policy auto's plan), the stage's runtime and
 * weights, --warmup, generate() (or a batch job's rounds, job_run.c), the report.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The ids that end a sequence: the config's (generation_config.json's eos_token_id, else a LLaMA
 * config.json's), else OPT's </s> (a LLaMA config without one: none, -1). */
static void set_eos(gen_options *g, const model_config *cfg) {
    g->n_eos = 1;
    g->eos_ids[0] = cfg->family == FAMILY_OPT ? OPT_EOS_ID : -1;
    if (cfg->n_eos > 0) {
        g->n_eos = cfg->n_eos;
        memcpy(g->eos_ids, cfg->eos_ids, sizeof g->eos_ids);
    }
}

/* Rank 0's prompts on every stage (the first needs the ids, every stage their lengths). */
static int share_prompts(fg_pipe *pipe, prompt_set *p, char *err) {
    int n = p->n, total = 0, rc = 0;
    fg_pipe_bcast(pipe, &n, sizeof n);
    int *lens = fg_pipe_rank(pipe) ? calloc((size_t)n, sizeof *lens) : p->lens;
    if (!lens) return fg_fail(err, "out of memory");
    fg_pipe_bcast(pipe, lens, (size_t)n * sizeof *lens);
    for (int i = 0; i < n; i++) total += lens[i];
    int *flat = malloc((size_t)total * sizeof *flat);
    if (!flat) return fg_fail(err, "out of memory"); /* every rank runs out alike, or aborts */
    for (int i = 0, at = 0; i < p->n; at += lens[i++])
        memcpy(flat + at, p->ids[i], (size_t)lens[i] * sizeof *flat);
    fg_pipe_bcast(pipe, flat, (size_t)total * sizeof *flat);
    for (int i = 0, at = 0; fg_pipe_rank(pipe) && i < n && rc == 0; at += lens[i++]) {
        int *ids = malloc((size_t)lens[i] * sizeof *ids);
        if (!ids) rc = fg_fail(err, "out of memory");
        else {
            memcpy(ids, flat + at, (size_t)lens[i] * sizeof *ids);
            rc = prompts_add(p, ids, lens[i], err);
        }
    }
    if (rc == 0 && n)
        fg_pipe_bcast(pipe, p->index, (size_t)n * sizeof *p->index); /* sampling's seeds */
    if (fg_pipe_rank(pipe)) free(lens);
    free(flat);
    return rc;
}

/* Every stage's v[0..n), each the least over the stages (rank 0 takes them and says); returns
 * whether this stage's own differed. */
static int agree_on_least(fg_pipe *pipe, int *v, int n) {
    int stages = fg_pipe_size(pipe), mine[n], all[stages * n], differs = 0;
    memcpy(mine, v, (size_t)n * sizeof *v);
    fg_pipe_gather(pipe, v, (size_t)n * sizeof *v, all);
    for (int r = 1; fg_pipe_rank(pipe) == 0 && r < stages; r++)
        for (int d = 0; d < n; d++) v[d] = all[r * n + d] < v[d] ? all[r * n + d] : v[d];
    fg_pipe_bcast(pipe, v, (size_t)n * sizeof *v);
    for (int d = 0; d < n; d++) differs |= v[d] != mine[d];
    return differs;
}

/* --policy auto: each stage searches for its share of the layers (§4.4); the stages then take
 * one schedule (the diagonal where every stage chose it, else zig-zag, each stage searching again
 * for it), then the smallest GPU batch and number of GPU batches any of them chose (each fits
 * where the larger did) and place their tensors again for that block shape. shape: a block shape
 * to keep (a resumed job's), or {0, 0}. */
static int plan_stages(cli_args *a, fg_pipe *pipe, const model_config *cfg, int n_prompts,
                       const int lengths[2], const int shape_kept[2], char *err) {
    fg_search_result res;
    fg_hardware hw;
    int rc = 0, n = fg_pipe_size(pipe);
    for (int r = 0; r < n; r++) { /* a machine without a hardware file measures itself once, a stage
                                     at a time: stages sharing a machine must not load each other */
        if (r == fg_pipe_rank(pipe)) rc = load_hardware(a, &hw, err);
        if (fg_pipe_agree(pipe, rc, err)) return -1;
    }
    rc = search_policy(a, &hw, cfg, shape_kept[0] ? 0 : n_prompts, lengths, shape_kept[0],
                       shape_kept[1], &res, err);
    fg_search_result fresh; /* where a new job would fit, the kept shape is what is refused */
    char fresh_err[FG_ERR_LEN];
    if (rc && shape_kept[0] &&
        search_policy(a, &hw, cfg, n_prompts, lengths, 0, 0, &fresh, fresh_err) == 0)
        fg_fail(err,
                "--resume: the job of %s keeps the block shape it began with (--gpu-batch-size %d, "
                "--num-gpu-batches %d), which these capacities do not hold (a new job would take "
                "--gpu-batch-size %d --num-gpu-batches %d); resume with the capacities it began "
                "with, or run it again into a new output",
                a->output, shape_kept[0], shape_kept[1], fresh.policy.gpu_batch_size,
                fresh.policy.num_gpu_batches);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    int schedule = res.policy.schedule; /* zig-zag unless every stage chose the diagonal */
    if (agree_on_least(pipe, &schedule, 1)) {
        a->policy.schedule = schedule;
        a->schedule_given = 1;
        rc = search_policy(a, &hw, cfg, shape_kept[0] ? 0 : n_prompts, lengths, shape_kept[0],
                           shape_kept[1], &res, err);
    }
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    a->policy.schedule = res.policy.schedule; /* kept while the shape is agreed */
    a->schedule_given = 1;
    int shape[2] = {res.policy.gpu_batch_size, res.policy.num_gpu_batches};
    if (agree_on_least(pipe, shape, 2))
        rc = search_policy(a, &hw, cfg, n_prompts, lengths, shape[0], shape[1], &res, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    a->policy = res.policy;
    if (a->gen.verbose) {
        fprintf(stderr, "policy auto: ");
        print_policy_flags(stderr, &a->policy);
        fprintf(stderr, " (predicted %.3f token/s, searched in %.2f s)\n", res.throughput,
                res.seconds);
    }
    return 0;
}

/* The last stage's logits (--dump-logits) to rank 0, in pieces that fit an MPI message. */
static void gather_logits(fg_pipe *pipe, float *logits, size_t count) {
    int last = fg_pipe_size(pipe) - 1, rank = fg_pipe_rank(pipe);
    if (last == 0 || (rank != 0 && rank != last)) return;
    size_t piece = (size_t)1 << 28; /* floats: 1 GiB */
    for (size_t at = 0; at < count; at += piece) {
        size_t n = count - at < piece ? count - at : piece;
        int msg = rank == 0
                      ? fg_pipe_recv(pipe, last, FG_TAG_LOGITS, logits + at, n * sizeof *logits)
                      : fg_pipe_send(pipe, 0, FG_TAG_LOGITS, logits + at, n * sizeof *logits);
        fg_pipe_release(pipe, msg);
    }
}

/* Rank 0's view of the whole job: peaks and bytes moved summed over the stages, the busiest
 * stage's compute and disk times. */
static void combine_stages(const stage_report *all, int n, fg_stats *st, gen_timing *t) {
    *st = all[0].st;
    for (int r = 1; r < n; r++) {
        for (int i = 0; i < N_TIERS; i++) {
            st->peak[i] += all[r].st.peak[i];
            st->capacity[i] += all[r].st.capacity[i];
        }
        for (int i = 0; i < N_LINKS; i++) st->link_bytes[i] += all[r].st.link_bytes[i];
    }
    for (int r = 0; r < n; r++) {
        t->compute_seconds = fmax(t->compute_seconds, all[r].compute);
        t->disk_read_seconds = fmax(t->disk_read_seconds, all[r].disk_read);
    }
}

/* The flags of the job, which every stage must share, against rank 0's. Rank 0 alone reads the
 * prompts and writes what is asked for (--dump-logits, --trace, --json, --output), so another
 * stage may leave them out (mpirun's MPMD form); prompts it names must be rank 0's, and an output
 * (or --warmup) given to it but not to rank 0 is refused, not dropped. */
typedef struct {
    char model[256];
    uint64_t prompts; /* the prompts' source: the flag that names them and its values, hashed */
    int gen_len, stop_at_eos, prompt_len, gbs, ngb, auto_policy, dump, trace, output, json,
        schedule, schedule_given;
    int compress_weight, compress_cache, int8, bf16; /* the numbers the job's records hold */
    int warmup;
    float temperature, top_p, sparsity;
    uint64_t seed;
} job_flags;

/* The prompts' source as the command line names it: --prompt-file's path, --prompt-ids', or the
 * --prompt texts; none (synthetic prompts of --prompt-len). */
static uint64_t prompts_source(const cli_args *a) {
    const char *flag = a->prompt_file ? "--prompt-file" : a->prompt_ids ? "--prompt-ids" : "";
    const char *path = a->prompt_file ? a->prompt_file : a->prompt_ids ? a->prompt_ids : "";
    uint64_t h = fg_fnv64_more(FG_FNV64_START, flag, strlen(flag) + 1); /* each with its NUL */
    h = fg_fnv64_more(h, path, strlen(path) + 1);
    for (int i = 0; i < a->n_prompt_texts; i++)
        h = fg_fnv64_more(h, a->prompts[i], strlen(a->prompts[i]) + 1);
    return h;
}

/* Each stage's `name` gathered on rank 0 into out: "" where every stage's is rank 0's, else one a
 * stage, comma-separated. */
static void stage_names(fg_pipe *pipe, const char *name, char *out, size_t n) {
    char mine[112];
    snprintf(mine, sizeof mine, "%s,", name);
    char *all = fg_pipe_gather_text(pipe, mine); /* rank 0's; NULL on the others */
    size_t len = strlen(mine);
    out[0] = 0;
    for (size_t at = 0; all && all[at]; at += len)
        if (strncmp(all + at, mine, len)) { /* a stage's differs from rank 0's */
            all[strlen(all) - 1] = 0;
            snprintf(out, n, "%s", all);
            break;
        }
    free(all);
}

/* The libraries whose kernels set the bits of a CPU product, which a stage may run at another
 * level than rank 0 (another machine, or OPENBLAS_CORETYPE and ONEDNN_MAX_CPU_ISA of its own):
 * rank 0 takes every stage's into the job's identity and the report where they differ. */
static void share_libraries(cli_args *a, fg_pipe *pipe) {
    fg_blas_info blas;
    fg_blas_info_get(&blas);
    stage_names(pipe, blas.core, a->stage_cores, sizeof a->stage_cores);
    stage_names(pipe, a->policy.bf16_prefill ? gemm_library_isa() : "", a->stage_prefill_libraries,
                sizeof a->stage_prefill_libraries);
}

static int share_job(cli_args *a, fg_pipe *pipe, char *err) {
    job_flags mine = {.prompts = prompts_source(a),
                      .gen_len = a->gen.gen_len,
                      .stop_at_eos = a->gen.stop_at_eos,
                      .prompt_len = a->prompt_len,
                      .gbs = a->policy.gpu_batch_size,
                      .ngb = a->policy.num_gpu_batches,
                      .auto_policy = a->auto_policy,
                      .schedule = a->policy.schedule,
                      .schedule_given = a->schedule_given,
                      .dump = a->dump_logits != NULL,
                      .trace = a->trace != NULL,
                      .output = a->output != NULL,
                      .json = a->json,
                      .compress_weight = a->policy.compress_weight,
                      .compress_cache = a->policy.compress_cache,
                      .int8 = a->policy.int8_activations,
                      .bf16 = a->policy.bf16_prefill,
                      .sparsity = a->policy.attn_sparsity,
                      .warmup = a->warmup,
                      .temperature = a->gen.temperature,
                      .top_p = a->gen.top_p,
                      .seed = a->gen.seed};
    snprintf(mine.model, sizeof mine.model, "%s", a->model);
    job_flags job = mine;
    fg_pipe_bcast(pipe, &job, sizeof job);
    share_libraries(a, pipe); /* every stage takes part, before any refuses */
    cli_args none = {0};      /* the source of a stage that names no prompts: rank 0's are taken */
    uint64_t no_prompts = prompts_source(&none);
    if (fg_pipe_rank(pipe)) { /* rank 0 writes them; the others send it what they need */
        a->dump_logits = job.dump ? "(rank 0's)" : NULL;
        a->output = job.output ? "(rank 0's)" : NULL; /* the other stages run its rounds too */
        a->trace = job.trace ? "(rank 0's)" : NULL;
        a->policy.trace = job.trace;
        a->warmup = job.warmup; /* every stage runs it, or none */
    }
    const char *unwritten = mine.dump && !job.dump       ? "--dump-logits"
                            : mine.trace && !job.trace   ? "--trace"
                            : mine.output && !job.output ? "--output"
                            : mine.json && !job.json     ? "--json"
                            : mine.warmup && !job.warmup ? "--warmup"
                                                         : NULL;
    if (unwritten)
        return fg_fail(err,
                       "%s is given to this stage but not to rank 0, which writes the outputs "
                       "(and leads --warmup); give it to rank 0",
                       unwritten);
    const char *differs = strcmp(job.model, mine.model)         ? "--model"
                          : job.gen_len != mine.gen_len         ? "--gen-len"
                          : job.stop_at_eos != mine.stop_at_eos ? "--stop-at-eos"
                          : job.prompt_len != mine.prompt_len   ? "--prompt-len"
                          : mine.prompts != no_prompts && job.prompts != mine.prompts
                              ? "--prompt-file, --prompt-ids or --prompt"
                          : job.seed != mine.seed                       ? "--seed"
                          : job.temperature != mine.temperature         ? "--temperature"
                          : job.top_p != mine.top_p                     ? "--top-p"
                          : job.compress_weight != mine.compress_weight ? "--compress-weight"
                          : job.compress_cache != mine.compress_cache   ? "--compress-cache"
                          : job.int8 != mine.int8                       ? "--int8-activations"
                          : job.bf16 != mine.bf16                       ? "--bf16-prefill"
                          : job.sparsity != mine.sparsity               ? "--attn-sparsity"
                          : job.auto_policy != mine.auto_policy         ? "--policy"
                          : job.schedule != mine.schedule ||
                                  (job.auto_policy && job.schedule_given != mine.schedule_given)
                              ? "--schedule"
                          : !job.auto_policy && job.gbs != mine.gbs ? "--gpu-batch-size"
                          : !job.auto_policy && job.ngb != mine.ngb ? "--num-gpu-batches"
                                                                    : NULL;
    if (differs)
        return fg_fail(err, "%s differs from rank 0's: the stages of a pipeline share it", differs);
    return 0;
}

/* What each stage computes with, once it has resolved its --device and read its --model's
 * configuration (every stage reads its own), against rank 0's: the device, whose activations
 * cross between stages (fp32 on the CPU, fp16 on cpu-fp16 and CUDA; `auto` may resolve to either
 * on two machines), and the model's shape (one --model path on two machines may hold two
 * checkpoints). A stage that differs is refused naming what differs; the weights themselves are
 * not compared. */
static int share_model(const cli_args *a, fg_pipe *pipe, const model_config *cfg, char *err) {
    if (!pipe) return 0;
    static const char *const what[] = {"device",     "model type", "layers",    "hidden size",
                                       "heads",      "K/V heads",  "head size", "FFN size",
                                       "vocabulary", "word size",  "positions", "pre-LN"};
    int mine[] = {a->policy.device, cfg->family,     cfg->n_layers,     cfg->hidden,
                  cfg->n_heads,     cfg->n_kv_heads, cfg_head_dim(cfg), cfg->ffn,
                  cfg->vocab,       cfg->word_dim,   cfg->max_pos,      cfg->pre_ln};
    int first[sizeof mine / sizeof *mine];
    memcpy(first, mine, sizeof mine);
    fg_pipe_bcast(pipe, first, sizeof first);
    int rc = 0;
    if (first[0] != mine[0])
        rc = fg_fail(err,
                     "--device: this stage runs on %s, rank 0 on %s: the stages of a pipeline pass "
                     "activations in one device's format",
                     fg_device_name((fg_device)mine[0]), fg_device_name((fg_device)first[0]));
    for (size_t i = 1; rc == 0 && i < sizeof mine / sizeof *mine; i++)
        if (first[i] != mine[i])
            rc = fg_fail(err,
                         "--model %s: its %s is %d, rank 0's %d: the stages of a pipeline must "
                         "read the same model",
                         a->model, what[i], mine[i], first[i]);
    return fg_pipe_agree(pipe, rc, err);
}

/* The prompts of the job on every stage: read (and tokenized) by rank 0, or synthetic ones to
 * fill the block that --policy auto chooses for each stage. */
static int job_prompts(cli_args *a, fg_pipe *pipe, const model_config *cfg, fg_tokenizer **tok,
                       prompt_set *p, job_output *out, char *err) {
    int rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe), rc = 0;
    if (rank == 0 && (open_run_tokenizer(a, tok, err) || gather_prompts(a, *tok, cfg, p, err)))
        rc = -1;
    if (rc == 0 && rank == 0 && a->output) rc = open_job_output(a, p, out, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    int given[7] = {p->n,
                    a->output && p->n == 0,
                    longest_prompt(p),
                    mean_prompt(a, p), /* n 0: synthetic */
                    out->recorded ? a->policy.gpu_batch_size : 0,
                    out->recorded ? a->policy.num_gpu_batches : 0,
                    out->recorded ? (int)a->policy.schedule : -1};
    fg_pipe_bcast(pipe, given, sizeof given); /* prompts, once the block is known, or a finished
                                                 job */
    if ((a->job_finished = given[1])) return 0;
    if (given[6] >= 0) { /* a resumed job's */
        a->policy.schedule = (fg_schedule)given[6];
        a->schedule_given = 1;
    }
    if (a->auto_policy && plan_stages(a, pipe, cfg, given[0] ? (given[0] + stages - 1) / stages : 0,
                                      given + 2, given + 4, err))
        return -1;
    if (rank == 0 && a->auto_policy)
        warn_searched(a, "--policy auto chose the block and the placement (--policy manual takes "
                         "them as given)");
    if (rank == 0 && a->output && a->auto_policy)
        rc = begin_job(a, out, err); /* the shape it chose */
    if (rc == 0 && rank == 0 && p->n == 0) rc = synthetic_prompts(p, a, stages, cfg->vocab, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    return share_prompts(pipe, p, err);
}

/* This stage's runtime and model, its plan checked, its weights in their homes. */
static int open_stage(cli_args *a, fg_pipe *pipe, const prompt_set *p, fg_runtime **rt,
                      fg_model **m, char *err) {
    int rc = open_runtime(&a->policy, rt, err);
    if (rc == 0) {
        fg_pipeline_attach(*rt, pipe);
        rc = fg_model_open(*rt, a->model, a->gen.seed, m, err);
    }
    if (rc == 0)
        rc = check_prompts(fg_model_config(*m), p->n, p->ids, p->lens, a->gen.gen_len, err);
    if (rc == 0)
        rc = fg_check_plan(*m, p->n, a->output ? NULL : p->lens, longest_prompt(p), a->gen.gen_len,
                           err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    if (a->gen.verbose) fprintf(stderr, "%s: placing weights\n", fg_model_config(*m)->name);
    for (int r = 0; r < fg_pipe_size(pipe); r++) { /* a stage at a time: stages that share a machine
                                                      share its dummy-weight file, the first writes
                                                      it */
        if (r == fg_pipe_rank(pipe)) rc = fg_model_load(*m, err);
        if (fg_pipe_agree(pipe, rc, err)) return -1;
    }
    return 0;
}

/* After the run: every stage's numbers and trace to rank 0, which writes the outputs and the
 * report. */
static int finish_job(const cli_args *a, fg_pipe *pipe, const fg_runtime *rt,
                      const model_config *cfg, const prompt_set *p, const fg_tokenizer *tok,
                      const int *tokens, float *logits, gen_timing *t, stage_report *all,
                      char *err) {
    int rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe);
    size_t n_logits = (size_t)p->n * a->gen.gen_len * cfg->vocab;
    gather_logits(pipe, logits, logits ? n_logits : 0);
    stage_report mine = {.sent = fg_pipe_bytes_sent(pipe),
                         .compute = t->compute_seconds,
                         .bubble = t->bubble_seconds,
                         .disk_read = t->disk_read_seconds,
                         .peak_rss = peak_rss_bytes()};
    fg_runtime_stats(rt, &mine.st);
    fg_stage_layers(cfg, rank, stages, &mine.first_layer, &mine.end_layer);
    mine.percent = a->policy.percent;
    fg_pipe_gather(pipe, &mine, sizeof mine, all);
    char *events = a->trace ? fg_trace_events(&rt->trace, rank, stages) : NULL;
    char *trace = a->trace ? fg_pipe_gather_text(pipe, events ? events : "") : NULL;
    free(events);
    int rc = 0;
    if (rank == 0) {
        rc = write_run_files(a, logits, n_logits, trace, err);
        if (rc == 0 && tok && !a->json && !a->output) print_texts(tok, p, tokens, &a->gen);
        fg_stats st;
        t->compute_seconds = t->disk_read_seconds = 0;
        combine_stages(all, stages, &st, t);
        if (rc == 0)
            report_run(a, cfg, p, t, &st, longest_prompt(p), fg_runtime_backend(rt)->name, all,
                       stages);
    }
    free(trace);
    return rc;
}

/* --warmup: a short generate before the timed one, as FlexGen's benchmark runs one, so that the
 * timed figures leave out first-time costs (a GPU's context, cuBLAS's handle, kernels loaded on
 * first use). A block of pseudo-random prompts of up to 32 tokens (no longer than the job's), 2
 * tokens generated so that a decode step runs too; its tokens are dropped (no record, no logits),
 * its trace too, and its latency is the report's cold run. */
static int warm_up(cli_args *a, fg_runtime *rt, fg_model *m, const prompt_set *p, int stages,
                   char *err) {
    const model_config *c = fg_model_config(m);
    int n = a->policy.gpu_batch_size * a->policy.num_gpu_batches * stages, len = longest_prompt(p);
    if (n > p->n) n = p->n;
    if (n < 1) return 0; /* no prompt, nothing to warm up */
    if (len > 32) len = 32;
    int **ids = calloc((size_t)n, sizeof *ids), *lens = calloc((size_t)n, sizeof *lens);
    int gen_len = a->gen.gen_len < 2 ? a->gen.gen_len : 2;
    int *tokens = malloc((size_t)n * gen_len * sizeof *tokens), rc = 0;
    fg_rng rng;
    rng_seed(&rng, a->gen.seed ^ 0x3a4eULL);
    for (int i = 0; i < n && ids && lens; i++) {
        lens[i] = len;
        ids[i] = malloc((size_t)len * sizeof *ids[i]);
        if (!ids[i]) break;
        ids[i][0] = OPT_BOS_ID; /* as synthetic_prompts' */
        for (int t = 1; t < len; t++)
            ids[i][t] = 3 + (int)(rng_next(&rng) % (uint64_t)(c->vocab - 3));
    }
    for (int i = 0; i < n && rc == 0; i++)
        rc = !ids || !lens || !ids[i] ? fg_fail(err, "out of memory") : 0;
    if (rc == 0 && !tokens) rc = fg_fail(err, "out of memory");
    gen_options opt = {.gen_len = gen_len,
                       .temperature = a->gen.temperature,
                       .top_p = a->gen.top_p,
                       .seed = a->gen.seed,
                       .n_eos = a->gen.n_eos};
    memcpy(opt.eos_ids, a->gen.eos_ids, sizeof opt.eos_ids);
    gen_timing t;
    if (rc == 0 && a->gen.verbose)
        fprintf(stderr, "warmup: %d prompts of %d tokens, %d generated\n", n, len, gen_len);
    if (rc == 0) rc = generate(m, &opt, n, ids, lens, tokens, NULL, &t, err);
    if (rc == 0) { /* the whole cold run: its decode step pays first-time costs too (a kernel first
                      used there) */
        a->cold_prefill = t.prefill_latency;
        a->cold_decode = t.decode_latency;
        a->cold_seconds = t.prefill_latency + t.decode_latency;
    }
    fg_runtime_trace_restart(rt);
    for (int i = 0; ids && i < n; i++) free(ids[i]);
    free(ids);
    free(lens);
    free(tokens);
    return rc;
}

/* A run: one process, or (under mpirun) one pipeline stage of the job (§4.4). */
int run_generation(cli_args *a, fg_pipe *pipe, char *err) {
    fg_tokenizer *tok = NULL;
    prompt_set p = {0};
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    int *tokens = NULL, rc = 0, rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe);
    float *logits = NULL;
    stage_report *all = NULL;
    gen_timing t;
    model_config cfg;
    job_output job = {.fd = -1};
    a->policy.stage = rank;
    a->policy.n_stages = stages;
    if (rank) a->gen.verbose = a->policy.verbose = 0; /* rank 0 speaks for the job */
    if (a->evaluate) rc = fg_fail(err, "--evaluate: a flag of `flexgen policy`");
    if (a->ppl_flag) rc = fg_fail(err, "%s: a flag of `flexgen perplexity`", a->ppl_flag);
    if (rc == 0 && a->max_latency > 0 && !a->auto_policy)
        rc = fg_fail(err,
                     "--max-latency: bounds the block --policy auto chooses; give --policy auto");
    if (rc == 0 && a->hw && !a->auto_policy)
        rc = fg_fail(err,
                     "--hw: the hardware file --policy auto's search reads; give --policy auto");
    if (rc == 0 && pipe) rc = share_job(a, pipe, err);
    if (rc == 0 && a->gen.refill && stages > 1)
        rc = fg_fail(
            err,
            "--refill: refills one process's block; the stages of a pipeline keep theirs in step");
    if (rc == 0 && rank == 0 && a->dump_logits)
        rc = fg_output_check("--dump-logits", a->dump_logits, err);
    if (rc == 0 && rank == 0 && a->trace) rc = fg_output_check("--trace", a->trace, err);
    if (rc == 0) rc = resolve_device(&a->policy.device, a->gen.verbose, err);
    if (rc == 0) {
        rc = resolve_model_config(a->model, &cfg, err);
        if (rc == 0 && rank == 0) warn_special_ids(a->model, &cfg);
        if (rc == 0) rc = check_lengths(a, &cfg, err);
        if (rc == 0) set_eos(&a->gen, &cfg);
    }
    if (fg_pipe_agree(pipe, rc, err) || share_model(a, pipe, &cfg, err) ||
        job_prompts(a, pipe, &cfg, &tok, &p, &job, err)) {
        rc = -1;
        goto out;
    }
    if (a->job_finished) { /* --resume of a job whose every prompt has its record */
        if (fg_pipe_agree(pipe, rank == 0 ? job_output_cut_partial(&job, err) : 0, err)) {
            rc = -1;
            goto out;
        }
        if (rank == 0 && a->json) report_finished_job(a->output, job.n_done);
        else if (rank == 0 && !a->quiet)
            fprintf(stderr, "job: every prompt has its record in %s\n", a->output);
        if (rank == 0 && a->trace)
            fprintf(stderr, "flexgen: --trace %s: not written: the job had nothing left to run\n",
                    a->trace);
        goto out;
    }
    if (open_stage(a, pipe, &p, &rt, &m, err)) {
        rc = -1;
        goto out;
    }
    int keeps_logits = a->dump_logits && (rank == 0 || rank == stages - 1);
    tokens = malloc((size_t)p.n * a->gen.gen_len * sizeof *tokens);
    if (keeps_logits) logits = malloc((size_t)p.n * a->gen.gen_len * cfg.vocab * sizeof *logits);
    all = calloc((size_t)stages, sizeof *all);
    rc = !tokens || (keeps_logits && !logits) || !all ? fg_fail(err, "out of memory") : 0;
    if (rc == 0 && a->warmup) rc = warm_up(a, rt, m, &p, stages, err);
    if (fg_pipe_agree(pipe, rc, err) ||
        (a->output ? run_rounds(a, pipe, m, &p, tok, &job, tokens, &t, err)
                   : generate(m, &a->gen, p.n, p.ids, p.lens, tokens, logits, &t, err))) {
        rc = -1;
        goto out;
    }
    rc = finish_job(a, pipe, rt, fg_model_config(m), &p, tok, tokens, logits, &t, all, err);
out:
    fg_model_close(m);
    fg_runtime_close(rt);
    prompts_free(&p);
    if (tok) tokenizer_free(tok);
    free(tokens);
    free(logits);
    free(all);
    job_output_close(&job);
    return rc;
}
