/* app/plan.c: what a run, `flexgen policy` and `flexgen perplexity` share before they run: the
 * model's configuration and the lengths it allows, the device, the hardware file of the cost
 * model, the policy search's request for the command line (§4.3), and the runtime opened for the
 * policy.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* *d as run: auto is CUDA when a GPU is there, else the CPU, saying why (with progress on, and
 * when this build has CUDA; the report names the device either way). Where CUDA may run, its
 * FLEXGEN_CUDA_* settings are read first: one this build cannot read is refused (-1, err). */
int resolve_device(fg_device *d, int verbose, char *err) {
    char why[FG_ERR_LEN];
    if (*d == FG_DEVICE_CPU || *d == FG_DEVICE_CPU_FP16) return 0;
    if (fg_cuda_settings(err)) return -1; /* a misspelt setting is refused, not run on the CPU */
    if (*d != FG_DEVICE_AUTO) return 0;
    *d = fg_cuda_backend(why) ? FG_DEVICE_CUDA : FG_DEVICE_CPU;
    if (*d == FG_DEVICE_CPU && verbose && fg_cuda_compiled())
        fprintf(stderr, "flexgen: %s; running on the CPU backend\n", why);
    return 0;
}

/* A device as --device names it. */
const char *fg_device_name(fg_device d) {
    return d == FG_DEVICE_CUDA       ? "cuda"
           : d == FG_DEVICE_CPU_FP16 ? "cpu-fp16"
           : d == FG_DEVICE_AUTO     ? "auto"
                                     : "cpu";
}

/* The configuration of --model without opening its weights. */
int resolve_model_config(const char *model, model_config *cfg, char *err) {
    if (!is_dir(model)) return model_config_by_name(model, cfg, err);
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", model);
    if (model_config_from_json(path, cfg, err)) return -1;
    snprintf(cfg->name, sizeof cfg->name, "%s", model);
    return 0;
}

/* One line on stderr for each file whose bos_token_id or eos_token_id is not a token of the model
 * (not below vocab_size): the model never generates it, so a sequence never ends on that id. The
 * eos ids are generation_config.json's where that file is there (as the checkpoint reader takes
 * them), else config.json's; OPT's BOS is its table's. */
void warn_special_ids(const char *model, const model_config *cfg) {
    if (!is_dir(model)) return;
    char generation[4200];
    snprintf(generation, sizeof generation, "%s/generation_config.json", model);
    int eos_file = access(generation, F_OK) == 0; /* 0: config.json, 1: generation_config.json */
    char ids[2][256] = {"", ""};
    size_t n[2] = {0, 0};
    int count[2] = {0, 0};
    if (cfg->family != FAMILY_OPT && cfg->bos_id >= cfg->vocab) {
        n[0] += (size_t)snprintf(ids[0], sizeof ids[0], "bos_token_id %d", cfg->bos_id);
        count[0]++;
    }
    for (int i = 0; i < cfg->n_eos; i++) {
        size_t *used = &n[eos_file];
        if (cfg->eos_ids[i] < cfg->vocab || *used >= sizeof ids[0]) continue;
        *used += (size_t)snprintf(ids[eos_file] + *used, sizeof ids[0] - *used, "%seos_token_id %d",
                                  *used ? ", " : "", cfg->eos_ids[i]);
        count[eos_file]++;
    }
    static const char *const files[] = {"config.json", "generation_config.json"};
    for (int f = 0; f < 2; f++)
        if (count[f])
            fprintf(stderr,
                    "flexgen: warning: %s/%s: %s %s not below vocab_size %d: the model has no "
                    "such token\n",
                    model, files[f], ids[f], count[f] > 1 ? "are" : "is", cfg->vocab);
}

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

/* The default hardware file, ~/.cache/flexgen/hardware.json. */
void default_hw_path(char *path, size_t n) {
    char dir[4096];
    default_weight_dir(dir, sizeof dir);
    snprintf(path, n, "%s/hardware.json", dir);
}

/* The default hardware file, its directory made if need be (a run that fails takes it away
 * again: fg_remove_made_dirs). */
int default_hw_file(char *path, size_t n, char *err) {
    char dir[4096];
    default_weight_dir(dir, sizeof dir);
    if (mkdir_p(dir)) return fg_fail(err, "%s: cannot create: %s", dir, strerror(errno));
    default_hw_path(path, n);
    return 0;
}

/* --hw FILE, or the default hardware file, measuring this machine once when there is none (a
 * file that could not be written is said before the measuring; its steps are shown as a run's
 * progress is). */
int load_hardware(const cli_args *a, fg_hardware *hw, char *err) {
    if (a->hw) return fg_hardware_read(a->hw, hw, err) ? fg_fail_flag(err, "--hw") : 0;
    char path[4200];
    if (default_hw_file(path, sizeof path, err)) return -1;
    if (file_exists(path)) return fg_hardware_read(path, hw, err);
    if (fg_output_check("hardware file", path, err)) return -1;
    const char *offload = a->policy.offload_dir ? a->policy.offload_dir : FG_DEFAULT_OFFLOAD_DIR;
    fprintf(stderr,
            "flexgen: no hardware file yet: profiling this machine once (about 30 s), "
            "saved to %s\n",
            path);
    if (fg_profile(offload, a->policy.device, hw, a->gen.verbose, err) ||
        fg_hardware_write(path, hw, err))
        return -1;
    return 0;
}

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

