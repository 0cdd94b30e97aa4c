/* app/pipeline.c: pipeline parallelism (the paper's §4.4, "Extension to Multiple GPUs"): one
 * process per stage, each running the block schedule of Fig. 4 over its share of the layers.
 *
 *   fg_pipe_open    under mpirun, one process per stage: MPI started, a crash names its rank
 *   messages        non-blocking sends and receives that a thread of their own drives while the
 *                   stages compute (Open MPI moves large messages only inside MPI calls)
 *   collectives     what setup and the report need: agreeing on failure, broadcast, gathers
 *   stage hooks     what the schedule does at a stage's edges (fg_pipeline_attach): the first
 *                   layer's input comes from the previous stage, the last layer's output goes to
 *                   the next, the last stage's token ids go back to the first
 *
 * The schedule (flexgen.c) reaches a pipeline only through the hooks; it never asks whether MPI
 * is there. Built without MPI (no mpicc), or run without mpirun, every process is one stage and
 * fg_pipe_open gives NULL.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Launched by mpirun (Open MPI, or a PMI launcher such as MPICH's)? Without it, MPI is never
 * started: a plain ./flexgen behaves exactly as a build without MPI. */
static int under_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

#ifndef FLEXGEN_MPI

int fg_pipe_compiled(void) { return 0; }

int fg_pipe_open(int *argc, char ***argv, fg_pipe **out, char *err) {
    (void)argc;
    (void)argv;
    *out = NULL;
    if (under_mpirun() && getenv("OMPI_COMM_WORLD_SIZE") &&
        strcmp(getenv("OMPI_COMM_WORLD_SIZE"), "1"))
        return fg_fail(err,
                       "this flexgen was built without MPI (no mpicc at build time): it cannot "
                       "run as pipeline stages");
    return 0;
}
void fg_pipe_close(fg_pipe *p) { (void)p; }
int fg_pipe_rank(const fg_pipe *p) {
    (void)p;
    return 0;
}
int fg_pipe_size(const fg_pipe *p) {
    (void)p;
    return 1;
}
int fg_pipe_send(fg_pipe *p, int to, int tag, const void *buf, size_t bytes) {
    (void)p;
    (void)to;
    (void)tag;
    (void)buf;
    (void)bytes;
    return -1;
}
int fg_pipe_recv(fg_pipe *p, int from, int tag, void *buf, size_t bytes) {
    (void)p;
    (void)from;
    (void)tag;
    (void)buf;
    (void)bytes;
    return -1;
}
static double fg_pipe_wait(fg_pipe *p, int msg, size_t *bytes) {
    (void)p;
    (void)msg;
    if (bytes) *bytes = 0;
    return 0;
}
void fg_pipe_release(fg_pipe *p, int msg) {
    (void)p;
    (void)msg;
}
double fg_pipe_bytes_sent(const fg_pipe *p) {
    (void)p;
    return 0;
}
int fg_pipe_agree(fg_pipe *p, int rc, char *err) {
    (void)p;
    (void)err;
    return rc ? -1 : 0;
}
void fg_pipe_bcast(fg_pipe *p, void *buf, size_t bytes) {
    (void)p;
    (void)buf;
    (void)bytes;
}
void fg_pipe_gather(fg_pipe *p, const void *mine, size_t bytes, void *all) {
    (void)p;
    memcpy(all, mine, bytes);
}
char *fg_pipe_gather_text(fg_pipe *p, const char *mine) {
    (void)p;
    return strdup(mine);
}

#else /* FLEXGEN_MPI */

#include <errno.h>
#include <mpi.h>
#include <pthread.h>
#include <time.h>

/* A message in flight: started by the thread that posts it (so MPI sees them in posting order,
 * which keeps messages of one kind in order), completed by the pipe's thread, and free again once
 * its poster releases it (fg_pipe_release). A stage holds each GPU batch's send of the step until
 * the next step's (its outbox slot is not written before the message has left): a block's whole
 * shape of them, on every stage's block at once, so the table grows to what the schedule holds
 * (doubling from PIPE_MSGS) rather than making a post wait for a release that only the poster
 * itself would make. */
