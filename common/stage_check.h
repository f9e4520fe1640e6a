// stage_check.h - may a stage run a shape on a GPU? The one decision the harness and the PyTorch op
// (python/flash_stages, through the stage library's flash_stages_refusal) take before a launch, in
// two steps: the shape alone (no GPU needed, so bad input is refused anywhere), then the GPU.
#ifndef FLASH_STAGES_STAGE_CHECK_H
#define FLASH_STAGES_STAGE_CHECK_H

#include <stddef.h>
#include "attn.h"

typedef struct {
    const char *name;   // e.g. "NVIDIA H100 80GB HBM3"
    int major, minor;   // compute capability
    size_t smem_optin;  // per-block shared memory a kernel may opt in to
} gpu_info;

enum { REFUSED_SHAPE = 3, REFUSED_GPU = 77 };  // the harness's exit statuses

// 0 when `program` (the stage's name, or <stage>.<ablation>) runs `shape`; otherwise REFUSED_SHAPE
// with the reason in `message`: too many elements for the kernels' int indexing, or a shape the
// stage does not support.
int shape_refusal(const attn_stage *stage, const char *program, const attn_shape *shape, char *message,
                  size_t message_size);

// 0 when the stage runs `shape` on `gpu`; otherwise REFUSED_GPU (sm_90a code on another GPU) or
// REFUSED_SHAPE (more shared memory per block than the GPU allows), with the reason in `message`.
int gpu_refusal(const attn_stage *stage, const char *program, const attn_shape *shape, const gpu_info *gpu,
                char *message, size_t message_size);

#endif
