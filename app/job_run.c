/* app/job_run.c: a batch job's run (--output): its output opened, locked and (--resume) the
 * prompts that have records dropped; the prompts in windows of rounds, longest first; each
 * window's records appended in file order (jobs.c writes them), and a progress line.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The prompts as a job runs them: each one's id and tokens, hashed (FNV-1a). A prompt file read
 * from another path, or the same prompts given another way, are the same job. */
static uint64_t prompts_hash(const prompt_set *p) {
    uint64_t h = FG_FNV64_START;
    for (int i = 0; i < p->n; i++) {
        h = fg_fnv64_more(h, p->record_ids[i], strlen(p->record_ids[i]) + 1);
        h = fg_fnv64_more(h, &p->lens[i], sizeof p->lens[i]);
        h = fg_fnv64_more(h, p->ids[i], (size_t)p->lens[i] * sizeof *p->ids[i]);
    }
    return h;
}

/* The job's first line for its flags and (once planned) block shape; an existing output must hold
 * the same (rank 0). */
int begin_job(const cli_args *a, job_output *out, char *err) {
    /* the CPU devices' prefill runs on OpenBLAS's sgemm, and --bf16-prefill's on oneDNN's kernels
     * (those its instruction set allows) or sgemm, whose fp32 sums each go in their own order;
     * int8's integer sums are exact on any kernel */
    fg_blas_info blas;
    fg_blas_info_get(&blas);
    job_identity id = {.model = is_dir(a->model) ? NULL : a->model,
                       .device = fg_device_name(a->policy.device),
                       .blas_core = a->policy.device == FG_DEVICE_CUDA ? NULL
                                    : a->stage_cores[0]                ? a->stage_cores
                                                                       : blas.core,
                       .prefill_library = !a->policy.bf16_prefill ? NULL
                                          : a->stage_prefill_libraries[0]
                                              ? a->stage_prefill_libraries
                                              : gemm_library_isa(),
                       .prompts_hash = a->prompts_hash,
                       .n_prompts = a->n_job_prompts};
    if (!id.model && job_checkpoint_hash(a->model, &id.checkpoint_hash, err)) return -1;
    char *header = job_header(&id, &a->gen, &a->policy);
    if (!header) return fg_fail(err, "out of memory");
    return job_output_begin(out, header, err);
}

/* --output (rank 0): locked for the job, and with --resume the prompts it holds records of are
 * dropped (their place in the file stays in p->index). Two prompts with one id are refused, and
 * so is an output with records of prompts the job does not have. --policy auto keeps the block
 * shape and the schedule an existing output was made with (a --schedule given must be its). */
int open_job_output(cli_args *a, prompt_set *p, job_output *out, char *err) {
    for (int i = 0; i < p->n; i++) /* --prompt texts: numbered in order */
        if (!p->record_ids[i] && (p->record_ids[i] = malloc(16)))
            snprintf(p->record_ids[i], 16, "%d", i + 1);
        else if (!p->record_ids[i]) return fg_fail(err, "out of memory");
    const char *repeated = job_repeated_id(p->record_ids, p->n);
    if (repeated)
        return fg_fail(err,
                       "%s: the id %.60s is given to two prompts; a record names its prompt by id",
                       a->prompt_file ? a->prompt_file : "the prompts", repeated);
    a->prompts_hash = prompts_hash(p);
    a->n_job_prompts = p->n;
    if (job_output_open(out, a->output, a->resume, err)) return -1;
    int shape[2];
    fg_schedule schedule;
    job_output_shape(out, &shape[0], &shape[1], &schedule);
    if (a->auto_policy && shape[0] > 0 && shape[1] > 0) {
        a->policy.gpu_batch_size = shape[0];
        a->policy.num_gpu_batches = shape[1];
        if (!a->schedule_given) {
            a->policy.schedule = schedule;
            a->schedule_given = 1;
        }
    }
    if (begin_job(a, out, err)) return -1;
    const char *stranger = job_output_stranger(out, p->record_ids, p->n);
    if (stranger)
        return fg_fail(err,
                       "--resume: %s has a record of the id %.60s, which no prompt of this job has",
                       a->output, stranger);
    int kept = 0;
    for (int i = 0; i < p->n; i++) {
        if (job_output_done(out, p->record_ids[i])) {
            free(p->ids[i]);
            free(p->record_ids[i]);
            free(p->texts[i]);
            continue;
        }
        p->ids[kept] = p->ids[i];
        p->lens[kept] = p->lens[i];
        p->index[kept] = p->index[i];
        p->record_ids[kept] = p->record_ids[i];
        p->texts[kept] = p->texts[i];
        kept++;
    }
    if (out->n_done && kept && !a->quiet) /* none left: run_generation() says the job is finished */
        fprintf(stderr, "job: %d of %d prompts already in %s; resuming\n", p->n - kept, p->n,
                a->output);
    p->n = kept;
    return 0;
}

