// Stage 06 - both matrix products on the tensor cores through WMMA; O lives in accumulator
// fragments.
//
// The idea: P V is a matrix product too. The softmax writes P to shared memory as fp16 (values in
// [0, 1], so fp16 costs at most 2^-11 relative), and each warp accumulates its 16 x D slab of O
// in D/16 WMMA accumulator fragments, in registers, across all K/V tiles.
// The catch: the online softmax must rescale row r of O by alpha_r = exp(m_old - m_new) on every
// tile, and WMMA does not document which (row, column) each fragment element holds. The method
// here is correct by construction: at start each warp loads a 16 x 16 matrix whose entries are
// their own row index into an accumulator fragment (`row_of`). load_matrix_sync, mma_sync and
// store_matrix_sync must agree on one element layout for an accumulator type (the API's own
// load-C, multiply, store-D contract depends on it), so row_of.x[i] is the row of element x[i] in
// every accumulator fragment of this type. Rescaling is then o.x[i] *= alpha[row_of.x[i]], with
// alpha read from shared memory. It costs 8 registers and 8 shared-memory reads per thread per
// tile (one per element of a fragment, shared by all D/16 fragments); stage 07 drops WMMA for mma.sync, whose layout is documented, to avoid even
// that and to keep S and P in registers.
// What changed from stage 05: P is stored as fp16 (over the warp's own S rows); O moves from shared memory to
// registers; P V is 4 x D/16 mma_sync per warp per 64-key tile instead of 64 x 16 x D scalar FMAs
// (stage 05's D = 128 tiles hold 32 keys; with O in registers a 64-key tile fits at both D).
// Limits: S and P round-trip through shared memory; K/V tiles are loaded synchronously through
// registers while the block waits; 152 registers and 70.4 KB per block hold the SM to 3 blocks
// (12 warps) at D = 128, too few to hide those waits (stage 07: mma.sync with S and P in
// registers, a cp.async ring, swizzled tiles).
#include <math.h>
#include <mma.h>

#include "kernel_common.cuh"
#include "wmma_tiles.cuh"

using namespace nvcuda;

#define BLOCK_ROWS 64  // query rows per block
#define KEY_TILE 64    // keys per shared-memory tile
#define WARPS 4        // warp w owns query rows [16w, 16w + 16)
#define THREADS (32 * WARPS)

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_frag;

// Shared-memory row strides. WMMA needs 32-byte aligned fragment pointers and a stride that is a
// multiple of 8 halves or 4 floats; the extra 8 halves / 4 floats stagger rows across banks.
// -DPAD_ROWS=0 is the ablation build with unpadded rows, which measures what the padding is worth.
#ifndef PAD_ROWS
#define PAD_ROWS 1
#endif
constexpr bool kPadRows = PAD_ROWS;
template <int D> struct Layout {
    static constexpr int LD_HALF = D + (kPadRows ? 8 : 0);          // q_tile, k_tile, v_tile
    static constexpr int LD_SCORE = KEY_TILE + (kPadRows ? 4 : 0);  // s_tile (fp32)
    static constexpr int LD_P = 2 * LD_SCORE;                        // p_tile (fp16) overlays s_tile row by row
    static constexpr int LD_OUT = D + (kPadRows ? 4 : 0);            // output staging (fp32), reuses k_tile/v_tile
    static constexpr size_t bytes = sizeof(__half) * (BLOCK_ROWS + 2 * KEY_TILE) * LD_HALF +
                                    sizeof(float) * (BLOCK_ROWS * LD_SCORE + 3 * BLOCK_ROWS);
    static_assert(sizeof(float) * BLOCK_ROWS * LD_OUT <= sizeof(__half) * 2 * KEY_TILE * LD_HALF,
                  "output staging must fit in the K and V tiles");
};

