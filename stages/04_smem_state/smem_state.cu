// Stage 04 - the online softmax of stage 03 with its per-row state in shared memory.
//
// The idea: stage 03's o_acc[D] and scores[KEY_TILE] fill a thread's registers; at D = 128 ptxas
// spills 276 bytes. Here row_max, row_sum and o_acc live in shared memory, one row per thread
// (rows padded to D + 1 floats: conflict-free), and only the tile's scores stay in registers:
// 56 registers, no spills.
// What changed from stage 03: the three state variables moved; the P V loop still runs d-outer,
// so each o_acc element is read and written once per tile, not once per key.
// Limits: shared memory per block grows by BLOCK_ROWS * (D + 3) floats (33 to 50 KB at D = 64),
// so 4 blocks fit per SM instead of 6 (2 instead of 3 at D = 128): about 1.5x slower than stage
// 03. Still scalar fp32 math, about 100x below the tensor cores (stage 05).
#include <math.h>

#include "kernel_common.cuh"

#define BLOCK_ROWS 64  // query rows per block = threads per block
#define KEY_TILE 32    // keys per shared-memory tile

// P V with the output column outermost, so that the shared-memory o_acc is touched once per tile.
// -DCOLUMN_OUTER=0 is the ablation build: keys outermost, as stage 02 ran it with o_acc in registers.
#ifndef COLUMN_OUTER
#define COLUMN_OUTER 1
#endif
constexpr bool kColumnOuter = COLUMN_OUTER;

template <int D>
__global__ void __launch_bounds__(BLOCK_ROWS)
smem_state_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S,
                      float scale, int causal) {
    extern __shared__ float smem[];
    float *q_tile = smem;                           // [BLOCK_ROWS][D + 1]: thread r reads row r
    float *k_tile = q_tile + BLOCK_ROWS * (D + 1);  // [KEY_TILE][D]: all threads read one row
    float *v_tile = k_tile + KEY_TILE * D;          // [KEY_TILE][D]
    float *o_tile = v_tile + KEY_TILE * D;          // [BLOCK_ROWS][D + 1]: o_acc, row r per thread
    float *max_tile = o_tile + BLOCK_ROWS * (D + 1);  // [BLOCK_ROWS]: row_max
    float *sum_tile = max_tile + BLOCK_ROWS;          // [BLOCK_ROWS]: row_sum

    const size_t head = head_offset(blockIdx.z, blockIdx.y, gridDim.y, S, D);
    const int q0 = blockIdx.x * BLOCK_ROWS;
    const int query = q0 + threadIdx.x;
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;

    load_tile_f32<BLOCK_ROWS, D>(q_tile, D + 1, q + head, q0, S);
    const float *q_row = q_tile + threadIdx.x * (D + 1);

    // The per-row state, in shared memory. Each thread touches only its own row, so no barrier
    // is needed between these accesses.
    float *o_acc = o_tile + threadIdx.x * (D + 1);
    float *row_max = max_tile + threadIdx.x, *row_sum = sum_tile + threadIdx.x;
    *row_max = -INFINITY;
    *row_sum = 0.0f;
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
        const float new_max = fmaxf(*row_max, tile_max);
        const float alpha = expf(*row_max - new_max);  // 0 on the first tile (row_max = -inf)
        float tile_sum = 0.0f;
#pragma unroll
        for (int c = 0; c < KEY_TILE; c++) {
            scores[c] = expf(scores[c] - new_max);  // now P, unnormalized
            tile_sum += scores[c];
        }
        *row_sum = *row_sum * alpha + tile_sum;
        if constexpr (kColumnOuter) {
            // Each o_acc element is read and written once per tile; the sum over the tile's keys
            // runs in a register.
            for (int d = 0; d < D; d++) {
                float acc = o_acc[d] * alpha;
#pragma unroll
                for (int c = 0; c < KEY_TILE; c++) acc += scores[c] * v_tile[c * D + d];
                o_acc[d] = acc;
            }
        } else {
            // Keys outer: o_acc in shared memory is read and written once per key.
            for (int d = 0; d < D; d++) o_acc[d] *= alpha;
#pragma unroll
            for (int c = 0; c < KEY_TILE; c++)
                for (int d = 0; d < D; d++) o_acc[d] += scores[c] * v_tile[c * D + d];
        }
        *row_max = new_max;
    }

    if (query < S) {  // rows past S (zero-filled Q) are not part of the output
        __half *o_row = o + head + (size_t)query * D;
        for (int d = 0; d < D; d++) o_row[d] = __float2half(o_acc[d] / *row_sum);
    }
}

template <int D> struct Layout {  // q_tile, k_tile, v_tile, o_tile, max_tile, sum_tile
    static constexpr size_t bytes = sizeof(float) * (2 * BLOCK_ROWS * (D + 1) + 2 * KEY_TILE * D + 2 * BLOCK_ROWS);
};

template <int D>
static cudaError_t launch(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return launch_attention(smem_state_kernel<D>, BLOCK_ROWS, BLOCK_ROWS, Layout<D>::bytes, s, t, stream);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch<64>(s, t, stream) : launch<128>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "04_smem_state",
    .idea = "stage 03 with the per-row max, sum and O accumulator in shared memory instead of registers",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
};
