/* app/cli.c: the command line.
 *
 *   flexgen [flags]           generate text for prompts with a policy (§4.2) or --policy auto
 *                             (§4.3); under mpirun -np M, as one of M pipeline stages (§4.4)
 *   flexgen policy [flags]    the policy search's choice and its prediction (§4.3)
 *   flexgen profile           this machine's constants for the cost model (profile.c)
 *   flexgen tokenize          text to token ids, a line at a time
 *   flexgen perplexity        a text's perplexity through the runtime (perplexity.c, §6.2)
 *
 * The report prints FlexGen's benchmark lines (or one JSON object with --json). Everything that
 * can fail on user input returns an error line; main prints it and exits 2.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    const char *model, *prompt_file, *prompt_ids, *dump_logits, *vocab, *merges, *tokenizer, *trace;
    const char *output;  /* --output: the job's records, appended as rounds finish (jobs.c) */
    int resume, quiet;   /* --resume: finish the job of --output; --quiet: no progress at all */
    int warmup;          /* --warmup: a short generate first, untimed (warm_up) */
    double cold_seconds; /* its latency: the cold first run's; < 0 without --warmup */
    double cold_prefill, cold_decode; /* the two parts of it: its prefill, its decode step */
    int job_finished;    /* --resume found every prompt's record in --output */
    int n_job_prompts;   /* the job's prompts, with those --output has records of */
    uint64_t prompts_hash; /* their ids and tokens (a job's identity) */
    const char *hw;      /* hardware file of the cost model (--hw) */
    const char **prompts;
    int n_prompt_texts, prompt_len, json;
    int auto_policy;     /* --policy auto: search for the policy (§4.3) */
    int schedule_given;  /* --schedule: the search keeps it (else it chooses, Appendix A.2) */
    int evaluate;        /* flexgen policy --evaluate: predict the given policy, no search */
    double max_latency;  /* --max-latency: the search's bound on a block's latency */
    const char *text, *predictions, *compare; /* flexgen perplexity's files */
    ppl_options ppl;
    const char *ppl_flag; /* the first flag given that only flexgen perplexity takes */
    gen_options gen;
    fg_policy policy;
} cli_args;

static void usage(FILE *out) {
    fprintf(out,
"usage: flexgen [options]\n"
"       flexgen policy [options] [--evaluate]         (the policy search; no generation)\n"
"       flexgen profile [--offload-dir DIR] [--out FILE] [--device cuda|cpu|auto]\n"
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
"                          a JSON object a line, {\"prompt\": TEXT} or {\"prompt_ids\": [...]},\n"
"                          each with an optional \"id\" (the line number when absent)\n"
"  --prompt-ids F          one prompt a line, space-separated token ids, used as given\n"
"  --prompt-len N          length of synthetic prompts [512]\n"
"generation\n"
"  --gen-len N             tokens to generate per prompt [32]\n"
"  --temperature T         0 is greedy; > 0 samples from softmax(logits / T) [0]\n"
"  --top-p P               nucleus sampling mass, in (0, 1] [1]\n"
"  --seed N                seed of dummy weights, synthetic prompts and sampling [0]\n"
"  --stop-at-eos           stop a sequence after it generates </s>\n"
"  --refill                with --stop-at-eos, in one process: the slot of a sequence that\n"
"                          ends takes the next prompt, whose prefill joins the next step, so\n"
"                          a block runs full until the prompts run out\n"
"device\n"
"  --device cuda|cpu|auto  the compute device: auto is cuda where a GPU is present (this build:\n"
"                          %s), else the CPU [auto]; cpu-fp16 is the CPU holding\n"
"                          activations in fp16 as cuda does\n"
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
"                          widens the weights to int8 (one scale per column). Faster, and not\n"
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
"                          weights already written to --path]\n"
"  --offload-dir DIR       the disk tier's files, removed as soon as they are mapped [%s]\n"
"pipeline parallelism (paper section 4.4; this build: %s)\n"
"  mpirun -np M flexgen [options]\n"
"                          M stages, one process each (one GPU each where there are GPUs): the\n"
"                          decoder layers split evenly, the input embedding with the first stage,\n"
"                          the output embedding with the last. Rank 0 reads the prompts and\n"
"                          prints the report; the other flags mean what they mean in one process\n"
"                          and must agree across stages, except the policy and capacities, which\n"
"                          are each stage's own (mpirun's `-np 1 flexgen ... : -np 1 flexgen ...`\n"
"                          gives stages different ones; --policy auto plans each stage)\n"
"policy search (paper section 4.3)\n"
"  --policy auto|manual    auto: choose the block shape, --percent, --cpu-cache-compute and\n"
"                          (unless given) --schedule by the cost model and LP for these\n"
"                          capacities, prompts and --gen-len, keeping the other flags (the\n"
"                          diagonal schedule pays a warm-up: it gains on many prompts, not one\n"
"                          block); synthetic prompts fill the block it picks,\n"
"                          which can be thousands (bound it with --max-latency) [manual]\n"
"  --hw FILE               the cost model's hardware constants (JSON) [~/.cache/flexgen/\n"
"                          hardware.json, measured by `flexgen profile` the first time]\n"
"  --max-latency S         auto: a block may take at most S seconds (Fig. 1's trade-off)\n"
"  flexgen policy takes the flags of a run and prints the policy the search chooses, as flags,\n"
"  with its predicted throughput and each layer's latency terms, and each schedule's best\n"
"  (--json: one object; --device auto: the backend the hardware file describes);\n"
"  --evaluate predicts the policy given by the flags instead of searching.\n"
"  flexgen profile measures this machine (copies, the disk in --offload-dir, matrix products\n"
"  and attention) and writes the hardware file (--out FILE) [the default --hw]\n"
"perplexity (flexgen perplexity; with the policy, device and section 5 flags above)\n"
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
"  --json                  one JSON object on stdout instead of the report lines\n"
"  --warmup                first a short untimed generate (a block of prompts of up to 32\n"
"                          tokens, 2 generated), as FlexGen's benchmark does, so that the\n"
"                          figures leave out first-time costs (on a GPU: its context, cuBLAS,\n"
"                          loading kernels); the report gives its latency as the cold run's\n"
"  --quiet                 no progress on stderr\n"
"  --help                  this text\n"
"\n"
"Threads: OMP_NUM_THREADS (default: all cores). Bad input exits with status 2; standard output\n"
"that cannot be written (a full disk), with status 1.\n",
            fg_cuda_compiled() ? "with CUDA" : "CPU only, no nvcc when it was built",
            FG_DEFAULT_OFFLOAD_DIR, fg_pipe_compiled() ? "with MPI" : "without MPI, no mpicc when it was built");
}

static int parse_int(const char *flag, const char *s, int min, int max, int *out, char *err) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || *s == 0 || *end || v < min || v > max)
        return fg_fail(err, "%s: expected an integer in %d..%d, got '%s'", flag, min, max, s ? s : "");
    *out = (int)v;
    return 0;
}

static int parse_float(const char *flag, const char *s, double lo, double hi, float *out,
                       char *err) {
    char *end;
    errno = 0;
    double v = s ? strtod(s, &end) : 0;
    if (!s || errno || *s == 0 || *end || !(v >= lo && v <= hi))
        return fg_fail(err, "%s: expected a number in [%g, %g], got '%s'", flag, lo, hi, s ? s : "");
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
    if (u) v *= pow(1024, (double)(u - units + 1)), end++;
    if (*end == 'B' || *end == 'b') end++;
    if (errno || end == s || *end || !(v > 0) || v > 1e18)
        return fg_fail(err, "%s: expected a size such as 16G or 512M, got '%s'", flag, s);
    *out = v;
    return 0;
}