// The block's shared memory. P (fp16) is written over S: row r of P fills the first half of row r
// of S. Each warp touches only its own rows, and reads its scores into registers before writing
// P. Sharing the space saves 9 KB, which at D = 128 lets 3 blocks share an SM instead of 2.
template <int D> struct SharedTiles {
    __half *q_tile;     // [BLOCK_ROWS][LD_HALF]
    __half *k_tile;     // [KEY_TILE][LD_HALF]; with v_tile, the output staging at the end
    __half *v_tile;     // [KEY_TILE][LD_HALF]
    float *s_tile;      // [BLOCK_ROWS][LD_SCORE]: S
    __half *p_tile;     // [BLOCK_ROWS][LD_P]: P, over S
    float *max_tile;    // [BLOCK_ROWS]: row max
    float *sum_tile;    // [BLOCK_ROWS]: row sum
    float *alpha_tile;  // [BLOCK_ROWS]: this tile's rescale
    __device__ explicit SharedTiles(unsigned char *smem) {
        using L = Layout<D>;
        q_tile = (__half *)smem;
        k_tile = q_tile + BLOCK_ROWS * L::LD_HALF;
        v_tile = k_tile + KEY_TILE * L::LD_HALF;
        s_tile = (float *)(v_tile + KEY_TILE * L::LD_HALF);
        p_tile = (__half *)s_tile;
        max_tile = s_tile + BLOCK_ROWS * L::LD_SCORE;
        sum_tile = max_tile + BLOCK_ROWS;
        alpha_tile = sum_tile + BLOCK_ROWS;
    }
};

// row_of.x[i] = the row (0..15) of element i in any accumulator fragment: load a matrix whose
// entries are their row index. The warp's own 16 rows of s_tile serve as scratch.
template <int D>
__device__ __forceinline__ void load_row_of(acc_frag &row_of, const SharedTiles<D> &m, int warp, int lane) {
    float *scratch = m.s_tile + warp * 16 * Layout<D>::LD_SCORE;
    for (int i = lane; i < 16 * 16; i += 32) scratch[(i / 16) * Layout<D>::LD_SCORE + i % 16] = (float)(i / 16);
    __syncwarp();
    wmma::load_matrix_sync(row_of, scratch, Layout<D>::LD_SCORE, wmma::mem_row_major);
}

