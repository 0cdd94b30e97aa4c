/* fuzz_prompt_ids.c: fuzzer bytes as a prompt file read by prompts.c's read_prompt_lines: as
 * --prompt-ids (token ids, parse_id_line), as --prompt-file (text lines through the fixture
 * tokenizer, loaded once) and as a JSONL --prompt-file (jobs.c's jsonl_prompt, with and without
 * the tokenizer), for the fixture tokenizer's vocab and a model of 64 positions, 4 tokens
 * generated. Accepted ids lie in the vocab; every prompt has at least one, and an id, and leaves
 * room for the tokens generated. */
#include "../../app/prompts.c"
#include "fuzz.h"

static fg_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    tok = fuzz_fixture_tokenizer();
    return 0;
}

static void read_prompts(const char *path, const fg_tokenizer *t, int vocab) {
    prompt_set p = {0};
    char err[FG_ERR_LEN] = "";
    model_config c = {.vocab = vocab, .max_pos = 64};
    int rc = read_prompt_lines(&p, "--prompt-file", path, t, "the fixture tokenizer", &c, 4, err);
    fuzz_check(rc, err, "read_prompt_lines");
    for (int i = 0; rc == 0 && i < p.n; i++) {
        if (p.lens[i] < 1 || p.lens[i] + 3 > c.max_pos) abort();
        for (int j = 0; j < p.lens[i]; j++)
            if (p.ids[i][j] < 0 || p.ids[i][j] >= vocab) abort();
        if (strstr(path, ".jsonl") && !p.record_ids[i]) abort();
    }
    prompts_free(&p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write("prompts.txt", data, size);
    read_prompts(path, NULL, tokenizer_vocab_size(tok));
    read_prompts(path, tok, tokenizer_vocab_size(tok));
    path = fuzz_write("prompts.jsonl", data, size);
    read_prompts(path, NULL, tokenizer_vocab_size(tok));
    read_prompts(path, tok, tokenizer_vocab_size(tok));
    return 0;
}
