/* fuzz_safetensors.c: fuzzer bytes as a checkpoint's model.safetensors beside a fixed config.json,
 * opened as ./flexgen opens a checkpoint: the header and tensor table (st_open_file), the tensors
 * the config asks for with their shapes (opt_layout_check_archive), their values converted
 * (model_weights_load). Every tensor the parser accepts must lie inside the file. */
#define _GNU_SOURCE
#include "fuzz.h"

/* A small OPT (hidden 4, one layer), whose whole checkpoint is a seed of a few KB. */
static const char CONFIG[] =
    "{\"model_type\": \"opt\", \"num_hidden_layers\": 1, \"hidden_size\": 4, \"ffn_dim\": 8,"
    " \"num_attention_heads\": 2, \"vocab_size\": 8, \"max_position_embeddings\": 4,"
    " \"word_embed_proj_dim\": 4, \"do_layer_norm_before\": true}";

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_write("config.json", CONFIG, strlen(CONFIG));
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write("model.safetensors", data, size);
    char err[FG_ERR_LEN] = "";
    st_archive a = {0};
    int rc = st_open_file(path, &a, err);
    fuzz_check(rc, err, "st_open_file");
    for (int i = 0; rc == 0 && i < a.n_tensors; i++) {
        const st_tensor *t = &a.tensors[i];
        const char *p = t->data, *base = a.maps[0];
        if (t->file != 0 || p < base || t->nbytes > a.sizes[0] || (size_t)(p - base) > a.sizes[0] - t->nbytes) {
            fprintf(stderr, "tensor %s lies outside the file\n", t->name);
            abort();
        }
    }
    st_close(&a);

    fuzz_load_weights();
    return 0;
}