static int parse_device(const char *s, fg_device *d, char *err) {
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

/* auto: CUDA when a GPU is there, else the CPU, saying why (with progress on, and when this
 * build has CUDA; the report names the device either way). */
static fg_device resolve_device(fg_device d, int verbose) {
    char why[FG_ERR_LEN];
    if (d != FG_DEVICE_AUTO) return d;
    if (fg_cuda_backend(why)) return FG_DEVICE_CUDA;
    if (verbose && fg_cuda_compiled()) fprintf(stderr, "flexgen: %s; running on the CPU backend\n", why);
    return FG_DEVICE_CPU;
}

static int is_value_flag(const char *f) {
    static const char *const flags[] = {"--model", "--prompt", "--prompt-file", "--prompt-ids",
        "--dump-logits", "--vocab", "--merges", "--tokenizer", "--prompt-len", "--gen-len", "--gpu-batch-size",
        "--num-gpu-batches", "--temperature", "--top-p", "--seed", "--overlap", "--pin-weight",
        "--gpu-mem", "--cpu-mem", "--disk-mem", "--offload-dir", "--path", "--trace", "--attn-sparsity",
        "--policy", "--hw", "--max-latency", "--device", "--schedule", "--text", "--window", "--stride",
        "--predictions", "--compare", "--output"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (!strcmp(f, flags[i])) return 1;
    return 0;
}

static int check_flags(const cli_args *a, char *err);
static int parse_args(int argc, char **argv, cli_args *a, char *err) {
    memset(a, 0, sizeof *a);
    a->model = "opt-125m";
    a->prompt_len = 512;
    a->cold_seconds = -1;
    a->gen = (gen_options){.gen_len = 32, .temperature = 0, .top_p = 1, .seed = 0, .verbose = isatty(2)};
    a->policy = fg_default_policy();
    a->policy.device = FG_DEVICE_AUTO;
    a->prompts = calloc((size_t)argc, sizeof *a->prompts);
    if (!a->prompts) return fg_fail(err, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes_value = 1, rc = 0, seed;
        fg_policy *p = &a->policy;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) return 1;
        else if (!strcmp(f, "--json")) a->json = 1, takes_value = 0;
        else if (!strcmp(f, "--stop-at-eos")) a->gen.stop_at_eos = 1, takes_value = 0;
        else if (!strcmp(f, "--refill")) a->gen.refill = 1, takes_value = 0;
        else if (!strcmp(f, "--quiet")) a->gen.verbose = 0, a->quiet = 1, takes_value = 0;
        else if (!strcmp(f, "--resume")) a->resume = 1, takes_value = 0;
        else if (!strcmp(f, "--warmup")) a->warmup = 1, takes_value = 0;
        else if (!strcmp(f, "--cpu-cache-compute")) p->cpu_cache_compute = 1, takes_value = 0;
        else if (!strcmp(f, "--compress-weight")) p->compress_weight = 1, takes_value = 0;
        else if (!strcmp(f, "--compress-cache")) p->compress_cache = 1, takes_value = 0;
        else if (!strcmp(f, "--int8-activations")) p->int8_activations = 1, takes_value = 0;
        else if (!strcmp(f, "--bf16-prefill")) p->bf16_prefill = 1, takes_value = 0;
        else if (!strcmp(f, "--evaluate")) a->evaluate = 1, takes_value = 0;
        else if (!strcmp(f, "--decode")) a->ppl.decode = 1, takes_value = 0;
        else if (!strcmp(f, "--percent")) {
            int *fields[6] = {&p->percent.wg, &p->percent.wc, &p->percent.cg, &p->percent.cc,
                              &p->percent.hg, &p->percent.hc};
            for (int j = 0; j < 6 && rc == 0; j++)
                rc = parse_int(f, i + 1 + j < argc ? argv[i + 1 + j] : NULL, 0, 100, fields[j], err);
            if (rc) return fg_fail(err, "--percent: expected six integers in 0..100 (wg wc cg cc hg hc)");
            takes_value = 6;
        }
        else if (!is_value_flag(f)) return fg_fail(err, "%s: unknown option (see --help)", f);
        else if (!v) return fg_fail(err, "%s: missing value", f);
        else if (!strcmp(f, "--model")) a->model = v;
        else if (!strcmp(f, "--prompt")) a->prompts[a->n_prompt_texts++] = v;
        else if (!strcmp(f, "--prompt-file")) a->prompt_file = v;
        else if (!strcmp(f, "--prompt-ids")) a->prompt_ids = v;
        else if (!strcmp(f, "--dump-logits")) a->dump_logits = v;
        else if (!strcmp(f, "--output")) a->output = v;
        else if (!strcmp(f, "--trace")) a->trace = v, p->trace = 1;
        else if (!strcmp(f, "--vocab")) a->vocab = v;
        else if (!strcmp(f, "--tokenizer")) a->tokenizer = v;
        else if (!strcmp(f, "--merges")) a->merges = v;
        else if (!strcmp(f, "--offload-dir")) p->offload_dir = v;
        else if (!strcmp(f, "--device")) rc = parse_device(v, &p->device, err);
        else if (!strcmp(f, "--schedule")) rc = parse_schedule(v, &p->schedule, err), a->schedule_given = 1;
        else if (!strcmp(f, "--path")) p->weight_dir = v;
        else if (!strcmp(f, "--prompt-len")) rc = parse_int(f, v, 1, INT_MAX, &a->prompt_len, err);
        else if (!strcmp(f, "--gen-len")) rc = parse_int(f, v, 1, INT_MAX, &a->gen.gen_len, err);
        else if (!strcmp(f, "--gpu-batch-size")) rc = parse_int(f, v, 1, INT_MAX, &p->gpu_batch_size, err);
        else if (!strcmp(f, "--num-gpu-batches")) rc = parse_int(f, v, 1, INT_MAX, &p->num_gpu_batches, err);
        else if (!strcmp(f, "--overlap")) rc = parse_int(f, v, 0, 1, &p->overlap, err);
        else if (!strcmp(f, "--pin-weight")) rc = parse_int(f, v, 0, 1, &p->pin_weight, err);
        else if (!strcmp(f, "--gpu-mem")) rc = parse_size(f, v, &p->capacity[TIER_GPU], err);
        else if (!strcmp(f, "--cpu-mem")) rc = parse_size(f, v, &p->capacity[TIER_CPU], err);
        else if (!strcmp(f, "--disk-mem")) rc = parse_size(f, v, &p->capacity[TIER_DISK], err);
        else if (!strcmp(f, "--temperature")) rc = parse_float(f, v, 0, 1e6, &a->gen.temperature, err);
        else if (!strcmp(f, "--top-p")) rc = parse_float(f, v, 1e-9, 1, &a->gen.top_p, err);
        else if (!strcmp(f, "--attn-sparsity")) {
            if (parse_float(f, v, 0, 1, &p->attn_sparsity, err) || !(p->attn_sparsity > 0))
                rc = fg_fail(err, "--attn-sparsity: expected a fraction in (0, 1], got '%s'", v);
        }
        else if (!strcmp(f, "--seed")) { rc = parse_int(f, v, 0, INT_MAX, &seed, err); a->gen.seed = (uint64_t)seed; }
        else if (!strcmp(f, "--hw")) a->hw = v;
        else if (!strcmp(f, "--text")) a->text = v;
        else if (!strcmp(f, "--predictions")) a->predictions = v;
        else if (!strcmp(f, "--compare")) a->compare = v;
        else if (!strcmp(f, "--window")) rc = parse_int(f, v, 2, INT_MAX, &a->ppl.window, err);
        else if (!strcmp(f, "--stride")) rc = parse_int(f, v, 1, INT_MAX, &a->ppl.stride, err);
        else if (!strcmp(f, "--policy")) {
            if (strcmp(v, "auto") && strcmp(v, "manual"))
                rc = fg_fail(err, "--policy: expected auto or manual, got '%s'", v);
            a->auto_policy = !strcmp(v, "auto");
        }
        else if (!strcmp(f, "--max-latency")) {
            float lat;
            rc = parse_float(f, v, 0, 1e9, &lat, err);
            if (rc == 0 && !(lat > 0)) rc = fg_fail(err, "--max-latency: expected seconds > 0, got '%s'", v);
            a->max_latency = lat;
        }
        if (rc) return -1;
        static const char *const ppl_flags[] = {"--text", "--window", "--stride", "--decode",
                                                "--predictions", "--compare"};
        for (size_t j = 0; j < sizeof ppl_flags / sizeof *ppl_flags && !a->ppl_flag; j++)
            if (!strcmp(f, ppl_flags[j])) a->ppl_flag = ppl_flags[j];
        i += takes_value;
    }
    a->policy.verbose = a->gen.verbose;
    return check_flags(a, err);
}

/* dir gets path's directory ("." for a bare name); returns its last component. */
static const char *split_path(const char *path, char *dir, size_t n) {
    snprintf(dir, n, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, n, ".");
    else *(slash == dir ? slash + 1 : slash) = 0;
    return slash ? path + (slash - dir) + 1 : path;
}

/* Whether two paths name one file: the same device and inode, or (where neither exists yet) the
 * same name in the same directory. Names alone would miss ../p.txt, a link, a hard link. */
static int same_file(const char *x, const char *y) {
    struct stat a, b;
    int has_x = stat(x, &a) == 0, has_y = stat(y, &b) == 0;
    if (has_x || has_y) return has_x && has_y && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
    char dx[4096], dy[4096];
    const char *nx = split_path(x, dx, sizeof dx), *ny = split_path(y, dy, sizeof dy);
    return !strcmp(nx, ny) && stat(dx, &a) == 0 && stat(dy, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* An output that is an input would destroy it, and two outputs on one file lose one of them. */
static int check_outputs_apart(const cli_args *a, char *err) {
    const char *const out_flags[] = {"--output", "--dump-logits", "--trace", "--predictions"};
    const char *const in_flags[] = {"--prompt-file", "--prompt-ids", "--text", "--compare", "--vocab", "--merges",
                                    "--tokenizer", "--hw"};
    const char *outs[] = {a->output, a->dump_logits, a->trace, a->predictions};
    const char *ins[] = {a->prompt_file, a->prompt_ids, a->text, a->compare, a->vocab, a->merges, a->tokenizer, a->hw};
    for (int i = 0; i < 4; i++) {
        for (int j = 0; outs[i] && j < 8; j++)
            if (ins[j] && same_file(outs[i], ins[j]))
                return fg_fail(err, "%s %s: the same file as %s %s, which it would overwrite; give another file",
                               out_flags[i], outs[i], in_flags[j], ins[j]);
        for (int j = 0; outs[i] && j < i; j++)
            if (outs[j] && same_file(outs[i], outs[j]))
                return fg_fail(err, "%s %s: the same file as %s %s; give each its own", out_flags[i], outs[i],
                               out_flags[j], outs[j]);
    }
    return 0;
}

/* Flags that need or exclude others. */
static int check_flags(const cli_args *a, char *err) {
    if ((a->prompt_file != NULL) + (a->prompt_ids != NULL) + (a->n_prompt_texts > 0) > 1)
        return fg_fail(err, "--prompt, --prompt-file and --prompt-ids: give only one of them");
    if (a->resume && !a->output) return fg_fail(err, "--resume: finishes the job of --output F; give it");
    if (a->output && !a->prompt_file && !a->prompt_ids && !a->n_prompt_texts)
        return fg_fail(err, "--output: a job writes a record for each prompt given; give --prompt-file, "
                            "--prompt-ids or --prompt");
    if (a->gen.refill && !a->gen.stop_at_eos)
        return fg_fail(err, "--refill: gives a slot whose sequence generated </s> the next prompt; give --stop-at-eos too");
    if (a->policy.schedule == FG_SCHEDULE_DIAGONAL && a->gen.refill)
        return fg_fail(err, "--refill and --schedule diagonal: the diagonal schedule refills its GPU batches itself; "
                            "give one of them");
    if (a->policy.int8_activations && !a->policy.compress_weight)
        return fg_fail(err, "--int8-activations: multiplies 4-bit weights by int8 activations; give --compress-weight too");
    if (a->policy.int8_activations && a->policy.bf16_prefill)
        return fg_fail(err, "--int8-activations and --bf16-prefill: two schemes for prefill's products; give one of them");
    if (a->output && a->dump_logits) return fg_fail(err, "--output and --dump-logits: give one of them");
    if ((long)a->policy.gpu_batch_size * a->policy.num_gpu_batches > 1 << 20)
        return fg_fail(err, "--gpu-batch-size x --num-gpu-batches: block of %ld sequences is too large",
                    (long)a->policy.gpu_batch_size * a->policy.num_gpu_batches);
    return check_outputs_apart(a, err);
}

/* ---- prompts ---- */

/* The prompts, and for a job's records (rank 0) each one's id (JSON text) and text as given
 * (NULL: given as ids); index: its place in the prompt file (a resumed job skips some). */
typedef struct {
    int n, cap;
    int **ids;
    int *lens, *index;
    char **record_ids, **texts;
} prompt_set;

static void prompts_free(prompt_set *p) {
    for (int i = 0; i < p->n; i++) free(p->ids[i]), free(p->record_ids[i]), free(p->texts[i]);
    free(p->ids), free(p->lens), free(p->index), free(p->record_ids), free(p->texts);
    memset(p, 0, sizeof *p);
}

/* Takes ids, id and text (id and text may be NULL), as prompt p->n of the file. */
static int prompts_add_record(prompt_set *p, int *ids, int len, char *id, char *text, char *err) {
    if (p->n == p->cap) {
        int cap = p->cap * 2 + 8, ok = 1;
        void **arrays[5] = {(void **)&p->ids, (void **)&p->lens, (void **)&p->index, (void **)&p->record_ids,
                            (void **)&p->texts};
        size_t sizes[5] = {sizeof *p->ids, sizeof *p->lens, sizeof *p->index, sizeof *p->record_ids, sizeof *p->texts};
        for (int k = 0; k < 5 && ok; k++) {
            void *grown = realloc(*arrays[k], (size_t)cap * sizes[k]);
            if (grown) *arrays[k] = grown;
            ok = grown != NULL;
        }
        if (!ok) { free(ids), free(id), free(text); return fg_fail(err, "out of memory"); }
        p->cap = cap;
    }
    p->ids[p->n] = ids, p->lens[p->n] = len, p->index[p->n] = p->n, p->record_ids[p->n] = id, p->texts[p->n] = text;
    p->n++;
    return 0;
}

static int prompts_add(prompt_set *p, int *ids, int len, char *err) {
    return prompts_add_record(p, ids, len, NULL, NULL, err);
}

/* The tokenizer's BOS (if it has one) + the text's tokens; the record keeps the text (valid
 * UTF-8) and its id (taken; NULL: its number). */
static int add_text_prompt(prompt_set *p, const fg_tokenizer *tok, const char *text, size_t len, char *id,
                           char *err) {
    int *ids, n;
    if (!id && (id = malloc(16))) snprintf(id, 16, "%d", p->n + 1);
    if (!id) return fg_fail(err, "out of memory");
    if (tokenizer_encode(tok, text, len, &ids, &n, err)) { free(id); return -1; }
    int *with_bos = malloc((size_t)(n + 1) * sizeof *with_bos), bos = tokenizer_bos_id(tok) >= 0;
    char *clean = utf8_replace_invalid(text, len, NULL);
    if (!with_bos || !clean) { free(ids), free(with_bos), free(clean), free(id); return fg_fail(err, "out of memory"); }
    with_bos[0] = tokenizer_bos_id(tok);
    memcpy(with_bos + bos, ids, (size_t)n * sizeof *ids);
    free(ids);
    return prompts_add_record(p, with_bos, n + bos, id, clean, err);
}

static int is_jsonl(const char *path) {
    size_t n = strlen(path);
    return n > 6 && !strcmp(path + n - 6, ".jsonl");
}

/* A JSONL line's prompt and its id (jobs.c parses the line): a text is tokenized as --prompt's. */
static int add_jsonl_prompt(prompt_set *p, const char *path, int line_no, const char *line,
                            const fg_tokenizer *tok, int vocab, char *err) {
    int *ids, n, rc;
    char *id, *text;
    if (jsonl_prompt(path, line_no, line, vocab, &ids, &n, &id, &text, err)) return -1;
    if (ids) return prompts_add_record(p, ids, n, id, NULL, err);
    if (!tok) rc = fg_fail(err, "%s line %d: a text prompt needs a tokenizer (the model directory's tokenizer.json, or --vocab and --merges)", path, line_no), free(id);
    else rc = add_text_prompt(p, tok, text, strlen(text), id, err);
    free(text);
    return rc;
}

static int parse_id_line(const char *path, int line_no, char *line, int vocab, int **out, int *n,
                         char *err) {
    int cap = 16, count = 0, *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return fg_fail(err, "out of memory");
    for (char *s = line, *end;; s = end) {
        while (*s == ' ' || *s == '\t' || *s == '\r') s++;
        if (!*s) break;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || (*end && *end != ' ' && *end != '\t' && *end != '\r')) {
            free(ids);
            return fg_fail(err, "%s line %d: not a token id: '%.20s'", path, line_no, s);
        }
        if (v < 0 || v >= vocab) {
            free(ids);
            return fg_fail(err, "%s line %d: token id %ld out of range [0, %d)", path, line_no, v, vocab);
        }
        if (count == cap) {
            int *grown = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
            if (!grown) { free(ids); return fg_fail(err, "out of memory"); }
            ids = grown;
        }
        ids[count++] = (int)v;
    }
    if (count == 0) {
        free(ids);
        return fg_fail(err, "%s line %d: empty prompt", path, line_no);
    }
    *out = ids;
    *n = count;
    return 0;
}

/* Reads one prompt a line from path: token ids (tok == NULL), text, or (a name ending in .jsonl)
 * JSON objects, whose blank lines are skipped. A NUL byte ends no line: it is refused, as it
 * could only be a damaged or binary file. */
static int read_prompt_lines(prompt_set *p, const char *path, const fg_tokenizer *tok, int vocab,
                             char *err) {
    size_t size;
    char *text = fg_read_file(path, &size, err);
    if (!text) return -1;
    int line_no = 0, rc = 0, jsonl = is_jsonl(path);
    for (char *line = text, *end; rc == 0 && line < text + size; line = end + 1) {
        end = memchr(line, '\n', (size_t)(text + size - line));
        if (!end) end = text + size;
        *end = 0;
        size_t len = (size_t)(end - line);
        line_no++;
        if (memchr(line, 0, len)) {
            rc = fg_fail(err, "%s line %d: a NUL byte inside the line", path, line_no);
        } else if (jsonl) {
            rc = strspn(line, " \t\r") == len ? 0 : add_jsonl_prompt(p, path, line_no, line, tok, vocab, err);
        } else if (tok) {
            rc = add_text_prompt(p, tok, line, len, NULL, err);
        } else {
            int *ids = NULL, n = 0;
            char *id = malloc(16);
            if (id) snprintf(id, 16, "%d", line_no);
            rc = id ? parse_id_line(path, line_no, line, vocab, &ids, &n, err) : fg_fail(err, "out of memory");
            if (rc == 0) rc = prompts_add_record(p, ids, n, id, NULL, err);
            else free(id);
        }
    }
    free(text);
    if (rc == 0 && p->n == 0) rc = fg_fail(err, "%s: no prompts in the file", path);
    return rc;
}

/* FlexGen's benchmark prompts: BOS and prompt_len - 1 pseudo-random ids, one block's worth for
 * each stage (a pipeline keeps that many micro-batches in flight, §4.4). */
static int synthetic_prompts(prompt_set *p, const cli_args *a, int stages, int vocab, char *err) {
    fg_rng rng;
    rng_seed(&rng, a->gen.seed ^ 0x5eedULL);
    int n = a->policy.gpu_batch_size * a->policy.num_gpu_batches * stages;
    for (int i = 0; i < n; i++) {
        int *ids = malloc((size_t)a->prompt_len * sizeof *ids);
        if (!ids) return fg_fail(err, "out of memory");
        ids[0] = OPT_BOS_ID;
        for (int t = 1; t < a->prompt_len; t++) ids[t] = 3 + (int)(rng_next(&rng) % (uint64_t)(vocab - 3));
        if (prompts_add(p, ids, a->prompt_len, err)) return -1;
    }
    return 0;
}

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

/* The tokenizer from --vocab/--merges or the model directory; NULL (no error) when there is
 * none and none is needed. */
static int open_tokenizer(const cli_args *a, fg_tokenizer **tok, char *err) {
    char vocab[4096], merges[4096];
    *tok = NULL;
    if (!a->vocab != !a->merges) return fg_fail(err, "--vocab and --merges go together");
    if (a->vocab && a->tokenizer) return fg_fail(err, "--tokenizer: give it or --vocab and --merges, not both");
    if (a->tokenizer) return (*tok = tokenizer_load_json(a->tokenizer, err)) ? 0 : -1;
    if (a->vocab) {
        snprintf(vocab, sizeof vocab, "%s", a->vocab);
        snprintf(merges, sizeof merges, "%s", a->merges);
    } else {
        if (!is_dir(a->model)) return 0;
        *tok = tokenizer_load_dir(a->model, err);
        return *tok || !err[0] ? 0 : -1;
    }
    *tok = tokenizer_load(vocab, merges, err);
    return *tok ? 0 : -1;
}

static int gather_prompts(const cli_args *a, const fg_tokenizer *tok, int vocab, prompt_set *p,
                          char *err) {
    if ((a->n_prompt_texts || (a->prompt_file && !is_jsonl(a->prompt_file))) && !tok)
        return fg_fail(err, "%s needs a tokenizer: give --vocab and --merges, or a model directory "
                         "holding tokenizer.json, or vocab.json and merges.txt",
                       a->prompt_file ? "--prompt-file" : "--prompt");
    if (a->prompt_ids) return read_prompt_lines(p, a->prompt_ids, NULL, vocab, err);
    if (a->prompt_file) return read_prompt_lines(p, a->prompt_file, tok, vocab, err);
    for (int i = 0; i < a->n_prompt_texts; i++)
        if (add_text_prompt(p, tok, a->prompts[i], strlen(a->prompts[i]), NULL, err)) return -1;
    return 0;
}

/* ---- output ---- */

/* The placement as the JSON report writes it: [wg, wc, cg, cc, hg, hc]. */
static cJSON *percent_json(const fg_percent *p) {
    const int v[6] = {p->wg, p->wc, p->cg, p->cc, p->hg, p->hc};
    return cJSON_CreateIntArray(v, 6);
}

/* What each stage of a pipeline tells rank 0 for the report (§4.4). */
typedef struct {
    int first_layer, end_layer;
    fg_percent percent;
    fg_stats st;
    double sent, compute, bubble, disk_read, peak_rss;
} stage_report;

/* Written whole or not at all (fg_output). */
static int dump_logits(const char *path, const float *logits, size_t n, char *err) {
    fg_output o;
    if (fg_output_open(&o, "--dump-logits", path, err)) return -1;
    fwrite(logits, sizeof(float), n, o.f);
    return fg_output_commit(&o, err);
}

/* Writes decoded bytes as text: invalid UTF-8 (a token can end mid-character) becomes U+FFFD,
 * as in HF's tokenizer.decode. */
static void print_utf8(const char *text, size_t len) {
    size_t n;
    char *clean = utf8_replace_invalid(text, len, &n);
    if (clean) fwrite(clean, 1, n, stdout);
    free(clean);
}

/* "[i] prompt + generated text" for each prompt (without its BOS); with --stop-at-eos the text
 * ends before the EOS. */
static void print_texts(const fg_tokenizer *tok, const prompt_set *p, const int *tokens,
                        const gen_options *opt) {
    int longest = 0;
    for (int i = 0; i < p->n; i++) longest = p->lens[i] > longest ? p->lens[i] : longest;
    int *ids = malloc((size_t)(longest + opt->gen_len + 1) * sizeof *ids);
    for (int i = 0; ids && i < p->n; i++) {
        int skip = p->ids[i][0] == tokenizer_bos_id(tok), len = p->lens[i] - skip, n = 0;
        const int *gen = tokens + (size_t)i * opt->gen_len;
        while (n < opt->gen_len && !(opt->stop_at_eos && gen_is_eos(opt, gen[n]))) n++;
        memcpy(ids, p->ids[i] + skip, (size_t)len * sizeof *ids);
        memcpy(ids + len, gen, (size_t)n * sizeof *ids);
        size_t text_len;
        char *text = tokenizer_decode(tok, ids, len + n, &text_len);
        printf("[%d] ", i + 1);
        if (text) print_utf8(text, text_len);
        printf("\n");
        free(text);
    }
    free(ids);
}

static double peak_rss_bytes(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss * 1024.0;
}

/* The report's per-stage entries (--json): the layers, the policy, peaks, bytes sent, times. */
static cJSON *stages_json(const stage_report *stages, int n) {
    cJSON *list = cJSON_CreateArray();
    for (int r = 0; r < n; r++) {
        const stage_report *s = &stages[r];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "first_layer", s->first_layer);
        cJSON_AddNumberToObject(o, "end_layer", s->end_layer);
        cJSON_AddItemToObject(o, "percent", percent_json(&s->percent));
        for (int i = 0; i < N_TIERS; i++) {
            char key[64];
            snprintf(key, sizeof key, "peak_%s_bytes", fg_tier_names[i]);
            cJSON_AddNumberToObject(o, key, s->st.peak[i]);
        }
        cJSON_AddNumberToObject(o, "bytes_sent", s->sent);
        cJSON_AddNumberToObject(o, "compute_seconds", s->compute);
        cJSON_AddNumberToObject(o, "bubble_seconds", s->bubble);
        cJSON_AddNumberToObject(o, "disk_read_seconds", s->disk_read);
        cJSON_AddNumberToObject(o, "peak_rss_bytes", s->peak_rss);
        cJSON_AddItemToArray(list, o);
    }
    return list;
}

/* What the host asked of the device (--json's "device_counts"): each counter, summed. */
static cJSON *counts_json(const fg_device_counts *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "host_waits", (double)c->host_waits);
    cJSON_AddNumberToObject(o, "launches", (double)c->launches);
    cJSON_AddNumberToObject(o, "blas_calls", (double)c->blas_calls);
    cJSON_AddNumberToObject(o, "widened", (double)c->widened);
    cJSON_AddNumberToObject(o, "graph_launches", (double)c->graph_launches);
    cJSON_AddNumberToObject(o, "copies_in", (double)c->copies_in);
    cJSON_AddNumberToObject(o, "copies_out", (double)c->copies_out);
    cJSON_AddNumberToObject(o, "copies_on_device", (double)c->copies_on_device);
    cJSON_AddNumberToObject(o, "pageable_copies", (double)c->pageable_copies);
    cJSON_AddNumberToObject(o, "allocations", (double)c->allocations);
    cJSON_AddNumberToObject(o, "bytes_in", (double)c->bytes_in);
    cJSON_AddNumberToObject(o, "bytes_out", (double)c->bytes_out);
    return o;
}

