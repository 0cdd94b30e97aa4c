/* tests/cuda_emu/cublasLt.h: the cublasLt calls support/cuda_device.cu makes, for the CPU execution
 * harness. Each call checks its arguments as cublasLt documents them (descriptors made and not
 * yet destroyed, layouts that agree with the operation's m, n and k, the workspace an algorithm
 * needs) and, beyond cublasLt, that each matrix and the workspace lie inside their device
 * allocations. The harness has three algorithms, which compute alike (in fp32 through OpenBLAS,
 * as cublasGemmEx does) but take different times on its clock (tests/cuda_emu/emu.cpp, "cuBLAS"):
 * so a choice by timing has one answer here. An algorithm holds the alignments its heuristic was
 * asked for (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES, 256 unless set, as cublasLt documents);
 * given a matrix less aligned, cublasLtMatmul writes NaN into D, where a GPU's kernel gives wrong
 * sums without an error.
 */
#ifndef CUDA_EMU_CUBLASLT_H
#define CUDA_EMU_CUBLASLT_H

#include <stddef.h>
#include <stdint.h>

#include "cublas_v2.h"

typedef struct cublasLtContext *cublasLtHandle_t;
typedef struct cuda_emu_lt_desc *cublasLtMatmulDesc_t;
typedef struct cuda_emu_lt_layout *cublasLtMatrixLayout_t;
typedef struct cuda_emu_lt_preference *cublasLtMatmulPreference_t;

typedef struct {
    uint64_t data[8];
} cublasLtMatmulAlgo_t;

typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;

typedef enum { CUBLASLT_MATMUL_DESC_TRANSA = 3, CUBLASLT_MATMUL_DESC_TRANSB = 4 } cublasLtMatmulDescAttributes_t;
typedef enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
} cublasLtMatmulPreferenceAttributes_t;

cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                        cudaDataType_t scale_type);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t bytes);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t bytes);
/* Up to `requested` algorithms for the product, best first, whose workspace fits the preference's. */
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *returned);
/* D = alpha op(A) op(B) + beta C, column-major, alpha and beta on the host; C and D the same
 * matrix here (the only use the harness takes). */
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspace_bytes,
                              cudaStream_t stream);

#endif
