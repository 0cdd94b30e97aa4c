/* fuzz_config.c: fuzzer bytes as an HF config.json (model_config_from_json), then the sizes the
 * program derives from an accepted config (parameters, bytes, the split over pipeline stages). */
#define _GNU_SOURCE
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write("config.json", data, size);
    char err[FG_ERR_LEN] = "";
    model_config cfg;
    int rc = model_config_from_json(path, &cfg, err);
    fuzz_check(rc, err, "model_config_from_json");
    if (rc) return 0;
    if (cfg.n_layers < 1 || cfg.hidden < 1 || cfg.n_heads < 1 || cfg.hidden % cfg.n_heads ||
        cfg.ffn < 1 || cfg.vocab < 1 || cfg.max_pos < 1 || cfg.word_dim < 1) {
        fprintf(stderr, "accepted a config with a size below 1\n");
        abort();
    }
    volatile double bytes = (double)opt_param_count(&cfg) + opt_model_bytes(&cfg) +
                            opt_cache_bytes(&cfg, 4, 8) + opt_hidden_bytes(&cfg, 4, 8);
    (void)bytes;
    for (int n = 1; n <= 4; n++) { /* every layer of FlexGen's list on exactly one stage */
        int next = 0;
        for (int s = 0; s < n; s++) {
            int first, end;
            fg_stage_layers(&cfg, s, n, &first, &end);
            if (first != next || end < first) abort();
            next = end;
        }
        if (next != cfg.n_layers + 2) abort();
    }
    return 0;
}
