// stage_check.c - see stage_check.h.
#include "stage_check.h"

#include <limits.h>
#include <stdio.h>

#include "smem_limit.h"

int shape_refusal(const attn_stage *stage, const char *program, const attn_shape *shape, char *message,
                  size_t message_size) {
    if (attn_elems(shape) > (size_t)INT_MAX) {
        snprintf(message, message_size, "%s: B*H*S*D = %zu elements per tensor; at most %d are supported",
                 program, attn_elems(shape), INT_MAX);
        return REFUSED_SHAPE;
    }
    const char *why_not = stage->unsupported(shape);
    if (why_not) {
        snprintf(message, message_size, "%s: unsupported shape B=%d H=%d S=%d D=%d: %s", program, shape->batch,
                 shape->heads, shape->seq, shape->dim, why_not);
        return REFUSED_SHAPE;
    }
    return 0;
}

int gpu_refusal(const attn_stage *stage, const char *program, const attn_shape *shape, const gpu_info *gpu,
                char *message, size_t message_size) {
    // sm_90a code runs on compute capability 9.0 only.
    if (stage->needs_sm90a && !(gpu->major == 9 && gpu->minor == 0)) {
        snprintf(message, message_size,
                 "%s uses Hopper-only instructions (wgmma, setmaxnreg, sm_90a) and needs an H100 or H200; "
                 "%s is sm_%d%d",
                 program, gpu->name, gpu->major, gpu->minor);
        return REFUSED_GPU;
    }
    // sm_86 and sm_89 allow 101,376 bytes per block, the H100 232,448.
    if (smem_exceeds_limit(program, shape, stage->shared_bytes(shape), gpu->name, gpu->smem_optin, message,
                           message_size))
        return REFUSED_SHAPE;
    return 0;
}