enum { MSG_FREE, MSG_ACTIVE, MSG_DONE };
typedef struct {
    int state, send, peer, tag;
    void *buf;
    size_t bytes, got;
    MPI_Request req;
} pipe_msg;

#define PIPE_MSGS 256 /* the table's first size */

struct fg_pipe {
    int rank, size;
    long crash_after; /* tests: crash after posting this many messages (0: never) */
    long posted;
    pthread_t thread;
    pthread_mutex_t lock; /* the messages, and every MPI call (MPI_THREAD_SERIALIZED) */
    pthread_cond_t changed;
    pipe_msg *msgs; /* `capacity` of them */
    int capacity;
    int stop;
    double bytes_sent;
};

/* A crash of one stage: one line naming it, then the signal's own end, on which mpirun ends
 * the others; their offload files are unnamed, so nothing is left behind. */
static char crash_line[128];

static void on_crash(int sig) {
    char line[256];
    const char *name = sigdescr_np(sig);
    size_t n = (size_t)snprintf(line, sizeof line, "%s%s (signal %d)\n", crash_line,
                                name ? name : "", sig);
    if (write(2, line, n < sizeof line ? n : sizeof line - 1) < 0) { /* nothing else to do */
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void sleep_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* Completes what finished; polls while anything is in flight (with a backoff from 20 us to 1 ms),
 * sleeps on the condition otherwise. */
static void *pipe_thread(void *arg) {
    fg_pipe *p = arg;
    long idle_us = 20;
    pthread_mutex_lock(&p->lock);
    while (!p->stop) {
        int active = 0, finished = 0;
        for (int i = 0; i < p->capacity; i++) {
            pipe_msg *m = &p->msgs[i];
            if (m->state != MSG_ACTIVE) continue;
            int done = 0;
            MPI_Status st;
            MPI_Test(&m->req, &done, &st);
            if (!done) {
                active++;
                continue;
            }
            int count = 0;
            if (!m->send) MPI_Get_count(&st, MPI_BYTE, &count);
            m->got = m->send ? m->bytes : (size_t)count;
            if (m->send) p->bytes_sent += (double)m->bytes;
            m->state = MSG_DONE;
            finished++;
        }
        if (finished) {
            pthread_cond_broadcast(&p->changed);
            idle_us = 20;
        }
        if (!active && !finished) {
            pthread_cond_wait(&p->changed, &p->lock);
            continue;
        }
        pthread_mutex_unlock(&p->lock);
        if (!finished) {
            sleep_us(idle_us);
            idle_us = idle_us < 1000 ? idle_us * 2 : 1000;
        }
        pthread_mutex_lock(&p->lock);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

int fg_pipe_compiled(void) { return 1; }

int fg_pipe_open(int *argc, char ***argv, fg_pipe **out, char *err) {
    *out = NULL;
    if (!under_mpirun()) return 0;
    int provided;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
        return fg_fail(err, "MPI_Init_thread failed");
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size == 1) { /* -np 1: one process, as without mpirun */
        MPI_Finalize();
        return 0;
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        MPI_Finalize();
        return fg_fail(err, "this MPI does not allow calls from more than one thread");
    }
    fg_pipe *p = calloc(1, sizeof *p);
    pipe_msg *msgs = calloc(PIPE_MSGS, sizeof *msgs);
    if (!p || !msgs) {
        MPI_Abort(MPI_COMM_WORLD, 2);
        return fg_fail(err, "out of memory");
    }
    p->msgs = msgs;
    p->capacity = PIPE_MSGS;
    p->rank = rank;
    p->size = size;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->changed, NULL);
    if (pthread_create(&p->thread, NULL, pipe_thread, p)) {
        MPI_Abort(MPI_COMM_WORLD, 2);
        return fg_fail(err, "cannot start the pipeline thread: %s", strerror(errno));
    }
    /* FLEXGEN_TEST_CRASH=R:N: rank R crashes as it posts its Nth message (a stage failing in
     * the middle of a run, for the tests) */
    const char *crash = getenv("FLEXGEN_TEST_CRASH");
    int crash_rank;
    long crash_n;
    if (crash && sscanf(crash, "%d:%ld", &crash_rank, &crash_n) == 2 && crash_rank == rank)
        p->crash_after = crash_n;
    snprintf(crash_line, sizeof crash_line, "flexgen: rank %d (stage %d of %d): crashed: ", rank,
             rank + 1, size);
    int signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
    for (size_t i = 0; i < sizeof signals / sizeof *signals; i++) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_crash;
        sigaction(signals[i], &sa, NULL);
    }
    *out = p;
    return 0;
}

void fg_pipe_close(fg_pipe *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    pthread_join(p->thread, NULL);
    MPI_Finalize();
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->changed);
    free(p->msgs);
    free(p);
}