static int check_keeping_capacities(const model_config *model, uint64_t seed, const fg_policy *p,
                                    int sequences, int s, int n, int check, double x[N_X],
                                    fg_stats *st, char *err) {
    int rc = fg_runtime_check(model, seed, p, sequences, s, n, check, x, st, err);
    if (st) searched_capacities = *st;
    return rc;
}

/* --gen-len and --prompt-len against the model's positions and its sliding window (attention
 * beyond it is not implemented), before anything is sized by them (given prompts are checked one
 * by one once they are read: check_prompts). */
int check_lengths(const cli_args *a, const model_config *cfg, char *err) {
    int given = a->prompt_ids || a->prompt_file || a->n_prompt_texts,
        least = given ? 1 : a->prompt_len;
    if (a->gen.gen_len - 1 > cfg->max_pos - least && given) /* the last token is not fed back */
        return fg_fail(err,
                       "--gen-len %d: even a one-token prompt needs %d positions (the last token "
                       "generated is not fed back); the model has %d",
                       a->gen.gen_len, a->gen.gen_len, cfg->max_pos);
    if (a->gen.gen_len - 1 > cfg->max_pos - least)
        return fg_fail(
            err,
            "--prompt-len %d + --gen-len %d need %lld positions (the last token generated is "
            "not fed back); the model has %d",
            least, a->gen.gen_len, (long long)least + a->gen.gen_len - 1, cfg->max_pos);
    if (cfg->window && !given && a->gen.gen_len - 1 > cfg->window - least)
        return fg_fail(err,
                       "--prompt-len %d + --gen-len %d need %lld positions, beyond the model's "
                       "sliding_window %d (sliding-window attention is not implemented)",
                       least, a->gen.gen_len, (long long)least + a->gen.gen_len - 1, cfg->window);
    return 0;
}

/* The policy search's request for this command line: n_prompts given (0: synthetic, any
 * block), the longest of them (0: --prompt-len), their mean length (0: not known). The plan
 * check holds the longest; the costs take the mean. */
int search_policy(const cli_args *a, const fg_hardware *hw, const model_config *cfg, int n_prompts,
                  const int lengths[2], int gbs, int ngb, fg_search_result *res, char *err) {
    int diagonal_runs = !a->gen.refill; /* it refills its GPU batches itself */
    fg_search_request req = {
        .s = lengths[0] ? lengths[0] : a->prompt_len,
        .s_mean = lengths[1],
        .n = a->gen.gen_len,
        .max_block = n_prompts,
        .max_latency = a->max_latency,
        .check = hardware_is_here(hw, a->policy.device) ? check_keeping_capacities : NULL,
        .place = fg_runtime_check,
        .seed = a->gen.seed,
        .gbs = gbs,
        .ngb = ngb,
        .schedules = a->schedule_given
                         ? 1 << a->policy.schedule
                         : 1 << FG_SCHEDULE_ZIGZAG | diagonal_runs << FG_SCHEDULE_DIAGONAL,
        .stream_blocks = a->output ? JOB_WINDOW : 0};
    if (a->evaluate) return fg_policy_evaluate(cfg, hw, &a->policy, &req, res, err);
    return fg_policy_search(cfg, hw, &a->policy, &req, res, err);
}

void print_policy_flags(FILE *out, const fg_policy *p) {
    fprintf(out,
            "--gpu-batch-size %d --num-gpu-batches %d --percent %d %d %d %d %d %d%s --schedule %s",
            p->gpu_batch_size, p->num_gpu_batches, p->percent.wg, p->percent.wc, p->percent.cg,
            p->percent.cc, p->percent.hg, p->percent.hc,
            p->cpu_cache_compute ? " --cpu-cache-compute" : "", fg_schedule_names[p->schedule]);
}

/* The runtime, refused where --int8-activations or --bf16-prefill meets a backend that keeps
 * section 5's products. */
int open_runtime(const fg_policy *p, fg_runtime **rt, char *err) {
    if (fg_runtime_open(p, rt, err)) return -1;
    const char *flag = p->int8_activations ? "--int8-activations"
                       : p->bf16_prefill   ? "--bf16-prefill"
                                           : NULL;
    if (!flag || fg_runtime_backend(*rt)->gpu_is_host) return 0;
    fg_runtime_close(*rt);
    *rt = NULL;
    return fg_fail(err,
                   "%s: the CPU backend's scheme; this run's device is CUDA, which "
                   "multiplies as section 5 does (give --device cpu)",
                   flag);
}

/* The capacities the plan used: each tier's, and *host, the host memory that the gpu and cpu tiers
 * share on the CPU backend of this machine (0: no such bound). */
void planned_capacities(const cli_args *a, const fg_hardware *hw, double cap[N_TIERS],
                        double *host) {
    int here = hardware_is_here(hw, a->policy.device);
    for (int t = 0; t < N_TIERS; t++)
        cap[t] = here ? searched_capacities.capacity[t] : a->policy.capacity[t];
    *host = here && hw->gpu_is_host ? searched_capacities.host_memory : 0;
}
