/* fuzz_numbers.c: fuzzer bytes (up to the first NUL) as the value of a size flag (parse_size:
 * --gpu-mem 16G), an integer flag (parse_int), a number flag (parse_float) and --device, with
 * the ranges the flags use; what is accepted must lie in its range. */
#include "../../app/args.c"
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    return 0;
}

static void fail(const char *what, const char *s) {
    fprintf(stderr, "%s accepted '%s' out of range\n", what, s);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *s = malloc(size + 1), err[FG_ERR_LEN] = "";
    if (!s) abort();
    memcpy(s, data, size);
    s[size] = 0;
    double bytes = -1;
    int rc = parse_size("--gpu-mem", s, &bytes, err);
    fuzz_check(rc, err, "parse_size");
    if (rc == 0 && !(bytes > 0 && bytes <= 1e18)) fail("parse_size", s);
    static const int ranges[][2] = {{0, 100}, {1, INT_MAX}, {0, 1}, {0, INT_MAX}};
    for (int i = 0; i < 4; i++) {
        int v = 0;
        err[0] = 0;
        rc = parse_int("--gen-len", s, ranges[i][0], ranges[i][1], &v, err);
        fuzz_check(rc, err, "parse_int");
        if (rc == 0 && (v < ranges[i][0] || v > ranges[i][1])) fail("parse_int", s);
    }
    /* --temperature, --top-p, --attn-sparsity and --max-latency: lo, above lo only (1) or from it, hi */
    static const double franges[][3] = {{0, 0, 1e6}, {1e-9, 0, 1}, {0, 1, 1}, {0, 1, 1e9}};
    for (int i = 0; i < 4; i++) {
        float v = 0, lo = (float)franges[i][0];
        err[0] = 0;
        rc = parse_float("--top-p", s, franges[i][0], (int)franges[i][1], franges[i][2], &v, err);
        fuzz_check(rc, err, "parse_float");
        if (rc == 0 && !((franges[i][1] ? v > lo : v >= lo) && v <= (float)franges[i][2])) fail("parse_float", s);
    }
    fg_device d;
    err[0] = 0;
    fuzz_check(parse_device(s, &d, err), err, "parse_device");
    free(s);
    return 0;
}
