/* app/args.c: the command line's flags: --help's text, the parsers of numbers, sizes and names,
 * parse_args (a flag at a time into cli_args), and the checks between flags (those that need or
 * exclude others, an output that would overwrite an input). Each bad flag is one error line.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* --help, in three parts: the commands and the model, prompts, generation and device flags;
 * the policy and the pipeline; the search, perplexity and the outputs. The text is
 * laid out as --help prints it, so the formatter leaves it as it stands. */
/* clang-format off */
static void usage_run(FILE *out) {
    fprintf(out,
"usage: flexgen [options]\n"
"       flexgen policy [options] [--evaluate]         (the policy search; no generation)\n"
"       flexgen profile [--offload-dir DIR] [--out FILE] [--device cuda|cpu|cpu-fp16|auto]\n"
"       flexgen tokenize --vocab FILE --merges FILE | --tokenizer FILE.json | --model DIR\n"
"                                                     (stdin lines -> token ids, no BOS)\n"
"       flexgen perplexity --model DIR --text FILE [options]   (section 6.2's measure)\n"
"\n"
"Generates text with an OPT or LLaMA-family model (LLaMA 1-3, Mistral, Qwen2), placing weights,\n"
"KV cache and activations on the gpu, cpu\n"
"and disk tiers and walking blocks of GPU batches in the order of the FlexGen paper's Fig. 4\n"
"with I/O overlapped, then prints FlexGen's benchmark report. On the CUDA backend the gpu tier\n"
"is device memory; on the CPU backend it is the CPU's working set in host memory. Both hold\n"
"the weights as stored (fp16, or 4-bit with --compress-weight) and compute in fp32.\n"
"\n"
"model\n"
"  --model NAME|DIR        opt-125m ... opt-175b, llama-2-7b, llama-2-13b, llama-2-70b,\n"
"                          llama-3-8b, llama-3.2-1b, tinyllama-1.1b, mistral-7b or\n"
"                          qwen2.5-0.5b with dummy weights, or an HF checkpoint directory\n"
"                          (config.json of model_type opt, llama, mistral or qwen2, and\n"
"                          model.safetensors or its shard index) [opt-125m]\n"
"  --path DIR              dummy weights placed on disk are written here once and reused\n"
"                          [$XDG_CACHE_HOME/flexgen or ~/.cache/flexgen]\n"
"  --vocab F, --merges F   tokenizer files (default: DIR's tokenizer.json, else its\n"
"                          vocab.json and merges.txt); the special-token files beside\n"
"                          vocab.json are read too\n"
"  --tokenizer F.json      an HF tokenizer.json instead (LLaMA, Mistral, Qwen2), with the\n"
"                          add_bos_token of the tokenizer_config.json beside it\n"
"prompts (synthetic ones of --prompt-len tokens when none are given)\n"
"  --prompt TEXT           a prompt (repeatable); needs a tokenizer; its BOS is prepended\n"
"  --prompt-file F         one prompt a line; needs a tokenizer; its BOS is prepended. F.jsonl:\n"
"                          a JSON object a line, {\"prompt\": TEXT} (tokenized) or\n"
"                          {\"prompt_ids\": [...]} (used as given: no tokenizer needed), each\n"
"                          with an optional \"id\" (the line number when absent)\n"
"  --prompt-ids F          one prompt a line, space-separated token ids, used as given\n"
"  --prompt-len N          length of synthetic prompts [512]\n"
"generation\n"
"  --gen-len N             tokens to generate per prompt [32]\n"
"  --temperature T         0 is greedy; > 0 samples from softmax(logits / T) [0]\n"
"  --top-p P               nucleus sampling mass, in [1e-9, 1] [1]\n"
"  --seed N                seed of dummy weights, synthetic prompts and sampling [0]\n"
"  --stop-at-eos           stop a sequence after it generates </s>\n"
"  --refill                with --stop-at-eos, in one process: the slot of a sequence that\n"
"                          ends takes the next prompt, whose prefill joins the next step, so\n"
"                          a block runs full until the prompts run out\n"
"device\n"
"  --device cuda|cpu|auto  the compute device: auto is cuda where a GPU is present (this build:\n"
"                          %s), else the CPU [auto]; cpu-fp16 is the CPU holding\n"
"                          activations in fp16 as cuda does\n",
            fg_cuda_compiled() ? "with CUDA" : "CPU only, no nvcc when it was built");
}

