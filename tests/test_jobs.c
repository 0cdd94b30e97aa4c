/* test_jobs.c: batch jobs end to end, as subprocesses of the flexgen binary (app/jobs.c and
 * app/job_run.c).
 *
 * A job's records against a plain run and against HF's tokens; a job killed, cut short or out of
 * disk resumes to an uninterrupted run's output; one job at a time on an output (the lock); what
 * names a job (its prompts and model by content, its flags and block shape); and bad input: a
 * JSONL line with more than one object, ids and strings that would not come back unchanged, an
 * output that is an input, an output removed while the job runs, records of other prompts.
 */
#define _GNU_SOURCE
#include "tests.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static char kjv_dir[4096], llama_kjv_dir[4096], tiny_dir[4096], tiny_prompts[4096], tiny_tokens[4096];

static int jobs_init(void) {
    snprintf(kjv_dir, sizeof kjv_dir, "%s", fixture("../../models/opt-kjv"));
    snprintf(llama_kjv_dir, sizeof llama_kjv_dir, "%s", fixture("../../models/llama-kjv"));
    snprintf(tiny_dir, sizeof tiny_dir, "%s", fixture("opt-tiny"));
    snprintf(tiny_prompts, sizeof tiny_prompts, "%s", fixture("opt-tiny/prompts.txt"));
    snprintf(tiny_tokens, sizeof tiny_tokens, "%s", fixture("opt-tiny/tokens.txt"));
    setenv("OMP_WAIT_POLICY", "passive", 0); /* children must not spin on a loaded machine */
    return 0;
}

/* Runs argv (argv[0] the binary) and expects exit 0; frees what it printed. */
static void run_ok(const char *const *argv) {
    char *out, *err;
    int rc = run_command(argv, NULL, &out, &err);
    EXPECT(rc == 0, "%s ...: exit %d: %s", argv[0], rc, err);
    free(out), free(err);
}

/* The first n lines of text (malloc'd). */
static char *first_lines(const char *text, int n) {
    const char *end = text;
    for (int i = 0; i < n && end && *end; i++) end = strchr(end, '\n') ? strchr(end, '\n') + 1 : NULL;
    return strndup(text, end ? (size_t)(end - text) : strlen(text));
}

static int whole_lines(const char *text) {
    int ok = 1;
    for (const char *l = text; ok && l && *l;) {
        const char *end = strchr(l, '\n');
        if (!end) return 0;
        char *line = strndup(l, (size_t)(end - l));
        cJSON *o = cJSON_Parse(line);
        ok = cJSON_IsObject(o);
        cJSON_Delete(o);
        free(line);
        l = end + 1;
    }
    return ok;
}

/* --prompt-file F.jsonl with text, ids and ids of their own (named F.JSONL here: the suffix in
 * capitals is JSONL too, not text); --output: a header line, then a record a prompt in order, whose
 * completion and tokens are those a run without --output prints, greedy and sampled (each prompt
 * draws from its own place in the file, whatever round it is in). */
static void test_job_output(void) {
    char *dir = make_temp_dir(), prompts[4200], output[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.JSONL"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    write_text_file(prompts, "{\"prompt\": \"In the beginning God created\", \"id\": \"gen-1\"}\n"
                        "{\"prompt_ids\": [2, 133, 1040, 9]}\n\n"
                        "{\"prompt\": \"And the LORD said unto Moses\", \"id\": 7}\n"
                        "{\"prompt\": \"Blessed are the meek\"}\n{\"prompt\": \"Let there be\"}\n");
    static const char *const ids[] = {"\"gen-1\"", "2", "7", "5", "6"};
    for (int sampled = 0; sampled < 2; sampled++) {
        const char *t = sampled ? "0.8" : "0";
        char *out, *err, *plain, *perr;
        unlink(output);
        int rc = run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "6",
                                  "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--temperature", t, "--seed", "3",
                                  "--quiet"), NULL, &out, &err);
        CU_ASSERT_EQUAL(rc, 0);
        free(out), free(err);
        rc = run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "6", "--gpu-batch-size", "5",
                              "--temperature", t, "--seed", "3", "--quiet"), NULL, &plain, &perr);
        CU_ASSERT_EQUAL(rc, 0);
        char *records = slurp(output, NULL);
        CU_ASSERT_FATAL(records != NULL);
        EXPECT(whole_lines(records) && count_lines(records) == 6 && strstr(records, "{\"flexgen_job\":") == records,
               "--output: expected a job line and 5 records, got:\n%s", records);
        const char *line = strchr(records, '\n') + 1;
        for (int i = 0; i < 5 && line; i++, line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
            char *copy = strndup(line, (size_t)(strchr(line, '\n') - line)), want_id[16];
            cJSON *r = cJSON_Parse(copy);
            char *id = cJSON_PrintUnformatted(cJSON_GetObjectItem(r, "id"));
            const cJSON *completion = cJSON_GetObjectItem(r, "completion"), *tokens = cJSON_GetObjectItem(r, "tokens");
            const char *stop = cJSON_GetStringValue(cJSON_GetObjectItem(r, "stop"));
            char next[24]; /* the plain run's text of prompt i + 1 ends with the completion */
            snprintf(want_id, sizeof want_id, "[%d] ", i + 1);
            snprintf(next, sizeof next, i < 4 ? "\n[%d] " : "\nmodel size:", i + 2);
            const char *printed = strstr(plain, want_id), *end = printed ? strstr(printed, next) : NULL;
            size_t clen = cJSON_IsString(completion) ? strlen(completion->valuestring) : 0;
            int same = printed && end && clen > 0 && (size_t)(end - printed) > clen &&
                       !strncmp(end - clen, completion->valuestring, clen);
            EXPECT(id && !strcmp(id, ids[i]) && cJSON_GetArraySize(tokens) == 6 && stop && !strcmp(stop, "length") &&
                   same && (i != 1 || cJSON_GetObjectItem(r, "prompt_ids")) && (i == 1 || cJSON_GetObjectItem(r, "prompt")),
                   "%s record %d: expected id %s, 6 tokens, stop length, and the completion the plain run prints; "
                   "got %s (plain run: %.*s)", sampled ? "sampled" : "greedy", i + 1, ids[i], copy,
                   printed && end ? (int)(end - printed) : 0, printed ? printed : "");
            free(id), free(copy);
            cJSON_Delete(r);
        }
        free(records), free(plain), free(perr);
    }
    rm_tree(dir);
    free(dir);
}

/* --warmup runs a generate of its own before the job's: the records are the same bytes with and
 * without it, sampled, and a job cut after two records and resumed with it too; --json gives the
 * cold run's latency, which is the whole of it: its prefill and its decode step, each taking
 * time. */
static void test_job_warmup(void) {
    char *dir = make_temp_dir(), prompts[4200], plain[4200], warm[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(plain, sizeof plain, "%s", join(dir, "plain.jsonl"));
    snprintf(warm, sizeof warm, "%s", join(dir, "warm.jsonl"));
    write_text_file(prompts, "{\"prompt\": \"In the beginning God created\"}\n{\"prompt\": \"And the LORD said\"}\n"
                             "{\"prompt\": \"Blessed are the meek\"}\n{\"prompt\": \"Let there be\"}\n"
                             "{\"prompt\": \"And it came to pass\"}\n");
#define JOB_FLAGS "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "5", "--gpu-batch-size", "2", \
                  "--num-gpu-batches", "1", "--temperature", "0.8", "--seed", "3", "--quiet"
    run_ok(ARGS(flexgen_bin(), JOB_FLAGS, "--output", plain));
    char *out, *err;
    int rc = run_flexgen(ARGS(JOB_FLAGS, "--output", warm, "--warmup", "--json"), NULL, &out, &err);
    CU_ASSERT_EQUAL(rc, 0);
    cJSON *o = cJSON_Parse(out);
    const cJSON *cold = cJSON_GetObjectItem(o, "warmup_latency");
    double prefill = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "warmup_prefill_latency"));
    double decode = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "warmup_decode_latency"));
    EXPECT(cJSON_IsNumber(cold) && prefill > 0 && decode > 0 && fabs(cold->valuedouble - (prefill + decode)) <=
           1e-9 * cold->valuedouble, "--warmup --json: expected warmup_latency the sum of its prefill's and its "
           "decode step's, each > 0; got %s", out);
    cJSON_Delete(o);
    free(out), free(err);
    char *want = slurp(plain, NULL), *got = slurp(warm, NULL);
    CU_ASSERT_FATAL(want && got);
    EXPECT(!strcmp(want, got), "--warmup: the job's records differ from a run without it:\n%s\nagainst\n%s", got, want);
    char *cut = first_lines(got, 3); /* the job line and two records */
    write_text_file(warm, cut);
    run_ok(ARGS(flexgen_bin(), JOB_FLAGS, "--output", warm, "--resume", "--warmup"));
#undef JOB_FLAGS
    free(got);
    got = slurp(warm, NULL);
    EXPECT(got && !strcmp(want, got), "--resume --warmup: the output differs from an uninterrupted run's:\n%s", got);
    free(want), free(got), free(cut);
    rm_tree(dir);
    free(dir);
}

/* Each line of `some` (a newline ends it) is a line of `all`, and they have as many. */
static int same_lines(const char *some, const char *all) {
    int missing = count_lines(some) != count_lines(all);
    for (const char *l = some; !missing && *l; l = strchr(l, '\n') + 1) {
        char line[4096];
        size_t n = (size_t)(strchr(l, '\n') - l) + 1;
        snprintf(line, sizeof line, "%.*s", (int)n, l);
        missing = n >= sizeof line || !strstr(all, line);
    }
    return !missing;
}

/* A job (the flags of args, up to 24) run with each schedule into dir: the output files, zig-zag's
 * then the diagonal's (NULL where none was written). */
static void job_by_schedule(const char *dir, const char *const *args, char *files[2]) {
    for (int diagonal = 0; diagonal < 2; diagonal++) {
        const char *argv[32];
        char path[4200], *out, *err;
        snprintf(path, sizeof path, "%s", join(dir, diagonal ? "diagonal.jsonl" : "zigzag.jsonl"));
        int n = 0;
        for (; args[n] && n < 24; n++) argv[n] = args[n];
        const char *more[] = {"--output", path, "--schedule", diagonal ? "diagonal" : "zigzag", "--quiet", NULL};
        memcpy(argv + n, more, sizeof more);
        int rc = run_flexgen(argv, NULL, &out, &err);
        EXPECT(rc == 0, "--schedule %s job: exit %d, %s", diagonal ? "diagonal" : "zigzag", rc, err);
        free(out), free(err);
        files[diagonal] = slurp(path, NULL);
    }
}

