/* app/int8_columns.c: --int8-activations' prefill (not the paper's scheme: docs/DESIGN.md, "Integer
 * products, an opt-in beside §5"): W's int8 columns (support/matmul.c) made once for the 4-bit
 * matrices that stay in their homes on the gpu tier, where the plan of a generate has room for
 * them beside everything else (a plan item of tiers.c's), and dropped where a later plan needs
 * that room.
 */
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

/* The 4-bit matrices that stay in their homes on the gpu tier, whose int8 columns may be kept:
 * tensor i's W, its parts and shape, or NULL. */
static const void *resident_matrix(const fg_model *m, int i, int *parts, int *in, int *out) {
    const weight_home *h = &m->homes[i];
    const opt_tensor *t = &m->layout.tensors[i];
    if (!h->q4 || is_staged(m, h) || tied_here(m, i) >= 0 || t->group_len == 0 ||
        t->group_inner != 1)
        return NULL;
    *parts = t->n_specs; /* q|k|v: [in][3][h] */
    *in = (int)(t->group_outer / (size_t)t->n_specs);
    *out = (int)t->group_len * t->n_specs;
    return *t->slot;
}

void keep_int8_columns(fg_model *m, int n_prompts, const int *lens, int max_prompt, int gen_len) {
    if (m->view.products != PRODUCTS_INT8 || !m->rt->backend->gpu_is_host || m->int8_columns.n)
        return;
    int first = m->layer_first[m->first_layer], end = m->layer_first[m->end_layer];
    int parts, in, out;
    double estimate = 0;
    for (int i = first; i < end; i++)
        if (resident_matrix(m, i, &parts, &in, &out)) estimate += int8_columns_estimate(in, out);
    char err[FG_ERR_LEN];
    m->int8_columns_bytes = estimate;
    if (estimate == 0 || fg_check_plan(m, n_prompts, lens, max_prompt, gen_len, err)) {
        m->int8_columns_bytes = 0; /* no room: the products make them per call */
        return;
    }
    for (int j = m->first_layer; j < m->end_layer; j++) {
        for (int i = m->layer_first[j]; i < m->layer_first[j + 1]; i++) {
            const void *W = resident_matrix(m, i, &parts, &in, &out);
            if (W && int8_column_set_add(&m->int8_columns, W, parts, in, out)) {
                int8_column_set_free(&m->int8_columns); /* no memory: per call, as without room */
                m->int8_columns_bytes = 0;
                return;
            }
        }
        load_progress(m, "int8 columns", j + 1 - m->first_layer, stage_layers(m));
    }
    m->int8_columns_bytes = (double)m->int8_columns.bytes;
    tier_add(m->rt, TIER_GPU, m->int8_columns_bytes);
}

void drop_int8_columns(fg_model *m) {
    if (!m->int8_columns.n) return;
    tier_add(m->rt, TIER_GPU, -m->int8_columns_bytes);
    int8_column_set_free(&m->int8_columns);
    m->int8_columns_bytes = 0;
}