static void usage_policy(FILE *out) {
    fprintf(out,
"policy (paper section 4.2)\n"
"  --gpu-batch-size N      sequences per GPU batch [16]\n"
"  --num-gpu-batches N     GPU batches per block; a block is their product, and prompts are\n"
"                          processed a block at a time (the last may be partial) [2]\n"
"  --percent WG WC CG CC HG HC\n"
"                          percent of weights, KV cache and activations on the gpu and cpu\n"
"                          tiers; disk holds the rest of each [100 0 100 0 100 0]\n"
"  --schedule zigzag|diagonal\n"
"                          zigzag: a block's GPU batches step together (section 4.2); diagonal:\n"
"                          GPU batch k starts k gen_len / num-gpu-batches steps after the\n"
"                          first, and each takes the next prompts as its sequences end, so\n"
"                          prompts stream through the block and its KV cache peaks lower\n"
"                          (Appendix A.2); a job's records go out as groups end [zigzag;\n"
"                          --policy auto: the faster]\n"
"  --overlap 0|1           I/O on its own threads, overlapped with compute [1]\n"
"  --cpu-cache-compute     decode attention over a cache on cpu or disk runs on the CPU where\n"
"                          the cache lives\n"
"  --pin-weight 0|1        page-locked cpu-tier weights, for fast copies to the GPU (CUDA only)\n"
"                          [1]\n"
"  --compress-weight       keep every weight matrix 4-bit, group-wise (section 5) in whichever\n"
"                          tier holds it; the products read it as stored (CUDA's prefill\n"
"                          widens a slice of a matrix at a time for cuBLAS)\n"
"  --int8-activations      with --compress-weight, on the CPU: multiply in integers. Decode\n"
"                          rounds the activations to int8 (one scale per row, group and 64\n"
"                          inputs) against the 4-bit codes; prefill rounds each row once and\n"
"                          widens the weights to int8 (one scale per column; made once where\n"
"                          the weights stay on the gpu tier and it has room). Faster, and not\n"
"                          section 5's scheme (its accuracy: BENCHMARKS.md); lm_head keeps fp32\n"
"  --bf16-prefill          on the CPU: prefill's linear layers round both operands to bf16 and\n"
"                          sum in fp32 (AMX or AVX-512 BF16 where the CPU has them); decode\n"
"                          keeps fp32 (its accuracy: BENCHMARKS.md)\n"
"  --compress-cache        keep the KV cache 4-bit, group-wise along each head (section 5)\n"
"  --attn-sparsity F       decode attention keeps the top F of the past tokens by weight and\n"
"                          reads only their V rows (section 5), 0 < F <= 1 [1]\n"
"  --gpu-mem SIZE, --cpu-mem SIZE, --disk-mem SIZE\n"
"                          tier capacities, e.g. 16G, 512M (K, M, G, T are powers of 1024)\n"
"                          [available memory; free space in the offload dir, plus dummy\n"
"                          weights already in --path or going to another file system]\n"
"  --offload-dir DIR       the disk tier's files, removed as soon as they are mapped [%s]\n"
"pipeline parallelism (paper section 4.4; this build: %s)\n"
"  mpirun -np M flexgen [options]\n"
"                          M stages, one process each (one GPU each where there are GPUs): the\n"
"                          decoder layers split evenly, the input embedding with the first stage,\n"
"                          the output embedding with the last. Rank 0 reads the prompts and\n"
"                          prints the report; the other flags mean what they mean in one process\n"
"                          and must agree across stages, except the policy and capacities, which\n"
"                          are each stage's own (mpirun's `-np 1 flexgen ... : -np 1 flexgen ...`\n"
"                          gives stages different ones; --policy auto plans each stage)\n",
            FG_DEFAULT_OFFLOAD_DIR,
            fg_pipe_compiled() ? "with MPI" : "without MPI, no mpicc when it was built");
}

