/* support/disk_arena.c: a file of the disk tier, mapped. The files live in the offload dir (or the
 * weight dir), created unnamed or unlinked at once, so nothing is left behind after an exit, an
 * error or Ctrl-C. Pages come in with WILLNEED and a touch and leave with msync and DONTNEED, so
 * resident memory follows the policy and not the page cache; tiers.c's disk_fetch and
 * disk_release count them on the tiers and links.
 */
#define _GNU_SOURCE
#include "support/support.h"
#include "support/tools.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Maps `bytes` of fd (prot: PROT_READ, or with PROT_WRITE). Takes ownership of fd. */
static int map_file(disk_arena *a, int fd, size_t bytes, int prot, const char *flag,
                    const char *dir, char *err) {
    a->base = mmap(NULL, bytes, prot, MAP_SHARED, fd, 0);
    if (a->base == MAP_FAILED) {
        a->base = NULL;
        close(fd);
        return fg_fail(err, "%s %s: cannot map %s: %s", flag, dir, human((double)bytes).s,
                       strerror(errno));
    }
    a->fd = fd;
    a->size = bytes;
    return 0;
}

/* Maps a file of `bytes`, reserving its blocks first so that a full disk is an error here and
 * not a SIGBUS later. Takes ownership of fd. */
int arena_map(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir, char *err) {
    memset(a, 0, sizeof *a);
    a->fd = -1;
    bytes = page_up(bytes ? bytes : 1);
    int rc = posix_fallocate(fd, 0, (off_t)bytes);
    if (rc) {
        close(fd);
        return fg_fail(err, "%s %s: cannot reserve %s: %s", flag, dir, human((double)bytes).s,
                       fg_write_failure(dir, rc));
    }
    return map_file(a, fd, bytes, PROT_READ | PROT_WRITE, flag, dir, err);
}

/* Maps a whole file of `bytes` that is only read (the weights' file that a run reuses, which may
 * lie on a file system it cannot write: a shared, read-only cache). Takes ownership of fd. */
int arena_map_read_only(disk_arena *a, int fd, size_t bytes, const char *flag, const char *dir,
                        char *err) {
    memset(a, 0, sizeof *a);
    a->fd = -1;
    return map_file(a, fd, page_up(bytes ? bytes : 1), PROT_READ, flag, dir, err);
}

void arena_close(disk_arena *a) {
    if (a->base) {
        fg_unwatch_mapping(a->base);
        munmap(a->base, a->size);
    }
    if (a->fd >= 0) close(a->fd);
    memset(a, 0, sizeof *a);
    a->fd = -1;
}

/* A page-aligned piece of the arena (the plan sized the arena, so this cannot run out). */
void *arena_take(disk_arena *a, size_t bytes) {
    void *p = a->base + a->used;
    a->used += page_up(bytes);
    return p;
}

void page_range(const disk_arena *a, const void *p, size_t bytes, size_t *off, size_t *len) {
    size_t start = (size_t)((const char *)p - a->base) & ~(page_size() - 1);
    size_t end = page_up((size_t)((const char *)p - a->base) + bytes);
    *off = start;
    *len = end > a->size ? a->size - start : end - start;
}

/* Reads len bytes of the arena at off into memory (and waits for them). */
void disk_fetch_pages(const disk_arena *a, size_t off, size_t len) {
    madvise(a->base + off, len, MADV_WILLNEED);
    volatile const char *c = a->base + off;
    unsigned sum = 0;
    for (size_t i = 0; i < len; i += page_size()) sum += c[i];
    (void)sum;
}

/* Writes the pages under p back (when dirty) and drops them from memory and the page cache. */
void drop_pages(const disk_arena *a, const void *p, size_t bytes, int dirty) {
    size_t off, len;
    page_range(a, p, bytes, &off, &len);
    if (dirty) msync(a->base + off, len, MS_SYNC);
    madvise(a->base + off, len, MADV_DONTNEED);
    posix_fadvise(a->fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
}
