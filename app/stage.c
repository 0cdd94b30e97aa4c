/* app/stage.c: the stage hooks of a run in one process. §4.4's pipeline splits the layers
 * over stages (fg_stage_layers; app/pipeline.c's hooks); one process is one stage whose first layer
 * reads token ids and whose last gives the logits, so nothing travels between stages and every hook
 * does nothing.
 */
#include "flexgen.h"
#include "support/support.h"

static int single_agree(fg_runtime *rt, int rc, char *err) {
    (void)rt;
    (void)err;
    return rc ? -1 : 0;
}
static int single_open_block(block *bl, const block *shared, char *err) {
    (void)bl;
    (void)shared;
    (void)err;
    return 0;
}
static void single_block(block *bl) { (void)bl; }
static uint64_t single_receive(block *bl, int k, int arena) {
    (void)bl;
    (void)k;
    (void)arena;
    return 0;
}
static void single_send(block *bl, int k, int arena) {
    (void)bl;
    (void)k;
    (void)arena;
}
static void single_await(block *bl, int k) {
    (void)bl;
    (void)k;
}
static int single_step_input(block *bl) {
    (void)bl;
    return 1;
}
static void single_receive_tokens(block *bl, int step) {
    (void)bl;
    (void)step;
}
static void single_tokens_out(block *bl, const gen_options *opt, int *out) {
    (void)bl;
    (void)opt;
    (void)out;
}

const stage_hooks fg_single_stage = {
    .agree = single_agree,
    .open_block = single_open_block,
    .close_block = single_block,
    .receive_activations = single_receive,
    .send_activations = single_send,
    .await_input = single_await,
    .input_taken = single_block,
    .step_input = single_step_input,
    .receive_tokens = single_receive_tokens,
    .tokens_out = single_tokens_out,
    .pass_stop = single_block,
    .end_round = single_block,
};