/* With the diagonal schedule a job's window streams through one block, and each GPU batch's group
 * is recorded as it ends: zig-zag's records (7 prompts, GPU batches of 1, 3 of them, sampled),
 * each line the same, in the order the window runs them (longest first, so prompt 3 leads), under
 * a job line that names the schedule. */
static void test_job_diagonal(void) {
    char *dir = make_temp_dir(), prompts[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    write_text_file(prompts, "{\"prompt\": \"In the beginning\"}\n{\"prompt\": \"And God said\"}\n"
                             "{\"prompt\": \"Blessed are the meek, for they\"}\n{\"prompt\": \"Let there be\"}\n"
                             "{\"prompt\": \"The LORD is my shepherd\"}\n{\"prompt\": \"Jesus wept\"}\n"
                             "{\"prompt\": \"And it came to pass\"}\n");
    char *files[2];
    job_by_schedule(dir, ARGS("--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "5", "--gpu-batch-size", "1",
                              "--num-gpu-batches", "3", "--temperature", "0.7", "--seed", "2"), files);
    CU_ASSERT_PTR_NOT_NULL_FATAL(files[0]);
    CU_ASSERT_PTR_NOT_NULL_FATAL(files[1]);
    const char *records[2] = {strchr(files[0], '\n') + 1, strchr(files[1], '\n') + 1};
    const char *named = strstr(files[1], ",\"schedule\":\"diagonal\"}}\n");
    int header_ok = named && named < records[1] && !strstr(files[0], "schedule");
    EXPECT(count_lines(files[0]) == 8 && same_lines(records[1], records[0]) && header_ok &&
           !strncmp(records[1], "{\"id\":3,", 8) && strcmp(records[0], records[1]),
           "the diagonal job's records: expected zig-zag's lines, prompt 3's first, under a job line with "
           "\"schedule\":\"diagonal\":\n%s\n---\n%s", files[0], files[1]);
    free(files[0]), free(files[1]);
    rm_tree(dir);
    free(dir);
}

/* Each GPU batch pads its prompts to its own longest in either schedule, so a prompt meets the
 * same rows in both: ten prompts of 10 to 13 tokens in GPU batches of 5, 2 of them, with 4-bit
 * weights and --int8-activations (whose prefill takes another path from 64 rows up: 5 x 13 = 65
 * against 5 x 12 = 60), get zig-zag's records from the diagonal schedule. (Zig-zag padded the
 * whole block to its longest, and prompts 6 and 8 took other tokens.) */
static void test_job_schedules_pad_alike(void) {
    char *dir = make_temp_dir(), prompts[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    write_text_file(prompts,
                    "{\"prompt_ids\": [2, 404, 403, 308, 43, 265, 104, 203, 388, 84, 129, 211, 36]}\n"
                    "{\"prompt_ids\": [2, 332, 103, 203, 375, 210, 107, 485, 6, 225, 464, 83, 219]}\n"
                    "{\"prompt_ids\": [2, 238, 398, 86, 69, 10, 29, 285, 75, 331, 415, 468, 206]}\n"
                    "{\"prompt_ids\": [2, 380, 261, 90, 77, 181, 148, 85, 269, 90, 476, 37, 58]}\n"
                    "{\"prompt_ids\": [2, 315, 390, 132, 84, 168, 462, 317, 143, 466, 420, 236, 76]}\n"
                    "{\"prompt_ids\": [2, 229, 89, 58, 4, 43, 146, 44, 182, 218, 492, 456]}\n"
                    "{\"prompt_ids\": [2, 318, 323, 224, 216, 265, 189, 461, 27, 70, 253]}\n"
                    "{\"prompt_ids\": [2, 57, 270, 185, 276, 117, 214, 301, 157, 304, 71]}\n"
                    "{\"prompt_ids\": [2, 193, 36, 204, 202, 448, 304, 42, 187, 476]}\n"
                    "{\"prompt_ids\": [2, 226, 264, 164, 100, 398, 194, 404, 492, 222]}\n");
    char *files[2];
    job_by_schedule(dir, ARGS("--model", tiny_dir, "--prompt-file", prompts, "--gen-len", "16", "--gpu-batch-size", "5",
                              "--num-gpu-batches", "2", "--compress-weight", "--int8-activations"), files);
    CU_ASSERT_PTR_NOT_NULL_FATAL(files[0]);
    CU_ASSERT_PTR_NOT_NULL_FATAL(files[1]);
    const char *records[2] = {strchr(files[0], '\n') + 1, strchr(files[1], '\n') + 1};
    EXPECT(count_lines(files[0]) == 11 && count_lines(files[1]) == 11 && same_lines(records[1], records[0]),
           "the diagonal job's records: expected zig-zag's lines:\n%s\n---\n%s", records[0], records[1]);
    free(files[0]), free(files[1]);
    rm_tree(dir);
    free(dir);
}

/* A job runs a window's prompts longest first, so that a GPU batch holds prompts of similar
 * lengths: prompts of 40 and 4 tokens in turn, in GPU batches of 2, prefill 8 x 40 = 320 rows in
 * file order (each batch padded to 40) and 4 x 40 + 4 x 4 = 176 as a job (--json's
 * prefill_tokens; prompt_tokens, 176, are the prompts' own). */
static void test_job_less_padding(void) {
    char *dir = make_temp_dir(), prompts[4200], output[4200], text[4096] = "";
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    for (int i = 0; i < 8; i++) {
        strcat(text, "{\"prompt_ids\": [2");
        for (int t = 1; t < (i % 2 ? 4 : 40); t++) sprintf(text + strlen(text), ", %d", 3 + (i * 13 + t * 7) % 900);
        strcat(text, "]}\n");
    }
    write_text_file(prompts, text);
    double rows[2], own[2];
    for (int job = 0; job < 2; job++) {
        char *out, *err;
        const char *args[] = {"--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "2", "--gpu-batch-size", "2",
                              "--num-gpu-batches", "1", "--json", "--quiet", job ? "--output" : NULL, output, NULL};
        CU_ASSERT_EQUAL(run_flexgen(args, NULL, &out, &err), 0);
        cJSON *o = cJSON_Parse(out);
        rows[job] = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "prefill_tokens"));
        own[job] = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "prompt_tokens"));
        cJSON_Delete(o);
        free(out), free(err);
    }
    EXPECT(rows[0] == 320 && rows[1] == 176 && own[0] == 176 && own[1] == 176, "prompts of 40 and 4 tokens in turn, "
           "GPU batches of 2: expected 320 prefill rows in file order and 176 as a job (176 the prompts' own); got "
           "%g and %g (%g and %g)", rows[0], rows[1], own[0], own[1]);
    rm_tree(dir);
    free(dir);
}

/* A job killed (SIGKILL) while it runs leaves whole records; --resume finishes it, and the output
 * is byte for byte the output of a run never stopped. A last line cut short (a write the crash
 * interrupted) is dropped before the rest is appended. With the diagonal schedule (GPU batches of
 * 2, 3 of them: windows of 48 prompts) records go out a group at a time as groups end, so the kill
 * leaves whole groups of a window part done, whose other groups the resumed job runs as the
 * unbroken one did. */
