// stage_check.c - see stage_check.h.
#include "stage_check.h"

#include <limits.h>
#include <stdio.h>

#include "smem_limit.h"

// Whether B*H*S*D exceeds INT_MAX, the kernels' int indexing, without computing the product: each
// factor (at least 1) must fit in what the ones before it leave. B and H may each be up to INT_MAX,
// so their product in size_t could already overflow.
static int too_many_elements(const attn_shape *s) {
    const int factors[4] = {s->batch, s->heads, s->seq > attn_kv_seq(s) ? s->seq : attn_kv_seq(s), s->dim};
    int room = INT_MAX;
    for (int i = 0; i < 4; i++) {
        if (factors[i] < 1) return 0;  // no elements: the callers refuse empty shapes first
        if (factors[i] > room) return 1;
        room /= factors[i];
    }
    return 0;
}

int shape_refusal(const attn_stage *stage, const char *program, const attn_shape *shape, char *message,
                  size_t message_size) {
    if (too_many_elements(shape)) {
        snprintf(message, message_size, "%s: B*H*S*D = %.0f elements per tensor; at most %d are supported",
                 program, (double)shape->batch * shape->heads * shape->seq * shape->dim, INT_MAX);
        return REFUSED_SHAPE;
    }
    if (shape->kv_heads < 0 || shape->kv_seq < 0 || shape->heads % attn_kv_heads(shape)) {
        snprintf(message, message_size, "%s: K and V have %d heads, which must divide the %d of Q", program,
                 attn_kv_heads(shape), shape->heads);
        return REFUSED_SHAPE;
    }
    if (shape->causal && attn_kv_seq(shape) < shape->seq) {
        snprintf(message, message_size,
                 "%s: causal attention aligned bottom-right needs at least as many keys as queries (%d keys, %d "
                 "queries): the first queries would see no key",
                 program, attn_kv_seq(shape), shape->seq);
        return REFUSED_SHAPE;
    }
    if (attn_kv_heads(shape) != shape->heads && !stage->runs_gqa) {
        snprintf(message, message_size,
                 "%s: K and V of other heads than Q are not supported: this stage's kernels take [B, H, S, D] "
                 "for all four",
                 program);
        return REFUSED_SHAPE;
    }
    if (attn_kv_seq(shape) != shape->seq && !stage->runs_kv_seq) {
        snprintf(message, message_size,
                 "%s: K and V of another length than Q are not supported: this stage's kernels take S keys for "
                 "S queries",
                 program);
        return REFUSED_SHAPE;
    }
    if (shape->dtype != ATTN_FP16 && !(shape->dtype == ATTN_BF16 && stage->runs_bf16)) {
        snprintf(message, message_size, "%s: %s tensors are not supported: this stage's kernels take fp16 only%s",
                 program, shape->dtype == ATTN_BF16 ? "bf16" : "this dtype's",
                 shape->dtype == ATTN_BF16 ? " (stages 08, 09 and 10 take bf16 too)" : "");
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
