// stage10.h - the entry points of stage 10's forward (forward.cu) and backward (backward.cu).
#ifndef FLASH_STAGES_STAGE10_H
#define FLASH_STAGES_STAGE10_H

#include "attn.h"

cudaError_t stage10_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream);
// The most dynamic shared memory a backward kernel's block asks for at this shape.
size_t stage10_backward_shared_bytes(const attn_shape *s);
// The backward's scratch: delta, then with atomic dQ a float [B, H, S, D] dQ accumulator
// (kernel_common.cuh). The workspace holds lse_log2 only (lse_workspace_bytes).
size_t stage10_backward_scratch_bytes(const attn_shape *s);
cudaError_t stage10_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream);

#endif