/* The device's counters of the prefill steps and the decode steps, and the most of each in one
 * decode step (the steady state of a run on the gpu tier). */
static cJSON *device_counts_json(const gen_timing *t) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "prefill", counts_json(&t->prefill_counts));
    cJSON_AddItemToObject(o, "decode", counts_json(&t->decode_counts));
    cJSON_AddNumberToObject(o, "decode_steps", (double)t->decode_steps);
    cJSON_AddItemToObject(o, "decode_step_most", counts_json(&t->decode_step_most));
    return o;
}

/* The prompts' own tokens (prefill computes them and their padding). */
static long prompt_tokens(const prompt_set *p) {
    long total = 0;
    for (int i = 0; i < p->n; i++) total += p->lens[i];
    return total;
}

/* Whether prefill's products run an opt-in scheme on onednn.c, and the path its last product took
 * ("" without a scheme): gemm_path's, which names what ran, or "none ran" (no GPU batch's prompts
 * came to more than MATMUL_DECODE_ROWS tokens, so decode's products took every one). */
static int prefill_scheme(const fg_policy *p) {
    return p->int8_activations || p->bf16_prefill;
}

static const char *prefill_path(const fg_policy *p) {
    return prefill_scheme(p) ? gemm_path(p->bf16_prefill) : "";
}

/* What the CPU's products ran on, into --json's object: the OpenBLAS core, the path of this
 * program's kernels, and the opt-in schemes' own products. */
static void add_kernels_json(cJSON *o, const fg_policy *p, const fg_blas_info *blas) {
    cJSON_AddStringToObject(o, "blas_library", blas->library);
    cJSON_AddStringToObject(o, "blas_core", blas->core);
    cJSON_AddStringToObject(o, "cpu_kernels", matmul_path());
    if (p->int8_activations) cJSON_AddStringToObject(o, "int8_sums", matmul_int8_path());
    if (prefill_scheme(p)) cJSON_AddStringToObject(o, "prefill_products", prefill_path(p));
}

/* FlexGen's numbers (flexgen/utils.py): sizes for the padded prompt + gen_len, throughputs per
 * generated (decode) or processed (prefill) token; then the tiers' peaks and the links' bytes,
 * the times, and the OpenBLAS core the CPU's products ran on. */
static void report(const cli_args *a, const model_config *c, const prompt_set *p,
                   const gen_timing *t, const fg_stats *st, int max_prompt, const char *device,
                   const stage_report *stages, int n_stages) {
    int seq = max_prompt + a->gen.gen_len;
    double model = opt_model_bytes(c), cache = opt_cache_bytes(c, p->n, seq);
    double hidden = opt_hidden_bytes(c, p->n, seq), total = t->prefill_latency + t->decode_latency;
    double prefill_tp = t->prefill_tokens / fmax(t->prefill_latency, 1e-10);
    double decode_tp = t->decode_tokens / fmax(t->decode_latency, 1e-10);
    double total_tp = (double)p->n * a->gen.gen_len / fmax(total, 1e-10);
    double completion = t->completion_seconds / (double)(t->completed > 0 ? t->completed : 1);
    static const char *const link_keys[N_LINKS] = {"disk_to_cpu_bytes", "cpu_to_gpu_bytes",
                                                   "gpu_to_cpu_bytes", "cpu_to_disk_bytes"};
    fg_blas_info blas; /* the CPU's products and attention, on either device */
    fg_blas_info_get(&blas);
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", c->name);
        cJSON_AddStringToObject(o, "device", device);
        cJSON_AddNumberToObject(o, "num_prompts", p->n);
        cJSON_AddNumberToObject(o, "prompt_len", max_prompt);
        cJSON_AddNumberToObject(o, "gen_len", a->gen.gen_len);
        cJSON_AddNumberToObject(o, "gpu_batch_size", a->policy.gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", a->policy.num_gpu_batches);
        cJSON_AddStringToObject(o, "schedule", fg_schedule_names[a->policy.schedule]);
        cJSON_AddItemToObject(o, "percent", percent_json(&a->policy.percent));
        cJSON_AddBoolToObject(o, "overlap", a->policy.overlap);
        cJSON_AddBoolToObject(o, "cpu_cache_compute", a->policy.cpu_cache_compute);
        cJSON_AddBoolToObject(o, "compress_weight", a->policy.compress_weight);
        cJSON_AddBoolToObject(o, "int8_activations", a->policy.int8_activations);
        cJSON_AddBoolToObject(o, "bf16_prefill", a->policy.bf16_prefill);
        cJSON_AddBoolToObject(o, "compress_cache", a->policy.compress_cache);
        cJSON_AddNumberToObject(o, "attn_sparsity", a->policy.attn_sparsity);
        cJSON_AddNumberToObject(o, "model_size_bytes", model);
        cJSON_AddNumberToObject(o, "cache_size_bytes", cache);
        cJSON_AddNumberToObject(o, "hidden_size_bytes", hidden);
        cJSON_AddNumberToObject(o, "peak_rss_bytes", peak_rss_bytes());
        for (int i = 0; i < N_TIERS; i++) {
            char key[64];
            snprintf(key, sizeof key, "peak_%s_bytes", fg_tier_names[i]);
            cJSON_AddNumberToObject(o, key, st->peak[i]);
            snprintf(key, sizeof key, "capacity_%s_bytes", fg_tier_names[i]);
            cJSON_AddNumberToObject(o, key, st->capacity[i]);
        }
        for (int i = 0; i < N_LINKS; i++) cJSON_AddNumberToObject(o, link_keys[i], st->link_bytes[i]);
        cJSON_AddNumberToObject(o, "compute_seconds", t->compute_seconds);
        cJSON_AddNumberToObject(o, "disk_read_seconds", t->disk_read_seconds);
        cJSON_AddNumberToObject(o, "prefill_latency", t->prefill_latency);
        cJSON_AddNumberToObject(o, "prefill_throughput", prefill_tp);
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)prompt_tokens(p));
        cJSON_AddNumberToObject(o, "prefill_tokens", (double)t->prefill_tokens);
        cJSON_AddNumberToObject(o, "rows_computed", (double)t->rows); /* padding and ended ones too */
        cJSON_AddNumberToObject(o, "kv_cache_rows", (double)t->cache_rows); /* each sequence's pages at its end */
        cJSON_AddNumberToObject(o, "kv_cache_tokens", (double)t->cache_tokens); /* the tokens in them */
        cJSON_AddNumberToObject(o, "decode_latency", t->decode_latency);
        cJSON_AddNumberToObject(o, "decode_throughput", decode_tp);
        cJSON_AddNumberToObject(o, "total_latency", total);
        cJSON_AddNumberToObject(o, "total_throughput", total_tp);
        cJSON_AddNumberToObject(o, "mean_completion_seconds", completion);
        if (a->cold_seconds >= 0) {
            cJSON_AddNumberToObject(o, "warmup_latency", a->cold_seconds);
            cJSON_AddNumberToObject(o, "warmup_prefill_latency", a->cold_prefill);
            cJSON_AddNumberToObject(o, "warmup_decode_latency", a->cold_decode);
        }
        add_kernels_json(o, &a->policy, &blas);
        if (t->device_counted) cJSON_AddItemToObject(o, "device_counts", device_counts_json(t));
        if (n_stages > 1) cJSON_AddItemToObject(o, "stages", stages_json(stages, n_stages));
        char *s = cJSON_PrintUnformatted(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
        return;
    }
    printf("model size: %.3f GB\tcache size: %.3f GB\thidden size (p): %.3f GB\n", model / GB,
           cache / GB, hidden / GB);
    printf("peak gpu mem: %.3f GB\tprojected: False\n", st->peak[TIER_GPU] / GB);
    printf("prefill latency: %.3f s\tprefill throughput: %.3f token/s\n", t->prefill_latency, prefill_tp);
    printf("decode latency: %.3f s\tdecode throughput: %.3f token/s\n", t->decode_latency, decode_tp);
    printf("total latency: %.3f s\ttotal throughput: %.3f token/s\n", total, total_tp);
    printf("mean time to a completed sequence: %.3f s\n", completion);
    if (a->cold_seconds >= 0) printf("cold first run (--warmup, not in the figures above): %.3f s\n", a->cold_seconds);
    printf("peak tiers: gpu %.3f GB\tcpu %.3f GB\tdisk %.3f GB\n", st->peak[TIER_GPU] / GB,
           st->peak[TIER_CPU] / GB, st->peak[TIER_DISK] / GB);
    printf("moved: disk->cpu %.3f GB\tcpu->gpu %.3f GB\tgpu->cpu %.3f GB\tcpu->disk %.3f GB\n",
           st->link_bytes[LINK_DISK_TO_CPU] / GB, st->link_bytes[LINK_CPU_TO_GPU] / GB,
           st->link_bytes[LINK_GPU_TO_CPU] / GB, st->link_bytes[LINK_CPU_TO_DISK] / GB);
    printf("compute: %.3f s\tdisk reads: %.3f s\tdevice: %s\n", t->compute_seconds,
           t->disk_read_seconds, device);
    printf("blas: %s, core %s (%s)\tcpu kernels: %s%s%s%s%s\n", blas.library, blas.core, blas.why, matmul_path(),
           a->policy.int8_activations ? ", int8 sums " : "", a->policy.int8_activations ? matmul_int8_path() : "",
           prefill_scheme(&a->policy) ? ", prefill products " : "", prefill_path(&a->policy));
    for (int r = 0; n_stages > 1 && r < n_stages; r++) {
        const stage_report *s = &stages[r];
        printf("stage %d/%d (layers %d-%d): peak gpu %.3f GB\tcpu %.3f GB\tdisk %.3f GB\t"
               "sent %.3f GB\tcompute %.3f s\tbubble %.3f s\n", r + 1, n_stages, s->first_layer,
               s->end_layer - 1, s->st.peak[TIER_GPU] / GB, s->st.peak[TIER_CPU] / GB,
               s->st.peak[TIER_DISK] / GB, s->sent / GB, s->compute, s->bubble);
    }
}

