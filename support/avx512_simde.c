/* support/avx512_simde.c: support/avx512.c's kernels built a second time, on SIMDe's portable C
 * (no AVX-512 target), so that every machine runs them: the tests hold this build to the portable
 * path's bits, and FLEXGEN_ISA=avx512-simde runs a whole job on it. */
#define AVX512_SIMDE 1
#include "support/avx512.c"