static void resume_after_kill(const char *gbs, const char *ngb, const char *schedule) {
    enum { PROMPTS = 60 };
    char *dir = make_temp_dir(), prompts[4200], whole[4200], killed[4200], text[PROMPTS * 120];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(whole, sizeof whole, "%s", join(dir, "whole.jsonl"));
    snprintf(killed, sizeof killed, "%s", join(dir, "killed.jsonl"));
    size_t at = 0;
    for (int i = 0; i < PROMPTS; i++) { /* ids out of order, lengths 3 to 9 */
        at += (size_t)snprintf(text + at, sizeof text - at, "{\"id\": \"q%02d\", \"prompt_ids\": [2", (i * 7) % PROMPTS);
        for (int t = 0; t < 2 + i % 7; t++) at += (size_t)snprintf(text + at, sizeof text - at, ", %d", 3 + (i * 31 + t * 17) % 900);
        at += (size_t)snprintf(text + at, sizeof text - at, "]}\n");
    }
    write_text_file(prompts, text);
    const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "12",
                         "--gpu-batch-size", gbs, "--num-gpu-batches", ngb, "--stop-at-eos", "--quiet", "--schedule",
                         schedule, "--output", whole, NULL, NULL};
    char *out, *err;
    CU_ASSERT_EQUAL(run_command(job, NULL, &out, &err), 0);
    free(out), free(err);
    char *full = slurp(whole, NULL);
    CU_ASSERT_FATAL(full && count_lines(full) == PROMPTS + 1); /* the job line, a record a prompt */
    job[16] = killed;
    pid_t pid;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    CU_ASSERT_EQUAL_FATAL(posix_spawn(&pid, job[0], &fa, NULL, (char *const *)job, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    int lines = 0;
    for (int tries = 0; tries < 60000 && lines < 3; tries++) { /* the job line and two records */
        char *now = slurp(killed, NULL);
        lines = count_lines(now);
        free(now);
        if (lines < 3) usleep(1000);
    }
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    char *part = slurp(killed, NULL);
    int kept = count_lines(part), group = atoi(gbs);
    EXPECT(WIFSIGNALED(status) && kept >= 3 && kept < PROMPTS + 1 && whole_lines(part) && (kept - 1) % group == 0,
           "%s, killed mid-job: expected whole lines in groups of %d, fewer than all %d records; got %d lines, %s",
           schedule, group, PROMPTS, kept, whole_lines(part) ? "all whole" : "not all whole");
    printf("[%s: killed after %d records] ", schedule, kept - 1);
    job[17] = "--resume";
    CU_ASSERT_EQUAL(run_command(job, NULL, &out, &err), 0);
    free(out), free(err);
    char *resumed = slurp(killed, NULL);
    EXPECT(resumed && full && !strcmp(resumed, full), "%s, killed after %d records and resumed: the output differs "
           "from an uninterrupted run's", schedule, kept - 1);
    /* a record cut short at the end: dropped, then the job finishes as before */
    FILE *f = fopen(killed, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    const char *cut = full;
    for (int i = 0; i < 1 + 2 * group; i++) cut = strchr(cut, '\n') + 1; /* the job line, two groups */
    fwrite(full, 1, (size_t)(cut - full), f);
    fwrite(cut, 1, (size_t)(strchr(cut, '\n') - cut) / 2, f);
    fclose(f);
    CU_ASSERT_EQUAL(run_command(job, NULL, &out, &err), 0);
    free(out), free(err), free(resumed);
    resumed = slurp(killed, NULL);
    EXPECT(resumed && !strcmp(resumed, full), "%s, a cut last line and --resume: the output differs from an "
           "uninterrupted run's", schedule);
    free(resumed), free(part), free(full);
    rm_tree(dir);
    free(dir);
}

static void test_job_resume_after_kill(void) {
    resume_after_kill("1", "1", "zigzag");
    resume_after_kill("2", "3", "diagonal");
}

/* A window's records that cannot all be written (a file size limit stands in for a full disk) are
 * taken back: exit 2 with one line, the output keeps the windows written before (or is removed if
 * it was made for nothing), and --resume then finishes the job as an uninterrupted run. */
static void test_job_output_full(void) {
    enum { PROMPTS = 24 };
    char *dir = make_temp_dir(), prompts[4200], whole[4200], cut[4200], text[PROMPTS * 80] = "";
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(whole, sizeof whole, "%s", join(dir, "whole.jsonl"));
    snprintf(cut, sizeof cut, "%s", join(dir, "cut.jsonl"));
    for (int i = 0; i < PROMPTS; i++)
        sprintf(text + strlen(text), "{\"id\": \"q%02d\", \"prompt_ids\": [2, %d, %d, %d]}\n", i, 10 + i, 300 + i, 7 * i + 3);
    write_text_file(prompts, text);
    const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "8",
                         "--gpu-batch-size", "1", "--num-gpu-batches", "1", "--quiet", "--output", whole, NULL, NULL};
    char *out, *err;
    CU_ASSERT_EQUAL_FATAL(run_command(job, NULL, &out, &err), 0);
    free(out), free(err);
    char *full = slurp(whole, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(full);
    const char *end = full; /* the job line and the first window's 8 records */
    for (int i = 0; i < 9; i++) end = strchr(end, '\n') + 1;
    size_t first = (size_t)(end - full);
    job[13] = cut;
    struct rlimit old, small;
    getrlimit(RLIMIT_FSIZE, &old);
    void (*old_xfsz)(int) = signal(SIGXFSZ, SIG_IGN); /* inherited: EFBIG instead of a kill */
    for (int k = 0; k < 2; k++) { /* a limit below the first window, then one inside the second */
        small.rlim_cur = k ? first + 100 : 100, small.rlim_max = old.rlim_max;
        setrlimit(RLIMIT_FSIZE, &small);
        int rc = run_command(job, NULL, &out, &err);
        setrlimit(RLIMIT_FSIZE, &old);
        char *kept = slurp(cut, NULL);
        int ok = k ? kept && strlen(kept) == first && !strncmp(kept, full, first) : !kept;
        EXPECT(rc == 2 && strstr(err, "--output") && strstr(err, "file size limit") && count_lines(err) == 1 && ok,
               "--output past a file size limit of %llu bytes: expected exit 2, one line, and %s; got %d, '%s', %zu bytes",
               (unsigned long long)small.rlim_cur, k ? "the first window's records" : "no file", rc, err,
               kept ? strlen(kept) : 0);
        free(out), free(err), free(kept);
    }
    signal(SIGXFSZ, old_xfsz);
    job[14] = "--resume";
    CU_ASSERT_EQUAL(run_command(job, NULL, &out, &err), 0);
    free(out), free(err);
    char *resumed = slurp(cut, NULL);
    EXPECT(resumed && !strcmp(resumed, full), "--resume after a failed write: the output differs from an "
           "uninterrupted run's");
    free(resumed), free(full);
    rm_tree(dir);
    free(dir);
}

/* Bad jobs: one line, exit 2, and the output neither made nor changed. Among them resumes of
 * another job: another model, other prompts, and a flag the job began with (--refill) dropped. */
static void test_job_bad_input(void) {
    char *dir = make_temp_dir(), prompts[4200], bad[4200], output[4200], other[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(bad, sizeof bad, "%s", join(dir, "bad.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    snprintf(other, sizeof other, "%s", join(dir, "other.jsonl"));
    write_text_file(prompts, "{\"prompt_ids\": [2, 10, 11]}\n{\"prompt_ids\": [2, 12]}\n");
    write_text_file(bad, "{\"prompt_ids\": [2, 10, 11]}\n{\"prompt_ids\": [2, 99999]}\n");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", bad, "--output", output), "bad.jsonl line 2", "prompt_ids");
    write_text_file(bad, "{\"prompt_ids\": [2, 10]}\n\n{\"prompt\": \"x\"\n");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", bad, "--output", output), "bad.jsonl line 3", "malformed JSON");
    write_text_file(bad, "[2, 10]\n");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", bad, "--output", output), "bad.jsonl line 1", "not a JSON object");
    write_text_file(bad, "{\"prompt_ids\": [2, 10], \"id\": 1}\n{\"prompt_ids\": [2, 12], \"id\": 1}\n");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", bad, "--output", output), "the id 1 is given to two prompts");
    write_text_file(bad, "{\"prompt_ids\": [2, 10], \"id\": 0}\n{\"prompt_ids\": [2, 12], \"id\": -0}\n");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", bad, "--output", output), "the id 0 is given to two prompts");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", dir), "--output", "not a regular file");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--resume"), "--resume", "--output");
    char dangling[4200]; /* a symbolic link to a file that does not exist: said as such */
    snprintf(dangling, sizeof dangling, "%s", join(dir, "dangling.jsonl"));
    CU_ASSERT_FATAL(symlink("no-such-dir/out.jsonl", dangling) == 0);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", dangling), "--output",
                "a symbolic link to no-such-dir/out.jsonl, which does not exist");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", dangling, "--resume"), "--output",
                "a symbolic link to no-such-dir/out.jsonl, which does not exist");
    unlink(dangling);
    EXPECT(dir_entries(dir) == 2, "refused jobs left %d files beside the two prompt files", dir_entries(dir) - 2);
    char *out, *err; /* a finished job's output, then others' --resume against it */
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                                     "--quiet"), NULL, &out, &err), 0);
    free(out), free(err);
    char *before = slurp(output, NULL);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3"), "--output",
                "exists", "--resume");
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--prompt-file", prompts, "--output", output, "--gen-len", "3", "--resume"),
                "another job", "model");
    write_text_file(other, "{\"prompt_ids\": [2, 10, 11]}\n{\"prompt_ids\": [2, 13]}\n");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", other, "--output", output, "--gen-len", "3", "--resume"),
                "another job", "prompts_fnv64");
    char *after = slurp(output, NULL);
    EXPECT(before && after && !strcmp(before, after), "refused jobs changed %s", output);
    free(after);
    /* a job's output whose last line was cut short, resumed as another job, and a file of one line
     * without its newline, resumed: refused, and neither loses a byte (a cut line goes only when
     * records follow it) */
    char cut_text[8192], notes[4200];
    snprintf(cut_text, sizeof cut_text, "%s{\"id\": \"3", before ? before : "");
    write_text_file(output, cut_text);
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--prompt-file", prompts, "--output", output, "--gen-len", "3", "--resume"),
                "another job", "model");
    after = slurp(output, NULL);
    EXPECT(after && !strcmp(after, cut_text), "a refused --resume cut the last line of %s", output);
    free(after);
    snprintf(notes, sizeof notes, "%s", join(dir, "notes.txt"));
    write_text_file(notes, "notes, not a job");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", notes, "--gen-len", "3", "--resume"),
                "--resume", "does not start with a flexgen job line");
    after = slurp(notes, NULL);
    EXPECT(after && !strcmp(after, "notes, not a job"), "--resume of a line without a job changed it to '%s'",
           after ? after : "(removed)");
    free(before), free(after);
    unlink(output); /* a job begun with --refill, resumed without it: every recorded key is compared */
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                                     "--stop-at-eos", "--refill", "--quiet"), NULL, &out, &err), 0);
    free(out), free(err);
    char *full = slurp(output, NULL);
    CU_ASSERT_FATAL(full != NULL);
    before = first_lines(full, 2); /* the job line and one of two records: the resume has work left */
    write_text_file(output, before);
    free(full);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                     "--stop-at-eos", "--resume"), "another job", "refill is true there, false here");
    after = slurp(output, NULL);
    EXPECT(before && after && !strcmp(before, after), "a resume without the job's --refill changed %s", output);
    free(before), free(after);
    /* a key the job line leaves out at its default is named by that default */
    unlink(output);
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                                     "--quiet"), NULL, &out, &err), 0);
    free(out), free(err);
    full = slurp(output, NULL);
    CU_ASSERT_FATAL(full != NULL);
    before = first_lines(full, 2);
    write_text_file(output, before);
    free(full);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                     "--schedule", "diagonal", "--resume"), "another job", "schedule is \"zigzag\" there, \"diagonal\" here");
    free(before);
    /* a job of --int8-activations whose line has no int8_weight_max: begun when W's integer columns
     * took 8 bits, resumed where they take 7, is another job, and says which key differs */
    unlink(output);
    CU_ASSERT_EQUAL(run_flexgen(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                                     "--compress-weight", "--int8-activations", "--quiet"), NULL, &out, &err), 0);
    free(out), free(err);
    full = slurp(output, NULL);
    CU_ASSERT_FATAL(full != NULL);
    before = first_lines(full, 2);
    free(full);
    const char *w8_key = ",\"int8_weight_max\":64";
    char *key = strstr(before, w8_key);
    CU_ASSERT_FATAL(key != NULL);
    memmove(key, key + strlen(w8_key), strlen(key + strlen(w8_key)) + 1);
    write_text_file(output, before);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                     "--compress-weight", "--int8-activations", "--resume"), "another job", "int8_weight_max");
    free(before);
    rm_tree(dir);
    free(dir);
}

/* A job's records hold every generated token, </s> included, unless --stop-at-eos: opt-tiny's
 * prompts as a job give HF's tokens (tokens.txt); prompt 4's first token is </s>, and with
 * --stop-at-eos its record is empty and stops at "eos". */