/* The configuration of --model without opening its weights. */
static int resolve_model_config(const char *model, model_config *cfg, char *err) {
    if (!is_dir(model)) return model_config_by_name(model, cfg, err);
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", model);
    if (model_config_from_json(path, cfg, err)) return -1;
    snprintf(cfg->name, sizeof cfg->name, "%s", model);
    return 0;
}

/* One line on stderr where config.json's bos_token_id or eos_token_id is not a token of the model
 * (not below vocab_size): the model never generates it, so a sequence never ends on that id. */
static void warn_special_ids(const char *model, const model_config *cfg) {
    char ids[256] = "";
    size_t n = 0;
    int count = 0;
    if (cfg->family == FAMILY_OPT || !is_dir(model)) return;
    if (cfg->bos_id >= cfg->vocab) {
        n += (size_t)snprintf(ids + n, sizeof ids - n, "bos_token_id %d", cfg->bos_id);
        count++;
    }
    for (int i = 0; i < cfg->n_eos && n < sizeof ids; i++)
        if (cfg->eos_ids[i] >= cfg->vocab) {
            n += (size_t)snprintf(ids + n, sizeof ids - n, "%seos_token_id %d", n ? ", " : "", cfg->eos_ids[i]);
            count++;
        }
    if (count == 0) return;
    fprintf(stderr, "flexgen: warning: %s/config.json: %s %s not below vocab_size %d: the model has no such token\n",
            model, ids, count > 1 ? "are" : "is", cfg->vocab);
}

/* --gen-len and --prompt-len against the model's positions, before anything is sized by them
 * (given prompts are checked one by one once they are read). */
static int check_lengths(const cli_args *a, const model_config *cfg, char *err) {
    int given = a->prompt_ids || a->prompt_file || a->n_prompt_texts, least = given ? 1 : a->prompt_len;
    if (a->gen.gen_len - 1 > cfg->max_pos - least && given) /* the last token is not fed back */
        return fg_fail(err, "--gen-len %d: even a one-token prompt needs %d positions (the last token "
                       "generated is not fed back); the model has %d", a->gen.gen_len, a->gen.gen_len, cfg->max_pos);
    if (a->gen.gen_len - 1 > cfg->max_pos - least)
        return fg_fail(err, "--prompt-len %d + --gen-len %d need %lld positions (the last token generated is "
                       "not fed back); the model has %d", least, a->gen.gen_len,
                       (long long)least + a->gen.gen_len - 1, cfg->max_pos);
    return 0;
}

/* The default hardware file, ~/.cache/flexgen/hardware.json, its directory made if need be. */
static int default_hw_file(char *path, size_t n, char *err) {
    char dir[4096];
    default_weight_dir(dir, sizeof dir);
    if (mkdir_p(dir)) return fg_fail(err, "%s: cannot create: %s", dir, strerror(errno));
    snprintf(path, n, "%s/hardware.json", dir);
    return 0;
}

/* --hw FILE, or the default hardware file, measuring this machine once when there is none. */
static int load_hardware(const cli_args *a, fg_hardware *hw, char *err) {
    if (a->hw) return fg_hardware_read(a->hw, hw, err);
    char path[4200];
    if (default_hw_file(path, sizeof path, err)) return -1;
    if (file_exists(path)) return fg_hardware_read(path, hw, err);
    const char *offload = a->policy.offload_dir ? a->policy.offload_dir : FG_DEFAULT_OFFLOAD_DIR;
    fprintf(stderr, "flexgen: no hardware file yet: profiling this machine once (about 30 s), "
                    "saved to %s\n", path);
    if (fg_profile(offload, a->policy.device, hw, 1, err)) return -1;
    return fg_hardware_write(path, hw, err);
}

/* The ids that end a sequence: OPT's </s>, or the LLaMA config's eos_token_id (none: -1). */
static void set_eos(gen_options *g, const model_config *cfg) {
    g->n_eos = 1;
    g->eos_ids[0] = cfg->family == FAMILY_OPT ? OPT_EOS_ID : -1;
    if (cfg->family != FAMILY_OPT && cfg->n_eos > 0) {
        g->n_eos = cfg->n_eos;
        memcpy(g->eos_ids, cfg->eos_ids, sizeof g->eos_ids);
    }
}

static int longest_prompt(const prompt_set *p) {
    int longest = 0;
    for (int i = 0; i < p->n; i++) longest = p->lens[i] > longest ? p->lens[i] : longest;
    return longest;
}

/* The prompts' mean length for the cost model: a job (--output) runs its prompts by length, so
 * that a block pads little. 0 otherwise: in file order a block pads to its longest prompt. */
static int mean_prompt(const cli_args *a, const prompt_set *p) {
    return a->output && p->n ? (int)((prompt_tokens(p) + p->n - 1) / p->n) : 0;
}

enum { JOB_WINDOW = 8 }; /* a batch job's window: rounds of prompts (run_rounds) */

/* Whether the hardware file is of the backend the device gets on this machine (a CPU file on the
 * CPU, a GPU file where a GPU is present): then this runtime checks each plan; otherwise the
 * plan is for another machine, whose capacities the flags give. */
static int hardware_is_here(const fg_hardware *hw, fg_device device) {
    char why[FG_ERR_LEN];
    const fg_backend *be = backend_for(device, why);
    return be && !be->gpu_is_host == !hw->gpu_is_host;
}

/* The capacities the last policy search on this machine planned within, as the runtime's plan
 * check gave them to it (the defaults filled in, the host's memory where the gpu and cpu tiers
 * share it): flexgen policy reports them. */
static fg_stats searched_capacities;

static int check_keeping_capacities(const model_config *model, uint64_t seed, const fg_policy *p, int sequences,
                                    int s, int n, int check, double x[N_X], fg_stats *st, char *err) {
    int rc = fg_runtime_check(model, seed, p, sequences, s, n, check, x, st, err);
    if (st) searched_capacities = *st;
    return rc;
}

/* The policy search's request for this command line: n_prompts given (0: synthetic, any
 * block), the longest of them (0: --prompt-len), their mean length (0: not known). The plan
 * check holds the longest; the costs take the mean. */
static int search_policy(const cli_args *a, const fg_hardware *hw, const model_config *cfg,
                         int n_prompts, const int lengths[2], int gbs, int ngb, fg_search_result *res,
                         char *err) {
    int diagonal_runs = !a->gen.refill; /* it refills its GPU batches itself */
    fg_search_request req = {.s = lengths[0] ? lengths[0] : a->prompt_len, .s_mean = lengths[1], .n = a->gen.gen_len,
                             .max_block = n_prompts, .max_latency = a->max_latency,
                             .check = hardware_is_here(hw, a->policy.device) ? check_keeping_capacities : NULL,
                             .place = fg_runtime_check, .seed = a->gen.seed, .gbs = gbs, .ngb = ngb,
                             .schedules = a->schedule_given ? 1 << a->policy.schedule
                                          : 1 << FG_SCHEDULE_ZIGZAG | diagonal_runs << FG_SCHEDULE_DIAGONAL,
                             .stream_blocks = a->output ? JOB_WINDOW : 0};
    if (a->evaluate) return fg_policy_evaluate(cfg, hw, &a->policy, &req, res, err);
    return fg_policy_search(cfg, hw, &a->policy, &req, res, err);
}

static void print_policy_flags(FILE *out, const fg_policy *p) {
    fprintf(out, "--gpu-batch-size %d --num-gpu-batches %d --percent %d %d %d %d %d %d%s --schedule %s",
            p->gpu_batch_size, p->num_gpu_batches, p->percent.wg, p->percent.wc, p->percent.cg,
            p->percent.cc, p->percent.hg, p->percent.hc, p->cpu_cache_compute ? " --cpu-cache-compute" : "",
            fg_schedule_names[p->schedule]);
}

/* ---- a run as one stage of a pipeline (§4.4): rank 0 reads the prompts and reports ---- */

/* Rank 0's prompts on every stage (the first needs the ids, every stage their lengths). */
static int share_prompts(fg_pipe *pipe, prompt_set *p, char *err) {
    int n = p->n, total = 0, rc = 0;
    fg_pipe_bcast(pipe, &n, sizeof n);
    int *lens = fg_pipe_rank(pipe) ? calloc((size_t)n, sizeof *lens) : p->lens;
    if (!lens) return fg_fail(err, "out of memory");
    fg_pipe_bcast(pipe, lens, (size_t)n * sizeof *lens);
    for (int i = 0; i < n; i++) total += lens[i];
    int *flat = malloc((size_t)total * sizeof *flat);
    if (!flat) return fg_fail(err, "out of memory"); /* every rank runs out alike, or aborts */
    for (int i = 0, at = 0; i < p->n; at += lens[i++]) memcpy(flat + at, p->ids[i], (size_t)lens[i] * sizeof *flat);
    fg_pipe_bcast(pipe, flat, (size_t)total * sizeof *flat);
    for (int i = 0, at = 0; fg_pipe_rank(pipe) && i < n && rc == 0; at += lens[i++]) {
        int *ids = malloc((size_t)lens[i] * sizeof *ids);
        if (!ids) rc = fg_fail(err, "out of memory");
        else memcpy(ids, flat + at, (size_t)lens[i] * sizeof *ids), rc = prompts_add(p, ids, lens[i], err);
    }
    if (rc == 0 && n) fg_pipe_bcast(pipe, p->index, (size_t)n * sizeof *p->index); /* sampling's seeds */
    if (fg_pipe_rank(pipe)) free(lens);
    free(flat);
    return rc;
}

/* Every stage's v[0..n), each the least over the stages (rank 0 takes them and says); returns
 * whether this stage's own differed. */
static int agree_on_least(fg_pipe *pipe, int *v, int n) {
    int stages = fg_pipe_size(pipe), mine[n], all[stages * n], differs = 0;
    memcpy(mine, v, (size_t)n * sizeof *v);
    fg_pipe_gather(pipe, v, (size_t)n * sizeof *v, all);
    for (int r = 1; fg_pipe_rank(pipe) == 0 && r < stages; r++)
        for (int d = 0; d < n; d++) v[d] = all[r * n + d] < v[d] ? all[r * n + d] : v[d];
    fg_pipe_bcast(pipe, v, (size_t)n * sizeof *v);
    for (int d = 0; d < n; d++) differs |= v[d] != mine[d];
    return differs;
}

/* --policy auto: each stage searches for its share of the layers (§4.4); the stages then take
 * one schedule (the diagonal where every stage chose it, else zig-zag, each stage searching again
 * for it), then the smallest GPU batch and number of GPU batches any of them chose (each fits
 * where the larger did) and place their tensors again for that block shape. shape: a block shape
 * to keep (a resumed job's), or {0, 0}. */
