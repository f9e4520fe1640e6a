// Stage 01 - standard attention in three kernels.
//
// The idea: compute attention exactly as the formula reads, one step per kernel:
//   1. scores  = scale * Q K^T          written to global memory, fp32 [B, H, S, S]
//   2. P       = softmax(scores) by row in place
//   3. O       = P V
// What changed: nothing, this is the starting point every reader knows.
// Limits: the S x S scores go through global memory: written by kernel 1, read three times and
// written twice by kernel 2, read by kernel 3, so traffic and memory grow with S^2 (17 GB at B=2,
// H=32, S=8192). Slower still is kernel 1's access pattern: a warp reads the same column of 32
// different key rows, 32 cache lines a load, and the L1 cache sets the stage's time.
#include <math.h>

#include "kernel_common.cuh"

// Kernel 1: one thread per score, a warp = 32 consecutive keys of one query. q_row[d] is a
// broadcast; the k_row[d] loads are 2*D bytes apart, 32 cache lines a load instruction: the L1
// cache sets the pace (the lesson's profile). The dot product runs in fp32 from fp16 inputs.
__global__ void scores_kernel(const __half *q, const __half *k, float *scores, int S, int D,
                              float scale, int causal, int bh0) {
    const int key = blockIdx.x * blockDim.x + threadIdx.x;
    const int query = blockIdx.y * blockDim.y + threadIdx.y;
    const size_t bh = bh0 + blockIdx.z;  // (batch, head) flattened
    if (query >= S || key >= S) return;

    float *score = scores + (bh * S + query) * S + key;
    if (causal && key > query) {  // masked: softmax turns -inf into probability 0
        *score = -INFINITY;
        return;
    }
    const __half *q_row = q + (bh * S + query) * D;
    const __half *k_row = k + (bh * S + key) * D;
    float dot = 0.0f;
    for (int d = 0; d < D; d++) dot += __half2float(q_row[d]) * __half2float(k_row[d]);
    *score = scale * dot;
}

// Kernel 2: one warp per row. Three sweeps over the row: max, sum of exp(x - max), normalize.
// Subtracting the max keeps every exp() in (0, 1]; key 0 is never masked, so max is finite.
__global__ void softmax_rows_kernel(float *scores, long long rows, int S) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    float *x = scores + row * S;

    float row_max = -INFINITY;
    for (int j = lane; j < S; j += 32) row_max = fmaxf(row_max, x[j]);
    for (int offset = 16; offset > 0; offset /= 2)
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, offset));

    float row_sum = 0.0f;
    for (int j = lane; j < S; j += 32) {
        const float p = expf(x[j] - row_max);
        x[j] = p;
        row_sum += p;
    }
    for (int offset = 16; offset > 0; offset /= 2)
        row_sum += __shfl_xor_sync(0xffffffffu, row_sum, offset);

    const float inv_sum = 1.0f / row_sum;
    for (int j = lane; j < S; j += 32) x[j] *= inv_sum;
}

// Kernel 3: one block per query row, one thread per output column d. All threads read the same
// P[row, j] (a broadcast) and consecutive V[j, d] (coalesced).
__global__ void pv_kernel(const float *probs, const __half *v, __half *o, int S, int D, int causal) {
    const int query = blockIdx.x, d = threadIdx.x;
    const size_t bh = (size_t)blockIdx.z * gridDim.y + blockIdx.y;
    const float *p_row = probs + (bh * S + query) * S;
    const __half *v_head = v + bh * S * D;
    const int n_keys = causal ? query + 1 : S;  // P is exactly 0 past the diagonal
    float acc = 0.0f;
    for (int j = 0; j < n_keys; j++) acc += p_row[j] * __half2float(v_head[(size_t)j * D + d]);
    o[(bh * S + query) * D + d] = __float2half(acc);
}

static size_t scores_bytes(const attn_shape *s) {
    return (size_t)s->batch * s->heads * s->seq * (size_t)s->seq * sizeof(float);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    const __half *q = (const __half *)t->q, *k = (const __half *)t->k, *v = (const __half *)t->v;
    float *scores = (float *)t->workspace;
    const int S = s->seq, D = s->dim, BH = s->batch * s->heads;
    const float scale = 1.0f / sqrtf((float)D);

    const dim3 block(32, 8);  // 32 keys x 8 queries
    for (int bh0 = 0; bh0 < BH; bh0 += 65535) {  // gridDim.z is at most 65535
        const dim3 grid(ceil_div(S, 32), ceil_div(S, 8), min(BH - bh0, 65535));
        scores_kernel<<<grid, block, 0, stream>>>(q, k, scores, S, D, scale, s->causal, bh0);
    }
    const long long rows = (long long)BH * S;
    softmax_rows_kernel<<<(unsigned)((rows + 3) / 4), 128, 0, stream>>>(scores, rows, S);
    for (int first = 0; first < BH;) {  // one block per (query row, head), in chunks of heads
        const head_chunk c = head_chunk_from(first, BH, S);
        const size_t offset = (size_t)first * S * D;
        pv_kernel<<<c.grid, D, 0, stream>>>(scores + (size_t)first * S * S, v + offset, (__half *)t->o + offset, S,
                                            D, s->causal);
        first += c.count;
    }
    return cudaGetLastError();
}

extern "C" const attn_stage STAGE = {
    .name = "01_naive_3pass",
    .idea = "three kernels: S = scale*QK^T to global memory, softmax in place, O = PV",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = scores_bytes,
    .shared_bytes = no_shared_memory,
    .forward = forward,
};