static void test_job_tokens_match_hf(void) {
    enum { PROMPTS = 5, GEN = 8 };
    char *dir = make_temp_dir(), prompts[4200], output[4200], text[1024] = "", *ids = slurp(tiny_prompts, NULL);
    int want[PROMPTS][GEN];
    FILE *f = fopen(tiny_tokens, "r");
    CU_ASSERT_FATAL(f && ids);
    for (int p = 0; p < PROMPTS; p++)
        for (int s = 0; s < GEN; s++) CU_ASSERT_FATAL(fscanf(f, "%d", &want[p][s]) == 1);
    fclose(f);
    CU_ASSERT_FATAL(want[3][0] == 2);
    for (char *line = strtok(ids, "\n"); line; line = strtok(NULL, "\n")) { /* "2 153 146" -> [2, 153, 146] */
        strcat(text, "{\"prompt_ids\": [");
        for (char *c = line; *c; c++) {
            size_t n = strlen(text);
            if (*c == ' ') strcat(text, ", ");
            else text[n] = *c, text[n + 1] = 0;
        }
        strcat(text, "]}\n");
    }
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    write_text_file(prompts, text);
    for (int stop = 0; stop < 2; stop++) {
        unlink(output);
        run_ok(ARGS(flexgen_bin(), "--model", tiny_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "8",
                    "--device", "cpu", "--quiet", stop ? "--stop-at-eos" : "--gpu-batch-size", stop ? NULL : "4"));
        char *records = slurp(output, NULL), *line = records ? strchr(records, '\n') : NULL;
        int bad = 0;
        for (int p = 0; p < PROMPTS && line; p++, line = strchr(line + 1, '\n')) {
            cJSON *r = cJSON_Parse(line + 1);
            const cJSON *tokens = cJSON_GetObjectItem(r, "tokens");
            const char *why = cJSON_GetStringValue(cJSON_GetObjectItem(r, "stop"));
            int n = stop && p == 3 ? 0 : GEN, same = cJSON_GetArraySize(tokens) == n;
            for (int s = 0; same && s < n; s++) same = cJSON_GetArrayItem(tokens, s)->valueint == want[p][s];
            bad += !same || !why || strcmp(why, stop && p == 3 ? "eos" : "length");
            cJSON_Delete(r);
        }
        EXPECT(records && count_lines(records) == PROMPTS + 1 && bad == 0, "opt-tiny as a job%s: %d records differ "
               "from HF's tokens (</s> included unless --stop-at-eos):\n%s", stop ? " with --stop-at-eos" : "", bad,
               records ? records : "(no output)");
        free(records);
    }
    free(ids);
    rm_tree(dir);
    free(dir);
}

/* --resume finds the finished ids whatever their order: ids 1 to 12 ("1" < "10" < "11" < "2" as
 * text), cut after 11 records, resume to the uninterrupted output, each id once. Resumed again,
 * --json says the job is finished. */
static void test_job_resume_unsorted_ids(void) {
    char *dir = make_temp_dir(), prompts[4200], whole[4200], cut[4200], text[1024] = "";
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(whole, sizeof whole, "%s", join(dir, "whole.jsonl"));
    snprintf(cut, sizeof cut, "%s", join(dir, "cut.jsonl"));
    for (int i = 0; i < 12; i++) sprintf(text + strlen(text), "{\"prompt_ids\": [2, %d, %d]}\n", 20 + i, 400 - 3 * i);
    write_text_file(prompts, text);
    const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "4", "--quiet",
                         "--gpu-batch-size", "1", "--num-gpu-batches", "1", "--output", whole, NULL, NULL, NULL,
                         NULL, NULL};
    run_ok(job);
    char *full = slurp(whole, NULL), *part = full ? first_lines(full, 12) : NULL;
    CU_ASSERT_FATAL(full && count_lines(full) == 13);
    write_text_file(cut, part);
    job[13] = cut, job[14] = "--resume";
    run_ok(job);
    char *resumed = slurp(cut, NULL), *out, *err;
    EXPECT(resumed && !strcmp(resumed, full), "ids 1..12 cut after 11 records and resumed: expected the "
           "uninterrupted output, got:\n%s", resumed ? resumed : "(none)");
    job[15] = "--json";
    int rc = run_command(job, NULL, &out, &err);
    cJSON *o = cJSON_Parse(out);
    EXPECT(rc == 0 && cJSON_IsTrue(cJSON_GetObjectItem(o, "finished")) &&
           cJSON_GetNumberValue(cJSON_GetObjectItem(o, "records")) == 12,
           "--resume --json of a finished job: expected {\"finished\": true, \"records\": 12, ...}, got exit %d, '%s'", rc, out);
    cJSON_Delete(o);
    free(out), free(err);
    /* nothing left to run: a --trace asked for is not written, and one line says so (--quiet too) */
    char trace[4200];
    snprintf(trace, sizeof trace, "%s", join(dir, "trace.json"));
    job[15] = "--trace", job[16] = trace;
    rc = run_command(job, NULL, &out, &err);
    EXPECT(rc == 0 && access(trace, F_OK) != 0 && count_lines(err) == 1 && strstr(err, "--trace") &&
           strstr(err, trace), "--resume --trace of a finished job: expected exit 0, no trace and one line naming "
           "it, got exit %d, '%s'", rc, err);
    free(out), free(err), free(resumed), free(part), free(full);
    rm_tree(dir);
    free(dir);
}

/* An output that holds its job line and no record (the job stopped between the two writes)
 * resumes to the uninterrupted output: no finished id is no list to sort or search. */
static void test_job_resume_job_line_only(void) {
    char *dir = make_temp_dir(), prompts[4200], whole[4200], cut[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(whole, sizeof whole, "%s", join(dir, "whole.jsonl"));
    snprintf(cut, sizeof cut, "%s", join(dir, "cut.jsonl"));
    write_text_file(prompts, "{\"prompt_ids\": [2, 10, 11]}\n{\"prompt_ids\": [2, 12]}\n{\"prompt_ids\": [2, 40, 7]}\n");
    const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "3", "--quiet",
                         "--output", whole, NULL, NULL};
    run_ok(job);
    char *full = slurp(whole, NULL), *part = full ? first_lines(full, 1) : NULL;
    CU_ASSERT_FATAL(full && part && count_lines(full) == 4 && count_lines(part) == 1);
    write_text_file(cut, part);
    job[9] = cut, job[10] = "--resume";
    char *out, *err;
    int rc = run_command(job, NULL, &out, &err);
    char *resumed = slurp(cut, NULL);
    EXPECT(rc == 0 && resumed && !strcmp(resumed, full), "an output of its job line alone, resumed: expected exit 0 "
           "and the uninterrupted output; got %d, '%.300s', output:\n%s", rc, err, resumed ? resumed : "(none)");
    free(out), free(err), free(resumed), free(part), free(full);
    rm_tree(dir);
    free(dir);
}

/* A finished job's output whose last line was cut short (a crash while a record was written over
 * a whole output, or a hand's edit): --resume drops the cut line and leaves the records as they
 * were. A line that names an id and nothing else is no record: refused, the output untouched. */
static void test_job_resume_finished_and_cut(void) {
    char *dir = make_temp_dir(), prompts[4200], whole[4200], cut[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(whole, sizeof whole, "%s", join(dir, "whole.jsonl"));
    snprintf(cut, sizeof cut, "%s", join(dir, "cut.jsonl"));
    write_text_file(prompts, "{\"prompt_ids\": [2, 10, 11], \"id\": \"a\"}\n{\"prompt_ids\": [2, 12], \"id\": \"b\"}\n");
    const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "3", "--quiet",
                         "--output", whole, NULL, NULL};
    run_ok(job);
    char *full = slurp(whole, NULL);
    CU_ASSERT_FATAL(full && count_lines(full) == 3);
    char *text = malloc(strlen(full) + 64);
    sprintf(text, "%s{\"id\": \"a\", \"prom", full);
    write_text_file(cut, text);
    job[9] = cut, job[10] = "--resume";
    char *out, *err;
    int rc = run_command(job, NULL, &out, &err);
    char *resumed = slurp(cut, NULL);
    EXPECT(rc == 0 && resumed && !strcmp(resumed, full), "a finished output with a cut last line, resumed: expected "
           "exit 0 and the cut line gone; got %d, '%.300s', output ends '%.60s'", rc, err,
           resumed ? resumed + (strlen(resumed) > 60 ? strlen(resumed) - 60 : 0) : "(none)");
    free(out), free(err), free(resumed);
    char *first_two = first_lines(full, 2);
    sprintf(text, "%s{\"id\": \"b\"}\n", first_two);
    write_text_file(cut, text);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "3", "--output", cut, "--resume"),
                "line 3", "not a whole record");
    char *after = slurp(cut, NULL);
    EXPECT(after && !strcmp(after, text), "a refused output was changed: '%.300s'", after ? after : "(none)");
    free(after), free(first_two), free(text), free(full);
    rm_tree(dir);
    free(dir);
}

/* A LLaMA-family job (models/llama-kjv: its tokenizer.json, grouped-query attention, the KV cache
 * on disk): seven text prompts of different lengths in blocks of 2 x 2, cut after 3 records and
 * resumed, gives the uninterrupted output byte for byte; each record's completion is what its
 * tokens decode to, a text of its own for each prompt. */
static void test_job_llama(void) {
    char *dir = make_temp_dir(), prompts[4200], whole[4200], cut[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(whole, sizeof whole, "%s", join(dir, "whole.jsonl"));
    snprintf(cut, sizeof cut, "%s", join(dir, "cut.jsonl"));
    write_text_file(prompts, "{\"prompt\": \"In the beginning\"}\n{\"prompt\": \"And God said, Let there be\"}\n"
                             "{\"prompt\": \"The LORD is my shepherd;\"}\n{\"prompt\": \"Blessed are\"}\n"
                             "{\"prompt\": \"And it came to pass, when the king heard\"}\n{\"prompt\": \"Jesus wept.\"}\n"
                             "{\"prompt\": \"For God so loved the world, that he gave\"}\n");
    const char *job[] = {flexgen_bin(), "--model", llama_kjv_dir, "--prompt-file", prompts, "--gen-len", "6", "--quiet",
                         "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--percent", "100", "0", "0", "0", "100", "0",
                         "--offload-dir", dir, "--output", whole, NULL, NULL};
    enum { OUTPUT = 22 };
    run_ok(job);
    char *full = slurp(whole, NULL), *part = full ? first_lines(full, 4) : NULL;
    CU_ASSERT_FATAL(full && count_lines(full) == 8 && whole_lines(full));
    int distinct = 0;
    char seen[7][256] = {{0}};
    for (const char *l = strchr(full, '\n') + 1; *l; l = strchr(l, '\n') + 1) {
        char *line = strndup(l, (size_t)(strchr(l, '\n') - l));
        cJSON *o = cJSON_Parse(line), *completion = cJSON_GetObjectItem(o, "completion");
        const char *c = cJSON_GetStringValue(completion);
        EXPECT(c && strlen(c) > 0 && cJSON_GetArraySize(cJSON_GetObjectItem(o, "tokens")) >= 1,
               "a LLaMA job's record without a completion: %s", line);
        int fresh = c != NULL;
        for (int i = 0; c && i < distinct; i++) fresh &= strcmp(seen[i], c) != 0;
        if (fresh && distinct < 7) snprintf(seen[distinct++], sizeof seen[0], "%s", c);
        cJSON_Delete(o);
        free(line);
    }
    EXPECT(distinct == 7, "a LLaMA job: expected 7 different completions, got %d:\n%s", distinct, full);
    write_text_file(cut, part);
    job[OUTPUT] = cut, job[OUTPUT + 1] = "--resume";
    run_ok(job);
    char *resumed = slurp(cut, NULL);
    EXPECT(resumed && !strcmp(resumed, full), "a LLaMA job cut after 3 records and resumed: expected the "
           "uninterrupted output, got:\n%s", resumed ? resumed : "(none)");
    CU_ASSERT_EQUAL(dir_entries(dir), 3); /* the prompts and the two outputs */
    free(resumed), free(part), free(full);
    rm_tree(dir);
    free(dir);
}

/* A job that runs a while: N_LONG prompts, a round a prompt. */
enum { N_LONG = 80 };
static pid_t start_long_job(const char *prompts, const char *output, const char *stderr_file) {
    const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "32", "--quiet",
                         "--gpu-batch-size", "1", "--num-gpu-batches", "1", "--output", output, NULL};
    pid_t pid;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, stderr_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int rc = posix_spawn(&pid, job[0], &fa, NULL, (char *const *)job, environ);
    posix_spawn_file_actions_destroy(&fa);
    return rc == 0 ? pid : -1;
}

