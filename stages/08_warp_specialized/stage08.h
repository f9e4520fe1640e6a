// stage08.h - what stage 08's forward (forward.cu) and backward (backward.cu) share.
#ifndef FLASH_STAGES_STAGE08_H
#define FLASH_STAGES_STAGE08_H

#include "attn.h"

// The backward's scratch: delta (kernel_common.cuh), then, when dQ is accumulated with atomics, a
// float [B, H, S, D] dQ accumulator. The workspace holds lse_log2 only (lse_workspace_bytes).
size_t stage08_backward_scratch_bytes(const attn_shape *s);
// The most dynamic shared memory a backward kernel's block asks for at this shape.
size_t stage08_backward_shared_bytes(const attn_shape *s);
cudaError_t stage08_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream);

#endif