int fg_pipe_rank(const fg_pipe *p) { return p ? p->rank : 0; }
int fg_pipe_size(const fg_pipe *p) { return p ? p->size : 1; }

/* A free entry of the table, which doubles when every entry is held (under the lock: the pipe's
 * thread holds no entry's address across it). */
static int free_msg(fg_pipe *p) {
    for (int i = 0; i < p->capacity; i++)
        if (p->msgs[i].state == MSG_FREE) return i;
    pipe_msg *more = realloc(p->msgs, 2 * (size_t)p->capacity * sizeof *more);
    if (!more) {
        fprintf(stderr, "flexgen: rank %d: out of memory for pipeline messages\n", p->rank);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    memset(more + p->capacity, 0, (size_t)p->capacity * sizeof *more); /* MSG_FREE */
    p->msgs = more;
    p->capacity *= 2;
    return p->capacity / 2;
}

static int post(fg_pipe *p, int send, int peer, int tag, void *buf, size_t bytes) {
    if (p->crash_after && ++p->posted == p->crash_after) raise(SIGSEGV);
    pthread_mutex_lock(&p->lock);
    int i = free_msg(p);
    pipe_msg *m = &p->msgs[i];
    *m = (pipe_msg){MSG_ACTIVE, send, peer, tag, buf, bytes, 0, MPI_REQUEST_NULL};
    if (send) MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, MPI_COMM_WORLD, &m->req);
    else MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, tag, MPI_COMM_WORLD, &m->req);
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    return i;
}

int fg_pipe_send(fg_pipe *p, int to, int tag, const void *buf, size_t bytes) {
    return post(p, 1, to, tag, (void *)buf, bytes);
}

int fg_pipe_recv(fg_pipe *p, int from, int tag, void *buf, size_t bytes) {
    return post(p, 0, from, tag, buf, bytes);
}

/* Waits for a message (any thread may); returns the seconds waited, *bytes what arrived. */
static double fg_pipe_wait(fg_pipe *p, int msg, size_t *bytes) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pthread_mutex_lock(&p->lock);
    while (p->msgs[msg].state != MSG_DONE) pthread_cond_wait(&p->changed, &p->lock);
    if (bytes) *bytes = p->msgs[msg].got;
    pthread_mutex_unlock(&p->lock);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
}

void fg_pipe_release(fg_pipe *p, int msg) {
    fg_pipe_wait(p, msg, NULL);
    pthread_mutex_lock(&p->lock);
    p->msgs[msg].state = MSG_FREE;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
}

double fg_pipe_bytes_sent(const fg_pipe *p) {
    if (!p) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&p->lock);
    double b = p->bytes_sent;
    pthread_mutex_unlock((pthread_mutex_t *)&p->lock);
    return b;
}

/* The collectives run on the calling thread while the pipe's thread is idle (nothing in flight
 * between runs); the lock keeps the two from calling MPI at once all the same. */
int fg_pipe_agree(fg_pipe *p, int rc, char *err) {
    if (!p) return rc ? -1 : 0;
    int mine = rc ? p->rank : p->size, first;
    pthread_mutex_lock(&p->lock);
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    pthread_mutex_unlock(&p->lock);
    if (first == p->size) return 0;
    if (first == p->rank) { /* the one line of the job: this rank's, named */
        char line[FG_ERR_LEN];
        snprintf(line, sizeof line, "%s", err);
        fg_fail(err, "rank %d (stage %d of %d): %s", p->rank, p->rank + 1, p->size, line);
    } else {
        err[0] = 0; /* another rank says why */
    }
    return -1;
}