/* Waits until path holds at least n lines (up to a minute); returns the lines. */
static int wait_for_lines(const char *path, int n) {
    int lines = 0;
    for (int tries = 0; tries < 60000 && lines < n; tries++) {
        char *now = slurp(path, NULL);
        lines = count_lines(now);
        free(now);
        if (lines < n) usleep(1000);
    }
    return lines;
}

static int exit_status(pid_t pid) {
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Two jobs on one output: the second, plain or --resume, is refused while the first runs, which
 * then finishes with one record a prompt. An output removed while its job runs stops the job with
 * one line. The running job is stopped (SIGSTOP) once its first window is out and continued
 * after: it holds its lock and has windows left however slowly the other runs go (a loaded
 * machine, the sanitizers). */
static void test_job_lock(void) {
    char *dir = make_temp_dir(), prompts[4200], output[4200], log[4200], text[N_LONG * 40] = "";
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    snprintf(log, sizeof log, "%s", join(dir, "stderr.txt"));
    for (int i = 0; i < N_LONG; i++) sprintf(text + strlen(text), "{\"prompt_ids\": [2, %d, %d]}\n", 10 + i, 900 - i);
    write_text_file(prompts, text);
    pid_t first = start_long_job(prompts, output, log);
    CU_ASSERT_FATAL(first > 0);
    CU_ASSERT(wait_for_lines(output, 2) >= 2); /* its first window is out: it holds the lock */
    kill(first, SIGSTOP);
    for (int resume = 0; resume < 2; resume++) {
        const char *args[] = {"--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "32", "--quiet",
                              "--gpu-batch-size", "1", "--num-gpu-batches", "1", "--output", output,
                              resume ? "--resume" : NULL, NULL};
        expect_fail(args, NULL, "--output", "another job holds it", (const char *)NULL);
    }
    int still_running = waitpid(first, NULL, WNOHANG) == 0;
    kill(first, SIGCONT);
    int rc = exit_status(first);
    char *records = slurp(output, NULL);
    int lines = count_lines(records), once = whole_lines(records);
    char **ids = calloc(N_LONG + 1, sizeof *ids);
    for (const char *l = records ? strchr(records, '\n') : NULL; l && l[1] && once; l = strchr(l + 1, '\n')) {
        cJSON *r = cJSON_Parse(l + 1);
        int i = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(r, "id"));
        once = i >= 1 && i <= N_LONG && !ids[i];
        if (once) ids[i] = "seen";
        cJSON_Delete(r);
    }
    EXPECT(still_running && rc == 0 && lines == N_LONG + 1 && once, "two jobs on one output: expected the first to "
           "run on alone (running %d, exit %d) to one record a prompt; got %d lines%s", still_running, rc, lines,
           once ? "" : ", an id twice or a line not whole");
    free(ids), free(records);
    unlink(output); /* now removed while a job writes it */
    pid_t job = start_long_job(prompts, output, log);
    CU_ASSERT(wait_for_lines(output, 2) >= 2);
    kill(job, SIGSTOP);
    unlink(output);
    kill(job, SIGCONT);
    rc = exit_status(job);
    char *said = slurp(log, NULL);
    EXPECT(rc == 2 && said && strstr(said, "--output") && strstr(said, "removed or replaced") && count_lines(said) == 1,
           "the output removed during the job: expected exit 2 and one line saying so; got %d, '%s'", rc, said);
    free(said);
    rm_tree(dir);
    free(dir);
}

/* A job stopped (SIGINT) before its first record removes the output it made: nothing is left. */
static void test_job_interrupted_early(void) {
    char *dir = make_temp_dir(), prompts[4200], output[4200], text[300 * 40] = "";
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    for (int i = 0; i < 300; i++) sprintf(text + strlen(text), "{\"prompt_ids\": [2, %d, 7, 9]}\n", 10 + i);
    write_text_file(prompts, text);
    const char *job[] = {flexgen_bin(), "--model", "opt-125m", "--prompt-file", prompts, "--output", output,
                         "--gen-len", "64", "--quiet", NULL}; /* its first window: 256 prompts */
    pid_t pid;
    CU_ASSERT_FATAL(posix_spawn(&pid, job[0], NULL, NULL, (char *const *)job, environ) == 0);
    for (int tries = 0; tries < 30000 && access(output, F_OK) != 0; tries++) usleep(1000);
    int made = access(output, F_OK) == 0;
    kill(pid, SIGINT);
    int rc = exit_status(pid);
    EXPECT(made && rc == 128 + SIGINT && dir_entries(dir) == 1, "a job stopped before its first record: expected "
           "the output it made removed; made %d, exit %d, %d files beside the prompts", made, rc, dir_entries(dir) - 1);
    rm_tree(dir);
    free(dir);
}

/* What names a job. Other --prompt texts are another job; the same prompt file and checkpoint by
 * other paths (a symbolic link, ..) are the same job; another --gpu-batch-size is another job (a
 * batch's numbers depend on its rows); --policy auto resumes with the block shape the job began
 * with, to the uninterrupted output. */
static void test_job_identity(void) {
    char *dir = make_temp_dir(), prompts[4200], output[4200], cut[4200], link[4200], hw[4200], text[2048] = "";
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    snprintf(cut, sizeof cut, "%s", join(dir, "cut.jsonl"));
    snprintf(link, sizeof link, "%s", join(dir, "model"));
    snprintf(hw, sizeof hw, "%s", join(dir, "hw.json"));
    write_hw(hw);
    char *model = realpath(kjv_dir, NULL);
    CU_ASSERT_FATAL(model && symlink(model, link) == 0);
    free(model);
    run_ok(ARGS(flexgen_bin(), "--model", kjv_dir, "--prompt", "In the beginning", "--prompt", "And God said",
                "--output", output, "--gen-len", "3", "--quiet"));
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt", "Blessed are", "--prompt", "the meek", "--output", output,
                     "--gen-len", "3", "--resume"), "another job", "prompts_fnv64");
    unlink(output);
    for (int i = 0; i < 20; i++) sprintf(text + strlen(text), "{\"prompt_ids\": [2, %d, %d, %d]}\n", 30 + i, 7 * i + 5, 600 - i);
    write_text_file(prompts, text);
    char other_path[4300];
    snprintf(other_path, sizeof other_path, "%s/../%s/prompts.jsonl", dir, strrchr(dir, '/') + 1);
    for (int auto_policy = 0; auto_policy < 2; auto_policy++) { /* --hw is the search's: a manual run refuses it */
        const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "6", "--quiet",
                             "--temperature", "0.9", "--seed", "5", "--output", output, "--policy",
                             auto_policy ? "auto" : "manual", auto_policy ? "--hw" : "--offload-dir",
                             auto_policy ? hw : dir, "--gpu-batch-size", "2", NULL, NULL};
        unlink(output);
        run_ok(job);
        char *full = slurp(output, NULL), *part = full ? first_lines(full, 18) : NULL; /* 17 of 20 records */
        CU_ASSERT_FATAL(full && part);
        write_text_file(cut, part);
        job[2] = link, job[4] = other_path, job[13] = cut, job[20] = "--resume";
        run_ok(job);
        char *resumed = slurp(cut, NULL);
        EXPECT(resumed && !strcmp(resumed, full), "%s job resumed by other paths to its model and prompts: expected "
               "the uninterrupted output", auto_policy ? "a --policy auto" : "a");
        if (!auto_policy) {
            write_text_file(cut, part);
            job[19] = "3";
            char *out, *err;
            int rc = run_command(job, NULL, &out, &err);
            EXPECT(rc == 2 && strstr(err, "another job") && strstr(err, "gpu_batch_size"), "resumed with another "
                   "--gpu-batch-size: expected exit 2 naming gpu_batch_size; got %d, '%s'", rc, err);
            free(out), free(err);
        }
        free(full), free(part), free(resumed);
    }
    /* --policy auto keeps the block shape a job began with: capacities too small for it, where a new
     * job would fit, are refused with one line that says so */
    text[0] = 0;
    for (int i = 0; i < 40; i++) sprintf(text + strlen(text), "{\"prompt_ids\": [2, %d, %d]}\n", 30 + i, 600 - i);
    write_text_file(prompts, text);
    unlink(output);
    run_ok(ARGS(flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "4", "--quiet", "--policy",
                "auto", "--hw", hw, "--gpu-mem", "64M", "--output", output));
    char *full = slurp(output, NULL), *part = full ? first_lines(full, 3) : NULL;
    CU_ASSERT_FATAL(part != NULL);
    write_text_file(cut, part);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "4", "--policy", "auto", "--hw", hw,
                     "--gpu-mem", "6M", "--cpu-mem", "64M", "--output", cut, "--resume", "--quiet"),
                "--resume", "keeps the block shape it began with", "a new job would take");
    free(full), free(part);
    rm_tree(dir);
    free(dir);
}

/* FLEXGEN_ISA (or the env var named) set to value for run_command, then put back. */
static int run_with_env(const char *name, const char *value, const char *const *argv, char **out, char **err) {
    char *saved = env_put(name, value);
    int rc = run_command(argv, NULL, out, err);
    env_restore(name, saved);
    return rc;
}

/* What the kernels do to a job's identity. Every path of the CPU kernels gives the same bits
 * (tests/test_cli.c, "FLEXGEN_ISA: every path to the same logits"), so the job line does not name
 * the path: a job of 4-bit weights times int8 activations (where a last-bit difference upstream
 * would become a whole step of int8), begun on this CPU's widest path and resumed on the portable
 * one, ends as the uninterrupted output. OpenBLAS's core, whose sgemm runs prefill, does change
 * bits: the job line names it, and a resume on another core is another job, refused with one line
 * naming blas_core and the output untouched; so does the instruction set of oneDNN's kernels for
 * --bf16-prefill (prefill_library). */
