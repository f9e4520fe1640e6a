// Stage 02 - one fused kernel, tiled through shared memory, scalar fp32 math.
//
// The idea: never write the S x S scores to global memory. A block owns BLOCK_ROWS query rows of
// one (batch, head), one thread per row; it walks over the keys in tiles of KEY_TILE rows of K
// (and V), staged in shared memory where all BLOCK_ROWS threads reuse them.
// What changed from stage 01: one kernel instead of three; the only global traffic is Q, K, V
// in and O out (K and V once per query tile), no O(S^2) buffer.
// Limits: softmax needs the row max before any exp(), so the kernel makes two passes over K:
// pass 1 finds each row's max, pass 2 recomputes every score to sum exp(s - max) and accumulate
// P V. QK^T is computed twice. Stage 03 removes pass 1 with the online softmax.
#include <math.h>

#include "kernel_common.cuh"

#define BLOCK_ROWS 64  // query rows per block = threads per block
#define KEY_TILE 32    // keys per shared-memory tile

// Thread r reads row r of q_tile, all threads at the same column d at once. With a row stride of
// D floats (a multiple of 32) a warp's rows start in one bank and are 16-byte aligned, so the
// compiler reads 4 floats at a time: a 32-way conflict, 8 passes a column. One float of padding
// per row puts row r in bank (r + d) % 32: 1 pass a column, in scalar loads. -DPAD_Q_ROWS=0 is
// the ablation build without it.
#ifndef PAD_Q_ROWS
#define PAD_Q_ROWS 1
#endif
constexpr bool kPadQRows = PAD_Q_ROWS;
template <int D> __host__ __device__ constexpr int q_stride() { return kPadQRows ? D + 1 : D; }

template <int D>
__global__ void __launch_bounds__(BLOCK_ROWS)
scalar_tiled_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S,
                    float scale, int causal) {
    extern __shared__ float smem[];
    float *q_tile = smem;                              // [BLOCK_ROWS][q_stride]: thread r reads row r
    float *k_tile = q_tile + BLOCK_ROWS * q_stride<D>();  // [KEY_TILE][D]: all threads read one row
    float *v_tile = k_tile + KEY_TILE * D;          // [KEY_TILE][D]

    const size_t head = head_offset(blockIdx.z, blockIdx.y, gridDim.y, S, D);
    const int q0 = blockIdx.x * BLOCK_ROWS;
    const int query = q0 + threadIdx.x;
    // Causal: tiles past the block's last query are masked for every row, so skip them.
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;

    load_tile_f32<BLOCK_ROWS, D>(q_tile, q_stride<D>(), q + head, q0, S);
    const float *q_row = q_tile + threadIdx.x * q_stride<D>();

    // Pass 1: row max over every key this query sees.
    float row_max = -INFINITY;
    for (int k0 = 0; k0 < kv_end; k0 += KEY_TILE) {
        __syncthreads();  // everyone is done with the previous tile (and Q is loaded)
        load_tile_f32<KEY_TILE, D>(k_tile, D, k + head, k0, S);
        __syncthreads();
        for (int c = 0; c < KEY_TILE; c++) {
            const int key = k0 + c;
            // Later keys are masked too. break, not return: the thread must still load the later
            // tiles with the others and meet them at every __syncthreads().
            if (key >= S || (causal && key > query)) break;
            row_max = fmaxf(row_max, scale * dot_row<D>(q_row, k_tile + c * D));
        }
    }

    // Pass 2: recompute the scores, now with the max known: P = exp(s - max), O += P V.
    float row_sum = 0.0f;
    float o_acc[D];
#pragma unroll
    for (int d = 0; d < D; d++) o_acc[d] = 0.0f;
    for (int k0 = 0; k0 < kv_end; k0 += KEY_TILE) {
        __syncthreads();
        load_tile_f32<KEY_TILE, D>(k_tile, D, k + head, k0, S);
        load_tile_f32<KEY_TILE, D>(v_tile, D, v + head, k0, S);
        __syncthreads();
        for (int c = 0; c < KEY_TILE; c++) {
            const int key = k0 + c;
            if (key >= S || (causal && key > query)) break;
            const float p = expf(scale * dot_row<D>(q_row, k_tile + c * D) - row_max);
            row_sum += p;
#pragma unroll
            for (int d = 0; d < D; d++) o_acc[d] += p * v_tile[c * D + d];
        }
    }

    if (query < S) {  // rows past S (zero-filled Q) are not part of the output
        __half *o_row = o + head + (size_t)query * D;
#pragma unroll
        for (int d = 0; d < D; d++) o_row[d] = __float2half(o_acc[d] / row_sum);
    }
}

template <int D> struct Layout {  // q_tile, k_tile, v_tile
    static constexpr size_t bytes = sizeof(float) * (BLOCK_ROWS * q_stride<D>() + 2 * KEY_TILE * D);
};

template <int D>
static cudaError_t launch(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return launch_attention(scalar_tiled_kernel<D>, BLOCK_ROWS, BLOCK_ROWS, Layout<D>::bytes, s, t, stream);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch<64>(s, t, stream) : launch<128>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "02_scalar_tiled",
    .idea = "one fused kernel, K/V tiles in shared memory, two passes over K for the softmax",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
};
