/* support/trace.c: what each thread of a run did, and when, as a Chrome trace (chrome://tracing or
 * Perfetto open it): the compute thread and the four I/O threads of Fig. 4 are one track each,
 * every task and every layer's compute one event, so a reader can see the overlap the schedule
 * promises, or the gaps where it does not hold (docs/trace-opt-6.7b.png is one such picture).
 */
#define _GNU_SOURCE
#include "support/support.h"
#include "support/tools.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const track_names[N_TRACKS] = {"compute", "disk<->cpu weights",
    "cpu<->gpu weights", "disk<->cpu cache+activations", "cpu<->gpu cache+activations"};

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

void trace_free(fg_trace *tr) {
    for (int t = 0; t < N_TRACKS; t++) free(tr->tracks[t].events);
}

/* Chrome's trace event format: one complete ("X") event per task, one thread per track, one
 * process per pipeline stage. The events of this runtime as stage `stage` of n, one a line. */
char *fg_trace_events(const fg_runtime *rt, int stage, int n) {
    const fg_trace *tr = &rt->trace;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    int pid = stage + 1;
    if (n > 1)
        fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"stage %d of %d\"}},\n",
                pid, stage + 1, n);
    for (int t = 0; t < N_TRACKS; t++)
        fprintf(f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}},\n",
                pid, t, track_names[t]);
    for (int t = 0; t < N_TRACKS; t++)
        for (size_t i = 0; i < tr->tracks[t].n; i++) {
            const trace_event *e = &tr->tracks[t].events[i];
            fprintf(f, "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.1f,\"dur\":%.1f,"
                       "\"args\":{\"a\":%d,\"b\":%d}},\n",
                    e->name, pid, t, e->start * 1e6, (e->end - e->start) * 1e6, e->layer, e->batch);
        }
    if (fclose(f) != 0) { free(text); return NULL; }
    return text;
}

/* The trace file from every stage's events, written whole or not at all. */
int fg_trace_write_events(const char *path, const char *events, char *err) {
    if (!events) return fg_fail(err, "--trace %s: out of memory", path);
    fg_output o;
    if (fg_output_open(&o, "--trace", path, err)) return -1;
    fprintf(o.f, "{\"traceEvents\":[\n%s", events);
    fprintf(o.f, "{\"name\":\"end\",\"ph\":\"i\",\"pid\":1,\"tid\":0,\"ts\":0,\"s\":\"g\"}\n]}\n");
    return fg_output_commit(&o, err);
}

int fg_trace_write(const fg_runtime *rt, const char *path, char *err) {
    char *events = fg_trace_events(rt, 0, 1);
    int rc = fg_trace_write_events(path, events, err);
    free(events);
    return rc;
}

