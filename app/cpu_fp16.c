/* app/cpu_fp16.c: the CPU backend holding activations in fp16 (--device cpu-fp16), as the
 * CUDA backend does, so that the runtime's 2-byte activations run and are tested on any machine.
 * Each operation widens the GPU batch's x into ws->x32, runs the CPU backend's fp32 operation on
 * it, and rounds its output back to fp16. Results differ from the fp32 backend's by that rounding
 * of the hidden states between layers alone (tests/test_runtime.c bounds it).
 */
#include "support/support.h"
#include "app/app.h"

#include <pthread.h>
#include <stdlib.h>

static size_t fp16_workspace_bytes(const model_config *cfg, size_t rows, int max_prompt,
                                   int max_len) {
    return model_workspace_bytes(cfg, rows, max_prompt, max_len) + 4 * rows * cfg->hidden;
}

static int fp16_workspace_init(model_workspace *ws, const model_config *cfg, size_t rows,
                               int max_prompt, int max_len, char *err) {
    if (model_workspace_init(ws, cfg, rows, max_prompt, max_len, err)) return -1;
    if (!(ws->x32 = aligned_alloc(64, (rows * cfg->hidden * sizeof(float) + 63) & ~(size_t)63))) {
        model_workspace_free(ws);
        return fg_fail(err, "gpu tier: cannot allocate the workspace for %zu token rows", rows);
    }
    return 0;
}

/* The GPU batch with x widened into ws->x32 (n rows of it; 0: none, x is only written). */
static gpu_batch widened(const gpu_batch *gb, const model_config *c, model_workspace *ws,
                         size_t n) {
    gpu_batch wide = *gb;
    fp16_to_fp32_n(gb->x, ws->x32, n * c->hidden);
    wide.x = ws->x32;
    return wide;
}

static void fp16_embed(const model_weights *w, gpu_batch *gb, model_workspace *ws) {
    size_t n = (size_t)gb->batch * gb->n_new * w->cfg.hidden;
    gpu_batch wide = widened(gb, &w->cfg, ws, 0);
    fg_cpu_backend.forward[w->cfg.family].embed(w, &wide, ws);
    fp32_to_fp16_n(ws->x32, gb->x, n);
}

static void fp16_layer(const model_weights *w, int layer, gpu_batch *gb, model_workspace *ws) {
    size_t rows = (size_t)gb->batch * gb->n_new;
    gpu_batch wide = widened(gb, &w->cfg, ws, rows);
    fg_cpu_backend.forward[w->cfg.family].layer(w, layer, &wide, ws);
    fp32_to_fp16_n(ws->x32, gb->x, rows * w->cfg.hidden);
}

static void fp16_output(const model_weights *w, gpu_batch *gb, model_workspace *ws, float *logits) {
    gpu_batch wide = widened(gb, &w->cfg, ws, (size_t)gb->batch * gb->n_new);
    fg_cpu_backend.forward[w->cfg.family].output(w, &wide, ws, logits);
}

/* fg_cpu_backend's memory operations, with fp16 activations and the operations above. */
static fg_backend fp16_backend;
static pthread_once_t fp16_once = PTHREAD_ONCE_INIT;
static void fp16_backend_init(void) {
    fp16_backend = fg_cpu_backend;
    fp16_backend.name = "cpu-fp16";
    fp16_backend.act_elem = sizeof(fp16);
    fp16_backend.workspace_bytes = fp16_workspace_bytes;
    fp16_backend.workspace_init = fp16_workspace_init;
    for (int f = 0; f < N_FAMILIES; f++)
        fp16_backend.forward[f] = (fg_forward){fp16_embed, fp16_layer, fp16_output};
}

const fg_backend *fg_cpu_fp16_backend(void) {
    pthread_once(&fp16_once, fp16_backend_init);
    return &fp16_backend;
}