static void test_job_kernels_identity(void) {
    char *dir = make_temp_dir(), prompts[4200], output[4200], cut[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    snprintf(cut, sizeof cut, "%s", join(dir, "cut.jsonl"));
    /* the last four are resumed; the two in the middle are prompts whose third token came out
     * otherwise on the portable path while its decode attention summed in another order */
    write_text_file(prompts, "{\"prompt_ids\": [2, 49, 251, 10, 42]}\n{\"prompt_ids\": [2, 58, 252, 17, 73]}\n"
                             "{\"prompt_ids\": [2, 175, 265, 108, 476]}\n{\"prompt_ids\": [2, 544, 306, 395, 1747]}\n"
                             "{\"prompt_ids\": [2, 67, 253, 24, 104]}\n{\"prompt_ids\": [2, 76, 254, 31, 135]}\n");
    const char *job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "6",
                         "--gpu-batch-size", "1", "--num-gpu-batches", "1", "--compress-weight", "--int8-activations",
                         "--device", "cpu", "--quiet", "--output", output, NULL, NULL};
    run_ok(job);
    char *full = slurp(output, NULL), *part = full ? first_lines(full, 3) : NULL; /* 2 of 6 records */
    CU_ASSERT_FATAL(full && part && count_lines(full) == 7);
    char *line = first_lines(full, 1);
    cJSON *head = cJSON_Parse(line);
    const cJSON *core = cJSON_GetObjectItem(cJSON_GetObjectItem(head, "flexgen_job"), "blas_core");
    EXPECT(cJSON_IsString(core) && *core->valuestring, "a CPU job's line: expected \"blas_core\", got %s", line);
    char other[32] = "Prescott"; /* a core every x86-64 CPU runs */
    if (cJSON_IsString(core) && !strcasecmp(core->valuestring, "Prescott")) snprintf(other, sizeof other, "Nehalem");
    cJSON_Delete(head);
    free(line);
    job[17] = cut, job[18] = "--resume";
    char *out, *err;
    write_text_file(cut, part);
    int rc = run_with_env("FLEXGEN_ISA", "portable", job, &out, &err);
    char *resumed = slurp(cut, NULL);
    EXPECT(rc == 0 && resumed && !strcmp(resumed, full), "a job resumed with FLEXGEN_ISA=portable: expected exit 0 "
           "and the uninterrupted output, got %d: %s", rc, err);
    free(out), free(err), free(resumed);
#if defined(__x86_64__)
    write_text_file(cut, part);
    rc = run_with_env("OPENBLAS_CORETYPE", other, job, &out, &err);
    resumed = slurp(cut, NULL);
    EXPECT(rc == 2 && strstr(err, "another job") && strstr(err, "blas_core") && count_lines(err) == 1 && resumed &&
           !strcmp(resumed, part), "a job resumed with OPENBLAS_CORETYPE=%s: expected exit 2, one line naming "
           "blas_core, and the output as it was; got %d, '%s'", other, rc, err);
    free(out), free(err), free(resumed);
    /* --bf16-prefill's products sum in fp32 in the order of oneDNN's kernel, which its instruction
     * set decides (with the shapes): the job line names that set, and a resume where
     * ONEDNN_MAX_CPU_ISA gives oneDNN another is another job (oneDNN 2.6 has bf16 products from
     * AVX-512 on; capped at AVX512_CORE, an AVX-512 CPU's set is avx512_core) */
    if (fg_isa_of_cpu() >= FG_ISA_AVX512) {
        const char *bf16_job[] = {flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--gen-len", "3",
                                  "--bf16-prefill", "--device", "cpu", "--quiet", "--output", output, NULL, NULL};
        unlink(output);
        run_ok(bf16_job);
        char *bf16_full = slurp(output, NULL), *bf16_part = bf16_full ? first_lines(bf16_full, 3) : NULL;
        CU_ASSERT_FATAL(bf16_full && bf16_part);
        line = first_lines(bf16_full, 1);
        head = cJSON_Parse(line);
        const cJSON *isa = cJSON_GetObjectItem(cJSON_GetObjectItem(head, "flexgen_job"), "prefill_library");
        EXPECT(cJSON_IsString(isa), "a --bf16-prefill job's line: expected \"prefill_library\", got %s", line);
        int same = cJSON_IsString(isa) &&
                   (!strcmp(isa->valuestring, "onednn avx512_core") || !strcmp(isa->valuestring, "none"));
        bf16_job[12] = cut, bf16_job[13] = "--resume";
        write_text_file(cut, bf16_part);
        rc = run_with_env("ONEDNN_MAX_CPU_ISA", "AVX512_CORE", bf16_job, &out, &err);
        resumed = slurp(cut, NULL);
        if (same)
            EXPECT(rc == 0 && resumed && !strcmp(resumed, bf16_full), "a --bf16-prefill job resumed on its own "
                   "oneDNN instruction set: expected the uninterrupted output, got %d: %s", rc, err);
        else
            EXPECT(rc == 2 && strstr(err, "prefill_library") && count_lines(err) == 1 && resumed &&
                   !strcmp(resumed, bf16_part), "a --bf16-prefill job begun on %s, resumed with "
                   "ONEDNN_MAX_CPU_ISA=AVX512_CORE: expected exit 2, one line naming prefill_library, and the "
                   "output as it was; got %d, '%s'", cJSON_IsString(isa) ? isa->valuestring : "?", rc, err);
        free(out), free(err), free(resumed);
        cJSON_Delete(head);
        free(line), free(bf16_full), free(bf16_part);
    }
#endif
    free(full), free(part);
    rm_tree(dir);
    free(dir);
}

/* Where a tensor's bytes lie in a safetensors file: [*begin, *end) from the file's start. */
static int tensor_span(const char *path, const char *name, long *begin, long *end) {
    FILE *f = fopen(path, "rb");
    uint64_t n = 0;
    char *header = NULL;
    int ok = f && fread(&n, 8, 1, f) == 1 && n < (1 << 20) && (header = calloc(n + 1, 1)) && fread(header, 1, n, f) == n;
    if (f) fclose(f);
    cJSON *root = ok ? cJSON_Parse(header) : NULL;
    const cJSON *offsets = cJSON_GetObjectItem(cJSON_GetObjectItem(root, name), "data_offsets");
    ok = cJSON_GetArraySize(offsets) == 2;
    if (ok) {
        *begin = 8 + (long)n + (long)cJSON_GetArrayItem(offsets, 0)->valuedouble;
        *end = 8 + (long)n + (long)cJSON_GetArrayItem(offsets, 1)->valuedouble;
    }
    cJSON_Delete(root);
    free(header);
    return ok ? 0 : -1;
}

/* Whether bytes [at, at + 2) of a file of `size` bytes miss what a hash of samples would read: its
 * first 64 KiB and 4 KiB at each sixteenth of it. */
static int between_samples(long at, long size) {
    if (at < 65536) return 0;
    for (int k = 0; k < 16; k++)
        if (at + 2 > size / 16 * k && at < size / 16 * k + 4096) return 0;
    return 1;
}

/* A job's output, cut after its job line and two records, resumed with `model`: its exit status,
 * the output as the resume left it in *after (malloc'd), its stderr in *err. */
static int resume_cut_job(const char *model, const char *prompts, const char *output, const char *full, char **after,
                          char **err) {
    char *part = first_lines(full, 3), *out;
    write_text_file(output, part);
    free(part);
    int rc = run_flexgen(ARGS("--model", model, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                              "--gpu-batch-size", "1", "--quiet", "--resume"), NULL, &out, err);
    free(out);
    *after = slurp(output, NULL);
    return rc;
}

/* A checkpoint is named by every byte of it. A job cut short and resumed with another checkpoint
 * directory, or with its own whose layer 1 down_proj had two bytes changed in its middle (where a
 * hash of the first 64 KiB and 16 samples of 4 KiB reads nothing), is another job: refused with
 * one line naming checkpoint_hash64, the output untouched; so is one with a generation_config.json
 * added (its eos ids end sequences), and without it the job resumes to the uninterrupted output.
 * A job line of an earlier version, which named the checkpoint by samples (checkpoint_fnv64), is
 * refused with a line saying so. */