/* The records of prompts which[first .. first + count - 1] (which NULL: first .. first + count - 1
 * themselves), in one write (rank 0). */
static int append_records(const cli_args *a, const prompt_set *p, const fg_tokenizer *tok,
                          const int *tokens, const int *which, int first, int count,
                          job_output *out, char *err) {
    size_t len = 0, cap = 0;
    char *lines = NULL;
    int rc = 0;
    for (int j = first, i; j < first + count && rc == 0; j++) {
        i = which ? which[j] : j;
        char *r = job_record(p->record_ids[i], p->texts[i], p->ids[i], p->lens[i],
                             tokens + (size_t)i * a->gen.gen_len, &a->gen, tok);
        size_t n = r ? strlen(r) : 0;
        if (r && len + n + 1 > cap) {
            char *grown = realloc(lines, cap = 2 * (len + n + 1));
            if (grown) lines = grown;
            else {
                free(r);
                r = NULL;
            }
        }
        if (!r) rc = fg_fail(err, "out of memory");
        else {
            memcpy(lines + len, r, n);
            len += n;
            free(r);
        }
    }
    if (rc == 0) rc = job_output_append(out, lines, len, err);
    free(lines);
    return rc;
}

static void add_timing(gen_timing *sum, const gen_timing *t) {
    sum->prefill_latency += t->prefill_latency;
    sum->decode_latency += t->decode_latency;
    sum->prefill_tokens += t->prefill_tokens;
    sum->decode_tokens += t->decode_tokens;
    sum->rows += t->rows;
    sum->cache_rows += t->cache_rows;
    sum->cache_tokens += t->cache_tokens;
    sum->compute_seconds += t->compute_seconds;
    sum->bubble_seconds += t->bubble_seconds;
    sum->disk_read_seconds += t->disk_read_seconds;
    sum->completed += t->completed;
    sum->completion_seconds += t->completion_seconds;
    sum->device_counted |= t->device_counted;
    sum->decode_steps += t->decode_steps;
    device_counts_add(&sum->prefill_counts, &t->prefill_counts, 0);
    device_counts_add(&sum->decode_counts, &t->decode_counts, 0);
    device_counts_add(&sum->decode_step_most, &t->decode_step_most, 1);
}

/* "job: 120 of 1000 prompts, 35.2 token/s, about 0:12:31 left": a line a window of rounds,
 * rewritten in place on a terminal. */
static void job_progress(int done, int total, double tokens, double seconds, int done_here) {
    double left = seconds / done_here * (total - done);
    int tty = isatty(2);
    fprintf(stderr, "%sjob: %d of %d prompts, %.1f token/s, about %d:%02d:%02d left%s",
            tty ? "\r" : "", done, total, seconds > 0 ? tokens / seconds : 0, (int)(left / 3600),
            (int)(left / 60) % 60, (int)left % 60, tty && done < total ? "" : "\n");
}

/* A window's prompts, longest first (ties in file order): rounds of similar lengths pad less. */
static int by_length(const void *a, const void *b, void *prompts) {
    int x = *(const int *)a, y = *(const int *)b;
    const int *lens = ((const prompt_set *)prompts)->lens;
    return lens[x] != lens[y] ? lens[y] - lens[x] : x - y;
}

/* A diagonal job's records as its groups end (generate()'s group_done, on rank 0): the groups of
 * a window end in the order they started, so their records go out in the window's order, a
 * group in one write. */
typedef struct {
    const cli_args *a;
    const prompt_set *p;
    const fg_tokenizer *tok;
    job_output *out;
    int *tokens;
    const int *got, *order; /* generate()'s tokens, and each of its prompts' place in p */
    int written, rc;        /* its prompts recorded (a group's failed write: rc -1, err says why) */
    char *err;
} group_records;

static void record_group(void *ctx, int first, int count) {
    group_records *g = ctx;
    int G = g->a->gen.gen_len;
    if (g->rc || first != g->written) return;
    for (int i = first; i < first + count; i++)
        memcpy(g->tokens + (size_t)g->order[i] * G, g->got + (size_t)i * G,
               (size_t)G * sizeof *g->got);
    g->rc = append_records(g->a, g->p, g->tok, g->tokens, g->order, first, count, g->out, g->err);
    g->written = first + count;
}

