/* support/io_links.c: the I/O threads behind Fig. 4's asynchronous loads and stores. A link
 * (disk <-> cpu or cpu <-> gpu, for weights or for the KV cache and activations) is a queue of
 * tasks run in order on a thread of its own, as FlexGen's CUDA streams run theirs. A task may wait
 * for an earlier task of another link (a load from disk is read before it is copied to the gpu
 * tier; a store reaches the cpu tier before disk); since a task only ever waits for one submitted
 * before it, the queues cannot deadlock. With --overlap 0 no thread starts, and every task runs
 * at once on the compute thread: the same steps, in sequence. The runtime (flexgen.c, tiers.c)
 * submits the tasks; io_sync is Fig. 4's "synchronize". After the compute thread waits for a
 * link's tasks, the backend's join orders the device work they queued before the compute
 * thread's next (CUDA's streams: no host wait for the device).
 */
#include "support/support.h"

#include <stdlib.h>

static void run_task(io_links *io, int link, const io_task *t) {
    double start = now_seconds();
    t->fn(io->owner, t);
    trace_record(io->trace, io->link[link].track, t->name, t->layer, t->batch, start,
                 now_seconds());
}

static _Thread_local int this_thread_link = -1;

int io_link_of_this_thread(void) { return this_thread_link; }

/* The link's tasks up to seq are done. */
static void wait_done(io_link *l, uint64_t seq) {
    pthread_mutex_lock(&l->lock);
    while (l->done < seq) pthread_cond_wait(&l->changed, &l->lock);
    pthread_mutex_unlock(&l->lock);
}

/* The compute thread waits for a link's tasks up to seq; then what they queued on the device
 * comes before what it queues next. */
void io_wait(io_links *io, int link, uint64_t seq) {
    wait_done(&io->link[link], seq);
    if (io->join) io->join(1u << link);
}

typedef struct {
    io_links *io;
    int link;
} link_thread;

static void *io_thread(void *arg) {
    io_links *io = ((link_thread *)arg)->io;
    int link = ((link_thread *)arg)->link;
    free(arg);
    this_thread_link = link;
    io_link *l = &io->link[link];
    pthread_mutex_lock(&l->lock);
    for (;;) {
        while (!l->stop && l->done == l->submitted) pthread_cond_wait(&l->changed, &l->lock);
        if (l->done == l->submitted) break;
        io_task t = l->queue[l->done % IO_QUEUE];
        pthread_mutex_unlock(&l->lock);
        if (t.after_seq) wait_done(&io->link[t.after_link], t.after_seq);
        run_task(io, link, &t);
        pthread_mutex_lock(&l->lock);
        l->done++;
        pthread_cond_broadcast(&l->changed);
    }
    pthread_mutex_unlock(&l->lock);
    return NULL;
}

/* The links' locks, and with overlap their threads (a link whose thread cannot start runs its
 * tasks at once, rather than not at all). Tasks get `owner` and are traced on track 1 + link. */
void io_start(io_links *io, struct fg_runtime *owner, fg_trace *trace, int overlap,
              void (*join)(unsigned links)) {
    io->owner = owner;
    io->trace = trace;
    io->join = join;
    for (int i = 0; i < N_IO; i++) {
        io_link *l = &io->link[i];
        l->track = 1 + i;
        pthread_mutex_init(&l->lock, NULL);
        pthread_cond_init(&l->changed, NULL);
        link_thread *arg = overlap ? malloc(sizeof *arg) : NULL;
        if (!arg) continue;
        *arg = (link_thread){io, i};
        if (pthread_create(&l->thread, NULL, io_thread, arg) == 0) l->running = 1;
        else free(arg);
    }
}

/* Queues a task on a link; returns its sequence number there (for io_wait and `after`). */
uint64_t io_submit(io_links *io, int link, io_task t) {
    io_link *l = &io->link[link];
    if (!l->running) { /* --overlap 0: in order, now */
        run_task(io, link, &t);
        ++l->done;
        return ++l->submitted;
    }
    pthread_mutex_lock(&l->lock);
    while (l->submitted - l->done == IO_QUEUE) pthread_cond_wait(&l->changed, &l->lock);
    l->queue[l->submitted % IO_QUEUE] = t;
    uint64_t seq = ++l->submitted;
    pthread_cond_broadcast(&l->changed);
    pthread_mutex_unlock(&l->lock);
    return seq;
}

/* Fig. 4's "synchronize": the KV cache and activations that moved for this iteration are done;
 * with `weights` too, the next layer's weights (needed when the next iteration starts a layer),
 * but not the disk read of the layer after it, which may go on. */
void io_sync(io_links *io, int weights) {
    unsigned links = 0;
    for (int i = weights ? IO_WEIGHT_HOST : IO_DISK; i < N_IO; i++) {
        wait_done(&io->link[i], io->link[i].submitted);
        links |= 1u << i;
    }
    if (io->join) io->join(links);
}

/* Every queued task runs, then the threads end. */
void io_stop(io_links *io) {
    for (int i = 0; i < N_IO; i++) {
        io_link *l = &io->link[i];
        if (l->running) {
            pthread_mutex_lock(&l->lock);
            l->stop = 1;
            pthread_cond_broadcast(&l->changed);
            pthread_mutex_unlock(&l->lock);
            pthread_join(l->thread, NULL);
            l->running = 0;
        }
        pthread_mutex_destroy(&l->lock);
        pthread_cond_destroy(&l->changed);
    }
}