static int plan_stages(cli_args *a, fg_pipe *pipe, const model_config *cfg, int n_prompts,
                       const int lengths[2], const int shape_kept[2], char *err) {
    fg_search_result res;
    fg_hardware hw;
    int rc = 0, n = fg_pipe_size(pipe);
    for (int r = 0; r < n; r++) { /* a machine without a hardware file measures itself once, a stage
                                     at a time: stages sharing a machine must not load each other */
        if (r == fg_pipe_rank(pipe)) rc = load_hardware(a, &hw, err);
        if (fg_pipe_agree(pipe, rc, err)) return -1;
    }
    rc = search_policy(a, &hw, cfg, shape_kept[0] ? 0 : n_prompts, lengths, shape_kept[0], shape_kept[1], &res, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    int schedule = res.policy.schedule; /* zig-zag unless every stage chose the diagonal */
    if (agree_on_least(pipe, &schedule, 1)) {
        a->policy.schedule = schedule, a->schedule_given = 1;
        rc = search_policy(a, &hw, cfg, shape_kept[0] ? 0 : n_prompts, lengths, shape_kept[0], shape_kept[1], &res, err);
    }
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    a->policy.schedule = res.policy.schedule, a->schedule_given = 1; /* kept while the shape is agreed */
    int shape[2] = {res.policy.gpu_batch_size, res.policy.num_gpu_batches};
    if (agree_on_least(pipe, shape, 2)) rc = search_policy(a, &hw, cfg, n_prompts, lengths, shape[0], shape[1], &res, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    a->policy = res.policy;
    if (a->gen.verbose) {
        fprintf(stderr, "policy auto: ");
        print_policy_flags(stderr, &a->policy);
        fprintf(stderr, " (predicted %.3f token/s, searched in %.2f s)\n", res.throughput, res.seconds);
    }
    return 0;
}

/* The last stage's logits (--dump-logits) to rank 0, in pieces that fit an MPI message. */
static void gather_logits(fg_pipe *pipe, float *logits, size_t count) {
    int last = fg_pipe_size(pipe) - 1, rank = fg_pipe_rank(pipe);
    if (last == 0 || (rank != 0 && rank != last)) return;
    size_t piece = (size_t)1 << 28; /* floats: 1 GiB */
    for (size_t at = 0; at < count; at += piece) {
        size_t n = count - at < piece ? count - at : piece;
        int msg = rank == 0 ? fg_pipe_recv(pipe, last, FG_TAG_LOGITS, logits + at, n * sizeof *logits)
                            : fg_pipe_send(pipe, 0, FG_TAG_LOGITS, logits + at, n * sizeof *logits);
        fg_pipe_release(pipe, msg);
    }
}

/* Rank 0's view of the whole job: peaks and bytes moved summed over the stages, the busiest
 * stage's compute and disk times. */
static void combine_stages(const stage_report *all, int n, fg_stats *st, gen_timing *t) {
    *st = all[0].st;
    for (int r = 1; r < n; r++) {
        for (int i = 0; i < N_TIERS; i++)
            st->peak[i] += all[r].st.peak[i], st->capacity[i] += all[r].st.capacity[i];
        for (int i = 0; i < N_LINKS; i++) st->link_bytes[i] += all[r].st.link_bytes[i];
    }
    for (int r = 0; r < n; r++) {
        t->compute_seconds = fmax(t->compute_seconds, all[r].compute);
        t->disk_read_seconds = fmax(t->disk_read_seconds, all[r].disk_read);
    }
}

/* The flags of the job, which every stage must share, against rank 0's; what rank 0 alone
 * writes (--dump-logits, --trace, --json, --output) is taken from it. */
typedef struct {
    char model[256];
    int gen_len, stop_at_eos, prompt_len, gbs, ngb, auto_policy, dump, trace, output, schedule, schedule_given;
    int compress_weight, compress_cache, int8, bf16; /* the numbers the job's records hold */
    int warmup;
    float temperature, top_p, sparsity;
    uint64_t seed;
} job_flags;

static int share_job(cli_args *a, fg_pipe *pipe, char *err) {
    job_flags mine = {.gen_len = a->gen.gen_len, .stop_at_eos = a->gen.stop_at_eos,
                      .prompt_len = a->prompt_len, .gbs = a->policy.gpu_batch_size,
                      .ngb = a->policy.num_gpu_batches, .auto_policy = a->auto_policy,
                      .schedule = a->policy.schedule, .schedule_given = a->schedule_given,
                      .dump = a->dump_logits != NULL, .trace = a->trace != NULL, .output = a->output != NULL,
                      .compress_weight = a->policy.compress_weight, .compress_cache = a->policy.compress_cache,
                      .int8 = a->policy.int8_activations, .bf16 = a->policy.bf16_prefill,
                      .sparsity = a->policy.attn_sparsity,
                      .warmup = a->warmup,
                      .temperature = a->gen.temperature, .top_p = a->gen.top_p, .seed = a->gen.seed};
    snprintf(mine.model, sizeof mine.model, "%s", a->model);
    job_flags job = mine;
    fg_pipe_bcast(pipe, &job, sizeof job);
    if (fg_pipe_rank(pipe)) { /* rank 0 writes them; the others send it what they need */
        a->dump_logits = job.dump ? "(rank 0's)" : NULL;
        a->output = job.output ? "(rank 0's)" : NULL; /* the other stages run its rounds too */
        a->trace = job.trace ? "(rank 0's)" : NULL;
        a->policy.trace = job.trace;
        a->warmup = job.warmup; /* every stage runs it, or none */
    }
    const char *differs = strcmp(job.model, mine.model) ? "--model"
        : job.gen_len != mine.gen_len ? "--gen-len" : job.stop_at_eos != mine.stop_at_eos ? "--stop-at-eos"
        : job.prompt_len != mine.prompt_len ? "--prompt-len" : job.seed != mine.seed ? "--seed"
        : job.temperature != mine.temperature ? "--temperature" : job.top_p != mine.top_p ? "--top-p"
        : job.compress_weight != mine.compress_weight ? "--compress-weight"
        : job.compress_cache != mine.compress_cache ? "--compress-cache"
        : job.int8 != mine.int8 ? "--int8-activations" : job.bf16 != mine.bf16 ? "--bf16-prefill"
        : job.sparsity != mine.sparsity ? "--attn-sparsity"
        : job.auto_policy != mine.auto_policy ? "--policy"
        : job.schedule != mine.schedule || (job.auto_policy && job.schedule_given != mine.schedule_given) ? "--schedule"
        : !job.auto_policy && job.gbs != mine.gbs ? "--gpu-batch-size"
        : !job.auto_policy && job.ngb != mine.ngb ? "--num-gpu-batches" : NULL;
    if (differs) return fg_fail(err, "%s differs from rank 0's: the stages of a pipeline share it", differs);
    return 0;
}

/* The prompts as a job runs them: each one's id and tokens, hashed (FNV-1a). A prompt file read
 * from another path, or the same prompts given another way, are the same job. */
static uint64_t prompts_hash(const prompt_set *p) {
    uint64_t h = FG_FNV64_START;
    for (int i = 0; i < p->n; i++) {
        h = fg_fnv64_more(h, p->record_ids[i], strlen(p->record_ids[i]) + 1);
        h = fg_fnv64_more(h, &p->lens[i], sizeof p->lens[i]);
        h = fg_fnv64_more(h, p->ids[i], (size_t)p->lens[i] * sizeof *p->ids[i]);
    }
    return h;
}

static const char *device_name(fg_device d) {
    return d == FG_DEVICE_CUDA ? "cuda" : d == FG_DEVICE_CPU_FP16 ? "cpu-fp16" : "cpu";
}

/* The job's first line for its flags and (once planned) block shape; an existing output must hold
 * the same (rank 0). */
static int begin_job(const cli_args *a, job_output *out, char *err) {
    /* the CPU devices' prefill runs on OpenBLAS's sgemm, and --bf16-prefill's on oneDNN's kernels
     * (those its instruction set allows) or sgemm, whose fp32 sums each go in their own order;
     * int8's integer sums are exact on any kernel */
    fg_blas_info blas;
    fg_blas_info_get(&blas);
    job_identity id = {.model = is_dir(a->model) ? NULL : a->model, .device = device_name(a->policy.device),
                       .blas_core = a->policy.device == FG_DEVICE_CUDA ? NULL : blas.core,
                       .prefill_library = a->policy.bf16_prefill ? gemm_library_isa() : NULL,
                       .prompts_hash = a->prompts_hash, .n_prompts = a->n_job_prompts};
    if (!id.model && job_checkpoint_hash(a->model, &id.checkpoint_hash, err)) return -1;
    char *header = job_header(&id, &a->gen, &a->policy);
    if (!header) return fg_fail(err, "out of memory");
    return job_output_begin(out, header, err);
}

/* --output (rank 0): locked for the job, and with --resume the prompts it holds records of are
 * dropped (their place in the file stays in p->index). Two prompts with one id are refused, and
 * so is an output with records of prompts the job does not have. --policy auto keeps the block
 * shape and the schedule an existing output was made with (a --schedule given must be its). */
static int open_job_output(cli_args *a, prompt_set *p, job_output *out, char *err) {
    for (int i = 0; i < p->n; i++) /* --prompt texts: numbered in order */
        if (!p->record_ids[i] && (p->record_ids[i] = malloc(16))) snprintf(p->record_ids[i], 16, "%d", i + 1);
        else if (!p->record_ids[i]) return fg_fail(err, "out of memory");
    const char *repeated = job_repeated_id(p->record_ids, p->n);
    if (repeated)
        return fg_fail(err, "%s: the id %.60s is given to two prompts; a record names its prompt by id",
                       a->prompt_file ? a->prompt_file : "the prompts", repeated);
    a->prompts_hash = prompts_hash(p), a->n_job_prompts = p->n;
    if (job_output_open(out, a->output, a->resume, err)) return -1;
    int shape[2];
    fg_schedule schedule;
    job_output_shape(out, &shape[0], &shape[1], &schedule);
    if (a->auto_policy && shape[0] > 0 && shape[1] > 0) {
        a->policy.gpu_batch_size = shape[0], a->policy.num_gpu_batches = shape[1];
        if (!a->schedule_given) a->policy.schedule = schedule, a->schedule_given = 1;
    }
    if (begin_job(a, out, err)) return -1;
    const char *stranger = job_output_stranger(out, p->record_ids, p->n);
    if (stranger)
        return fg_fail(err, "--resume: %s has a record of the id %.60s, which no prompt of this job has", a->output,
                       stranger);
    int kept = 0;
    for (int i = 0; i < p->n; i++) {
        if (job_output_done(out, p->record_ids[i])) {
            free(p->ids[i]), free(p->record_ids[i]), free(p->texts[i]);
            continue;
        }
        p->ids[kept] = p->ids[i], p->lens[kept] = p->lens[i], p->index[kept] = p->index[i];
        p->record_ids[kept] = p->record_ids[i], p->texts[kept] = p->texts[i], kept++;
    }
    if (out->n_done && kept && !a->quiet) /* none left: run() says the job is finished */
        fprintf(stderr, "job: %d of %d prompts already in %s; resuming\n", p->n - kept, p->n, a->output);
    p->n = kept;
    return 0;
}

/* The records of prompts which[first .. first + count - 1] (which NULL: first .. first + count - 1
 * themselves), in one write (rank 0). */
static int append_records(const cli_args *a, const prompt_set *p, const fg_tokenizer *tok, const int *tokens,
                          const int *which, int first, int count, job_output *out, char *err) {
    size_t len = 0, cap = 0;
    char *lines = NULL;
    int rc = 0;
    for (int j = first, i; j < first + count && rc == 0; j++) {
        i = which ? which[j] : j;
        char *r = job_record(p->record_ids[i], p->texts[i], p->ids[i], p->lens[i],
                             tokens + (size_t)i * a->gen.gen_len, &a->gen, tok);
        size_t n = r ? strlen(r) : 0;
        if (r && len + n + 1 > cap) {
            char *grown = realloc(lines, cap = 2 * (len + n + 1));
            if (grown) lines = grown;
            else free(r), r = NULL;
        }
        if (!r) rc = fg_fail(err, "out of memory");
        else memcpy(lines + len, r, n), len += n, free(r);
    }
    if (rc == 0) rc = job_output_append(out, lines, len, err);
    free(lines);
    return rc;
}

static void add_timing(gen_timing *sum, const gen_timing *t) {
    sum->prefill_latency += t->prefill_latency, sum->decode_latency += t->decode_latency;
    sum->prefill_tokens += t->prefill_tokens, sum->decode_tokens += t->decode_tokens, sum->rows += t->rows;
    sum->cache_rows += t->cache_rows, sum->cache_tokens += t->cache_tokens;
    sum->compute_seconds += t->compute_seconds, sum->bubble_seconds += t->bubble_seconds;
    sum->disk_read_seconds += t->disk_read_seconds;
    sum->completed += t->completed, sum->completion_seconds += t->completion_seconds;
    sum->device_counted |= t->device_counted;
    sum->decode_steps += t->decode_steps;
    device_counts_add(&sum->prefill_counts, &t->prefill_counts, 0);
    device_counts_add(&sum->decode_counts, &t->decode_counts, 0);
    device_counts_add(&sum->decode_step_most, &t->decode_step_most, 1);
}

/* "job: 120 of 1000 prompts, 35.2 token/s, about 0:12:31 left": a line a window of rounds,
 * rewritten in place on a terminal. */
static void job_progress(int done, int total, double tokens, double seconds, int done_here) {
    double left = seconds / done_here * (total - done);
    int tty = isatty(2);
    fprintf(stderr, "%sjob: %d of %d prompts, %.1f token/s, about %d:%02d:%02d left%s", tty ? "\r" : "", done,
            total, seconds > 0 ? tokens / seconds : 0, (int)(left / 3600), (int)(left / 60) % 60, (int)left % 60,
            tty && done < total ? "" : "\n");
}

/* A window's prompts, longest first (ties in file order): rounds of similar lengths pad less. */
static int by_length(const void *a, const void *b, void *prompts) {
    int x = *(const int *)a, y = *(const int *)b;
    const int *lens = ((const prompt_set *)prompts)->lens;
    return lens[x] != lens[y] ? lens[y] - lens[x] : x - y;
}

/* A diagonal job's records as its groups end (generate()'s group_done, on rank 0): the groups of
 * a window end in the order they started, so their records go out in the window's order, a
 * group in one write. */
typedef struct {
    const cli_args *a;
    const prompt_set *p;
    const fg_tokenizer *tok;
    job_output *out;
    int *tokens;
    const int *got, *order; /* generate()'s tokens, and each of its prompts' place in p */
    int written, rc;        /* its prompts recorded (a group's failed write: rc -1, err says why) */
    char *err;
} group_records;

static void record_group(void *ctx, int first, int count) {
    group_records *g = ctx;
    int G = g->a->gen.gen_len;
    if (g->rc || first != g->written) return;
    for (int i = first; i < first + count; i++)
        memcpy(g->tokens + (size_t)g->order[i] * G, g->got + (size_t)i * G, (size_t)G * sizeof *g->got);
    g->rc = append_records(g->a, g->p, g->tok, g->tokens, g->order, first, count, g->out, g->err);
    g->written = first + count;
}

/* --output: the prompts in windows of JOB_WINDOW rounds of places in the file (those left of a
 * resumed job: the windows of the job unbroken). A window's prompts run longest first, a round
 * at a time (a block for each stage: what one generate() takes, §4.4), so that a round's prompts
 * have similar lengths and little padding; its records are appended in file order, in one write,
 * once the window is done. With --refill or the diagonal schedule the window is one generate():
 * its blocks take the next prompts as sequences end, and the diagonal's records are appended as
 * each GPU batch's group ends (record_group). A crash loses at most what is in flight, and
 * --resume forms the same windows of the prompts left, and the same groups, so it computes what
 * an unbroken run would: sampling draws by each prompt's place in the file. */
static int run_rounds(const cli_args *a, fg_pipe *pipe, fg_model *m, const prompt_set *p, const fg_tokenizer *tok,
                      job_output *out, int *tokens, gen_timing *t, char *err) {
    int round = a->policy.gpu_batch_size * a->policy.num_gpu_batches * fg_pipe_size(pipe), G = a->gen.gen_len;
    int window = round * JOB_WINDOW, rc = 0, diagonal = a->policy.schedule == FG_SCHEDULE_DIAGONAL;
    if (a->gen.refill || diagonal) round = window; /* its blocks stream them */
    int *order = malloc((size_t)window * sizeof *order), *index = malloc((size_t)round * sizeof *index);
    int **ids = malloc((size_t)round * sizeof *ids), *lens = malloc((size_t)round * sizeof *lens);
    int *got = malloc((size_t)round * G * sizeof *got);
    group_records groups = {.a = a, .p = p, .tok = tok, .out = out, .tokens = tokens, .got = got, .err = err};
    double start = now_seconds();
    memset(t, 0, sizeof *t);
    if (!order || !index || !ids || !lens || !got) rc = fg_fail(err, "out of memory");
    for (int w0 = 0, in_window = 0; rc == 0 && w0 < p->n; w0 += in_window) {
        for (in_window = 1; w0 + in_window < p->n && p->index[w0 + in_window] / window == p->index[w0] / window;
             in_window++) {}
        for (int i = 0; i < in_window; i++) order[i] = w0 + i;
        qsort_r(order, (size_t)in_window, sizeof *order, by_length, (void *)p);
        for (int r0 = 0; rc == 0 && r0 < in_window; r0 += round) {
            int count = in_window - r0 < round ? in_window - r0 : round;
            for (int i = 0; i < count; i++)
                ids[i] = p->ids[order[r0 + i]], lens[i] = p->lens[order[r0 + i]], index[i] = p->index[order[r0 + i]];
            gen_options opt = a->gen;
            opt.index = index;
            groups.order = order + r0, groups.written = 0;
            if (diagonal && fg_pipe_rank(pipe) == 0) opt.group_done = record_group, opt.group_ctx = &groups;
            gen_timing this_round;
            double began = now_seconds() - start; /* a completion's time counts from the job's start */
            if (generate(m, &opt, count, ids, lens, got, NULL, &this_round, err) || groups.rc) rc = -1;
            this_round.completion_seconds += began * (double)this_round.completed;
            for (int i = 0; rc == 0 && i < count; i++)
                memcpy(tokens + (size_t)order[r0 + i] * G, got + (size_t)i * G, (size_t)G * sizeof *got);
            if (rc == 0) add_timing(t, &this_round);
        }
        if (rc == 0 && fg_pipe_rank(pipe) == 0) /* the diagonal's groups that ended with the run */
            rc = diagonal ? append_records(a, p, tok, tokens, order, groups.written, in_window - groups.written, out, err)
                          : append_records(a, p, tok, tokens, NULL, w0, in_window, out, err);
        if (fg_pipe_agree(pipe, rc, err)) rc = -1;
        if (rc == 0 && fg_pipe_rank(pipe) == 0 && !a->quiet)
            job_progress(out->n_done + w0 + in_window, out->n_done + p->n,
                         (double)(t->prefill_tokens + t->decode_tokens), now_seconds() - start, w0 + in_window);
    }
    free(order), free(index), free(ids), free(lens), free(got);
    return rc;
}

/* The prompts of the job on every stage: read (and tokenized) by rank 0, or synthetic ones to
 * fill the block that --policy auto chooses for each stage. */
static int job_prompts(cli_args *a, fg_pipe *pipe, const model_config *cfg, fg_tokenizer **tok,
                       prompt_set *p, job_output *out, char *err) {
    int rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe), rc = 0;
    if (rank == 0 && (open_tokenizer(a, tok, err) || gather_prompts(a, *tok, cfg->vocab, p, err))) rc = -1;
    if (rc == 0 && rank == 0 && a->output) rc = open_job_output(a, p, out, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    int given[7] = {p->n, a->output && p->n == 0, longest_prompt(p), mean_prompt(a, p), /* n 0: synthetic */
                    out->recorded ? a->policy.gpu_batch_size : 0, out->recorded ? a->policy.num_gpu_batches : 0,
                    out->recorded ? (int)a->policy.schedule : -1};
    fg_pipe_bcast(pipe, given, sizeof given); /* prompts, once the block is known, or a finished job */
    if ((a->job_finished = given[1])) return 0;
    if (given[6] >= 0) a->policy.schedule = (fg_schedule)given[6], a->schedule_given = 1; /* a resumed job's */
    if (a->auto_policy &&
        plan_stages(a, pipe, cfg, given[0] ? (given[0] + stages - 1) / stages : 0, given + 2, given + 4, err))
        return -1;
    if (rank == 0 && a->output && a->auto_policy) rc = begin_job(a, out, err); /* the shape it chose */
    if (rc == 0 && rank == 0 && p->n == 0) rc = synthetic_prompts(p, a, stages, cfg->vocab, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    return share_prompts(pipe, p, err);
}

/* The runtime, refused where --int8-activations or --bf16-prefill meets a backend that keeps
 * section 5's products. */
static int open_runtime(const fg_policy *p, fg_runtime **rt, char *err) {
    if (fg_runtime_open(p, rt, err)) return -1;
    const char *flag = p->int8_activations ? "--int8-activations" : p->bf16_prefill ? "--bf16-prefill" : NULL;
    if (!flag || fg_runtime_backend(*rt)->gpu_is_host) return 0;
    fg_runtime_close(*rt);
    *rt = NULL;
    return fg_fail(err, "%s: the CPU backend's scheme; this run's device is CUDA, which "
                        "multiplies as section 5 does (give --device cpu)", flag);
}

/* This stage's runtime and model, its plan checked, its weights in their homes. */
static int open_stage(cli_args *a, fg_pipe *pipe, const prompt_set *p, fg_runtime **rt,
                      fg_model **m, char *err) {
    int rc = open_runtime(&a->policy, rt, err);
    if (rc == 0) fg_pipeline_attach(*rt, pipe), rc = fg_model_open(*rt, a->model, a->gen.seed, m, err);
    if (rc == 0) rc = check_prompts(fg_model_config(*m), p->n, p->ids, p->lens, a->gen.gen_len, err);
    if (rc == 0) rc = fg_check_plan(*m, p->n, a->output ? NULL : p->lens, longest_prompt(p), a->gen.gen_len, err);
    if (fg_pipe_agree(pipe, rc, err)) return -1;
    if (a->gen.verbose) fprintf(stderr, "%s: placing weights\n", fg_model_config(*m)->name);
    for (int r = 0; r < fg_pipe_size(pipe); r++) { /* a stage at a time: stages that share a machine
                                                      share its dummy-weight file, the first writes it */
        if (r == fg_pipe_rank(pipe)) rc = fg_model_load(*m, err);
        if (fg_pipe_agree(pipe, rc, err)) return -1;
    }
    return 0;
}

/* After the run: every stage's numbers and trace to rank 0, which writes the outputs and the
 * report. */
static int finish_job(const cli_args *a, fg_pipe *pipe, const fg_runtime *rt, const model_config *cfg,
                      const prompt_set *p, const fg_tokenizer *tok, const int *tokens, float *logits,
                      gen_timing *t, stage_report *all, char *err) {
    int rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe);
    size_t n_logits = (size_t)p->n * a->gen.gen_len * cfg->vocab;
    gather_logits(pipe, logits, logits ? n_logits : 0);
    stage_report mine = {.sent = fg_pipe_bytes_sent(pipe), .compute = t->compute_seconds,
                         .bubble = t->bubble_seconds, .disk_read = t->disk_read_seconds,
                         .peak_rss = peak_rss_bytes()};
    fg_runtime_stats(rt, &mine.st);
    fg_stage_layers(cfg, rank, stages, &mine.first_layer, &mine.end_layer);
    mine.percent = a->policy.percent;
    fg_pipe_gather(pipe, &mine, sizeof mine, all);
    char *events = a->trace ? fg_trace_events(&rt->trace, rank, stages) : NULL;
    char *trace = a->trace ? fg_pipe_gather_text(pipe, events ? events : "") : NULL;
    free(events);
    int rc = 0;
    if (rank == 0) {
        if (a->dump_logits) rc = dump_logits(a->dump_logits, logits, n_logits, err);
        if (rc == 0 && a->trace) rc = fg_trace_write_events(a->trace, trace, err);
        if (rc == 0 && tok && !a->json && !a->output) print_texts(tok, p, tokens, &a->gen);
        fg_stats st;
        t->compute_seconds = t->disk_read_seconds = 0;
        combine_stages(all, stages, &st, t);
        if (rc == 0) report(a, cfg, p, t, &st, longest_prompt(p), fg_runtime_backend(rt)->name, all, stages);
    }
    free(trace);
    return rc;
}

/* --json for a --resume that finds nothing left to do. */
static void report_finished_job(const char *output, int records) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "output", output);
    cJSON_AddNumberToObject(o, "records", records);
    cJSON_AddBoolToObject(o, "finished", 1);
    char *text = cJSON_PrintUnformatted(o);
    if (text) printf("%s\n", text);
    free(text);
    cJSON_Delete(o);
}