void fg_pipe_bcast(fg_pipe *p, void *buf, size_t bytes) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    for (size_t at = 0; at < bytes; at += 1 << 30) {
        size_t n = bytes - at < (size_t)1 << 30 ? bytes - at : (size_t)1 << 30;
        MPI_Bcast((char *)buf + at, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD);
    }
    pthread_mutex_unlock(&p->lock);
}

void fg_pipe_gather(fg_pipe *p, const void *mine, size_t bytes, void *all) {
    if (!p) {
        memcpy(all, mine, bytes);
        return;
    }
    pthread_mutex_lock(&p->lock);
    MPI_Gather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
    pthread_mutex_unlock(&p->lock);
}

char *fg_pipe_gather_text(fg_pipe *p, const char *mine) {
    if (!p) return strdup(mine);
    int len = (int)strlen(mine), *lens = calloc((size_t)p->size, sizeof *lens);
    int *at = calloc((size_t)p->size, sizeof *at), total = 0;
    if (!lens || !at) MPI_Abort(MPI_COMM_WORLD, 2);
    fg_pipe_gather(p, &len, sizeof len, lens);
    for (int r = 0; r < p->size; r++) at[r] = total, total += lens[r];
    char *all = p->rank == 0 ? malloc((size_t)total + 1) : NULL;
    pthread_mutex_lock(&p->lock);
    MPI_Gatherv(mine, len, MPI_CHAR, all, lens, at, MPI_CHAR, 0, MPI_COMM_WORLD);
    pthread_mutex_unlock(&p->lock);
    if (all) all[total] = 0;
    free(lens);
    free(at);
    return all;
}

#endif /* FLEXGEN_MPI */

/* ============================================================================================
 * The stage hooks. A stage's first layer takes the previous stage's output and its last layer
 * gives its own to the next, through host buffers (the network is not assumed to read device
 * memory). Messages of one kind between two stages arrive in the order they were sent, which is
 * the order in which both stages walk the blocks and their GPU batches. A GPU batch with no
 * sequences (the diagonal schedule's, before its first prompts and after its last) sends an empty
 * message; a block that stopped sends one of STOP_BYTES where its activations would be, a size
 * that rows of activations never have (a row is at least two bytes an element).
 * ============================================================================================ */

enum { STOP_BYTES = 1 };

static int rank_of(const block *bl) { return fg_pipe_rank(bl->rt->pipe); }
static int n_ranks(const block *bl) { return fg_pipe_size(bl->rt->pipe); }
static char *inbox_slot(const block *bl, int arena) {
    return bl->inbox + arena * bl->shape.act_message;
}
static char *outbox_slot(const block *bl, int k) { return bl->outbox + k * bl->shape.act_message; }

static int stage_agree(fg_runtime *rt, int rc, char *err) {
    return fg_pipe_agree(rt->pipe, rc, err);
}

/* A block's outbox (one slot per GPU batch) and the stage's inbox (two slots, by staging arena,
 * shared by its blocks), on the cpu tier. */
static int stage_open_block(block *bl, const block *shared, char *err) {
    const block_shape *s = &bl->shape;
    bl->in_msg = bl->ids_msg = -1;
    if (!(bl->out_msg = malloc((size_t)s->ngb * sizeof *bl->out_msg)))
        return fg_fail(err, "out of memory");
    for (int k = 0; k < s->ngb; k++) bl->out_msg[k] = -1;
    if (!is_last_stage(bl->m) &&
        !(bl->outbox = tier_alloc(bl->rt, TIER_CPU, s->act_message * s->ngb,
                                  "activations to the next stage", err)))
        return -1;
    if (shared) bl->inbox = shared->inbox;
    else if (!is_first_stage(bl->m) &&
             !(bl->inbox = tier_alloc(bl->rt, TIER_CPU, 2 * s->act_message,
                                      "activations from the previous stage", err)))
        return -1;
    return 0;
}