/* --output: the prompts in windows of JOB_WINDOW rounds of places in the file (those left of a
 * resumed job: the windows of the job unbroken). A window's prompts run longest first, a round
 * at a time (a block for each stage: what one generate() takes, §4.4), so that a round's prompts
 * have similar lengths and little padding; its records are appended in file order, in one write,
 * once the window is done. With --refill or the diagonal schedule the window is one generate():
 * its blocks take the next prompts as sequences end, and the diagonal's records are appended as
 * each GPU batch's group ends (record_group). A crash loses at most what is in flight, and
 * --resume forms the same windows of the prompts left, and the same groups, so it computes what
 * an unbroken run would: sampling draws by each prompt's place in the file. */
int run_rounds(const cli_args *a, fg_pipe *pipe, fg_model *m, const prompt_set *p,
               const fg_tokenizer *tok, job_output *out, int *tokens, gen_timing *t, char *err) {
    int round = a->policy.gpu_batch_size * a->policy.num_gpu_batches * fg_pipe_size(pipe),
        G = a->gen.gen_len;
    int window = round * JOB_WINDOW, rc = 0, diagonal = a->policy.schedule == FG_SCHEDULE_DIAGONAL;
    if (a->gen.refill || diagonal) round = window; /* its blocks stream them */
    int *order = malloc((size_t)window * sizeof *order),
        *index = malloc((size_t)round * sizeof *index);
    int **ids = malloc((size_t)round * sizeof *ids), *lens = malloc((size_t)round * sizeof *lens);
    int *got = malloc((size_t)round * G * sizeof *got);
    group_records groups = {
        .a = a, .p = p, .tok = tok, .out = out, .tokens = tokens, .got = got, .err = err};
    double start = now_seconds();
    memset(t, 0, sizeof *t);
    if (!order || !index || !ids || !lens || !got) rc = fg_fail(err, "out of memory");
    for (int w0 = 0, in_window = 0; rc == 0 && w0 < p->n; w0 += in_window) {
        for (in_window = 1;
             w0 + in_window < p->n && p->index[w0 + in_window] / window == p->index[w0] / window;
             in_window++) {}
        for (int i = 0; i < in_window; i++) order[i] = w0 + i;
        qsort_r(order, (size_t)in_window, sizeof *order, by_length, (void *)p);
        for (int r0 = 0; rc == 0 && r0 < in_window; r0 += round) {
            int count = in_window - r0 < round ? in_window - r0 : round;
            for (int i = 0; i < count; i++) {
                ids[i] = p->ids[order[r0 + i]];
                lens[i] = p->lens[order[r0 + i]];
                index[i] = p->index[order[r0 + i]];
            }
            gen_options opt = a->gen;
            opt.index = index;
            groups.order = order + r0;
            groups.written = 0;
            if (diagonal && fg_pipe_rank(pipe) == 0) {
                opt.group_done = record_group;
                opt.group_ctx = &groups;
            }
            gen_timing this_round;
            double began = now_seconds() - start; /* a completion's time counts from the job's
                                                     start */
            if (generate(m, &opt, count, ids, lens, got, NULL, &this_round, err) || groups.rc)
                rc = -1;
            this_round.completion_seconds += began * (double)this_round.completed;
            for (int i = 0; rc == 0 && i < count; i++)
                memcpy(tokens + (size_t)order[r0 + i] * G, got + (size_t)i * G,
                       (size_t)G * sizeof *got);
            if (rc == 0) add_timing(t, &this_round);
        }
        if (rc == 0 && fg_pipe_rank(pipe) == 0) /* the diagonal's groups that ended with the run */
            rc = diagonal ? append_records(a, p, tok, tokens, order, groups.written,
                                           in_window - groups.written, out, err)
                          : append_records(a, p, tok, tokens, NULL, w0, in_window, out, err);
        if (fg_pipe_agree(pipe, rc, err)) rc = -1;
        if (rc == 0 && fg_pipe_rank(pipe) == 0 && !a->quiet)
            job_progress(out->n_done + w0 + in_window, out->n_done + p->n,
                         (double)(t->prefill_tokens + t->decode_tokens), now_seconds() - start,
                         w0 + in_window);
    }
    free(order);
    free(index);
    free(ids);
    free(lens);
    free(got);
    return rc;
}