// The online softmax of one tile (as stage 05): lanes 2r and 2r + 1 take the two halves of row
// my_row's scores; P goes over S as fp16 for the tensor cores, and the row's max, sum and this
// tile's alpha to shared memory for the whole warp.
template <int D>
__device__ __forceinline__ void softmax_to_p(const SharedTiles<D> &m, int my_row, int half, int k0, int query,
                                             int S, float scale, int causal) {
    using L = Layout<D>;
    const float *s_row = m.s_tile + my_row * L::LD_SCORE + half * 32;
    __half *p_row = m.p_tile + my_row * L::LD_P + half * 32;
    float scores[32];
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; c++) {
        const int key = k0 + half * 32 + c;
        const bool masked = key >= S || (causal && key > query);
        scores[c] = masked ? -INFINITY : scale * s_row[c];
        tile_max = fmaxf(tile_max, scores[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    // Tile 0 holds key 0, which no row masks: the max is finite from the first tile on.
    const float old_max = m.max_tile[my_row];
    const float new_max = fmaxf(old_max, tile_max);
    const float alpha = expf(old_max - new_max);  // 0 on the first tile
    float tile_sum = 0.0f;
    __syncwarp();  // every lane has its scores in registers before P overwrites S
#pragma unroll
    for (int c = 0; c < 32; c++) {
        const __half p = __float2half(expf(scores[c] - new_max));
        p_row[c] = p;
        tile_sum += __half2float(p);  // sum what P V will use, rounding included
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
    __syncwarp();  // both lanes of a row have read the old max and written their half of P
    if (half == 0) {
        m.sum_tile[my_row] = m.sum_tile[my_row] * alpha + tile_sum;
        m.max_tile[my_row] = new_max;
        m.alpha_tile[my_row] = alpha;
    }
    __syncwarp();  // alpha_tile and p_tile are complete for the warp's 16 rows
}

// O = diag(alpha) O + P V for the warp's 16 rows.
template <int D>
__device__ __forceinline__ void rescale_and_accumulate(acc_frag (&o_frag)[D / 16], const acc_frag &row_of,
                                                       const SharedTiles<D> &m, int warp) {
    using L = Layout<D>;
    const float *alpha_tile = m.alpha_tile;
    const __half *p_tile = m.p_tile, *v_tile = m.v_tile;
    // O = diag(alpha) O + P V. Every accumulator fragment has the same layout, so the alpha of
    // element i is looked up once and applies to element i of all D/16 fragments.
#pragma unroll
    for (int i = 0; i < row_of.num_elements; i++) {
        const float alpha_i = alpha_tile[warp * 16 + (int)row_of.x[i]];
#pragma unroll
        for (int j = 0; j < D / 16; j++) o_frag[j].x[i] *= alpha_i;
    }
#pragma unroll
    for (int kk = 0; kk < KEY_TILE; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> p_frag;
        wmma::load_matrix_sync(p_frag, p_tile + warp * 16 * L::LD_P + kk, L::LD_P);
#pragma unroll
        for (int j = 0; j < D / 16; j++) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> v_frag;
            wmma::load_matrix_sync(v_frag, v_tile + kk * L::LD_HALF + j * 16, L::LD_HALF);
            wmma::mma_sync(o_frag[j], p_frag, v_frag, o_frag[j]);
        }
    }
}

// The epilogue: O / row sum, then out through shared memory (the K and V tiles, free once every
// warp is done) so the global stores are coalesced. The row sums were written by this warp's lanes.
template <int D>
__device__ __forceinline__ void store_o(acc_frag (&o_frag)[D / 16], const acc_frag &row_of, const SharedTiles<D> &m,
                                        __half *o_head, int q0, int S, int warp, int lane) {
    using L = Layout<D>;
#pragma unroll
    for (int i = 0; i < row_of.num_elements; i++) {
        const float inv_sum_i = 1.0f / m.sum_tile[warp * 16 + (int)row_of.x[i]];
#pragma unroll
        for (int j = 0; j < D / 16; j++) o_frag[j].x[i] *= inv_sum_i;
    }
    __syncthreads();
    float *out_tile = (float *)m.k_tile + warp * 16 * L::LD_OUT;  // this warp's [16][LD_OUT]
#pragma unroll
    for (int j = 0; j < D / 16; j++)
        wmma::store_matrix_sync(out_tile + j * 16, o_frag[j], L::LD_OUT, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < 16 * D; i += 32) {
        const int r = i / D, d = i % D, row = q0 + warp * 16 + r;
        if (row < S) o_head[(size_t)row * D + d] = __float2half(out_tile[r * L::LD_OUT + d]);
    }
}

// The kernel: per K/V tile, S by WMMA into shared memory, the softmax writes P over it, and each
// warp rescales its O fragments through row_of and adds P V.
template <int D>
__global__ void __launch_bounds__(THREADS)
wmma_pv_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S, float scale,
               int causal) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const SharedTiles<D> m(smem_raw);
    const size_t head = head_offset(blockIdx.z, blockIdx.y, gridDim.y, S, D);
    const int q0 = blockIdx.x * BLOCK_ROWS;
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // In the softmax, lanes 2r and 2r+1 of warp w share row 16w + r.
    const int my_row = warp * 16 + lane / 2, half = lane % 2;
    const int query = q0 + my_row;

    acc_frag row_of;
    load_row_of<D>(row_of, m, warp, lane);
    load_tile_f16<BLOCK_ROWS, D>(m.q_tile, L::LD_HALF, q + head, q0, S);
    if (threadIdx.x < BLOCK_ROWS) m.max_tile[threadIdx.x] = -INFINITY, m.sum_tile[threadIdx.x] = 0.0f;
    acc_frag o_frag[D / 16];  // this warp's 16 x D slab of O, columns 16j..16j+15 in o_frag[j]
#pragma unroll
    for (int j = 0; j < D / 16; j++) wmma::fill_fragment(o_frag[j], 0.0f);

    for (int k0 = 0; k0 < kv_end; k0 += KEY_TILE) {
        __syncthreads();  // everyone is done with the previous tile (and Q and the state are set)
        load_tile_f16<KEY_TILE, D>(m.k_tile, L::LD_HALF, k + head, k0, S);
        load_tile_f16<KEY_TILE, D>(m.v_tile, L::LD_HALF, v + head, k0, S);
        __syncthreads();
        // S = Q K^T for this warp's 16 rows and the tile's 64 keys (stage 05's wmma_score_tile;
        // stage 05's own tiles hold 32 keys at D = 128).
        wmma_score_tile<D, KEY_TILE>(m.q_tile + warp * 16 * L::LD_HALF, m.k_tile, L::LD_HALF,
                                     m.s_tile + warp * 16 * L::LD_SCORE, L::LD_SCORE);
        __syncwarp();
        softmax_to_p<D>(m, my_row, half, k0, query, S, scale, causal);
        rescale_and_accumulate<D>(o_frag, row_of, m, warp);
    }
    store_o<D>(o_frag, row_of, m, o + head, q0, S, warp, lane);
}

template <int D>
static cudaError_t launch(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    static_assert(Layout<D>::bytes <= 101376, "101,376 bytes is the per-block shared memory of sm_86 and sm_89");
    return launch_attention(wmma_pv_kernel<D>, BLOCK_ROWS, THREADS, Layout<D>::bytes, s, t, stream);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch<64>(s, t, stream) : launch<128>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "06_wmma_pv",
    .idea = "both products on the tensor cores (WMMA); O in accumulator fragments, rescaled by a row map",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
};
