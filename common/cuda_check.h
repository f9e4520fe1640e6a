// cuda_check.h - every CUDA call in the course goes through CUDA_CHECK; usable from C and CUDA.
#ifndef FLASH_STAGES_CUDA_CHECK_H
#define FLASH_STAGES_CUDA_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <cuda_runtime_api.h>

// Exit with the file, line, call and CUDA's own message: a failed call never goes unnoticed.
#define CUDA_CHECK(call)                                                                  \
    do {                                                                                  \
        cudaError_t cuda_check_err_ = (call);                                             \
        if (cuda_check_err_ != cudaSuccess) {                                             \
            fprintf(stderr, "%s:%d: CUDA error in %s: %s\n", __FILE__, __LINE__, #call,   \
                    cudaGetErrorString(cuda_check_err_));                                 \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

#endif