static void usage_search(FILE *out) {
    fputs(
"policy search (paper section 4.3)\n"
"  --policy auto|manual    auto: choose the block shape, --percent, --cpu-cache-compute and\n"
"                          (unless given) --schedule by the cost model and LP for these\n"
"                          capacities, prompts and --gen-len, keeping the other flags (the\n"
"                          diagonal schedule pays a warm-up: it gains on many prompts, not one\n"
"                          block); synthetic prompts fill the block it picks,\n"
"                          which can be thousands (bound it with --max-latency) [manual]\n"
"  --hw FILE               the cost model's hardware constants (JSON) [hardware.json in\n"
"                          $XDG_CACHE_HOME/flexgen or ~/.cache/flexgen, measured by\n"
"                          `flexgen profile` the first time]\n"
"  --max-latency S         auto: a block may take at most S seconds (Fig. 1's trade-off)\n"
"  --hw and --max-latency are the search's: a run takes them with --policy auto only.\n"
"  flexgen policy takes the flags of a run and prints the policy the search chooses, as flags,\n"
"  with its predicted throughput and each layer's latency terms, and each schedule's best\n"
"  (--json: one object; --device auto: the backend the hardware file describes);\n"
"  --evaluate predicts the policy given by the flags instead of searching.\n"
"  flexgen profile measures this machine (copies, the disk in --offload-dir, matrix products\n"
"  and attention) and writes the hardware file (--out FILE) [the default --hw]\n"
"perplexity (flexgen perplexity; with the device, section 5 and policy flags above but\n"
"  --schedule)\n"
"  --text F                the text to score, tokenized with the model's tokenizer after a BOS\n"
"  --window N              tokens the model sees at once [the model's positions]\n"
"  --stride N              how far each window advances; it scores the tokens no earlier one\n"
"                          did [window / 2]\n"
"  --decode                score token by token in decode steps, each fed the text's next\n"
"                          token, so a 4-bit cache and sparse attention act as in generation\n"
"                          (prefill, the default, attends to fresh keys and values)\n"
"  --predictions F         write the most likely token at each scored position, one a line\n"
"  --compare F             print the share of positions whose most likely token is the one\n"
"                          in F (another run's --predictions): top-1 agreement\n"
"output\n"
"  --output F.jsonl        a batch job of the prompts given: a JSON record a prompt (id, prompt,\n"
"                          completion, tokens, stop: eos or length) after a first line naming\n"
"                          the job. Prompts run in windows of 8 rounds of blocks, longest first\n"
"                          (less padding); a window's records are appended in file order,\n"
"                          flushed to disk. F is locked while the job runs (a second job on it is\n"
"                          refused). A progress line on stderr; an existing F is refused without\n"
"                          --resume\n"
"  --resume                finish the job of --output F: prompts with a record there are skipped\n"
"                          (F must hold this job: its model and prompts, by content, generation\n"
"                          flags, device and block shape, which --policy auto keeps)\n"
"  --dump-logits F         float32 [num_prompts][gen_len][vocab]: the logits each generated\n"
"                          token was chosen from, in prompt order\n"
"  --trace F               a Chrome trace (load it in Perfetto): one track per thread\n"
"  --json                  one JSON object on stdout instead of the report lines and texts\n"
"  --warmup                first a short untimed generate (a block of prompts of up to 32\n"
"                          tokens, 2 generated), as FlexGen's benchmark does, so that the\n"
"                          figures leave out first-time costs (on a GPU: its context, cuBLAS,\n"
"                          loading kernels); the report gives its latency as the cold run's\n"
"  --quiet                 no progress on stderr\n"
"  --progress              progress on stderr where it is not a terminal too (a log, mpirun,\n"
"                          whose ranks write to a pipe): by default it shows on a terminal only\n"
"  --help                  this text\n"
"\n"
"Threads: OMP_NUM_THREADS (default: all cores). Bad input exits with status 2; standard output\n"
"that cannot be written (a full disk), with status 1.\n",
          out);
}

static void usage_profile(FILE *out) {
    fprintf(out,
"usage: flexgen profile [--offload-dir DIR] [--out FILE] [--device cuda|cpu|cpu-fp16|auto]\n"
"\n"
"Measures this machine for the policy search's cost model (paper section 4.3): copies between\n"
"the tiers, the disk, matrix products and attention; then writes the hardware file that\n"
"--policy auto and `flexgen policy` read (--hw).\n"
"  --offload-dir DIR       the disk tier's directory, whose disk is measured [%s]\n"
"  --out FILE              the hardware file [hardware.json in $XDG_CACHE_HOME/flexgen or\n"
"                          ~/.cache/flexgen: the default --hw]\n"
"  --device D              the backend measured: cuda, cpu, cpu-fp16, or auto (cuda where a\n"
"                          GPU is present) [auto]\n",
            FG_DEFAULT_OFFLOAD_DIR);
}

static void usage_tokenize(FILE *out) {
    fputs(
"usage: flexgen tokenize --vocab FILE --merges FILE | --tokenizer FILE.json | --model DIR\n"
"\n"
"Reads text on standard input and prints each line's token ids, space-separated, a line for\n"
"a line (no BOS).\n"
"  --vocab F, --merges F   a byte-level BPE tokenizer's files (the special-token files beside\n"
"                          vocab.json are read too)\n"
"  --tokenizer F.json      an HF tokenizer.json\n"
"  --model DIR             DIR's tokenizer.json, else its vocab.json and merges.txt\n",
          out);
}

/* clang-format on */

void usage(FILE *out) {
    usage_run(out);
    usage_policy(out);
    usage_search(out);
}

int is_help(const char *arg) { return !strcmp(arg, "--help") || !strcmp(arg, "-h"); }

void usage_command(FILE *out, const char *command) {
    if (!strcmp(command, "profile")) usage_profile(out);
    else if (!strcmp(command, "tokenize")) usage_tokenize(out);
    else usage(out);
}

static int parse_int(const char *flag, const char *s, int min, int max, int *out, char *err) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || *s == 0 || *end || v < min || v > max)
        return fg_fail(err, "%s: expected an integer in %d..%d, got '%s'", flag, min, max,
                       s ? s : "");
    *out = (int)v;
    return 0;
}

/* Exponents as --help writes them: 1e+09 as 1e9, 1e-09 as 1e-9. */
static void plain_exponents(char *s) {
    for (char *e = strchr(s, 'e'); e; e = strchr(e + 1, 'e')) {
        char *digits = e + 1;
        if (*digits == '+') {
            digits++;
        } else if (*digits == '-') {
            e++;
            digits++;
        }
        while (*digits == '0' && digits[1] >= '0' && digits[1] <= '9') digits++;
        memmove(e + 1, digits, strlen(digits) + 1);
    }
}

