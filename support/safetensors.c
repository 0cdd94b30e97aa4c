/* support/safetensors.c: HF checkpoints as the loader reads them: safetensors archives, mapped with
 * mmap and validated (header, dtypes, shapes, offsets), single files or shards listed by an index.
 *
 * The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
 * shape and byte range, then the raw bytes. Nothing is copied here: a tensor's data pointer is
 * inside the mapping, and checkpoint.c converts values as it places them (file_value).
 */
#define _GNU_SOURCE
#include "support/support.h"
#include "support/tools.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ============================================================================================
 * safetensors: 8-byte little-endian header length, a JSON header, then the raw tensor bytes.
 * ============================================================================================ */

static int dtype_from_string(const char *s, st_dtype *d, size_t *size) {
    if (strcmp(s, "F16") == 0) {
        *d = ST_F16;
        *size = 2;
        return 0;
    }
    if (strcmp(s, "BF16") == 0) {
        *d = ST_BF16;
        *size = 2;
        return 0;
    }
    if (strcmp(s, "F32") == 0) {
        *d = ST_F32;
        *size = 4;
        return 0;
    }
    return -1;
}

static int cmp_by_offset(const void *a, const void *b) {
    const st_tensor *x = a, *y = b;
    const char *px = x->data, *py = y->data;
    return px < py ? -1 : px > py;
}

/* Parses one header entry into t; `data` is the start of the byte buffer, `data_len` its size. */
static int parse_tensor_entry(const cJSON *e, const char *path, const char *data, size_t data_len,
                              st_tensor *t, char *err) {
    const char *name = e->string;
    if (strlen(name) >= sizeof t->name)
        return fg_fail(err, "%s: tensor name too long: %.60s...", path, name);
    snprintf(t->name, sizeof t->name, "%s", name);
    const cJSON *dt = fg_json_get(e, "dtype");
    const cJSON *shape = fg_json_get(e, "shape");
    const cJSON *offs = fg_json_get(e, "data_offsets");
    size_t elsize;
    if (!cJSON_IsString(dt)) return fg_fail(err, "%s: tensor %s: missing dtype", path, name);
    if (dtype_from_string(dt->valuestring, &t->dtype, &elsize))
        return fg_fail(err, "%s: tensor %s: unsupported dtype %s (F16, BF16 and F32 are)", path,
                       name, dt->valuestring);
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) > 4)
        return fg_fail(err, "%s: tensor %s: bad shape", path, name);
    t->ndim = cJSON_GetArraySize(shape);
    uint64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        const cJSON *d = cJSON_GetArrayItem(shape, i);
        if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble > 1e12 ||
            d->valuedouble != (double)(int64_t)d->valuedouble)
            return fg_fail(err, "%s: tensor %s: bad shape", path, name);
        t->shape[i] = (int64_t)d->valuedouble;
        if (__builtin_mul_overflow(numel, (uint64_t)t->shape[i], &numel) ||
            numel > ((uint64_t)1 << 40))
            return fg_fail(err, "%s: tensor %s: shape of more than 2^40 elements", path, name);
    }
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
        return fg_fail(err, "%s: tensor %s: bad data_offsets", path, name);
    double b = cJSON_GetArrayItem(offs, 0)->valuedouble,
           en = cJSON_GetArrayItem(offs, 1)->valuedouble;
    if (!cJSON_IsNumber(cJSON_GetArrayItem(offs, 0)) ||
        !cJSON_IsNumber(cJSON_GetArrayItem(offs, 1)) || !(b >= 0 && en >= b))
        return fg_fail(err, "%s: tensor %s: bad data_offsets", path, name);
    if (en > (double)data_len) /* checked before the casts below, which need the range */
        return fg_fail(err,
                       "%s: tensor %s: data_offsets [%.0f, %.0f] out of bounds (data is %zu "
                       "bytes; truncated file?)",
                       path, name, b, en, data_len);
    if (b != (double)(uint64_t)b || en != (double)(uint64_t)en)
        return fg_fail(err, "%s: tensor %s: bad data_offsets", path, name);
    t->nbytes = (size_t)(en - b);
    if (t->nbytes != numel * elsize) /* no overflow: numel <= 2^40, elsize <= 4 */
        return fg_fail(err, "%s: tensor %s: data_offsets hold %zu bytes, shape and dtype need %llu",
                       path, name, t->nbytes, (unsigned long long)(numel * elsize));
    t->data = data + (size_t)b;
    return 0;
}