static void stage_close_block(block *bl) {
    const block_shape *s = &bl->shape;
    free(bl->out_msg);
    if (bl->outbox) tier_free(bl->rt, TIER_CPU, bl->outbox, s->act_message * s->ngb);
    if (!bl->borrowed && bl->inbox) tier_free(bl->rt, TIER_CPU, bl->inbox, 2 * s->act_message);
}

/* Posts the receive of GPU batch k's activations into inbox slot `arena`, unless it is posted. */
static void receive_hidden(block *bl, int k, int arena) {
    if (bl->in_msg >= 0) return;
    bl->in_k = k;
    bl->in_msg = fg_pipe_recv(bl->rt->pipe, rank_of(bl) - 1, FG_TAG_ACTIVATIONS,
                              inbox_slot(bl, arena), bl->shape.act_message);
}

/* The compute thread waits for the input of GPU batch k from the previous stage, if it is on its
 * way: the time is the pipeline's bubble. Returns the bytes that came (STOP_BYTES: the block
 * stopped), or 0 with nothing on its way. */
static size_t await_hidden(block *bl, int k) {
    size_t got = 0;
    if (bl->in_msg < 0 || bl->in_k != k) return 0;
    double start = now_seconds();
    bl->bubble += fg_pipe_wait(bl->rt->pipe, bl->in_msg, &got);
    trace_add(bl->rt, TRACK_COMPUTE, "wait for the previous stage", k, 0, start, now_seconds());
    return got;
}

static void stage_await_input(block *bl, int k) { await_hidden(bl, k); }

/* After the copy of a received input: its message is done with. */
static void stage_input_taken(block *bl) {
    if (bl->in_msg >= 0) fg_pipe_release(bl->rt->pipe, bl->in_msg);
    bl->in_msg = -1;
}

static void act_receive_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    size_t want = batch_act_bytes(bl, task->batch), got;
    fg_pipe_wait(rt->pipe, task->msg, &got);
    if (got != want) { /* the stages disagree on the schedule: a bug, not bad input */
        fprintf(stderr,
                "flexgen: rank %d: %zu bytes of activations came from the previous stage, "
                "%zu expected\n",
                rank_of(bl), got, want);
        abort();
    }
    rt->backend->copy_in(bl->x_stage[task->arena], inbox_slot(bl, task->arena), want);
    rt->backend->copies_done(); /* before the inbox takes the next message */
    link_add(rt, LINK_CPU_TO_GPU, (double)want);
}

static void act_send_task(fg_runtime *rt, const io_task *task) {
    block *bl = task->ctx;
    int k = task->batch;
    size_t bytes = batch_act_bytes(bl, k);
    if (bl->out_msg[k] >= 0) fg_pipe_release(rt->pipe, bl->out_msg[k]); /* the last step's left */
    rt->backend->copy_out(outbox_slot(bl, k), bl->x_stage[task->arena], bytes);
    rt->backend->copies_done(); /* in the outbox before it is sent */
    link_add(rt, LINK_GPU_TO_CPU, (double)bytes);
    bl->out_msg[k] =
        fg_pipe_send(rt->pipe, rank_of(bl) + 1, FG_TAG_ACTIVATIONS, outbox_slot(bl, k), bytes);
}

/* The stage's first layer: the previous stage's output of GPU batch k, copied into staging arena
 * `arena` once it arrives (nothing on the first stage, whose first layer reads token ids). */
static uint64_t stage_receive_activations(block *bl, int k, int arena) {
    if (is_first_stage(bl->m)) return 0;
    receive_hidden(bl, k, arena);
    io_task t = {.fn = act_receive_task,
                 .name = "receive activations",
                 .ctx = bl,
                 .layer = bl->m->first_layer,
                 .batch = k,
                 .arena = arena,
                 .msg = bl->in_msg};
    return io_submit(&bl->rt->io, IO_HOST, t);
}

