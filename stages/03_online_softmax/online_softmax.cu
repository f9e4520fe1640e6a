// Stage 03 - online softmax: one pass over K and V, per-row state in registers.
//
// The idea: keep, for each query row, the running max m, the running sum l of exp(s - m) and the
// unnormalized output o_acc = sum_j exp(s_j - m) v_j. When a new tile raises the max to m_new,
// everything accumulated so far was computed against the old max, so it is rescaled by
// alpha = exp(m - m_new); at the end O = o_acc / l. The K/V-tile loop stays outermost: each tile is
// loaded into shared memory once and used by every query row of the block.
// What changed from stage 02: pass 1 is gone; each score is computed once, and K is read once.
// The tile's scores are kept in a KEY_TILE-long register array until the tile max is known;
// masked keys get -inf instead of ending the loop, so the c loops unroll and index scores[]
// with constants, as a register array requires.
// Limits: o_acc[D] and scores[KEY_TILE] live in one thread's registers: at D = 128 ptxas uses
// all 255 and spills 276 bytes per thread. The math is still scalar fp32.
#include <math.h>

#include "kernel_common.cuh"

#define BLOCK_ROWS 64  // query rows per block = threads per block
#define KEY_TILE 32    // keys per shared-memory tile

template <int D>
__global__ void __launch_bounds__(BLOCK_ROWS)
online_softmax_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S,
                      float scale, int causal) {
    extern __shared__ float smem[];
    float *q_tile = smem;                           // [BLOCK_ROWS][D + 1]: thread r reads row r
    float *k_tile = q_tile + BLOCK_ROWS * (D + 1);  // [KEY_TILE][D]: all threads read one row
    float *v_tile = k_tile + KEY_TILE * D;          // [KEY_TILE][D]

    const size_t head = head_offset(blockIdx.z, blockIdx.y, gridDim.y, S, D);
    const int q0 = blockIdx.x * BLOCK_ROWS;
    const int query = q0 + threadIdx.x;
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;

    load_tile_f32<BLOCK_ROWS, D>(q_tile, D + 1, q + head, q0, S);
    const float *q_row = q_tile + threadIdx.x * (D + 1);

    // The per-row state, in registers.
    float row_max = -INFINITY, row_sum = 0.0f;
    float o_acc[D];
#pragma unroll
    for (int d = 0; d < D; d++) o_acc[d] = 0.0f;

    for (int k0 = 0; k0 < kv_end; k0 += KEY_TILE) {
        __syncthreads();  // everyone is done with the previous tile (and Q is loaded)
        load_tile_f32<KEY_TILE, D>(k_tile, D, k + head, k0, S);
        load_tile_f32<KEY_TILE, D>(v_tile, D, v + head, k0, S);
        __syncthreads();

        // Scores of this tile; masked keys get -inf, which exp() turns into 0.
        float scores[KEY_TILE];
        float tile_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < KEY_TILE; c++) {
            const int key = k0 + c;
            const bool masked = key >= S || (causal && key > query);
            scores[c] = masked ? -INFINITY : scale * dot_row<D>(q_row, k_tile + c * D);
            tile_max = fmaxf(tile_max, scores[c]);
        }
        // Tile 0 holds key 0, which no row masks, so new_max is finite from the first tile on
        // and exp(row_max - new_max) never computes -inf - (-inf), which is NaN.
        const float new_max = fmaxf(row_max, tile_max);
        const float alpha = expf(row_max - new_max);  // 0 on the first tile (row_max = -inf)
        row_sum *= alpha;
#pragma unroll
        for (int c = 0; c < KEY_TILE; c++) {
            scores[c] = expf(scores[c] - new_max);  // now P, unnormalized
            row_sum += scores[c];
        }
#pragma unroll
        for (int d = 0; d < D; d++) {
            float acc = o_acc[d] * alpha;
#pragma unroll
            for (int c = 0; c < KEY_TILE; c++) acc += scores[c] * v_tile[c * D + d];
            o_acc[d] = acc;
        }
        row_max = new_max;
    }

    if (query < S) {  // rows past S (zero-filled Q) are not part of the output
        __half *o_row = o + head + (size_t)query * D;
#pragma unroll
        for (int d = 0; d < D; d++) o_row[d] = __float2half(o_acc[d] / row_sum);
    }
}

// -DSMEM_OF_04=1 builds the experiment of stage 04's lesson: this kernel, unchanged, with as much
// (unused) shared memory per block as stage 04 asks for, so that it fits as few blocks per SM as
// stage 04 does. It separates what stage 04's occupancy costs from where its state lives.
#ifndef SMEM_OF_04
#define SMEM_OF_04 0
#endif
constexpr bool kSmemOf04 = SMEM_OF_04;

template <int D> struct Layout {  // q_tile, k_tile, v_tile (and, for the experiment, stage 04's state)
    static constexpr size_t state_of_04 = kSmemOf04 ? BLOCK_ROWS * (D + 1) + 2 * BLOCK_ROWS : 0;
    static constexpr size_t bytes = sizeof(float) * (BLOCK_ROWS * (D + 1) + 2 * KEY_TILE * D + state_of_04);
};

template <int D>
static cudaError_t launch(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return launch_attention(online_softmax_kernel<D>, BLOCK_ROWS, BLOCK_ROWS, Layout<D>::bytes, s, t, stream);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch<64>(s, t, stream) : launch<128>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "03_online_softmax",
    .idea = "online softmax: one pass over K/V tiles, per-row max, sum and O accumulator in registers",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
};