static void test_job_checkpoint_identity(void) {
    char *dir = make_temp_dir(), *model = make_temp_dir(), prompts[4200], output[4200], cmd[9000], weights[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    snprintf(weights, sizeof weights, "%s", join(model, "model.safetensors"));
    write_text_file(prompts, "{\"prompt_ids\": [1, 10, 11]}\n{\"prompt_ids\": [1, 12]}\n{\"prompt_ids\": [1, 13, 14]}\n"
                             "{\"prompt_ids\": [1, 15]}\n{\"prompt_ids\": [1, 16, 17, 18]}\n");
    snprintf(cmd, sizeof cmd, "cp '%s'/config.json '%s'/model.safetensors '%s'/", llama_kjv_dir, llama_kjv_dir, model);
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    run_ok(ARGS(flexgen_bin(), "--model", model, "--prompt-file", prompts, "--output", output, "--gen-len", "3",
                "--gpu-batch-size", "1", "--quiet"));
    char *full = slurp(output, NULL), *after, *err;
    CU_ASSERT_FATAL(full && count_lines(full) == 6);
    EXPECT(strstr(full, "\"checkpoint_hash64\":\"") != NULL, "a job on a checkpoint: no checkpoint_hash64 in %.300s", full);
    int rc = resume_cut_job(kjv_dir, prompts, output, full, &after, &err);
    EXPECT(rc == 2 && strstr(err, "another job") && strstr(err, "checkpoint_hash64") && count_lines(err) == 1 &&
           after && count_lines(after) == 3, "resumed with another checkpoint directory: expected exit 2 naming "
           "checkpoint_hash64 and the output as it was, got %d, '%s', %d lines", rc, err, count_lines(after));
    free(after), free(err);
    long begin = 0, end = 0, at;
    struct stat st;
    CU_ASSERT_EQUAL_FATAL(tensor_span(weights, "model.layers.1.mlp.down_proj.weight", &begin, &end), 0);
    CU_ASSERT_EQUAL_FATAL(stat(weights, &st), 0);
    for (at = (begin + end) / 2 / 2 * 2; at + 2 <= end && !between_samples(at, (long)st.st_size); at += 2) continue;
    CU_ASSERT_FATAL(at + 2 <= end);
    FILE *f = fopen(weights, "r+b");
    unsigned char two[2];
    CU_ASSERT_FATAL(f && fseek(f, at, SEEK_SET) == 0 && fread(two, 1, 2, f) == 2);
    two[0] ^= 0xff; /* the low mantissa bytes of two fp16 weights: finite, a little changed */
    two[1] = (unsigned char)(two[1] ^ 0x01);
    CU_ASSERT_FATAL(fseek(f, at, SEEK_SET) == 0 && fwrite(two, 1, 2, f) == 2 && fclose(f) == 0);
    rc = resume_cut_job(model, prompts, output, full, &after, &err);
    EXPECT(rc == 2 && strstr(err, "another job") && strstr(err, "checkpoint_hash64") && after && count_lines(after) == 3,
           "resumed after two bytes at %ld of down_proj [%ld, %ld) changed: expected exit 2 naming checkpoint_hash64, "
           "got %d, '%s'", at, begin, end, rc, err);
    free(after), free(err);
    two[0] ^= 0xff; /* the weights as they were, and a generation_config.json beside them: its eos ids end sequences */
    two[1] = (unsigned char)(two[1] ^ 0x01);
    f = fopen(weights, "r+b");
    CU_ASSERT_FATAL(f && fseek(f, at, SEEK_SET) == 0 && fwrite(two, 1, 2, f) == 2 && fclose(f) == 0);
    write_text_file(join(model, "generation_config.json"), "{\"eos_token_id\": [2, 10]}\n");
    rc = resume_cut_job(model, prompts, output, full, &after, &err);
    EXPECT(rc == 2 && strstr(err, "another job") && strstr(err, "checkpoint_hash64") && after && count_lines(after) == 3,
           "resumed with a generation_config.json added: expected exit 2 naming checkpoint_hash64, got %d, '%s'", rc,
           err);
    free(after), free(err);
    unlink(join(model, "generation_config.json"));
    rc = resume_cut_job(model, prompts, output, full, &after, &err);
    EXPECT(rc == 0 && after && !strcmp(after, full), "resumed on the checkpoint as it was: expected exit 0 and the "
           "uninterrupted output, got %d, '%s'", rc, err);
    free(after), free(err);
    char *old = replaced(full, "\"checkpoint_hash64\":", "\"checkpoint_fnv64\":"); /* an earlier version's */
    rc = resume_cut_job(model, prompts, output, old, &after, &err);
    EXPECT(rc == 2 && strstr(err, "earlier flexgen") && strstr(err, "checkpoint_fnv64") && count_lines(err) == 1,
           "an earlier version's job line (checkpoint_fnv64): expected exit 2 and one line saying so, got %d, '%s'", rc,
           err);
    free(after), free(err), free(old), free(full);
    rm_tree(model), rm_tree(dir);
    free(model), free(dir);
}

/* A job on a checkpoint with a FIFO among its files (no writer: an open that waits would wait for
 * ever) ends within a bound: a `*.safetensors` the model does not use, and a shard index beside
 * model.safetensors (read over it, as HF reads it), are not read (the job runs and names the
 * checkpoint as without them), and a FIFO the model would read (the shard index alone, the
 * weights) is refused with one line naming it, no output made. */
static void test_job_checkpoint_fifo(void) {
    char *dir = make_temp_dir(), *model = make_temp_dir(), prompts[4200], output[4200], plain[4200], cmd[9000];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    snprintf(plain, sizeof plain, "%s", join(dir, "plain.jsonl"));
    write_text_file(prompts, "{\"prompt_ids\": [1, 10, 11]}\n{\"prompt_ids\": [1, 12]}\n");
    snprintf(cmd, sizeof cmd, "cp '%s'/config.json '%s'/model.safetensors '%s'/", llama_kjv_dir, llama_kjv_dir, model);
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    const char *job[] = {"timeout", "60", flexgen_bin(), "--model", model, "--prompt-file", prompts, "--gen-len", "2",
                         "--quiet", "--output", plain, NULL};
    run_ok(job);
    char *expected = slurp(plain, NULL), *out, *err;
    CU_ASSERT_PTR_NOT_NULL_FATAL(expected);
    job[11] = output;
    CU_ASSERT_EQUAL_FATAL(mkfifo(join(model, "extra.safetensors"), 0600), 0);
    CU_ASSERT_EQUAL_FATAL(mkfifo(join(model, "model.safetensors.index.json"), 0600), 0);
    int rc = run_command(job, NULL, &out, &err);
    char *got = slurp(output, NULL);
    EXPECT(rc == 0 && got && !strcmp(got, expected), "a FIFO extra.safetensors the model does not use, and a FIFO "
           "index beside model.safetensors: expected exit 0 and the job as without them, got %d (124: it hung), "
           "'%s'", rc, err);
    free(out), free(err), free(got);
    unlink(output);
    unlink(join(model, "model.safetensors.index.json"));
    CU_ASSERT_EQUAL_FATAL(rename(join(model, "model.safetensors"), join(dir, "weights")), 0);
    static const char *const fifos[] = {"model.safetensors.index.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        CU_ASSERT_EQUAL_FATAL(mkfifo(join(model, fifos[i]), 0600), 0);
        rc = run_command(job, NULL, &out, &err);
        EXPECT(rc == 2 && count_lines(err) == 1 && strstr(err, fifos[i]) && strstr(err, "not a regular file") &&
               access(output, F_OK) != 0, "a FIFO %s: expected exit 2, one line naming it and no output, got %d "
               "(124: it hung), '%s'", fifos[i], rc, err);
        free(out), free(err);
        unlink(join(model, fifos[i]));
    }
    free(expected);
    rm_tree(model), rm_tree(dir);
    free(model), free(dir);
}

/* A prompt file's line and an output's record line are one JSON object each, in UTF-8, whose
 * strings and ids come back unchanged; an output's records are of the job's prompts, once each. */
static void test_job_bad_lines(void) {
    char *dir = make_temp_dir(), prompts[4200], bad[4200], output[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "prompts.jsonl"));
    snprintf(bad, sizeof bad, "%s", join(dir, "bad.jsonl"));
    snprintf(output, sizeof output, "%s", join(dir, "out.jsonl"));
    static const struct { const char *line, *says; } lines[] = {
        {"{\"prompt_ids\": [2, 10]} {\"prompt_ids\": [2, 11]}", "text after the JSON object"},
        {"{\"prompt_ids\": [2, 10], \"id\": \"a\xff\"}", "UTF-8"},
        {"{\"prompt\": \"In the\\u0000 beginning\"}", "\\u0000"},
        {"{\"prompt_ids\": [2, 10], \"id\": 1e400}", "give it as a string"},
        {"{\"prompt_ids\": [2, 10], \"id\": 12345678901234567890}", "give it as a string"},
        {"{\"prompt_ids\": [2, 10], \"id\": 1.5}", "give it as a string"},
        {"{\"prompt_ids\": [2, 10], \"id\": 1000000000000000}", "give it as a string"},
    };
    for (size_t i = 0; i < sizeof lines / sizeof *lines; i++) {
        write_text_file(bad, lines[i].line);
        EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-file", bad, "--output", output), "bad.jsonl line 1", lines[i].says);
    }
    write_text_file(prompts, "{\"prompt_ids\": [2, 10, 11], \"id\": 999999999999999}\n"
                        "{\"prompt\": \"caf\\u00e9 \\\\u0000\", \"id\": \"\\u00e9\"}\n");
    run_ok(ARGS(flexgen_bin(), "--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "2", "--quiet"));
    char *full = slurp(output, NULL), *first = full ? first_lines(full, 2) : NULL;
    EXPECT(full && strstr(full, "{\"id\":999999999999999,") && strstr(full, "{\"id\":\"\xc3\xa9\",\"prompt\":\"caf\xc3\xa9 \\\\u0000\""),
           "ids and strings as given: expected them back unchanged, got:\n%s", full ? full : "(no output)");
    static const char *const records[] = {"{\"id\":999999999999999,\"tokens\":[]}GARBAGE\n",
                                          "{\"id\":\"zz\",\"tokens\":[5],\"stop\":\"length\"}\n",
                                          "{\"id\":999999999999999,\"tokens\":[5],\"stop\":\"length\"}\n"};
    static const char *const says[] = {"text after the JSON object", "no prompt of this job has", "two records"};
    for (int i = 0; i < 3 && first; i++) { /* the job line and one record, then one that is not right */
        char *text = malloc(strlen(full) + 100), *after;
        sprintf(text, "%s%s", first, records[i]);
        write_text_file(output, text);
        expect_fail(ARGS("--model", kjv_dir, "--prompt-file", prompts, "--output", output, "--gen-len", "2", "--resume"),
                    NULL, "--resume", says[i], (const char *)NULL);
        after = slurp(output, NULL);
        EXPECT(after && !strcmp(after, text), "a refused --resume changed its output");
        free(text), free(after);
    }
    free(full), free(first);
    rm_tree(dir);
    free(dir);
}

/* An output that is an input is refused, by device and inode (a hard link, a path through ..),
 * and the input stays as it was, the files read through --model DIR included; a job needs
 * prompts given (a record names its prompt). */
static void test_outputs_apart_from_inputs(void) {
    char *dir = make_temp_dir(), prompts[4200], linked[4200], dotdot[4300], text[4200];
    snprintf(prompts, sizeof prompts, "%s", join(dir, "p.txt"));
    snprintf(linked, sizeof linked, "%s", join(dir, "linked.jsonl"));
    snprintf(text, sizeof text, "%s", join(dir, "t.txt"));
    snprintf(dotdot, sizeof dotdot, "%s/../%s/p.txt", dir, strrchr(dir, '/') + 1);
    write_text_file(prompts, "2 10 11\n2 12\n");
    write_text_file(text, "In the beginning God created the heaven and the earth.\n");
    CU_ASSERT_FATAL(link(prompts, linked) == 0);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--dump-logits", dotdot), "--dump-logits", "--prompt-ids",
                "the same file");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--trace", linked), "--trace", "the same file");
    EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir, "--text", text, "--predictions", text), "--predictions", "--text",
                "the same file");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--output", linked, "--resume"), "--output", "the same file");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--dump-logits", join(dir, "x"), "--trace",
                     join(dir, "x")), "--trace", "--dump-logits");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--output", join(dir, "out.jsonl")), "--output", "--prompt-file");
    /* two paths of 800 bytes: the line still ends with its reason */
    char deep[4200], deep_prompts[4300];
    snprintf(deep, sizeof deep, "%s", dir);
    for (int i = 0; i < 4; i++) {
        size_t at = strlen(deep);
        deep[at] = '/';
        memset(deep + at + 1, 'd', 199);
        deep[at + 200] = 0;
        CU_ASSERT_EQUAL_FATAL(mkdir(deep, 0755), 0);
    }
    snprintf(deep_prompts, sizeof deep_prompts, "%s/p.txt", deep);
    write_text_file(deep_prompts, "2 10 11\n");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", deep_prompts, "--trace", deep_prompts), "--trace",
                "which it would overwrite; give another file");
    unlink(deep_prompts);
    for (char *cut; (cut = strrchr(deep, '/')) && strlen(deep) > strlen(dir); *cut = 0) rmdir(deep);
    /* an empty path is no file (it made a temporary in the working directory and failed at the end) */
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--dump-logits", ""), "--dump-logits", "an empty path");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--trace", ""), "--trace", "an empty path");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--output", ""), "--output", "an empty path");
    EXPECT_FAIL(ARGS("perplexity", "--model", kjv_dir, "--text", text, "--predictions", ""), "--predictions",
                "an empty path");
    char *p = slurp(prompts, NULL), *t = slurp(text, NULL);
    EXPECT(p && t && !strcmp(p, "2 10 11\n2 12\n") && strstr(t, "God created") && dir_entries(dir) == 3,
           "refused outputs changed an input or left a file (%d in the directory)", dir_entries(dir));
    free(p), free(t);
    /* the files read through --model DIR: its config, checkpoint and tokenizer, by any path */
    char model[4200], config[4300], weights[4300], vocab[4300], *out, *err;
    snprintf(model, sizeof model, "%s", join(dir, "m"));
    CU_ASSERT_FATAL(run_command(ARGS("cp", "-r", kjv_dir, model), NULL, &out, &err) == 0);
    free(out), free(err);
    snprintf(config, sizeof config, "%s/config.json", model);
    snprintf(weights, sizeof weights, "%s/../m/model.safetensors", model);
    snprintf(vocab, sizeof vocab, "%s", join(dir, "vocab-link.json"));
    CU_ASSERT_FATAL(symlink("m/vocab.json", vocab) == 0);
    unlink(join(model, "generation_config.json")); /* made new below: its eos ids are read over config.json's */
    int before = dir_entries(model);
    char *config_text = slurp(config, NULL);
    EXPECT_FAIL(ARGS("--model", model, "--prompt-ids", prompts, "--dump-logits", config), "--dump-logits", "config.json",
                "--model");
    EXPECT_FAIL(ARGS("--model", model, "--prompt-ids", prompts, "--trace", weights), "--trace", "model.safetensors",
                "--model");
    EXPECT_FAIL(ARGS("perplexity", "--model", model, "--text", text, "--predictions", vocab), "--predictions",
                "vocab.json", "--model");
    EXPECT_FAIL(ARGS("--model", model, "--prompt-ids", prompts, "--output", config), "--output", "config.json",
                "--model");
    /* names a run reads there, made new: the shard index is read before model.safetensors, and
     * tokenizer.json before vocab.json; a file of another name may go there */
    EXPECT_FAIL(ARGS("--model", model, "--prompt-ids", prompts, "--trace", join(model, "model.safetensors.index.json")),
                "--trace", "model.safetensors.index.json", "--model", "would read");
    EXPECT_FAIL(ARGS("--model", model, "--prompt-ids", prompts, "--output", join(model, "tokenizer.json")), "--output",
                "tokenizer.json", "--model", "would read");
    EXPECT_FAIL(ARGS("--model", model, "--prompt-ids", prompts, "--trace", join(model, "generation_config.json")),
                "--trace", "generation_config.json", "--model", "would read");
    run_ok(ARGS(flexgen_bin(), "--model", model, "--prompt-ids", prompts, "--gen-len", "2", "--quiet", "--trace",
                join(model, "trace.json")));
    EXPECT(dir_entries(model) == before + 1, "--trace m/trace.json: expected one new file in --model, got %d",
           dir_entries(model) - before);
    unlink(join(model, "trace.json"));
    char *config_after = slurp(config, NULL);
    EXPECT(config_text && config_after && !strcmp(config_text, config_after) && dir_entries(model) == before,
           "refused outputs into --model's files changed config.json or left a file (%d in the directory, %d before)",
           dir_entries(model), before);
    free(config_text), free(config_after);
    /* the files a tokenizer reads beside --vocab (special_tokens_map.json, tokenizer_config.json)
     * and beside --tokenizer (tokenizer_config.json), and the default hardware file */
    char tok[4200], side[4300], special[4300], llama_side[4300], hw[4300];
    snprintf(tok, sizeof tok, "%s", join(dir, "tok"));
    CU_ASSERT_FATAL(mkdir(tok, 0755) == 0);
    static const char *const copied[] = {"opt-kjv/vocab.json", "opt-kjv/merges.txt", "opt-kjv/special_tokens_map.json",
                                         "opt-kjv/tokenizer_config.json", "llama-kjv/tokenizer.json"};
    for (int i = 0; i < 5; i++) {
        snprintf(side, sizeof side, "%s/../%s", kjv_dir, copied[i]);
        CU_ASSERT_FATAL(run_command(ARGS("cp", side, tok), NULL, &out, &err) == 0);
        free(out), free(err);
    }
    snprintf(side, sizeof side, "%s/vocab.json", tok);
    snprintf(special, sizeof special, "%s/special_tokens_map.json", tok);
    snprintf(llama_side, sizeof llama_side, "%s/tokenizer_config.json", tok);
    char *special_text = slurp(special, NULL), *config_before = slurp(llama_side, NULL);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--vocab", side, "--merges", join(tok, "merges.txt"), "--prompt", "In",
                     "--dump-logits", special), "--dump-logits", "special_tokens_map.json", "--vocab");
    EXPECT_FAIL(ARGS("--model", llama_kjv_dir, "--tokenizer", join(tok, "tokenizer.json"), "--prompt", "In",
                     "--trace", llama_side), "--trace", "tokenizer_config.json", "--tokenizer");
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--vocab", side, "--merges", join(tok, "merges.txt"), "--prompt", "In",
                     "--trace", join(tok, "added_tokens.json")), "--trace", "added_tokens.json", "--vocab");
    /* the dummy weights' directory: a .fgw name there is a weights file a run writes and reads */
    char weights_dir[4300];
    snprintf(weights_dir, sizeof weights_dir, "%s", join(dir, "weights"));
    CU_ASSERT_FATAL(mkdir(weights_dir, 0755) == 0);
    EXPECT_FAIL(ARGS("--model", "opt-125m", "--path", weights_dir, "--percent", "0", "0", "100", "0", "100", "0",
                     "--prompt-len", "8", "--gen-len", "2", "--trace", join(weights_dir, "opt-125m-seed0.fgw")),
                "--trace", ".fgw", "--path");
    EXPECT(dir_entries(weights_dir) == 0 && dir_entries(tok) == 5, "refused outputs left %d files in --path and %d "
           "beside --vocab (5 before)", dir_entries(weights_dir), dir_entries(tok));
    char *special_after = slurp(special, NULL), *config_after_tok = slurp(llama_side, NULL);
    EXPECT(special_text && special_after && !strcmp(special_text, special_after) && config_before && config_after_tok &&
           !strcmp(config_before, config_after_tok), "refused outputs changed a file read beside --vocab or --tokenizer");
    free(special_text), free(special_after), free(config_before), free(config_after_tok);
    char *saved = env_put("XDG_CACHE_HOME", dir); /* the default hardware file: dir/flexgen/hardware.json */
    snprintf(hw, sizeof hw, "%s/flexgen", dir);
    CU_ASSERT_FATAL(mkdir(hw, 0755) == 0);
    strcat(hw, "/hardware.json");
    write_hw(hw);
    char *hw_text = slurp(hw, NULL);
    EXPECT_FAIL(ARGS("--model", kjv_dir, "--prompt-ids", prompts, "--path", tok, "--trace", hw), "--trace",
                "the default --hw");
    char *hw_after = slurp(hw, NULL);
    EXPECT(hw_text && hw_after && !strcmp(hw_text, hw_after), "a refused --trace changed the default hardware file");
    free(hw_text), free(hw_after);
    /* a relative XDG_CACHE_HOME is ignored (the XDG spec): not a directory under wherever the run starts */
    char cache_dir[4200];
    setenv("XDG_CACHE_HOME", "relative-cache", 1);
    default_weight_dir(cache_dir, sizeof cache_dir);
    EXPECT(cache_dir[0] == '/' && !strstr(cache_dir, "relative-cache"),
           "XDG_CACHE_HOME=relative-cache: the default directory is %s, expected an absolute one past it", cache_dir);
    env_restore("XDG_CACHE_HOME", saved);
    rm_tree(dir);
    free(dir);
}

