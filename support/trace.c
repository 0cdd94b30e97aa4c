/* support/trace.c: what each thread of a run did, and when, as a Chrome trace (chrome://tracing or
 * Perfetto open it): the compute thread and the four I/O threads of Fig. 4 are one track each,
 * every task and every layer's compute one event, so a reader can see the overlap the schedule
 * promises, or the gaps where it does not hold (docs/trace-opt-6.7b.png is one such picture).
 * Where the backend counts what the host asks of the device (CUDA), each step's counts are a
 * counter event at the step's end. On CUDA a compute event is the time the host took to queue
 * the layer's work; the GPU runs it later.
 */
#define _GNU_SOURCE
#include "support/support.h"
#include "support/tools.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const track_names[N_TRACKS] = {
    "compute", "disk<->cpu weights", "cpu<->gpu weights", "disk<->cpu cache+activations",
    "cpu<->gpu cache+activations"};

void trace_record(fg_trace *tr, int track, const char *name, int layer, int batch, double start,
                  double end) {
    trace_track *t = &tr->tracks[track];
    if (!tr->on) return;
    if (t->n == t->cap) {
        size_t cap = t->cap * 2 + 1024;
        trace_event *grown = realloc(t->events, cap * sizeof *grown);
        if (!grown) return; /* a trace with gaps rather than a failed run */
        t->events = grown;
        t->cap = cap;
    }
    t->events[t->n++] = (trace_event){name, layer, batch, start - tr->t0, end - tr->t0};
}

void trace_record_counts(fg_trace *tr, double end, const fg_device_counts *step) {
    if (!tr->on) return;
    if (tr->n_counts == tr->cap_counts) {
        size_t cap = tr->cap_counts * 2 + 64;
        trace_counts *grown = realloc(tr->counts, cap * sizeof *grown);
        if (!grown) return;
        tr->counts = grown;
        tr->cap_counts = cap;
    }
    tr->counts[tr->n_counts++] = (trace_counts){end - tr->t0, *step};
}

enum { N_COUNTERS = sizeof(fg_device_counts) / sizeof(int64_t) };

void device_counts_add(fg_device_counts *sum, const fg_device_counts *c, int most) {
    int64_t *to = (int64_t *)sum;
    const int64_t *from = (const int64_t *)c;
    for (int i = 0; i < N_COUNTERS; i++)
        to[i] = most ? (from[i] > to[i] ? from[i] : to[i]) : to[i] + from[i];
}

void device_counts_diff(const fg_device_counts *end, const fg_device_counts *start,
                        fg_device_counts *d) {
    const int64_t *to = (const int64_t *)end, *from = (const int64_t *)start;
    int64_t *delta = (int64_t *)d;
    for (int i = 0; i < N_COUNTERS; i++) delta[i] = to[i] - from[i];
}

void trace_restart(fg_trace *tr, double t0) {
    for (int t = 0; t < N_TRACKS; t++) tr->tracks[t].n = 0;
    tr->n_counts = 0;
    tr->t0 = t0;
}

void trace_free(fg_trace *tr) {
    for (int t = 0; t < N_TRACKS; t++) free(tr->tracks[t].events);
    free(tr->counts);
}

/* Chrome's trace event format: one complete ("X") event per task, one thread per track, one
 * process per pipeline stage. The events of this runtime as stage `stage` of n, one a line. */
char *fg_trace_events(const fg_trace *tr, int stage, int n) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    int pid = stage + 1;
    if (n > 1)
        fprintf(f,
                "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"stage %d "
                "of %d\"}},\n",
                pid, stage + 1, n);
    for (int t = 0; t < N_TRACKS; t++)
        fprintf(f,
                "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":"
                "\"%s\"}},\n",
                pid, t, track_names[t]);
    for (int t = 0; t < N_TRACKS; t++)
        for (size_t i = 0; i < tr->tracks[t].n; i++) {
            const trace_event *e = &tr->tracks[t].events[i];
            fprintf(f,
                    "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.1f,\"dur\":%.1f,"
                    "\"args\":{\"a\":%d,\"b\":%d}},\n",
                    e->name, pid, t, e->start * 1e6, (e->end - e->start) * 1e6, e->layer, e->batch);
        }
    for (size_t i = 0; i < tr->n_counts; i++) {
        const fg_device_counts *c = &tr->counts[i].step;
        fprintf(f,
                "{\"name\":\"device, this "
                "step\",\"ph\":\"C\",\"pid\":%d,\"tid\":0,\"ts\":%.1f,\"args\":{"
                "\"host_waits\":%lld,\"launches\":%lld,\"graph_launches\":%lld,"
                "\"blas_calls\":%lld,\"products_timed\":%lld,\"widened\":%lld,"
                "\"copies_in\":%lld,\"copies_out\":%lld,"
                "\"pageable_copies\":%lld,\"allocations\":%lld}},\n",
                pid, tr->counts[i].time * 1e6, (long long)c->host_waits, (long long)c->launches,
                (long long)c->graph_launches, (long long)c->blas_calls,
                (long long)c->products_timed, (long long)c->widened, (long long)c->copies_in,
                (long long)c->copies_out, (long long)c->pageable_copies, (long long)c->allocations);
    }
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    return text;
}

/* The trace file of every stage's events, into an output the run commits with its others. */
void fg_trace_write_events(FILE *f, const char *events) {
    fprintf(f, "{\"traceEvents\":[\n%s", events);
    fprintf(f, "{\"name\":\"end\",\"ph\":\"i\",\"pid\":1,\"tid\":0,\"ts\":0,\"s\":\"g\"}\n]}\n");
}
