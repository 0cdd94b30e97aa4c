/* fuzz_index.c: fuzzer bytes as model.safetensors.index.json in a copy of the sharded fixture
 * opt-tiny-350m (its config.json and three shards), opened and loaded as ./flexgen loads a
 * checkpoint (st_open_dir through model_weights_load). */
#define _GNU_SOURCE
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_copy_fixture("opt-tiny-350m/config.json", "config.json");
    for (int i = 1; i <= 3; i++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-00003.safetensors", i);
        char rel[128];
        snprintf(rel, sizeof rel, "opt-tiny-350m/%s", name);
        fuzz_copy_fixture(rel, name);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write("model.safetensors.index.json", data, size);
    char err[FG_ERR_LEN] = "";
    st_archive a;
    int rc = st_open_dir(fuzz_dir(), &a, err);
    fuzz_check(rc, err, "st_open_dir");
    if (rc == 0) {
        if (a.n_files > 3) abort(); /* each shard mapped once at most */
        st_close(&a);
    }
    fuzz_load_weights();
    return 0;
}
