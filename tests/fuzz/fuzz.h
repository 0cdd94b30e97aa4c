/* fuzz.h: what the libFuzzer harnesses of tests/fuzz/ share: a temp directory of their own for
 * the files that a parser reads by path, one input split into several files, fixtures, and the
 * check that a parser that fails has written its error line.
 *
 * A harness defines LLVMFuzzerTestOneInput (and LLVMFuzzerInitialize for work done once), is
 * built by `make fuzz` with clang's -fsanitize=fuzzer,address,undefined, and is run by
 * scripts/fuzz.sh. A finding is a crash, a sanitizer report, a leak, a timeout, or an abort()
 * of a check (a failure without its one error line, a broken promise of the parser).
 */
#ifndef FLEXGEN_FUZZ_H
#define FLEXGEN_FUZZ_H

#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Separates the files of one input (tokenizer: vocab.json, merges.txt, then the text). */
#define FUZZ_SEP "\n===\n"

enum { FUZZ_MAX_FILES = 8 };
static char fuzz_dir_[4096];
static char fuzz_paths_[FUZZ_MAX_FILES][4200];
static int fuzz_n_paths_;

static inline void fuzz_cleanup_(void) {
    for (int i = 0; i < fuzz_n_paths_; i++) unlink(fuzz_paths_[i]);
    rmdir(fuzz_dir_);
}

/* This process's directory, made on first use and removed with its files at exit: in /dev/shm
 * where there is one, since rewriting a file on a disk file system costs about a millisecond
 * (ext4 starts writing back a truncated file when it is closed), forty times a parse; else under
 * $TMPDIR or /tmp. */
static inline const char *fuzz_dir(void) {
    if (!fuzz_dir_[0]) {
        const char *tmp = getenv("TMPDIR");
        if (access("/dev/shm", W_OK | X_OK) == 0) tmp = "/dev/shm";
        snprintf(fuzz_dir_, sizeof fuzz_dir_, "%s/flexgen-fuzz-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(fuzz_dir_)) { perror(fuzz_dir_); abort(); }
        atexit(fuzz_cleanup_);
    }
    return fuzz_dir_;
}

/* Writes size bytes as fuzz_dir()/name; returns its path (the same string for the same name). */
static inline const char *fuzz_write(const char *name, const void *data, size_t size) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", fuzz_dir(), name);
    int i = 0;
    while (i < fuzz_n_paths_ && strcmp(fuzz_paths_[i], path)) i++;
    if (i == fuzz_n_paths_) {
        if (i == FUZZ_MAX_FILES) abort();
        snprintf(fuzz_paths_[fuzz_n_paths_++], sizeof fuzz_paths_[0], "%s", path);
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) { perror(path); abort(); }
    for (size_t done = 0; done < size;) {
        ssize_t n = write(fd, (const char *)data + done, size - done);
        if (n <= 0) { perror(path); abort(); }
        done += (size_t)n;
    }
    close(fd);
    return fuzz_paths_[i];
}

/* Copies tests/fixtures/rel ($FG_FIXTURES/rel) into fuzz_dir() as name (once, at start); returns
 * its path. */
static inline const char *fuzz_copy_fixture(const char *rel, const char *name) {
    char path[4200];
    const char *dir = getenv("FG_FIXTURES");
    snprintf(path, sizeof path, "%s/%s", dir && *dir ? dir : "tests/fixtures", rel);
    char err[FG_ERR_LEN];
    size_t len;
    char *data = fg_read_file(path, &len, err);
    if (!data) { fprintf(stderr, "%s (run from the repository's root)\n", err); abort(); }
    const char *copy = fuzz_write(name, data, len);
    free(data);
    return copy;
}

/* The fixture tokenizer (tests/fixtures/tokenizer), copied into the fuzz dir and loaded. */
static inline fg_tokenizer *fuzz_fixture_tokenizer(void) {
    char err[FG_ERR_LEN];
    fg_tokenizer *t = tokenizer_load(fuzz_copy_fixture("tokenizer/vocab.json", "vocab.json"),
                                     fuzz_copy_fixture("tokenizer/merges.txt", "merges.txt"), err);
    if (!t) { fprintf(stderr, "%s\n", err); abort(); }
    return t;
}

/* The n parts of data separated by FUZZ_SEP (the last takes the rest; missing ones are empty). */
static inline void fuzz_split(const uint8_t *data, size_t size, int n, const char **part, size_t *len) {
    const char *s = (const char *)data, *end = s + size;
    for (int i = 0; i < n; i++) {
        const char *sep = i < n - 1 ? memmem(s, (size_t)(end - s), FUZZ_SEP, strlen(FUZZ_SEP)) : NULL;
        part[i] = s;
        len[i] = (size_t)((sep ? sep : end) - s);
        s = sep ? sep + strlen(FUZZ_SEP) : end;
    }
}

/* A call that failed (rc != 0) must have written its one line into err: not empty, no newline. */
static inline void fuzz_check(int rc, const char *err, const char *call) {
    if (rc != 0 && (err[0] == 0 || strchr(err, '\n'))) {
        fprintf(stderr, "%s failed without its one error line: \"%s\"\n", call, err);
        abort();
    }
}

/* The checkpoint in the fuzz dir loaded whole (layout check and conversion), then freed. */
static inline void fuzz_load_weights(void) {
    char err[FG_ERR_LEN] = "";
    model_weights w;
    int rc = model_weights_load(fuzz_dir(), &w, err);
    fuzz_check(rc, err, "model_weights_load");
    if (rc == 0) model_weights_free(&w);
}

#endif