/* --warmup: a short generate before the timed one, as FlexGen's benchmark runs one, so that the
 * timed figures leave out first-time costs (a GPU's context, cuBLAS's handle, kernels loaded on
 * first use). A block of pseudo-random prompts of up to 32 tokens (no longer than the job's), 2
 * tokens generated so that a decode step runs too; its tokens are dropped (no record, no logits),
 * its trace too, and its latency is the report's cold run. */
static int warm_up(cli_args *a, fg_runtime *rt, fg_model *m, const prompt_set *p, int stages, char *err) {
    const model_config *c = fg_model_config(m);
    int n = a->policy.gpu_batch_size * a->policy.num_gpu_batches * stages, len = longest_prompt(p);
    if (n > p->n) n = p->n;
    if (n < 1) return 0; /* no prompt, nothing to warm up */
    if (len > 32) len = 32;
    int **ids = calloc((size_t)n, sizeof *ids), *lens = calloc((size_t)n, sizeof *lens);
    int gen_len = a->gen.gen_len < 2 ? a->gen.gen_len : 2;
    int *tokens = malloc((size_t)n * gen_len * sizeof *tokens), rc = 0;
    fg_rng rng;
    rng_seed(&rng, a->gen.seed ^ 0x3a4eULL);
    for (int i = 0; i < n && ids && lens; i++) {
        lens[i] = len;
        ids[i] = malloc((size_t)len * sizeof *ids[i]);
        if (!ids[i]) break;
        ids[i][0] = OPT_BOS_ID; /* as synthetic_prompts' */
        for (int t = 1; t < len; t++) ids[i][t] = 3 + (int)(rng_next(&rng) % (uint64_t)(c->vocab - 3));
    }
    for (int i = 0; i < n && rc == 0; i++) rc = !ids || !lens || !ids[i] ? fg_fail(err, "out of memory") : 0;
    if (rc == 0 && !tokens) rc = fg_fail(err, "out of memory");
    gen_options opt = {.gen_len = gen_len, .temperature = a->gen.temperature, .top_p = a->gen.top_p,
                       .seed = a->gen.seed, .n_eos = a->gen.n_eos};
    memcpy(opt.eos_ids, a->gen.eos_ids, sizeof opt.eos_ids);
    gen_timing t;
    if (rc == 0 && a->gen.verbose) fprintf(stderr, "warmup: %d prompts of %d tokens, %d generated\n", n, len, gen_len);
    if (rc == 0) rc = generate(m, &opt, n, ids, lens, tokens, NULL, &t, err);
    if (rc == 0) { /* the whole cold run: its decode step pays first-time costs too (a kernel first used there) */
        a->cold_prefill = t.prefill_latency, a->cold_decode = t.decode_latency;
        a->cold_seconds = t.prefill_latency + t.decode_latency;
    }
    fg_runtime_trace_restart(rt);
    for (int i = 0; ids && i < n; i++) free(ids[i]);
    free(ids);
    free(lens);
    free(tokens);
    return rc;
}

