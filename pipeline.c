/* pipeline.c: the link between pipeline stages (paper §4.4), over MPI.
 *
 *   fg_pipe_open    under mpirun, one process per stage: MPI started, a crash names its rank
 *   messages        non-blocking sends and receives that a thread of their own drives while the
 *                   stages compute (Open MPI moves large messages only inside MPI calls)
 *   collectives     what setup and the report need: agreeing on failure, broadcast, gathers
 *
 * The schedule (flexgen.c) sends activations to the next stage and token ids from the last stage
 * to the first through these calls; it never asks whether MPI is there. Built without MPI (no
 * mpicc), or run without mpirun, every process is one stage and fg_pipe_open gives NULL.
 */
#define _GNU_SOURCE
#include "flexgen.h"

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
    (void)argc, (void)argv;
    *out = NULL;
    if (under_mpirun() && getenv("OMPI_COMM_WORLD_SIZE") && strcmp(getenv("OMPI_COMM_WORLD_SIZE"), "1"))
        return fg_fail(err, "this flexgen was built without MPI (no mpicc at build time): it cannot "
                            "run as pipeline stages");
    return 0;
}
void fg_pipe_close(fg_pipe *p) { (void)p; }
int fg_pipe_rank(const fg_pipe *p) { (void)p; return 0; }
int fg_pipe_size(const fg_pipe *p) { (void)p; return 1; }
int fg_pipe_send(fg_pipe *p, int to, int tag, const void *buf, size_t bytes) {
    (void)p, (void)to, (void)tag, (void)buf, (void)bytes;
    return -1;
}
int fg_pipe_recv(fg_pipe *p, int from, int tag, void *buf, size_t bytes) {
    (void)p, (void)from, (void)tag, (void)buf, (void)bytes;
    return -1;
}
double fg_pipe_wait(fg_pipe *p, int msg, size_t *bytes) {
    (void)p, (void)msg;
    if (bytes) *bytes = 0;
    return 0;
}
void fg_pipe_release(fg_pipe *p, int msg) { (void)p, (void)msg; }
double fg_pipe_bytes_sent(const fg_pipe *p) { (void)p; return 0; }
int fg_pipe_agree(fg_pipe *p, int rc, char *err) { (void)p, (void)err; return rc ? -1 : 0; }
void fg_pipe_bcast(fg_pipe *p, void *buf, size_t bytes) { (void)p, (void)buf, (void)bytes; }
void fg_pipe_gather(fg_pipe *p, const void *mine, size_t bytes, void *all) {
    (void)p;
    memcpy(all, mine, bytes);
}
char *fg_pipe_gather_text(fg_pipe *p, const char *mine) { (void)p; return strdup(mine); }

#else /* FLEXGEN_MPI */

#include <errno.h>
#include <mpi.h>
#include <pthread.h>
#include <time.h>

/* A message in flight: started by the thread that posts it (so MPI sees them in posting order,
 * which keeps messages of one kind in order), completed by the pipe's thread. */
enum { MSG_FREE, MSG_ACTIVE, MSG_DONE };
typedef struct {
    int state, send, peer, tag;
    void *buf;
    size_t bytes, got;
    MPI_Request req;
} pipe_msg;

#define PIPE_MSGS 256

struct fg_pipe {
    int rank, size;
    long crash_after;       /* tests: crash after posting this many messages (0: never) */
    long posted;
    pthread_t thread;
    pthread_mutex_t lock;   /* the messages, and every MPI call (MPI_THREAD_SERIALIZED) */
    pthread_cond_t changed;
    pipe_msg msgs[PIPE_MSGS];
    int stop;
    double bytes_sent;
};

/* A crash of one stage: one line naming it, then the signal's own end, on which mpirun ends
 * the others; their offload files are unnamed, so nothing is left behind. */
static char crash_line[128];

static void on_crash(int sig) {
    char line[256];
    const char *name = sigdescr_np(sig);
    size_t n = (size_t)snprintf(line, sizeof line, "%s%s (signal %d)\n", crash_line, name ? name : "", sig);
    if (write(2, line, n < sizeof line ? n : sizeof line - 1) < 0) { /* nothing else to do */ }
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
        for (int i = 0; i < PIPE_MSGS; i++) {
            pipe_msg *m = &p->msgs[i];
            if (m->state != MSG_ACTIVE) continue;
            int done = 0;
            MPI_Status st;
            MPI_Test(&m->req, &done, &st);
            if (!done) { active++; continue; }
            int count = 0;
            if (!m->send) MPI_Get_count(&st, MPI_BYTE, &count);
            m->got = m->send ? m->bytes : (size_t)count;
            if (m->send) p->bytes_sent += (double)m->bytes;
            m->state = MSG_DONE;
            finished++;
        }
        if (finished) pthread_cond_broadcast(&p->changed), idle_us = 20;
        if (!active && !finished) {
            pthread_cond_wait(&p->changed, &p->lock);
            continue;
        }
        pthread_mutex_unlock(&p->lock);
        if (!finished) sleep_us(idle_us), idle_us = idle_us < 1000 ? idle_us * 2 : 1000;
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
    if (!p) {
        MPI_Abort(MPI_COMM_WORLD, 2);
        return fg_fail(err, "out of memory");
    }
    p->rank = rank, p->size = size;
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
    if (crash && sscanf(crash, "%d:%ld", &crash_rank, &crash_n) == 2 && crash_rank == rank) p->crash_after = crash_n;
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
    free(p);
}

int fg_pipe_rank(const fg_pipe *p) { return p ? p->rank : 0; }
int fg_pipe_size(const fg_pipe *p) { return p ? p->size : 1; }

static int post(fg_pipe *p, int send, int peer, int tag, void *buf, size_t bytes) {
    if (p->crash_after && ++p->posted == p->crash_after) raise(SIGSEGV);
    pthread_mutex_lock(&p->lock);
    int i;
    for (;;) {
        for (i = 0; i < PIPE_MSGS && p->msgs[i].state != MSG_FREE; i++) {}
        if (i < PIPE_MSGS) break;
        pthread_cond_wait(&p->changed, &p->lock); /* released by fg_pipe_release */
    }
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

double fg_pipe_wait(fg_pipe *p, int msg, size_t *bytes) {
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
    if (!p) { memcpy(all, mine, bytes); return; }
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