/* A number in [lo, hi], or (lo, hi] where above_lo, as a float. */
static int parse_float(const char *flag, const char *s, double lo, int above_lo, double hi,
                       float *out, char *err) {
    char *end;
    errno = 0;
    double v = s ? strtod(s, &end) : 0;
    char range[64];
    snprintf(range, sizeof range, "%c%g, %g]", above_lo ? '(' : '[', lo, hi);
    plain_exponents(range);
    /* out of a double's range, or under a float's least (1e-300 would be read as 0) */
    if (s && *s && !*end && (errno == ERANGE || (v != 0 && (float)v == 0)))
        return fg_fail(err, "%s: '%s' is too %s to read (expected a number in %s)", flag, s,
                       fabs(v) < 1 ? "close to 0" : "large", range);
    if (!s || errno || *s == 0 || *end || !(above_lo ? v > lo : v >= lo) || !(v <= hi) ||
        strpbrk(s, "xX")) /* strtod reads hexadecimal, which no user means */
        return fg_fail(err, "%s: expected a number in %s, got '%s'", flag, range, s ? s : "");
    *out = (float)v;
    return 0;
}

/* "16G", "512M", "1.5G", "4096": K, M, G, T are powers of 1024; a trailing B is allowed. */
static int parse_size(const char *flag, const char *s, double *out, char *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    const char *units = "KMGT";
    const char *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
    if (u) {
        v *= pow(1024, (double)(u - units + 1));
        end++;
    }
    if (*end == 'B' || *end == 'b') end++;
    if (errno || end == s || *end || !(v >= 1) || v > 1e18 || strpbrk(s, "xX"))
        return fg_fail(err,
                       "%s: expected a size such as 16G or 512M (a byte at least, 1e18 bytes at "
                       "most), got '%s'",
                       flag, s);
    *out = v;
    return 0;
}

int parse_device(const char *s, fg_device *d, char *err) {
    if (!strcmp(s, "auto")) *d = FG_DEVICE_AUTO;
    else if (!strcmp(s, "cpu")) *d = FG_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) *d = FG_DEVICE_CUDA;
    else if (!strcmp(s, "cpu-fp16")) *d = FG_DEVICE_CPU_FP16;
    else return fg_fail(err, "--device: expected cuda, cpu, cpu-fp16 or auto, got '%s'", s);
    return 0;
}

static int parse_schedule(const char *s, fg_schedule *schedule, char *err) {
    if (!strcmp(s, "zigzag")) *schedule = FG_SCHEDULE_ZIGZAG;
    else if (!strcmp(s, "diagonal")) *schedule = FG_SCHEDULE_DIAGONAL;
    else return fg_fail(err, "--schedule: expected zigzag or diagonal, got '%s'", s);
    return 0;
}