/* A run: one process, or (under mpirun) one pipeline stage of the job (§4.4). */
static int run(cli_args *a, fg_pipe *pipe, char *err) {
    fg_tokenizer *tok = NULL;
    prompt_set p = {0};
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    int *tokens = NULL, rc = 0, rank = fg_pipe_rank(pipe), stages = fg_pipe_size(pipe);
    float *logits = NULL;
    stage_report *all = NULL;
    gen_timing t;
    model_config cfg;
    job_output job = {.fd = -1};
    a->policy.stage = rank, a->policy.n_stages = stages;
    if (rank) a->gen.verbose = a->policy.verbose = 0; /* rank 0 speaks for the job */
    if (a->evaluate) rc = fg_fail(err, "--evaluate: a flag of `flexgen policy`");
    if (a->ppl_flag) rc = fg_fail(err, "%s: a flag of `flexgen perplexity`", a->ppl_flag);
    if (rc == 0 && pipe) rc = share_job(a, pipe, err);
    if (rc == 0 && a->gen.refill && stages > 1)
        rc = fg_fail(err, "--refill: refills one process's block; the stages of a pipeline keep theirs in step");
    if (rc == 0 && rank == 0 && a->dump_logits) rc = fg_output_check("--dump-logits", a->dump_logits, err);
    if (rc == 0 && rank == 0 && a->trace) rc = fg_output_check("--trace", a->trace, err);
    if (rc == 0) {
        a->policy.device = resolve_device(a->policy.device, a->gen.verbose);
        rc = resolve_model_config(a->model, &cfg, err);
        if (rc == 0 && rank == 0) warn_special_ids(a->model, &cfg);
        if (rc == 0) rc = check_lengths(a, &cfg, err);
        if (rc == 0) set_eos(&a->gen, &cfg);
    }
    if (fg_pipe_agree(pipe, rc, err) || job_prompts(a, pipe, &cfg, &tok, &p, &job, err)) {
        rc = -1;
        goto out;
    }
    if (a->job_finished) { /* --resume of a job whose every prompt has its record */
        if (rank == 0 && a->json) report_finished_job(a->output, job.n_done);
        else if (rank == 0 && !a->quiet) fprintf(stderr, "job: every prompt has its record in %s\n", a->output);
        goto out;
    }
    if (open_stage(a, pipe, &p, &rt, &m, err)) {
        rc = -1;
        goto out;
    }
    int keeps_logits = a->dump_logits && (rank == 0 || rank == stages - 1);
    tokens = malloc((size_t)p.n * a->gen.gen_len * sizeof *tokens);
    if (keeps_logits) logits = malloc((size_t)p.n * a->gen.gen_len * cfg.vocab * sizeof *logits);
    all = calloc((size_t)stages, sizeof *all);
    rc = !tokens || (keeps_logits && !logits) || !all ? fg_fail(err, "out of memory") : 0;
    if (rc == 0 && a->warmup) rc = warm_up(a, rt, m, &p, stages, err);
    if (fg_pipe_agree(pipe, rc, err) ||
        (a->output ? run_rounds(a, pipe, m, &p, tok, &job, tokens, &t, err)
                   : generate(m, &a->gen, p.n, p.ids, p.lens, tokens, logits, &t, err))) {
        rc = -1;
        goto out;
    }
    rc = finish_job(a, pipe, rt, fg_model_config(m), &p, tok, tokens, logits, &t, all, err);
out:
    fg_model_close(m);
    fg_runtime_close(rt);
    prompts_free(&p);
    if (tok) tokenizer_free(tok);
    free(tokens);
    free(logits);
    free(all);
    job_output_close(&job);
    return rc;
}

/* Flags a subcommand has no use for: refused, not ignored. */
static int refuse_flags(const char *command, const char *const *flags, int argc, char **argv, char *err) {
    for (int i = 2; i < argc; i++)
        for (int j = 0; flags[j]; j++)
            if (!strcmp(argv[i], flags[j])) return fg_fail(err, "%s: not a flag of `flexgen %s`", argv[i], command);
    return 0;
}

/* Each schedule's best policy (block shape) and prediction; null where it was not searched or none fits. */
static cJSON *schedules_json(const fg_search_result *r) {
    cJSON *all = cJSON_CreateObject();
    for (int k = 0; k < FG_SCHEDULES; k++) {
        if (!r->best[k].found) { cJSON_AddNullToObject(all, fg_schedule_names[k]); continue; }
        cJSON *o = cJSON_AddObjectToObject(all, fg_schedule_names[k]);
        cJSON_AddNumberToObject(o, "gpu_batch_size", r->best[k].policy.gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", r->best[k].policy.num_gpu_batches);
        cJSON_AddNumberToObject(o, "predicted_throughput", r->best[k].throughput);
        cJSON_AddNumberToObject(o, "block_latency", r->best[k].block_latency);
    }
    return all;
}

/* The capacities the plan used: each tier's, and *host, the host memory that the gpu and cpu tiers
 * share on the CPU backend of this machine (0: no such bound). */
static void planned_capacities(const cli_args *a, const fg_hardware *hw, double cap[N_TIERS], double *host) {
    int here = hardware_is_here(hw, a->policy.device);
    for (int t = 0; t < N_TIERS; t++) cap[t] = here ? searched_capacities.capacity[t] : a->policy.capacity[t];
    *host = here && hw->gpu_is_host ? searched_capacities.host_memory : 0;
}

/* The plan's capacities in the JSON report: "capacity" in bytes, "host_memory" (null: none), and
 * whether the gpu and cpu tiers were cut to it. */
static void add_capacities_json(cJSON *o, const double cap[N_TIERS], double host) {
    cJSON *c = cJSON_CreateObject();
    for (int t = 0; t < N_TIERS; t++) cJSON_AddNumberToObject(c, fg_tier_names[t], cap[t]);
    cJSON_AddItemToObject(o, "capacity", c);
    if (host > 0) cJSON_AddNumberToObject(o, "host_memory", host);
    else cJSON_AddNullToObject(o, "host_memory");
    cJSON_AddBoolToObject(o, "cut_to_host_memory", host > 0 && cap[TIER_GPU] + cap[TIER_CPU] > host);
}

/* In the text report, a line where the host's memory cut what the gpu and cpu tiers were given. */
static void print_capacity_cut(const double cap[N_TIERS], double host) {
    if (!(host > 0 && cap[TIER_GPU] + cap[TIER_CPU] > host)) return;
    printf("capacity: gpu %s, cpu %s, disk %s; the gpu and cpu tiers together within %s of host memory (a "
           "sixteenth of the machine's memory is kept for the system)\n", human(cap[TIER_GPU]).s,
           human(cap[TIER_CPU]).s, human(cap[TIER_DISK]).s, human(host).s);
}

/* flexgen policy: the search's choice, its prediction and the terms that bound it. */
static int policy_command(cli_args *a, char *err) {
    model_config cfg;
    fg_search_result r;
    fg_tokenizer *tok = NULL;
    prompt_set prompts = {0};
    int rc = a->ppl_flag ? fg_fail(err, "%s: a flag of `flexgen perplexity`", a->ppl_flag) : 0;
    if (rc == 0) rc = resolve_model_config(a->model, &cfg, err);
    if (rc == 0) warn_special_ids(a->model, &cfg);
    if (rc == 0) rc = open_tokenizer(a, &tok, err);
    if (rc == 0) rc = gather_prompts(a, tok, cfg.vocab, &prompts, err); /* given ones bound the block */
    fg_hardware hw;
    if (rc == 0) rc = load_hardware(a, &hw, err);
    if (rc == 0 && a->policy.device == FG_DEVICE_AUTO && hw.gpu_is_host) a->policy.device = FG_DEVICE_CPU;
    int lengths[2] = {longest_prompt(&prompts), mean_prompt(a, &prompts)};
    if (rc == 0) rc = search_policy(a, &hw, &cfg, prompts.n, lengths, 0, 0, &r, err);
    prompts_free(&prompts);
    if (tok) tokenizer_free(tok);
    if (rc) return -1;
    const fg_policy *p = &r.policy;
    double cap[N_TIERS], host;
    planned_capacities(a, &hw, cap, &host);
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "gpu_batch_size", p->gpu_batch_size);
        cJSON_AddNumberToObject(o, "num_gpu_batches", p->num_gpu_batches);
        cJSON_AddItemToObject(o, "percent", percent_json(&p->percent));
        cJSON_AddBoolToObject(o, "cpu_cache_compute", p->cpu_cache_compute);
        cJSON_AddNumberToObject(o, "predicted_throughput", r.throughput);
        cJSON_AddNumberToObject(o, "block_latency", r.block_latency);
        cJSON_AddNumberToObject(o, "t_pre", r.t_pre);
        cJSON_AddNumberToObject(o, "t_gen", r.t_gen);
        cJSON_AddItemToObject(o, "placement", cJSON_CreateDoubleArray(r.x, N_X));
        cJSON_AddNumberToObject(o, "search_seconds", r.seconds);
        cJSON_AddNumberToObject(o, "lps", r.lps);
        cJSON_AddStringToObject(o, "schedule", fg_schedule_names[p->schedule]);
        if (!a->evaluate) cJSON_AddItemToObject(o, "schedules", schedules_json(&r));
        add_capacities_json(o, cap, host);
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        return 0;
    }
    printf("policy: ");
    print_policy_flags(stdout, p);
    printf("\npredicted: %.4g token/s, a block of %d sequences in %.4g s\n", r.throughput,
           p->gpu_batch_size * p->num_gpu_batches, r.block_latency);
    printf("placement (gpu/cpu/disk %%): weights %.0f/%.0f/%.0f  cache %.0f/%.0f/%.0f  "
           "activations %.0f/%.0f/%.0f\n", 100 * r.x[0], 100 * r.x[1], 100 * r.x[2], 100 * r.x[3],
           100 * r.x[4], 100 * r.x[5], 100 * r.x[6], 100 * r.x[7], 100 * r.x[8]);
    int host_measured = hw.launch_seconds > 0 || hw.wait_seconds > 0; /* a GPU's, profiled */
    int terms_shown = host_measured ? N_TERMS : T_HOST;
    printf("per layer (s)");
    for (int i = 0; i < terms_shown; i++) printf("%11s", fg_cost_term_names[i]);
    printf("   bound\n");
    for (int phase = 0; phase < 2; phase++) {
        const fg_linear *terms = phase ? r.cost.gen : r.cost.pre;
        int arg = 0;
        printf("%-13s", phase ? "decode" : "prefill");
        for (int i = 0; i < terms_shown; i++) {
            double v = fg_linear_eval(&terms[i], r.x);
            printf("%11.4g", v);
            if (v > fg_linear_eval(&terms[arg], r.x)) arg = i;
        }
        printf("   %s\n", fg_cost_term_names[arg]);
    }
    for (int k = 0, shown = 0; k < FG_SCHEDULES && !a->evaluate; k++) /* each one searched that fits */
        if (r.best[k].found)
            printf("%s%s: %.4g token/s, a block of %d x %d", shown++ ? ", " : "schedules: ", fg_schedule_names[k],
                   r.best[k].throughput, r.best[k].policy.gpu_batch_size, r.best[k].policy.num_gpu_batches);
    if (!a->evaluate) printf("\n");
    if (!a->evaluate) printf("search: %d LPs, %d plans checked, %.3f s\n", r.lps, r.checks, r.seconds);
    print_capacity_cut(cap, host);
    return 0;
}

/* flexgen profile: measures this machine and saves the hardware file. */
static int profile_command(int argc, char **argv, char *err) {
    const char *dir = FG_DEFAULT_OFFLOAD_DIR, *out = NULL;
    char path[4200];
    fg_device device = FG_DEVICE_AUTO;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(stdout); return 1; }
        if (strcmp(argv[i], "--offload-dir") && strcmp(argv[i], "--out") && strcmp(argv[i], "--device"))
            return fg_fail(err, "%s: unknown option for profile", argv[i]);
        if (i + 1 >= argc) return fg_fail(err, "%s: missing value", argv[i]);
        if (!strcmp(argv[i], "--offload-dir")) dir = argv[++i];
        else if (!strcmp(argv[i], "--out")) out = argv[++i];
        else if (!strcmp(argv[i], "--device")) {
            if (parse_device(argv[++i], &device, err)) return -1;
        }
    }
    if (!out) {
        if (default_hw_file(path, sizeof path, err)) return -1;
        out = path;
    }
    char parent[4200];
    snprintf(parent, sizeof parent, "%s", out);
    char *slash = strrchr(parent, '/');
    if (slash) *(slash == parent ? slash + 1 : slash) = 0;
    if (access(slash ? parent : ".", W_OK | X_OK) != 0) /* before a minute of measuring */
        return fg_fail(err, "--out %s: cannot write there: %s", out, strerror(errno));
    fg_hardware hw;
    if (check_dir("--offload-dir", dir, err)) return -1;
    device = resolve_device(device, 1);
    if (fg_profile(dir, device, &hw, 1, err) || fg_hardware_write(out, &hw, err)) return -1;
    printf("cpu->gpu %.2f GiB/s, gpu->cpu %.2f GiB/s, disk->cpu %.3f GiB/s, cpu->disk %.3f GiB/s\n",
           hw.ctog_bdw / GB, hw.gtoc_bdw_hidden / GB, hw.dtoc_bdw / GB, hw.ctod_bdw_g / GB);
    printf("matrix products %.1f (prefill) %.1f (decode) GFLOP/s, attention %.1f (prefill) %.1f "
           "(decode) GFLOP/s, weights read %.2f GiB/s, 4-bit decompression %.2f GiB/s of fp16\n",
           hw.mm_flops_p / 1e9, hw.mm_flops_g / 1e9, hw.bmm_flops_p / 1e9, hw.bmm_flops_g / 1e9,
           hw.mem_bdw / GB, hw.dequant_bdw / GB);
    if (hw.mm_flops_int8_g > 0)
        printf("4-bit x int8 products %.1f (prefill) %.1f (decode) GFLOP/s\n", hw.mm_flops_int8_p / 1e9,
               hw.mm_flops_int8_g / 1e9);
    if (!hw.gpu_is_host)
        printf("the host: %.2f us to queue a launch, %.1f us to wait for the GPU\n", hw.launch_seconds * 1e6,
               hw.wait_seconds * 1e6);
    printf("saved %s (the products on OpenBLAS's %s core)\n", out, hw.blas_core);
    return 0;
}