void add_job_tests(void) {
    CU_pSuite s = CU_add_suite("jobs", jobs_init, NULL);
    CU_add_test(s, "a JSONL job: one record a prompt, as a plain run generates", test_job_output);
    CU_add_test(s, "a job's records hold HF's tokens, </s> included unless --stop-at-eos", test_job_tokens_match_hf);
    CU_add_test(s, "a job groups prompts of similar length: less padding", test_job_less_padding);
    CU_add_test(s, "a job with the diagonal schedule: zig-zag's records, a group at a time", test_job_diagonal);
    CU_add_test(s, "zig-zag and the diagonal pad each GPU batch alike: the same records, 4-bit and int8",
                test_job_schedules_pad_alike);
    CU_add_test(s, "--warmup: the same records, run and resumed; the cold run's latency", test_job_warmup);
    CU_add_test(s, "a job killed mid-run resumes to an uninterrupted run's output, zig-zag and diagonal", test_job_resume_after_kill);
    CU_add_test(s, "--resume finds finished ids in any order", test_job_resume_unsorted_ids);
    CU_add_test(s, "--resume of an output that holds only its job line", test_job_resume_job_line_only);
    CU_add_test(s, "--resume of a finished job drops a cut last line; a line of an id alone is refused",
                test_job_resume_finished_and_cut);
    CU_add_test(s, "a LLaMA job: text through tokenizer.json, the cache on disk, cut and resumed", test_job_llama);
    CU_add_test(s, "one job at a time on an output; an output removed mid-job stops it", test_job_lock);
    CU_add_test(s, "a job stopped before its first record leaves no output", test_job_interrupted_early);
    CU_add_test(s, "a job is named by its prompts, model, flags and block shape", test_job_identity);
    CU_add_test(s, "a job resumed on another FLEXGEN_ISA ends as it began; another BLAS core or oneDNN kernel is another job",
                test_job_kernels_identity);
    CU_add_test(s, "a job's checkpoint is named by every byte: another one, or one tensor changed, is refused",
                test_job_checkpoint_identity);
    CU_add_test(s, "a FIFO in the checkpoint directory: not read unless used, refused if used, no hang",
                test_job_checkpoint_fifo);
    CU_add_test(s, "bad jobs: one line, exit 2, the output untouched", test_job_bad_input);
    CU_add_test(s, "JSONL lines: one object, UTF-8, values that come back unchanged", test_job_bad_lines);
    CU_add_test(s, "an output that is an input is refused", test_outputs_apart_from_inputs);
    CU_add_test(s, "a job's output past a full disk keeps whole windows and resumes", test_job_output_full);
}
