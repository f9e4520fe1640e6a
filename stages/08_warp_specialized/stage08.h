// stage08.h - what stage 08's forward (forward.cu) and backward (backward.cu) share.
#ifndef FLASH_STAGES_STAGE08_H
#define FLASH_STAGES_STAGE08_H

#include "attn.h"

// Workspace: the forward's row log-sum-exp in log2 units, lse_log2[B*H*S] (float), which the
// backward uses to recompute P = 2^(s scale log2 e - lse_log2) without a softmax; then the
// backward's D_i = rowsum(dO * O), delta[B*H*S] (float).
inline size_t stage08_rows(const attn_shape *s) { return (size_t)s->batch * s->heads * s->seq; }
inline size_t stage08_workspace_bytes(const attn_shape *s) { return 2 * sizeof(float) * stage08_rows(s); }
inline float *stage08_lse(const attn_shape *, const attn_tensors *t) { return (float *)t->workspace; }
inline float *stage08_delta(const attn_shape *s, const attn_tensors *t) {
    return (float *)t->workspace + stage08_rows(s);
}

cudaError_t stage08_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream);
cudaError_t stage08_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream);

#endif