/* flexgen tokenize: a tokenizer from --vocab and --merges, --tokenizer FILE.json, or --model DIR. */
static fg_tokenizer *tokenize_tokenizer(const char *vocab, const char *merges, const char *json,
                                        const char *model, char *err) {
    if ((vocab || merges) + !!json + !!model != 1 || !vocab != !merges) {
        fg_fail(err, "tokenize: give --vocab and --merges, or --tokenizer FILE.json, or --model DIR");
        return NULL;
    }
    if (vocab) return tokenizer_load(vocab, merges, err);
    if (json) return tokenizer_load_json(json, err);
    fg_tokenizer *t = tokenizer_load_dir(model, err);
    if (!t && !err[0]) fg_fail(err, "--model %s: no tokenizer.json, and no vocab.json and merges.txt", model);
    return t;
}

static int tokenize_command(int argc, char **argv, char *err) {
    static const char *const flags[] = {"--vocab", "--merges", "--tokenizer", "--model"};
    const char *value[4] = {0};
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--help")) { usage(stdout); return 0; }
        int k = 0;
        while (k < 4 && strcmp(argv[i], flags[k])) k++;
        if (k == 4) return fg_fail(err, "%s: unknown option for tokenize", argv[i]);
        if (i + 1 >= argc) return fg_fail(err, "%s: missing value", argv[i]);
        value[k] = argv[++i];
    }
    fg_tokenizer *tok = tokenize_tokenizer(value[0], value[1], value[2], value[3], err);
    if (!tok) return -1;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = 0;
    while (rc == 0 && (len = getline(&line, &cap, stdin)) >= 0) {
        if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
        int *ids, n;
        rc = tokenizer_encode(tok, line, (size_t)len, &ids, &n, err);
        for (int i = 0; rc == 0 && i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        if (rc == 0) { printf("\n"); free(ids); }
    }
    free(line);
    tokenizer_free(tok);
    return rc;
}

/* ---- flexgen perplexity (perplexity.c) ---- */

/* The flags that flexgen policy and flexgen perplexity have no use for: the outputs of a run, and
 * (perplexity) generation's. */
static int check_command_flags(const char *command, int argc, char **argv, char *err) {
    /* a plan depends on none of a run's outputs, its warm-up run, its sampling or --policy's choice */
    static const char *const policy[] = {"--output", "--resume", "--trace", "--dump-logits", "--warmup",
        "--temperature", "--top-p", "--seed", "--policy", NULL};
    static const char *const perplexity[] = {"--prompt", "--prompt-file", "--prompt-ids", "--prompt-len",
        "--gen-len", "--temperature", "--top-p", "--stop-at-eos", "--refill", "--dump-logits", "--policy",
        "--max-latency", "--hw", "--evaluate", "--output", "--resume", "--trace", "--schedule", "--warmup", NULL};
    return refuse_flags(command, !strcmp(command, "policy") ? policy : perplexity, argc, argv, err);
}

/* BOS + the tokens of the text file at path. */
static int read_text_ids(const fg_tokenizer *tok, const char *path, int **ids, int *n, char *err) {
    size_t size;
    char *text = fg_read_file(path, &size, err);
    if (!text) return -1;
    prompt_set p = {0};
    int rc = memchr(text, 0, size) ? fg_fail(err, "--text %s: a NUL byte: not a text file", path)
                                   : add_text_prompt(&p, tok, text, size, NULL, err);
    free(text);
    if (rc == 0) *ids = p.ids[0], *n = p.lens[0], p.ids[0] = NULL; /* the rest is freed */
    prompts_free(&p);
    return rc;
}

/* Where the tokenizer came from, as the user named it: the flag and its file, or the model
 * directory's file. */
static void tokenizer_origin(const cli_args *a, char *out, size_t n) {
    char json[FG_PATH_LEN + 32];
    snprintf(json, sizeof json, "%s/tokenizer.json", a->model);
    if (a->tokenizer) snprintf(out, n, "--tokenizer %s", a->tokenizer);
    else if (a->vocab) snprintf(out, n, "--vocab %s", a->vocab);
    else if (access(json, F_OK) == 0) snprintf(out, n, "%s", json);
    else snprintf(out, n, "%s/vocab.json", a->model);
}

/* Every id of the text within the model's vocab: a tokenizer of a bigger vocab is named. */
static int check_text_ids(const cli_args *a, const int *ids, int n, int vocab, char *err) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) {
            char origin[FG_PATH_LEN + 64];
            tokenizer_origin(a, origin, sizeof origin);
            return fg_fail(err, "%s: token id %d of --text %s is out of range [0, %d) (the model's vocab_size)",
                           origin, ids[i], a->text, vocab);
        }
    return 0;
}

/* Another run's --predictions: one token id a line, as many as the text has scored tokens. */
static int read_predictions(const char *path, int scored, int vocab, int *ref, char *err) {
    size_t size;
    char *text = fg_read_file(path, &size, err), why[FG_ERR_LEN];
    if (!text) return snprintf(why, sizeof why, "%s", err), fg_fail(err, "--compare %s", why);
    int n = 0, line_no = 0, rc = 0;
    for (char *line = text, *end; rc == 0 && line < text + size; line = end + 1) {
        end = memchr(line, '\n', (size_t)(text + size - line));
        if (!end) end = text + size;
        char *after;
        errno = 0;
        long v = strtol(line, &after, 10);
        after += strspn(after, " \t\r");
        line_no++;
        if (after == line || after != end || errno || v < 0 || v >= vocab)
            rc = fg_fail(err, "--compare %s line %d: expected one token id in [0, %d)", path, line_no, vocab);
        else if (n < scored) ref[n++] = (int)v;
        else n++;
    }
    free(text);
    if (rc == 0 && n != scored)
        rc = fg_fail(err, "--compare %s: %d predictions, but the text has %d scored tokens", path, n, scored);
    return rc;
}

static int write_predictions(const char *path, const int *top1, int n, char *err) {
    fg_output o;
    if (fg_output_open(&o, "--predictions", path, err)) return -1;
    for (int i = 0; i < n; i++) fprintf(o.f, "%d\n", top1[i]);
    return fg_output_commit(&o, err);
}

static void report_perplexity(const cli_args *a, const ppl_result *r, int agree, const char *device) {
    const char *mode = a->ppl.decode ? "decode" : "prefill";
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "perplexity", r->perplexity);
        cJSON_AddNumberToObject(o, "nll_per_token", r->nll / (double)r->scored);
        cJSON_AddNumberToObject(o, "scored_tokens", (double)r->scored);
        cJSON_AddNumberToObject(o, "windows", r->windows);
        cJSON_AddNumberToObject(o, "window", r->window);
        cJSON_AddNumberToObject(o, "stride", r->stride);
        cJSON_AddStringToObject(o, "mode", mode);
        cJSON_AddStringToObject(o, "device", device);
        cJSON_AddNumberToObject(o, "seconds", r->seconds);
        if (a->compare) cJSON_AddNumberToObject(o, "top1_agreement", (double)agree / (double)r->scored);
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        return;
    }
    printf("perplexity: %.4f over %ld tokens (%.5f nats each)\n", r->perplexity, r->scored,
           r->nll / (double)r->scored);
    printf("windows: %d of %d tokens advancing %d, scored in %s on %s, %.2f s\n", r->windows,
           r->window, r->stride, mode, device, r->seconds);
    if (a->compare)
        printf("top-1 agreement with %s: %.4f (%d of %ld)\n", a->compare, (double)agree / (double)r->scored,
               agree, r->scored);
}

/* flexgen perplexity: a text's perplexity under the model with the run's policy. */
static int perplexity_command(cli_args *a, char *err) {
    fg_tokenizer *tok = NULL;
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    int *ids = NULL, *top1 = NULL, *ref = NULL, n = 0, agree = 0;
    model_config cfg;
    ppl_result r;
    int rc = 0;
    if (!a->text) rc = fg_fail(err, "perplexity: --text FILE is required");
    if (rc == 0 && a->predictions) rc = fg_output_check("--predictions", a->predictions, err);
    if (rc == 0) rc = resolve_model_config(a->model, &cfg, err);
    if (rc == 0) warn_special_ids(a->model, &cfg);
    if (rc == 0) rc = open_tokenizer(a, &tok, err);
    if (rc == 0 && !tok)
        rc = fg_fail(err, "perplexity needs a tokenizer: give --vocab and --merges, or a model "
                          "directory holding vocab.json and merges.txt");
    if (rc == 0) rc = read_text_ids(tok, a->text, &ids, &n, err);
    if (rc == 0) rc = check_text_ids(a, ids, n, cfg.vocab, err);
    if (rc == 0 && a->compare && !(ref = malloc((size_t)n * sizeof *ref))) rc = fg_fail(err, "out of memory");
    if (rc == 0 && a->compare) rc = read_predictions(a->compare, n - 1, cfg.vocab, ref, err);
    if (rc == 0 && !(top1 = malloc((size_t)n * sizeof *top1))) rc = fg_fail(err, "out of memory");
    if (rc == 0) {
        a->policy.device = resolve_device(a->policy.device, a->gen.verbose);
        rc = open_runtime(&a->policy, &rt, err);
    }
    if (rc == 0) rc = fg_model_open(rt, a->model, a->gen.seed, &m, err);
    a->ppl.verbose = a->gen.verbose;
    if (rc == 0) rc = fg_perplexity(m, ids, n, &a->ppl, top1, &r, err);
    if (rc == 0 && a->predictions) rc = write_predictions(a->predictions, top1, n - 1, err);
    for (int i = 0; rc == 0 && ref && i < n - 1; i++) agree += ref[i] == top1[i];
    if (rc == 0) report_perplexity(a, &r, agree, fg_runtime_backend(rt)->name);
    fg_model_close(m);
    fg_runtime_close(rt);
    if (tok) tokenizer_free(tok);
    free(ids);
    free(top1);
    free(ref);
    return rc;
}

int flexgen_main(int argc, char **argv) {
    char err[FG_ERR_LEN] = "";
    fg_pipe *pipe = NULL;
    int rc = fg_pipe_open(&argc, &argv, &pipe, err);
    fg_install_signal_handlers(); /* after a stage's crash handlers, which it passes on to */
    const char *command = argc > 1 ? argv[1] : "";
    int one_process = !strcmp(command, "tokenize") || !strcmp(command, "profile") ||
                      !strcmp(command, "policy") || !strcmp(command, "perplexity");
    if (rc == 0 && pipe && one_process) { /* every rank sees it; rank 0 says it */
        rc = fg_fail(err, "flexgen %s runs in one process: start it without mpirun", command);
        if (fg_pipe_rank(pipe)) err[0] = 0;
    }
    if (rc == 0) rc = fg_isa_check_env(err); /* FLEXGEN_ISA, before any kernel runs */
    if (rc == 0) rc = fg_blas_core_check_env(err); /* OPENBLAS_CORETYPE, before any product */
    /* A stage of a pipeline that refuses its FLEXGEN_ISA or OPENBLAS_CORETYPE still takes part in
     * the stages' agreement below: leaving early would leave the others waiting in it for ever. */
    int stages_agree = pipe && !one_process;
    if (rc && !stages_agree) {
    } else if (argc > 1 && !strcmp(argv[1], "tokenize")) {
        rc = tokenize_command(argc, argv, err);
    } else if (argc > 1 && !strcmp(argv[1], "profile")) {
        rc = profile_command(argc, argv, err);
        if (rc == 1) return 0;
    } else {
        int policy = argc > 1 && !strcmp(argv[1], "policy");
        int perplexity = argc > 1 && !strcmp(argv[1], "perplexity");
        cli_args a = {0};
        if (rc == 0 && (policy || perplexity)) rc = check_command_flags(argv[1], argc, argv, err);
        if (rc == 0) rc = parse_args(argc - policy - perplexity, argv + policy + perplexity, &a, err);
        if (rc == 1) {
            if (fg_pipe_rank(pipe) == 0) usage(stdout);
            rc = 0;
        } else if (fg_pipe_agree(pipe, rc, err)) { /* a bad flag on any stage stops them all */
            rc = -1;
        } else {
            rc = policy ? policy_command(&a, err) : perplexity ? perplexity_command(&a, err)
                                                               : run(&a, pipe, err);
        }
        free(a.prompts);
    }
    fg_pipe_close(pipe);
    if (rc) {
        if (err[0]) fprintf(stderr, "flexgen: %s\n", err);
        return 2;
    }
    int e = fflush(stdout) != 0 ? errno : ferror(stdout) ? EIO : 0;
    if (e) fprintf(stderr, "flexgen: standard output: write failed: %s\n", e == EIO ? "an I/O error" : strerror(e));
    return e ? 1 : 0;
}

#ifndef FLEXGEN_NO_MAIN
/* OpenMP threads that wait for work spin before they sleep, 300,000 rounds in libgomp. Beside
 * another busy process on the cores that spinning takes the time its threads need: two runs at
 * once each decoded at a tenth of their speed alone (BENCHMARKS.md, "Beside a busy neighbour").
 * 1000 rounds, libgomp's own figure for more threads than cores, keeps the speed alone and about
 * half of it beside a neighbour. libgomp reads GOMP_SPINCOUNT once, as it loads, so a run given
 * neither it nor OMP_WAIT_POLICY starts itself again with it set (and runs on if it cannot). */
static int short_openmp_spin(void) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT")) return 0;
    setenv("GOMP_SPINCOUNT", "1000", 1);
    return 1;
}

/* Both variables are read as the libraries load, so one new start takes both: OpenBLAS's core
 * where it picked one of an older instruction set than this CPU has (blas_core.c), and the spin. */
int main(int argc, char **argv) {
    /* A file size limit (ulimit -f) is a full disk to every write: EFBIG, reported with one line
     * and the write taken back, where SIGXFSZ would kill the run mid-write. */
    signal(SIGXFSZ, SIG_IGN);
    const char *core = fg_blas_core_force();
    int spin = short_openmp_spin();
    if (core || spin) {
        execv("/proc/self/exe", argv);
        if (core) fg_blas_core_unforce(core, errno);
    }
    return flexgen_main(argc, argv);
}
#endif