static int parse_header(st_archive *a, int file, const char *path, char *err) {
    const unsigned char *map = a->maps[file];
    size_t size = a->sizes[file];
    if (size < 8) return fg_fail(err, "%s: truncated file (%zu bytes, no header)", path, size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | map[i];
    if (hlen > size - 8)
        return fg_fail(err, "%s: header length %llu beyond the file (%zu bytes)", path,
                       (unsigned long long)hlen, size);
    char header[FG_PATH_LEN + 16]; /* the JSON text may be padded with spaces, nothing else */
    snprintf(header, sizeof header, "%s header", path);
    cJSON *root = fg_json_parse(header, (const char *)map + 8, (size_t)hlen, err);
    if (!root) return -1;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: malformed JSON (not an object)", header);
    }
    int first = a->n_tensors, n = 0, rc = 0;
    for (const cJSON *e = root->child; e; e = e->next) n++;
    st_tensor *grown = realloc(a->tensors, (size_t)(a->n_tensors + n + 1) * sizeof *grown);
    if (!grown) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: out of memory", path);
    }
    a->tensors = grown;
    const char *data = (const char *)map + 8 + hlen;
    for (const cJSON *e = root->child; e && rc == 0; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) continue;
        if (!cJSON_IsObject(e)) {
            rc = fg_fail(err, "%s: tensor %s: not an object", path, e->string);
            break;
        }
        st_tensor *t = &a->tensors[a->n_tensors];
        rc = parse_tensor_entry(e, path, data, size - 8 - hlen, t, err);
        t->file = file;
        if (rc == 0) a->n_tensors++;
    }
    cJSON_Delete(root);
    if (rc) return rc;
    /* Overlapping byte ranges mean a corrupt or hostile header. An empty tensor has no bytes,
     * so it overlaps nothing, wherever its offsets point. */
    int count = 0;
    st_tensor *sorted = malloc((size_t)(a->n_tensors - first + 1) * sizeof *sorted);
    if (!sorted) return fg_fail(err, "%s: out of memory", path);
    for (int i = first; i < a->n_tensors; i++)
        if (a->tensors[i].nbytes) sorted[count++] = a->tensors[i];
    qsort(sorted, (size_t)count, sizeof *sorted, cmp_by_offset);
    for (int i = 1; i < count && rc == 0; i++)
        if ((const char *)sorted[i - 1].data + sorted[i - 1].nbytes > (const char *)sorted[i].data)
            rc = fg_fail(err, "%s: tensors %s and %s overlap", path, sorted[i - 1].name,
                         sorted[i].name);
    free(sorted);
    return rc;
}

int st_open_file(const char *path, st_archive *a, char *err) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* a FIFO: refused below, not waited
                                                               on */
    if (fd < 0) return fg_fail(err, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return fg_fail(err, "%s: not a regular file", path);
    }
    size_t size = (size_t)st.st_size;
    void *map = size ? mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
    close(fd);
    if (map == MAP_FAILED) return fg_fail(err, "%s: mmap failed: %s", path, strerror(errno));
    int i = a->n_files;
    char **np = realloc(a->paths, (size_t)(i + 1) * sizeof *np);
    if (np) a->paths = np;
    void **nm = np ? realloc(a->maps, (size_t)(i + 1) * sizeof *nm) : NULL;
    if (nm) a->maps = nm;
    size_t *ns = nm ? realloc(a->sizes, (size_t)(i + 1) * sizeof *ns) : NULL;
    if (ns) a->sizes = ns;
    char *copy = ns ? strdup(path) : NULL;
    if (!copy) {
        if (map) munmap(map, size);
        return fg_fail(err, "%s: out of memory", path);
    }
    a->paths[i] = copy;
    a->maps[i] = map;
    if (map) fg_watch_mapping(map, size, path); /* truncated while mapped: a line, not a SIGBUS */
    a->sizes[i] = size;
    a->n_files++;
    return parse_header(a, i, path, err);
}

static int by_tensor_name(const void *x, const void *y) {
    return strcmp((*(const st_tensor *const *)x)->name, (*(const st_tensor *const *)y)->name);
}

static int open_index(const char *dir, const char *index_path, st_archive *a, char *err) {
    cJSON *root = fg_json_read_file(index_path, err);
    if (!root) return -1;
    const cJSON *wm = fg_json_get(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        cJSON_Delete(root);
        return fg_fail(err, "%s: malformed JSON (expected an object with \"weight_map\")",
                       index_path);
    }
    int rc = 0;
    for (const cJSON *e = wm->child; e && rc == 0; e = e->next) { /* the shards, each once */
        if (!cJSON_IsString(e) || strchr(e->valuestring, '/')) {
            rc = fg_fail(err, "%s: weight_map entry %s: bad file name", index_path, e->string);
            break;
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->valuestring);
        int seen = 0;
        for (int f = 0; f < a->n_files && !seen; f++) seen = strcmp(a->paths[f], path) == 0;
        if (!seen) rc = st_open_file(path, a, err);
    }
    /* each entry's tensor where the index says, found in the tensors sorted by name (a linear
     * search an entry took minutes on an index of 10^5 entries) */
    const st_tensor **by_name = rc ? NULL : malloc((size_t)(a->n_tensors + 1) * sizeof *by_name);
    if (rc == 0 && !by_name) rc = fg_fail(err, "out of memory");
    for (int i = 0; by_name && i < a->n_tensors; i++) by_name[i] = &a->tensors[i];
    if (by_name) qsort(by_name, (size_t)a->n_tensors, sizeof *by_name, by_tensor_name);
    for (int i = 1; by_name && rc == 0 && i < a->n_tensors; i++) /* HF would take either */
        if (!strcmp(by_name[i - 1]->name, by_name[i]->name))
            rc = fg_fail(err, "%s: tensor %s is in two shards, %s and %s", index_path,
                         by_name[i]->name, a->paths[by_name[i - 1]->file],
                         a->paths[by_name[i]->file]);
    for (const cJSON *e = wm->child; e && rc == 0; e = e->next) {
        st_tensor key;
        const st_tensor *want = &key, **t = NULL;
        if (strlen(e->string) < sizeof key.name) { /* no tensor has a longer name */
            snprintf(key.name, sizeof key.name, "%s", e->string);
            t = bsearch(&want, by_name, (size_t)a->n_tensors, sizeof *by_name, by_tensor_name);
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->valuestring);
        if (!t || strcmp(a->paths[(*t)->file], path) != 0)
            rc = fg_fail(err, "%s: tensor %s is not in %s as the index says", index_path, e->string,
                         e->valuestring);
    }
    free(by_name);
    cJSON_Delete(root);
    return rc;
}

