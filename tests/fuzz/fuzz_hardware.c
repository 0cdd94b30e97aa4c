/* fuzz_hardware.c: fuzzer bytes as a hardware file (fg_hardware_read); the constants it accepts
 * then drive the cost model: a given policy is evaluated (fg_policy_evaluate) and the placement
 * for a given block shape is searched (fg_policy_search: its LPs), for opt-1.3b on a stated
 * machine. A prediction must be finite, and a failure must say why. */
#define _GNU_SOURCE
#include "fuzz.h"

#include <math.h>

static model_config cfg;
static fg_policy policy;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    char err[FG_ERR_LEN];
    if (model_config_by_name("opt-1.3b", &cfg, err)) abort();
    policy = fg_default_policy();
    policy.gpu_batch_size = 8, policy.num_gpu_batches = 2;
    policy.percent = (fg_percent){20, 80, 0, 100, 100, 0};
    policy.capacity[TIER_GPU] = 16.0 * (1 << 30); /* capacities given: no look at this machine */
    policy.capacity[TIER_CPU] = 200.0 * (1 << 30);
    policy.capacity[TIER_DISK] = 1000.0 * (1 << 30);
    return 0;
}

static void check_result(int rc, const char *err, const fg_search_result *r, const char *call) {
    fuzz_check(rc, err, call);
    if (rc == 0 && !(isfinite(r->throughput) && r->throughput > 0 && isfinite(r->block_latency))) {
        fprintf(stderr, "%s: prediction %g token/s, block latency %g s\n", call, r->throughput,
                r->block_latency);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write("hardware.json", data, size);
    char err[FG_ERR_LEN] = "";
    fg_hardware hw;
    int rc = fg_hardware_read(path, &hw, err);
    fuzz_check(rc, err, "fg_hardware_read");
    if (rc) return 0;
    fg_search_request req = {.s = 512, .n = 32};
    fg_search_result r;
    err[0] = 0;
    check_result(fg_policy_evaluate(&cfg, &hw, &policy, &req, &r, err), err, &r, "fg_policy_evaluate");
    req.gbs = 8, req.ngb = 2;
    err[0] = 0;
    check_result(fg_policy_search(&cfg, &hw, &policy, &req, &r, err), err, &r, "fg_policy_search");
    return 0;
}
