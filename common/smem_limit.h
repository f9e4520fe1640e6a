// smem_limit.h - does a stage's block fit the GPU's shared memory? Decided on the host, before
// any launch, so a GPU with less shared memory per block gets a sentence instead of a bare
// "invalid argument" from cudaFuncSetAttribute.
#ifndef FLASH_STAGES_SMEM_LIMIT_H
#define FLASH_STAGES_SMEM_LIMIT_H

#include <stddef.h>
#include "attn.h"

// 0 when `needed` bytes of dynamic shared memory per block fit `allowed` (the device's per-block
// opt-in limit, cudaDevAttrMaxSharedMemoryPerBlockOptin). Otherwise 1, and `message` receives
// "<stage>: needs N bytes of shared memory per block at D=<d>; <gpu> allows M".
int smem_exceeds_limit(const char *stage, const attn_shape *shape, size_t needed, const char *gpu,
                       size_t allowed, char *message, size_t message_size);

#endif
