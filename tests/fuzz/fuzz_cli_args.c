/* fuzz_cli_args.c: fuzzer bytes as a command line (arguments separated by NUL bytes) for the flag
 * parser of `flexgen` and `flexgen policy` (args.c's parse_args, reached by including args.c). */
#include "../../app/args.c"
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    enum { MAX_ARGS = 64 };
    char *text = malloc(size + 1), *argv[MAX_ARGS + 2] = {"flexgen"};
    if (!text) abort();
    memcpy(text, data, size);
    text[size] = 0;
    int argc = 1;
    for (char *s = text; s <= text + size && argc <= MAX_ARGS; s += strlen(s) + 1) argv[argc++] = s;
    argv[argc] = NULL;
    cli_args a;
    char err[FG_ERR_LEN] = "";
    int rc = parse_args(argc, argv, &a, err);
    fuzz_check(rc < 0, err, "parse_args");
    if (rc == 0) {
        const fg_policy *p = &a.policy;
        if (p->gpu_batch_size < 1 || p->num_gpu_batches < 1 || a.prompt_len < 1 || a.gen.gen_len < 1 ||
            !(a.gen.top_p > 0 && a.gen.top_p <= 1) || !(p->attn_sparsity > 0 && p->attn_sparsity <= 1)) {
            fprintf(stderr, "parse_args accepted an out-of-range value\n");
            abort();
        }
    }
    free(a.prompts);
    free(text);
    return 0;
}
