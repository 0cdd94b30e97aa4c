/* support/weight_file.c: dummy weights for a disk home, written once to a file in the weight dir
 * (--path) and reused by later runs, so that a model larger than memory is not generated again
 * at every start.
 *
 * The file: a header naming the model, seed and size; a checksum of each layer's stored bytes;
 * then every tensor, page-aligned. A file that is reused is checked whole as it is opened: one
 * sequential read, the same as one decode step reads when the weights live on disk, and the
 * only way to catch damage before a single value is used (the runtime's reads have no path to
 * fail on). A damaged file is written again, as a missing one is.
 */
#define _GNU_SOURCE
#include "support/support.h"
#include "support/tools.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    char magic[16];
    model_config cfg;
    uint64_t seed, bytes;
} weight_file_header;

static int n_layers(const weight_file *f) { return f->cfg->n_layers + 2; }

static void weight_file_path(const weight_file *f, char *path, size_t n) {
    snprintf(path, n, "%s/%s-seed%llu%s.fgw", f->dir, f->cfg->name, (unsigned long long)f->seed,
             f->q4 ? "-q4" : "");
}

static weight_file_header header_of(const weight_file *f, size_t size) {
    weight_file_header h;
    memset(&h, 0, sizeof h);
    snprintf(h.magic, sizeof h.magic, f->q4 ? "flexgen-q4-3" : "flexgen-wt-2");
    h.cfg = *f->cfg;
    h.seed = f->seed;
    h.bytes = size;
    return h;
}

/* Where the layer checksums start; they are followed by the tensors. */
static size_t sums_at(void) { return sizeof(weight_file_header); }

static int tied(const weight_file *f, int i) { return f->layout->tensors[i].tied_to; }

/* Each tensor's offset in the file (offsets may be NULL); returns the file's size. */
static size_t weight_file_offsets(const weight_file *f, size_t *offsets) {
    size_t at = page_up(sums_at() + (size_t)n_layers(f) * sizeof(uint64_t));
    for (int i = 0; i < f->layout->n_tensors; i++) {
        int tie = tied(f, i);
        if (offsets) offsets[i] = tie >= 0 ? offsets[tie] : at; /* the same values, stored alike */
        if (tie < 0) at += page_up(f->bytes(f->ctx, i));
    }
    return at;
}

/* A 64-bit checksum of bytes, continued from h (FNV-1a's prime over 8-byte words, with a shift
 * that carries high bits down): fast enough to run at memory speed, and any change of a word
 * changes it but for a 2^-64 chance. */
static uint64_t checksum(const void *bytes, size_t n, uint64_t h) {
    const unsigned char *s = bytes;
    for (; n >= 8; n -= 8, s += 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    for (; n; n--, s++) h = (h ^ *s) * 0x100000001b3ULL;
    return h;
}

/* The checksum of layer j's tensors as the file stores them (from its base). */
static uint64_t layer_checksum(const weight_file *f, const char *base, const size_t *offsets,
                               int j) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int i = f->layer_first[j]; i < f->layer_first[j + 1]; i++)
        if (tied(f, i) < 0) h = checksum(base + offsets[i], f->bytes(f->ctx, i), h);
    return h;
}

static void progress(const weight_file *f, const char *what, int done, int total) {
    if (f->verbose) fprintf(stderr, "\r%s: layer %d/%d", what, done, total);
    if (f->verbose && done == total) fprintf(stderr, "\n");
}

/* Drops the pages under [p, p + n) of a mapping at base from memory and the page cache, written
 * back first where they were written. */
