/* app/cli.c: the command line's entry: main, and flexgen_main, which sends each command to its
 * file.
 *
 *   flexgen [flags]           generate text for prompts with a policy (§4.2) or --policy auto
 *                             (§4.3); under mpirun -np M, as one of M pipeline stages (§4.4)
 *                             (run.c, job_run.c, report.c)
 *   flexgen policy [flags]    the policy search's choice and its prediction (§4.3; commands.c)
 *   flexgen profile           this machine's constants for the cost model (profile.c)
 *   flexgen tokenize          text to token ids, a line at a time
 *   flexgen perplexity        a text's perplexity through the runtime (perplexity.c, §6.2)
 *
 * The flags are parsed in args.c. The report prints FlexGen's benchmark lines (or one JSON
 * object with --json). Everything that can fail on user input returns an error line; main
 * prints it and exits 2.
 */
#define _GNU_SOURCE
#include "flexgen.h"
#include "support/support.h"
#include "app/app.h"

#include <errno.h>
#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* OpenMP's threads (OMP_NUM_THREADS), at most 8 a CPU: libgomp starts every one and the
 * workspace has a share for each, so a count far past the CPUs only breaks the run (65,535
 * crashed inside libgomp, 30,000 took minutes to start, a million asked for 183 GiB). */
static int check_thread_count(char *err) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN), most = 8 * (cpus > 0 ? cpus : 1);
    int threads = omp_get_max_threads();
    const char *given = getenv("OMP_NUM_THREADS");
    if (threads <= most) return 0;
    return fg_fail(err,
                   "OMP_NUM_THREADS=%s: %d threads, more than the %ld (8 a CPU) this machine's %ld "
                   "CPUs can run; set it lower",
                   given ? given : "(unset)", threads, most, cpus);
}

int flexgen_main(int argc, char **argv) {
    char err[FG_ERR_LEN] = "";
    fg_pipe *pipe = NULL;
    int rc = fg_pipe_open(&argc, &argv, &pipe, err);
    fg_install_signal_handlers(); /* after a stage's crash handlers, which it passes on to */
    const char *command = argc > 1 ? argv[1] : "";
    int one_process = !strcmp(command, "tokenize") || !strcmp(command, "profile") ||
                      !strcmp(command, "policy") || !strcmp(command, "perplexity");
    if (rc == 0 && pipe && one_process)
        rc = fg_fail(err, "flexgen %s runs in one process: start it without mpirun", command);
    if (rc == 0) rc = fg_isa_check_env(err);       /* FLEXGEN_ISA, before any kernel runs */
    if (rc == 0) rc = fg_blas_core_check_env(err); /* OPENBLAS_CORETYPE, before any product */
    if (rc == 0) rc = check_thread_count(err);     /* before the first parallel loop */
    /* Under mpirun every stage takes part in the stages' agreements, whatever its own command line
     * (each context of mpirun has its own): one that left early, refusing its command or its
     * FLEXGEN_ISA, or for --help, would leave the others waiting in them for ever. */
    if (pipe && fg_pipe_agree(pipe, rc, err)) rc = -1;
    if (rc) {
    } else if (argc > 1 && !strcmp(argv[1], "tokenize")) {
        rc = tokenize_command(argc, argv, err);
    } else if (argc > 1 && !strcmp(argv[1], "profile")) {
        rc = profile_command(argc, argv, err);
        if (rc == 1) rc = 0; /* --help, on standard output */
    } else {
        int policy = argc > 1 && !strcmp(argv[1], "policy");
        int perplexity = argc > 1 && !strcmp(argv[1], "perplexity");
        cli_args a = {0};
        if (rc == 0 && (policy || perplexity)) rc = check_command_flags(argv[1], argc, argv, err);
        if (rc == 0)
            rc = parse_args(argc - policy - perplexity, argv + policy + perplexity, &a, err);
        int help = rc == 1;
        char unused[FG_ERR_LEN] = "";
        if (pipe && fg_pipe_agree(pipe, help, unused)) help = 1; /* --help on any stage */
        if (help) {
            if (fg_pipe_rank(pipe) == 0) usage(stdout);
            rc = 0;
        } else if (fg_pipe_agree(pipe, rc, err)) { /* a bad flag on any stage stops them all */
            rc = -1;
        } else {
            rc = policy       ? policy_command(&a, err)
                 : perplexity ? perplexity_command(&a, err)
                              : run_generation(&a, pipe, err);
        }
        free(a.prompts);
    }
    fg_pipe_close(pipe);
    if (rc) {
        if (err[0]) fprintf(stderr, "flexgen: %s\n", err);
        fg_remove_made_dirs(); /* --path's, the hardware file's: made for nothing */
        return 2;
    }
    int e = fflush(stdout) != 0 ? errno : ferror(stdout) ? EIO : 0;
    if (e)
        fprintf(stderr, "flexgen: standard output: write failed: %s\n",
                e == EIO ? "an I/O error" : strerror(e));
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

/* A standard stream the run was started without (`2>&-`) is a free descriptor that the first
 * file opened would take: an output file would then receive the messages or the report. Each
 * closed one is given /dev/null, opened the other way round (stdin for writing, stdout and
 * stderr for reading), so that it still fails as a closed one does and no file takes it (where
 * /dev/null cannot be opened, the stream stays closed, as before). */
static void hold_standard_streams(void) {
    for (int fd = 0; fd <= 2; fd++)
        if (fcntl(fd, F_GETFD) == -1 && errno == EBADF)
            open("/dev/null", fd == 0 ? O_WRONLY : O_RDONLY); /* the lowest free: fd */
}

/* Both variables are read as the libraries load, so one new start takes both: OpenBLAS's core
 * where it picked one of an older instruction set than this CPU has (blas_core.c), and the spin. */
int main(int argc, char **argv) {
    /* A file size limit (ulimit -f) is a full disk to every write: EFBIG, reported with one line
     * and the write taken back, where SIGXFSZ would kill the run mid-write. */
    signal(SIGXFSZ, SIG_IGN);
    hold_standard_streams();
    const char *core = fg_blas_core_force();
    int spin = short_openmp_spin();
    if (core || spin) {
        execv("/proc/self/exe", argv);
        if (core) fg_blas_core_unforce(core, errno);
    }
    return flexgen_main(argc, argv);
}
#endif