/* The stage's last layer: its output of GPU batch k, to the next stage (the last stage's output
 * is the logits, which stay). */
static void stage_send_activations(block *bl, int k, int arena) {
    if (is_last_stage(bl->m)) return;
    io_task t = {.fn = act_send_task,
                 .name = "send activations",
                 .ctx = bl,
                 .layer = bl->m->end_layer - 1,
                 .batch = k,
                 .arena = arena};
    io_submit(&bl->rt->io, IO_HOST, t);
}

/* Tells the next stage that this block has stopped. */
static void stage_pass_stop(block *bl) {
    if (!is_last_stage(bl->m))
        fg_pipe_release(bl->rt->pipe, fg_pipe_send(bl->rt->pipe, rank_of(bl) + 1,
                                                   FG_TAG_ACTIVATIONS, bl->ids, STOP_BYTES));
}

/* A later stage computes a step of a block when the previous stage's output arrives (into the
 * slot of the step's first staging arena, 0); a message of STOP_BYTES says the block stopped,
 * which is passed on. The last stage's ids of the step before have made their trip by then:
 * sampling may overwrite them. */
static int stage_step_input(block *bl) {
    if (!is_first_stage(bl->m)) {
        receive_hidden(bl, 0, 0);
        if (await_hidden(bl, 0) == STOP_BYTES) {
            stage_input_taken(bl);
            bl->running = 0;
            stage_pass_stop(bl);
            return 0;
        }
    }
    if (bl->ids_msg >= 0) {
        fg_pipe_release(bl->rt->pipe, bl->ids_msg);
        bl->ids_msg = -1;
    }
    return 1;
}

/* The first stage: the token ids of step `step` come back from the last stage; the time waiting
 * for them is the pipeline's bubble. */
static void stage_receive_tokens(block *bl, int step) {
    if (is_last_stage(bl->m)) return;
    double start = now_seconds();
    int msg = fg_pipe_recv(bl->rt->pipe, n_ranks(bl) - 1, FG_TAG_TOKENS, bl->ids,
                           (size_t)bl->count * sizeof(int));
    bl->bubble += fg_pipe_wait(bl->rt->pipe, msg, NULL);
    fg_pipe_release(bl->rt->pipe, msg);
    trace_add(bl->rt, TRACK_COMPUTE, "wait for the last stage", step, 0, start, now_seconds());
}

/* The last stage: the chosen ids go back to the first stage; its own copy of the outputs keeps
 * --stop-at-eos's bookkeeping for the logits. */
static void stage_tokens_out(block *bl, const gen_options *opt, int *out_tokens) {
    if (is_first_stage(bl->m)) return;
    take_tokens(bl, opt, out_tokens);
    bl->ids_msg =
        fg_pipe_send(bl->rt->pipe, 0, FG_TAG_TOKENS, bl->ids, (size_t)bl->count * sizeof(int));
}

/* The messages a block has in flight, done (at the end of a round). */
static void stage_end_round(block *bl) {
    for (int k = 0; k < bl->shape.ngb; k++)
        if (bl->out_msg[k] >= 0) {
            fg_pipe_release(bl->rt->pipe, bl->out_msg[k]);
            bl->out_msg[k] = -1;
        }
    if (bl->ids_msg >= 0) {
        fg_pipe_release(bl->rt->pipe, bl->ids_msg);
        bl->ids_msg = -1;
    }
}

static const stage_hooks pipeline_stage = {
    .agree = stage_agree,
    .open_block = stage_open_block,
    .close_block = stage_close_block,
    .receive_activations = stage_receive_activations,
    .send_activations = stage_send_activations,
    .await_input = stage_await_input,
    .input_taken = stage_input_taken,
    .step_input = stage_step_input,
    .receive_tokens = stage_receive_tokens,
    .tokens_out = stage_tokens_out,
    .pass_stop = stage_pass_stop,
    .end_round = stage_end_round,
};

void fg_pipeline_attach(fg_runtime *rt, fg_pipe *p) {
    rt->pipe = p;
    rt->stage = p ? &pipeline_stage : &fg_single_stage;
}
