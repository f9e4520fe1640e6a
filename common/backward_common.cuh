// backward_common.cuh - the delta pre-pass every stage with a backward pass runs first (included
// by a stage's backward .cu file only; the scratch it writes is described in kernel_common.cuh).
#ifndef FLASH_STAGES_BACKWARD_COMMON_CUH
#define FLASH_STAGES_BACKWARD_COMMON_CUH

#include "elem.cuh"
#include "kernel_common.cuh"

// delta_i = dO_i . O_i, the term every dS = P ∘ (dP - delta) needs: eight lanes per row, each
// reading 16 bytes (8 elements) of O and of dO at a time, so that a warp has four rows' loads in
// flight at once (D is a multiple of 64). Row i is row i % S of flat head i / S, wherever its
// strides put it in O and dO; delta is [B, H, S]. It also zeroes `zero_vec4` float4s at `zero` (an
// atomic dQ's sums; none: NULL, 0), which saves a launch.
#define DELTA_LANES_PER_ROW 8
template <typename Elem>
static __global__ void backward_delta(const Elem *o, RowLayout o_rows, const Elem *d_o, RowLayout d_o_rows,
                                      float *delta, int rows, int S, int D, float4 *zero, size_t zero_vec4) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < zero_vec4; i += (size_t)gridDim.x * blockDim.x)
        zero[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const size_t row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / DELTA_LANES_PER_ROW;
    const int part = threadIdx.x % DELTA_LANES_PER_ROW;
    if (row >= (size_t)rows) return;  // the row's eight lanes leave together
    const Elem *o_row = o + o_rows.offset((int)(row / S), (int)(row % S));
    const Elem *d_o_row = d_o + d_o_rows.offset((int)(row / S), (int)(row % S));
    float sum = 0.0f;
    for (int d = 8 * part; d < D; d += 8 * DELTA_LANES_PER_ROW) {
        const uint4 a = *(const uint4 *)(o_row + d), b = *(const uint4 *)(d_o_row + d);
        const uint32_t a2[4] = {a.x, a.y, a.z, a.w}, b2[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float2 x = unpack2<Elem>(a2[k]), y = unpack2<Elem>(b2[k]);
            sum += x.x * y.x + x.y * y.y;
        }
    }
    // The row's lanes are eight neighbours of one warp; the mask names them alone.
    const unsigned row_lanes = ((1u << DELTA_LANES_PER_ROW) - 1) << (threadIdx.x % 32 / DELTA_LANES_PER_ROW * DELTA_LANES_PER_ROW);
    for (int offset = DELTA_LANES_PER_ROW / 2; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(row_lanes, sum, offset);
    if (part == 0) delta[row] = sum;
}

// Enqueues backward_delta over all B*H*S rows, 16 rows per 128-thread block; with zero, it also
// zeroes zero_floats (a multiple of 4) floats there. Returns the launch's error.
template <typename Elem>
static inline cudaError_t launch_backward_delta(const attn_shape *s, const attn_tensors *t, cudaStream_t stream,
                                               float *zero = NULL, size_t zero_floats = 0) {
    const int rows = (int)attention_rows(s), threads = 128, rows_per_block = threads / DELTA_LANES_PER_ROW;
    backward_delta<<<ceil_div(rows, rows_per_block), threads, 0, stream>>>(
        (const Elem *)t->o, row_layout(t->o_strides, s->heads, s->seq, s->dim), (const Elem *)t->d_o,
        row_layout(t->d_o_strides, s->heads, s->seq, s->dim), scratch_delta(s, t), rows, s->seq, s->dim, (float4 *)zero,
        zero_floats / 4);
    return cudaGetLastError();
}

// dQ = scale * the float sums of an atomic dQ (scratch_dq_accum, kernel_common.cuh), as fp16 or
// bf16; n is even (D is).
template <typename Elem>
static __global__ void backward_dq_convert(const float *dq_accum, Elem *dq, size_t n, float scale) {
    for (size_t i = 2 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 2 * (size_t)gridDim.x * blockDim.x) {
        const float2 x = *(const float2 *)(dq_accum + i);
        *(uint32_t *)(dq + i) = pack2<Elem>(x.x * scale, x.y * scale);
    }
}

// Enqueues backward_dq_convert over the whole dQ.
template <typename Elem>
static inline void launch_backward_dq_convert(const attn_shape *s, const attn_tensors *t, float scale,
                                              cudaStream_t stream) {
    backward_dq_convert<<<1024, 256, 0, stream>>>(scratch_dq_accum(s, t), (Elem *)t->dq, attn_elems(s), scale);
}

#endif