static void drop(const char *base, int fd, const char *p, size_t n, int written) {
    size_t off = (size_t)(p - base) & ~(page_size() - 1),
           len = page_up((size_t)(p - base) + n) - off;
    if (written) msync((char *)base + off, len, MS_SYNC);
    madvise((char *)base + off, len, MADV_DONTNEED);
    posix_fadvise(fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
}

/* Layer j's tensors' pages dropped (drop). */
static void drop_layer(const weight_file *f, const char *base, int fd, const size_t *offsets, int j,
                       int written) {
    for (int i = f->layer_first[j]; i < f->layer_first[j + 1]; i++)
        if (tied(f, i) < 0) drop(base, fd, base + offsets[i], f->bytes(f->ctx, i), written);
}

/* Whether every layer of the file open as fd matches its checksum; a note names the first that
 * does not. Each layer's pages are dropped once it is summed, so that the check holds a layer at a
 * time in memory, not the whole file (which the disk tier is there to keep out of it). */
static int intact(const weight_file *f, int fd, size_t size, const char *path) {
    int L = n_layers(f), bad = -1;
    size_t *offsets = malloc((size_t)f->layout->n_tensors * sizeof *offsets);
    const char *base = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (!offsets || base == MAP_FAILED) {
        free(offsets);
        return 0;
    }
    fg_watch_mapping(base, size, path);
    madvise((void *)base, size, MADV_SEQUENTIAL);
    weight_file_offsets(f, offsets);
    const uint64_t *sums = (const uint64_t *)(base + sums_at());
    for (int j = 0; j < L && bad < 0; j++) {
        if (layer_checksum(f, base, offsets, j) != sums[j]) bad = j;
        drop_layer(f, base, fd, offsets, j, 0);
        progress(f, "checking dummy weights", j + 1, L);
    }
    fg_unwatch_mapping(base);
    munmap((void *)base, size);
    free(offsets);
    if (bad >= 0)
        fprintf(stderr,
                "flexgen: note: %s: layer %d does not match its checksum (the file was "
                "changed); writing the dummy weights again\n",
                path, bad);
    return bad < 0;
}

/* An fd of an intact file, or -1; where check, each layer's checksum is checked too, and a note
 * says why a file there is not taken. */
static int weight_file_find(const weight_file *f, int check) {
    char path[FG_PATH_LEN];
    weight_file_path(f, path, sizeof path);
    size_t size = weight_file_offsets(f, NULL);
    weight_file_header want = header_of(f, size), have;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* read only: a run never writes it */
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    int whole = (size_t)st.st_size == size &&
                pread(fd, &have, sizeof have, 0) == (ssize_t)sizeof have &&
                !memcmp(&have, &want, sizeof have);
    if (whole && (!check || intact(f, fd, size, path))) return fd;
    if (!whole && check && (size_t)st.st_size != size) /* the run's own look, not a plan's */
        fprintf(stderr,
                "flexgen: note: %s: %zu bytes, not the %zu of these weights (cut short, or "
                "written by another version); writing the dummy weights again\n",
                path, (size_t)st.st_size, size);
    else if (!whole && check)
        fprintf(stderr,
                "flexgen: note: %s: another header than these weights' (written by another "
                "version); writing the dummy weights again\n",
                path);
    close(fd);
    return -1;
}

/* Every layer's tensors into the mapped file, and each layer's checksum; the pages are written
 * back and dropped as they are done, so that memory follows the policy, not the page cache. */
static int write_layers(const weight_file *f, char *base, int fd, const size_t *offsets,
                        char *err) {
    uint64_t *sums = (uint64_t *)(base + sums_at());
    int L = n_layers(f);
    for (int j = 0; j < L; j++) {
        for (int i = f->layer_first[j]; i < f->layer_first[j + 1]; i++)
            if (tied(f, i) < 0 && f->fill(f->ctx, i, base + offsets[i], err)) return -1;
        sums[j] = layer_checksum(f, base, offsets, j);
        drop_layer(f, base, fd, offsets, j, 1);
        progress(f, "writing dummy weights", j + 1, L);
    }
    return 0;
}

/* The file of `size` bytes, new in the weight dir (fg_new_file: unnamed, or a temporary), its
 * blocks reserved (a full disk is an error here, not a SIGBUS later) and mapped. */
static char *create(const weight_file *f, size_t size, fg_new *made, int *fd, char *err) {
    if (mkdir_p(f->dir)) {
        fg_fail(err, "--path %s: cannot create it: %s", f->dir, strerror(errno));
        return NULL;
    }
    if ((*fd = fg_new_file(f->dir, "--path", made, err)) < 0) return NULL;
    int rc = posix_fallocate(*fd, 0, (off_t)size);
    char *base = rc ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    if (base != MAP_FAILED) return base;
    fg_fail(err, "--path %s: cannot %s %s: %s", f->dir, rc ? "reserve" : "map",
            human((double)size).s, rc ? fg_write_failure(f->dir, rc) : strerror(errno));
    fg_new_file_remove(made);
    close(*fd);
    *fd = -1;
    return NULL;
}

/* The complete file (mapped at base) written back and given its name, so that later runs find
 * it; a note where it cannot be (but not where another run, writing the same weights at once,
 * named its own first). */
static void keep(fg_new *made, char *base, size_t size, int fd, const char *path) {
    if (msync(base, size, MS_SYNC) == 0 && fg_new_file_name(made, fd, path) == 0) return;
    int e = errno;
    struct stat st;
    if (e == EEXIST && stat(path, &st) == 0 && S_ISREG(st.st_mode)) return;
    fprintf(stderr,
            "flexgen: note: could not keep the dummy weights as %s (%s); they are written again "
            "next run\n",
            path, strerror(e));
}

/* The file written; an fd of it, or -1. */
static int weight_file_write(const weight_file *f, char *err) {
    char path[FG_PATH_LEN];
    weight_file_path(f, path, sizeof path);
    size_t size = weight_file_offsets(f, NULL);
    size_t *offsets = calloc((size_t)f->layout->n_tensors, sizeof *offsets);
    if (!offsets) return fg_fail(err, "out of memory");
    weight_file_offsets(f, offsets);
    int fd = -1;
    fg_new made;
    char *base = create(f, size, &made, &fd, err);
    int rc = base ? write_layers(f, base, fd, offsets, err) : -1;
    free(offsets);
    if (base && rc == 0) {
        weight_file_header h = header_of(f, size);
        memcpy(base, &h, sizeof h);
        keep(&made, base, size, fd, path);
    }
    if (base) {
        munmap(base, size);
        fg_new_file_remove(&made); /* a temporary not named (nothing once it is) */
    }
    if (rc && fd >= 0) {
        close(fd);
        fd = -1;
    }
    return rc ? -1 : fd;
}

/* An intact file is there: an earlier run wrote it. */
int weight_file_exists(const weight_file *f) {
    int fd = weight_file_find(f, 0);
    if (fd >= 0) close(fd);
    return fd >= 0;
}

/* The file mapped into `a`, an intact one found or written now, and each tensor's offset in it. */
int weight_file_map(const weight_file *f, disk_arena *a, size_t *offsets, char *err) {
    size_t size = weight_file_offsets(f, offsets);
    int fd = weight_file_find(f, 1), found = fd >= 0;
    if (fd < 0 && (fd = weight_file_write(f, err)) < 0) return -1;
    if (arena_map_read_only(a, fd, size, "--path", f->dir, err)) return -1;
    char path[FG_PATH_LEN];
    weight_file_path(f, path, sizeof path);
    if (found) fg_watch_mapping(a->base, a->size, path);
    return 0;
}