static int is_value_flag(const char *f) {
    static const char *const flags[] = {
        "--model",       "--prompt",  "--prompt-file",    "--prompt-ids",
        "--dump-logits", "--vocab",   "--merges",         "--tokenizer",
        "--prompt-len",  "--gen-len", "--gpu-batch-size", "--num-gpu-batches",
        "--temperature", "--top-p",   "--seed",           "--overlap",
        "--pin-weight",  "--gpu-mem", "--cpu-mem",        "--disk-mem",
        "--offload-dir", "--path",    "--trace",          "--attn-sparsity",
        "--policy",      "--hw",      "--max-latency",    "--device",
        "--schedule",    "--text",    "--window",         "--stride",
        "--predictions", "--compare", "--output"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (!strcmp(f, flags[i])) return 1;
    return 0;
}

/* What a path flag names ("file" or "directory"), an input's or an output's; NULL for other
 * flags. */
static const char *path_kind(const char *f) {
    static const char *const files[] = {"--prompt-file", "--prompt-ids", "--vocab",
                                        "--merges",      "--tokenizer",  "--hw",
                                        "--text",        "--compare",    "--output",
                                        "--dump-logits", "--trace",      "--predictions"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        if (!strcmp(f, files[i])) return "file";
    if (!strcmp(f, "--offload-dir") || !strcmp(f, "--path")) return "directory";
    return NULL;
}

/* A flag without a value (--json, --compress-weight, ...) set in a; 0 where f is none of them. */
static int parse_switch(const char *f, cli_args *a) {
    fg_policy *p = &a->policy;
    if (!strcmp(f, "--json")) a->json = 1;
    else if (!strcmp(f, "--stop-at-eos")) a->gen.stop_at_eos = 1;
    else if (!strcmp(f, "--refill")) a->gen.refill = 1;
    else if (!strcmp(f, "--quiet")) {
        a->gen.verbose = 0;
        a->quiet = 1;
    } else if (!strcmp(f, "--progress")) a->progress = 1;
    else if (!strcmp(f, "--resume")) a->resume = 1;
    else if (!strcmp(f, "--warmup")) a->warmup = 1;
    else if (!strcmp(f, "--cpu-cache-compute")) p->cpu_cache_compute = 1;
    else if (!strcmp(f, "--compress-weight")) p->compress_weight = 1;
    else if (!strcmp(f, "--compress-cache")) p->compress_cache = 1;
    else if (!strcmp(f, "--int8-activations")) p->int8_activations = 1;
    else if (!strcmp(f, "--bf16-prefill")) p->bf16_prefill = 1;
    else if (!strcmp(f, "--evaluate")) a->evaluate = 1;
    else if (!strcmp(f, "--decode")) a->ppl.decode = 1;
    else return 0;
    return 1;
}

/* Whether s is one of this program's flags: as the value of a path it is a flag given where the
 * path belongs (`--dump-logits --quiet`), not a file to write. */
int is_flag(const char *s) {
    cli_args scratch;
    return is_help(s) || is_value_flag(s) || !strcmp(s, "--percent") || parse_switch(s, &scratch);
}

int flag_for_path(const char *flag, const char *value, const char *kind, char *err) {
    if (!is_flag(value)) return 0;
    return fg_fail(err, "%s: expected a %s, got the flag %s (for a %s of that name, give ./%s)",
                   flag, kind, value, kind, value);
}

/* --percent's six values, the first n of argv. */
static int parse_percent(int n, char **argv, fg_percent *percent, char *err) {
    int *fields[6] = {&percent->wg, &percent->wc, &percent->cg,
                      &percent->cc, &percent->hg, &percent->hc};
    for (int j = 0; j < 6; j++) {
        if (j < n && parse_int("--percent", argv[j], 0, 100, fields[j], err) == 0) continue;
        if (j < n) /* a value refused */
            return fg_fail(err,
                           "--percent: expected six integers in 0..100 (wg wc cg cc hg hc), got "
                           "'%s'",
                           argv[j]);
        return fg_fail(err,
                       "--percent: expected six integers in 0..100 (wg wc cg cc hg hc), got only "
                       "%d",
                       j);
    }
    return 0;
}

/* A flag that a search would choose, once, in the order given. */
static void add_searched(cli_args *a, const char *f) {
    for (int i = 0; i < a->n_searched; i++)
        if (!strcmp(a->searched[i], f)) return;
    if (a->n_searched < 3) a->searched[a->n_searched++] = f;
}

void warn_searched(const cli_args *a, const char *why) {
    if (!a->n_searched) return;
    char names[96] = "";
    size_t used = 0;
    for (int i = 0; i < a->n_searched; i++) {
        const char *sep = i == 0 ? "" : i == a->n_searched - 1 ? " and " : ", ";
        int n = snprintf(names + used, sizeof names - used, "%s%s", sep, a->searched[i]);
        used += n > 0 ? (size_t)n : 0;
    }
    fprintf(stderr, "flexgen: warning: %s %s not used: %s\n", names,
            a->n_searched > 1 ? "are" : "is", why);
}

static int check_flags(const cli_args *a, char *err);
int parse_args(int argc, char **argv, cli_args *a, char *err) {
    memset(a, 0, sizeof *a);
    a->model = "opt-125m";
    a->prompt_len = 512;
    a->cold_seconds = -1;
    a->gen =
        (gen_options){.gen_len = 32, .temperature = 0, .top_p = 1, .seed = 0, .verbose = isatty(2)};
    a->policy = fg_default_policy();
    a->policy.device = FG_DEVICE_AUTO;
    a->prompts = calloc((size_t)argc, sizeof *a->prompts);
    if (!a->prompts) return fg_fail(err, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes_value = 1, rc = 0, seed;
        fg_policy *p = &a->policy;
        if (is_help(f)) return 1;
        else if (parse_switch(f, a)) takes_value = 0;
        else if (!strcmp(f, "--percent")) {
            if (parse_percent(argc - i - 1, argv + i + 1, &p->percent, err)) return -1;
            takes_value = 6;
            add_searched(a, f);
        } else if (!is_value_flag(f)) return fg_fail(err, "%s: unknown option (see --help)", f);
        else if (!v) return fg_fail(err, "%s: missing value", f);
        else if (!*v && path_kind(f))
            return fg_fail(err, "%s: an empty path; give a %s", f, path_kind(f));
        else if (path_kind(f) && flag_for_path(f, v, path_kind(f), err)) return -1;
        else if (!strcmp(f, "--model")) a->model = v;
        else if (!strcmp(f, "--prompt")) a->prompts[a->n_prompt_texts++] = v;
        else if (!strcmp(f, "--prompt-file")) a->prompt_file = v;
        else if (!strcmp(f, "--prompt-ids")) a->prompt_ids = v;
        else if (!strcmp(f, "--dump-logits")) a->dump_logits = v;
        else if (!strcmp(f, "--output")) a->output = v;
        else if (!strcmp(f, "--trace")) {
            a->trace = v;
            p->trace = 1;
        } else if (!strcmp(f, "--vocab")) a->vocab = v;
        else if (!strcmp(f, "--tokenizer")) a->tokenizer = v;
        else if (!strcmp(f, "--merges")) a->merges = v;
        else if (!strcmp(f, "--offload-dir")) p->offload_dir = v;
        else if (!strcmp(f, "--device")) rc = parse_device(v, &p->device, err);
        else if (!strcmp(f, "--schedule")) {
            rc = parse_schedule(v, &p->schedule, err);
            a->schedule_given = 1;
        } else if (!strcmp(f, "--path")) p->weight_dir = v;
        else if (!strcmp(f, "--prompt-len")) {
            rc = parse_int(f, v, 1, INT_MAX, &a->prompt_len, err);
            a->prompt_len_given = 1;
        } else if (!strcmp(f, "--gen-len")) rc = parse_int(f, v, 1, INT_MAX, &a->gen.gen_len, err);
        else if (!strcmp(f, "--gpu-batch-size")) {
            rc = parse_int(f, v, 1, INT_MAX, &p->gpu_batch_size, err);
            add_searched(a, f);
        } else if (!strcmp(f, "--num-gpu-batches")) {
            rc = parse_int(f, v, 1, INT_MAX, &p->num_gpu_batches, err);
            add_searched(a, f);
        } else if (!strcmp(f, "--overlap")) rc = parse_int(f, v, 0, 1, &p->overlap, err);
        else if (!strcmp(f, "--pin-weight")) rc = parse_int(f, v, 0, 1, &p->pin_weight, err);
        else if (!strcmp(f, "--gpu-mem")) rc = parse_size(f, v, &p->capacity[TIER_GPU], err);
        else if (!strcmp(f, "--cpu-mem")) rc = parse_size(f, v, &p->capacity[TIER_CPU], err);
        else if (!strcmp(f, "--disk-mem")) rc = parse_size(f, v, &p->capacity[TIER_DISK], err);
        else if (!strcmp(f, "--temperature"))
            rc = parse_float(f, v, 0, 0, 1e6, &a->gen.temperature, err);
        else if (!strcmp(f, "--top-p")) rc = parse_float(f, v, 1e-9, 0, 1, &a->gen.top_p, err);
        else if (!strcmp(f, "--attn-sparsity"))
            rc = parse_float(f, v, 0, 1, 1, &p->attn_sparsity, err);
        else if (!strcmp(f, "--seed")) {
            rc = parse_int(f, v, 0, INT_MAX, &seed, err);
            a->gen.seed = (uint64_t)seed;
        } else if (!strcmp(f, "--hw")) a->hw = v;
        else if (!strcmp(f, "--text")) a->text = v;
        else if (!strcmp(f, "--predictions")) a->predictions = v;
        else if (!strcmp(f, "--compare")) a->compare = v;
        else if (!strcmp(f, "--window")) rc = parse_int(f, v, 2, INT_MAX, &a->ppl.window, err);
        else if (!strcmp(f, "--stride")) rc = parse_int(f, v, 1, INT_MAX, &a->ppl.stride, err);
        else if (!strcmp(f, "--policy")) {
            if (strcmp(v, "auto") && strcmp(v, "manual"))
                rc = fg_fail(err, "--policy: expected auto or manual, got '%s'", v);
            a->auto_policy = !strcmp(v, "auto");
        } else if (!strcmp(f, "--max-latency")) {
            float seconds;
            rc = parse_float(f, v, 0, 1, 1e9, &seconds, err);
            a->max_latency = seconds;
        }
        if (rc) return -1;
        static const char *const ppl_flags[] = {"--text",   "--window",      "--stride",
                                                "--decode", "--predictions", "--compare"};
        for (size_t j = 0; j < sizeof ppl_flags / sizeof *ppl_flags && !a->ppl_flag; j++)
            if (!strcmp(f, ppl_flags[j])) a->ppl_flag = ppl_flags[j];
        i += takes_value;
    }
    if (a->progress) a->gen.verbose = 1;
    a->policy.verbose = a->gen.verbose;
    return check_flags(a, err);
}

/* Whether two paths name one file: the same device and inode, or (where neither exists yet) the
 * same name in the same directory. Names alone would miss ../p.txt, a link, a hard link. */
static int same_file(const char *x, const char *y) {
    struct stat a, b;
    int has_x = stat(x, &a) == 0, has_y = stat(y, &b) == 0;
    if (has_x || has_y) return has_x && has_y && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
    char dx[4096], dy[4096];
    const char *nx = path_folder(x, dx, sizeof dx), *ny = path_folder(y, dy, sizeof dy);
    return !strcmp(nx, ny) && stat(dx, &a) == 0 && stat(dy, &b) == 0 && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}

/* Whether `path` is (or resolves to) a regular file of directory `dir`, one of the files a run
 * reads through --model DIR or from the dummy weights' --path DIR; `found` gets its name. */
static int file_of_dir(const char *path, const char *dir, char *found, size_t n) {
    struct stat st;
    if (!dir || stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return 0;
    DIR *d = opendir(dir);
    int hit = 0;
    for (struct dirent *e = d ? readdir(d) : NULL; e && !hit; e = readdir(d)) {
        char file[4096];
        snprintf(file, sizeof file, "%s/%s", dir, e->d_name);
        hit = stat(file, &st) == 0 && S_ISREG(st.st_mode) && same_file(path, file);
        if (hit) snprintf(found, n, "%s", e->d_name);
    }
    if (d) closedir(d);
    return hit;
}

/* Whether `path` is (or would be, where neither is there yet) dir/NAME for one of names[0..n);
 * `found` gets that NAME. */
static int name_in_dir(const char *path, const char *dir, const char *const *names, int n,
                       char *found, size_t len) {
    char file[4200];
    for (int k = 0; dir && k < n; k++) {
        snprintf(file, sizeof file, "%s/%s", dir, names[k]);
        if (same_file(path, file)) {
            snprintf(found, len, "%s", names[k]);
            return 1;
        }
    }
    return 0;
}

/* Whether `path` would be a file that a run reads by its name in --model DIR, made where there is
 * none yet: a new model.safetensors is read before model.safetensors.index.json, tokenizer.json
 * before vocab.json, generation_config.json's eos ids over config.json's. `found` gets the name. */
static int name_read_in_dir(const char *path, const char *dir, char *found, size_t n) {
    static const char *const names[] = {
        "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "vocab.json",  "merges.txt",        "generation_config.json"};
    return name_in_dir(path, dir, names, 7, found, n) ||
           name_in_dir(path, dir, fg_tokenizer_side_files, 3, found, n);
}

/* Whether `path` is a dummy weights file's name (*.fgw) in dir, the dummy weights' --path DIR,
 * where a run writes its own and reads those of others. */
static int weights_name_in_dir(const char *path, const char *dir) {
    char out_dir[4096];
    const char *name = path_folder(path, out_dir, sizeof out_dir);
    size_t len = strlen(name);
    struct stat a, b;
    return len > 4 && !strcmp(name + len - 4, ".fgw") && stat(out_dir, &a) == 0 &&
           stat(dir, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* Whether `path` is one of the files a tokenizer reads beside `in` (--vocab: its
 * tokenizer_config.json, special_tokens_map.json and added_tokens.json; --tokenizer: the first),
 * `found` its name. */
static int file_beside(const char *path, const char *in, int files, char *found, size_t n) {
    char dir[4096], name[256];
    path_folder(in, dir, sizeof dir);
    if (!name_in_dir(path, dir, fg_tokenizer_side_files, files, name, sizeof name))
        return 0; /* neither one there now nor one made there */
    return snprintf(found, n, "%s/%s", dir, name) > 0;
}

/* An output that is an input would destroy it, and two outputs on one file lose one of them. The
 * inputs: the files named by flags (the hardware file also where --hw is not given), those read
 * beside --vocab and --tokenizer, and those read through --model DIR (its checkpoint, config and
 * tokenizer) and from --path DIR (dummy weights placed on disk). */
static int check_outputs_apart(const cli_args *a, char *err) {
    const char *const out_flags[] = {"--output", "--dump-logits", "--trace", "--predictions"};
    const char *const in_flags[] = {
        "--prompt-file", "--prompt-ids", "--text",      "--compare",
        "--vocab",       "--merges",     "--tokenizer", a->hw ? "--hw" : "the default --hw"};
    const char *outs[] = {a->output, a->dump_logits, a->trace, a->predictions};
    char hw[4200], side[4200];
    default_hw_path(hw, sizeof hw);
    const char *ins[] = {a->prompt_file, a->prompt_ids, a->text,      a->compare,
                         a->vocab,       a->merges,     a->tokenizer, a->hw ? a->hw : hw};
    for (int i = 0; i < 4; i++) {
        for (int j = 0; outs[i] && j < 8; j++)
            if (ins[j] && same_file(outs[i], ins[j]))
                return fg_fail(
                    err,
                    "%s %s: the same file as %s %s, which it would overwrite; give another file",
                    out_flags[i], outs[i], in_flags[j], ins[j]);
        for (int j = 4; outs[i] && j <= 6; j += 2) /* --vocab's and --tokenizer's */
            if (ins[j] && file_beside(outs[i], ins[j], j == 4 ? 3 : 1, side, sizeof side))
                return fg_fail(err,
                               "%s %s: the same file as %s, which %s %s reads beside it; give "
                               "another file",
                               out_flags[i], outs[i], side, in_flags[j], ins[j]);
        if (outs[i] && fg_output_apart_from_std(out_flags[i], outs[i], err)) return -1;
        for (int j = 0; outs[i] && j < i; j++)
            if (outs[j] && same_file(outs[i], outs[j]))
                return fg_fail(err, "%s %s: the same file as %s %s; give each its own",
                               out_flags[i], outs[i], out_flags[j], outs[j]);
        char weight_dir[4096];
        char name[256];
        if (a->policy.weight_dir)
            snprintf(weight_dir, sizeof weight_dir, "%s", a->policy.weight_dir);
        else default_weight_dir(weight_dir, sizeof weight_dir);
        if (outs[i] && file_of_dir(outs[i], a->model, name, sizeof name))
            return fg_fail(err,
                           "%s %s: the file %s of --model %s, which it would overwrite; give "
                           "another file",
                           out_flags[i], outs[i], name, a->model);
        if (outs[i] && name_read_in_dir(outs[i], a->model, name, sizeof name))
            return fg_fail(err,
                           "%s %s: a file %s in --model %s, which a run would read as the "
                           "model's; give another file",
                           out_flags[i], outs[i], name, a->model);
        if (outs[i] && file_of_dir(outs[i], weight_dir, name, sizeof name))
            return fg_fail(err,
                           "%s %s: the file %s of the dummy weights' directory %s (--path), which "
                           "it would overwrite; give another file",
                           out_flags[i], outs[i], name, weight_dir);
        if (outs[i] && weights_name_in_dir(outs[i], weight_dir))
            return fg_fail(err,
                           "%s %s: a dummy weights file's name (.fgw) in their directory %s "
                           "(--path), where a run writes and reads them; give another file",
                           out_flags[i], outs[i], weight_dir);
    }
    return 0;
}

/* Flags that need or exclude others. */
static int check_flags(const cli_args *a, char *err) {
    if (a->progress && a->quiet)
        return fg_fail(err, "--progress and --quiet: give only one of them");
    if ((a->prompt_file != NULL) + (a->prompt_ids != NULL) + (a->n_prompt_texts > 0) > 1)
        return fg_fail(err, "--prompt, --prompt-file and --prompt-ids: give only one of them");
    if (a->prompt_len_given && (a->prompt_file || a->prompt_ids || a->n_prompt_texts))
        return fg_fail(err, "--prompt-len: the length of synthetic prompts, and prompts are given "
                            "(--prompt, --prompt-file or --prompt-ids); drop one of them");
    if (a->resume && !a->output)
        return fg_fail(err, "--resume: finishes the job of --output F; give it");
    if (a->output && !a->prompt_file && !a->prompt_ids && !a->n_prompt_texts)
        return fg_fail(err,
                       "--output: a job writes a record for each prompt given; give --prompt-file, "
                       "--prompt-ids or --prompt");
    if (a->gen.refill && !a->gen.stop_at_eos)
        return fg_fail(err, "--refill: gives a slot whose sequence generated </s> the next prompt; "
                            "give --stop-at-eos too");
    if (a->policy.schedule == FG_SCHEDULE_DIAGONAL && a->gen.refill)
        return fg_fail(err, "--refill and --schedule diagonal: the diagonal schedule refills its "
                            "GPU batches itself; "
                            "give one of them");
    if (a->policy.int8_activations && !a->policy.compress_weight)
        return fg_fail(err, "--int8-activations: multiplies 4-bit weights by int8 activations; "
                            "give --compress-weight too");
    if (a->policy.int8_activations && a->policy.bf16_prefill)
        return fg_fail(err, "--int8-activations and --bf16-prefill: two schemes for prefill's "
                            "products; give one of them");
    if (a->output && a->dump_logits)
        return fg_fail(err, "--output and --dump-logits: give one of them");
    if ((long)a->policy.gpu_batch_size * a->policy.num_gpu_batches > 1 << 20)
        return fg_fail(err,
                       "--gpu-batch-size x --num-gpu-batches: a block of %d x %d = %ld sequences; "
                       "at most %d",
                       a->policy.gpu_batch_size, a->policy.num_gpu_batches,
                       (long)a->policy.gpu_batch_size * a->policy.num_gpu_batches, 1 << 20);
    return check_outputs_apart(a, err);
}

/* Flags a subcommand has no use for: refused, not ignored. The command line is read as
 * parse_args reads it (a value is not a flag), to --help, which asks for the text alone. */
static int refuse_flags(const char *command, const char *const *flags, int argc, char **argv,
                        char *err) {
    const char *refused = NULL;
    for (int i = 2; i < argc; i++) {
        if (is_help(argv[i])) return 0;
        for (int j = 0; flags[j] && !refused; j++)
            if (!strcmp(argv[i], flags[j])) refused = argv[i];
        if (!strcmp(argv[i], "--percent")) i += 6;
        else if (is_value_flag(argv[i])) i++;
    }
    return refused ? fg_fail(err, "%s: not a flag of `flexgen %s`", refused, command) : 0;
}

/* The flags that flexgen policy and flexgen perplexity have no use for: the outputs of a run, and
 * (perplexity) generation's. */
int check_command_flags(const char *command, int argc, char **argv, char *err) {
    /* a plan depends on none of a run's outputs, its warm-up run, its sampling or --policy's
     * choice */
    static const char *const policy[] = {
        "--output",      "--resume", "--trace", "--dump-logits", "--warmup",
        "--temperature", "--top-p",  "--seed",  "--policy",      NULL};
    static const char *const perplexity[] = {
        "--prompt",      "--prompt-file", "--prompt-ids",  "--prompt-len", "--gen-len",
        "--temperature", "--top-p",       "--stop-at-eos", "--refill",     "--dump-logits",
        "--policy",      "--max-latency", "--hw",          "--evaluate",   "--output",
        "--resume",      "--trace",       "--schedule",    "--warmup",     NULL};
    return refuse_flags(command, !strcmp(command, "policy") ? policy : perplexity, argc, argv, err);
}