/* The directory's checkpoint file into path: model.safetensors where there is one (HF loads it
 * over an index beside it, which a sharded save leaves behind), else the shards' index; 1 for the
 * index, 0 for the one file, -1 (and err) for neither. */
static int checkpoint_file(const char *dir, char *path, size_t len, char *err) {
    snprintf(path, len, "%s/model.safetensors", dir);
    if (access(path, F_OK) == 0) return 0;
    snprintf(path, len, "%s/model.safetensors.index.json", dir);
    if (access(path, F_OK) == 0) return 1;
    return fg_fail(err,
                   "%s: no model.safetensors or model.safetensors.index.json (convert a "
                   "pytorch_model.bin with scripts/convert_to_safetensors.py)",
                   dir);
}

int st_open_dir(const char *dir, st_archive *a, char *err) {
    memset(a, 0, sizeof *a);
    char path[4096];
    int rc = checkpoint_file(dir, path, sizeof path, err);
    if (rc == 1) rc = open_index(dir, path, a, err);
    else if (rc == 0) rc = st_open_file(path, a, err);
    if (rc) st_close(a);
    return rc;
}

/* One more name, unless names already holds it. */
static int add_name(char ***names, int *n, const char *name) {
    for (int i = 0; i < *n; i++)
        if (!strcmp((*names)[i], name)) return 0;
    char **grown = realloc(*names, (size_t)(*n + 1) * sizeof *grown);
    if (!grown) return -1;
    *names = grown;
    if (!(grown[*n] = strdup(name))) return -1;
    (*n)++;
    return 0;
}

int st_dir_files(const char *dir, char ***names, int *n, char *err) {
    char path[4096];
    int rc = 0;
    *names = NULL;
    *n = 0;
    int index = checkpoint_file(dir, path, sizeof path, err);
    if (index < 0) return -1;
    if (!index) return add_name(names, n, "model.safetensors") ? fg_fail(err, "out of memory") : 0;
    cJSON *root = fg_json_read_file(path, err); /* a FIFO or a directory: refused, not waited on */
    if (!root) return -1;
    const cJSON *wm = fg_json_get(root, "weight_map");
    if (!cJSON_IsObject(wm))
        rc = fg_fail(err, "%s: malformed JSON (expected an object with \"weight_map\")", path);
    if (rc == 0 && add_name(names, n, "model.safetensors.index.json"))
        rc = fg_fail(err, "out of memory");
    for (const cJSON *e = wm ? wm->child : NULL; e && rc == 0; e = e->next) {
        if (!cJSON_IsString(e) || strchr(e->valuestring, '/'))
            rc = fg_fail(err, "%s: weight_map entry %s: bad file name", path, e->string);
        else if (add_name(names, n, e->valuestring)) rc = fg_fail(err, "out of memory");
    }
    cJSON_Delete(root);
    if (rc) {
        for (int i = 0; i < *n; i++) free((*names)[i]);
        free(*names);
        *names = NULL;
        *n = 0;
    }
    return rc;
}

const st_tensor *st_find(const st_archive *a, const char *name) {
    for (int i = 0; i < a->n_tensors; i++)
        if (strcmp(a->tensors[i].name, name) == 0) return &a->tensors[i];
    return NULL;
}

void st_close(st_archive *a) {
    for (int i = 0; i < a->n_files; i++) {
        if (a->maps[i]) {
            fg_unwatch_mapping(a->maps[i]);
            munmap(a->maps[i], a->sizes[i]);
        }
        free(a->paths[i]);
    }
    free(a->paths);
    free(a->maps);
    free(a->sizes);
    free(a->tensors);
    memset(a, 0, sizeof *a);
}
