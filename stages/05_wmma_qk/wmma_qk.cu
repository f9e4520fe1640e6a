// Stage 05 - tensor cores for S = Q K^T through the WMMA API; P V still scalar.
//
// The idea: QK^T is a matrix product, and the tensor cores do 16x16x16 fp16 products with fp32
// accumulation far faster than the CUDA cores. nvcuda::wmma exposes them per warp: a warp loads
// 16x16 "fragments" of A and B from shared memory, mma_sync() multiplies them, store_matrix_sync()
// writes the fp32 result back. K is read as a column-major B operand, which is exactly K^T: no
// transposed copy is made.
// What changed from stage 04: WMMA works per warp on 16-row slabs, so the block becomes 4 warps
// that each own 16 of the BLOCK_ROWS = 64 query rows, and a K/V tile grows to 64 keys at D = 64
// (it stays at 32 at D = 128, see key_tile). Q, K, V are kept in shared memory as fp16 (what WMMA
// reads); the score tile goes to shared memory as fp32, where two lanes per row run stage 04's
// online softmax. The per-row state (max, sum, O accumulator) stays in shared memory, as in
// stage 04; P goes back through shared memory too, where stage 04 kept it in registers.
// Limits: P V is still scalar: 16 rows x D columns x KEY_TILE keys of fp32 FMAs per warp per
// tile, each with two shared-memory loads (P from s_tile, V), so the shared-memory pipe sets the
// time. 62.2 / 77.6 KB per block allow only 3 / 2 blocks per SM, kept within 101,376 bytes, the
// most that sm_86 and sm_89 GPUs allow. Stage 06 puts P V on the tensor cores too.
#include <math.h>

#include "kernel_common.cuh"
#include "wmma_tiles.cuh"

#define BLOCK_ROWS 64  // query rows per block
#define WARPS 4        // warp w owns query rows [16w, 16w + 16)
#define THREADS (32 * WARPS)

// Keys per shared-memory K/V tile. At D = 128, 64 keys would need 103,168 bytes, more than an
// sm_86 or sm_89 block may have; 32 keys need 77,568, at the price of twice as many tiles.
template <int D> constexpr int key_tile() { return D == 64 ? 64 : 32; }

// Shared-memory row strides. WMMA needs 32-byte aligned fragment pointers and a stride that is a
// multiple of 8 halves or 4 floats; the extra 8 halves / 4 floats stagger rows across banks.
// -DPAD_ROWS=0 is the ablation build with unpadded rows, which measures what the padding is worth.
#ifndef PAD_ROWS
#define PAD_ROWS 1
#endif
constexpr bool kPadRows = PAD_ROWS;
template <int D> struct Layout {
    static constexpr int KEY_TILE = key_tile<D>();
    static constexpr int LD_HALF = D + (kPadRows ? 8 : 0);          // q_tile, k_tile, v_tile
    static constexpr int LD_SCORE = KEY_TILE + (kPadRows ? 4 : 0);  // s_tile
    static constexpr int LD_O = D + (kPadRows ? 1 : 0);             // o_tile (scalar access only)
    static constexpr size_t bytes = sizeof(__half) * (BLOCK_ROWS + 2 * KEY_TILE) * LD_HALF +
                                    sizeof(float) * (BLOCK_ROWS * LD_SCORE + BLOCK_ROWS * LD_O + 2 * BLOCK_ROWS);
};

template <int D>
__global__ void __launch_bounds__(THREADS)
wmma_qk_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S, float scale,
               int causal) {
    using L = Layout<D>;
    constexpr int KEY_TILE = L::KEY_TILE;
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;                      // [BLOCK_ROWS][LD_HALF]
    __half *k_tile = q_tile + BLOCK_ROWS * L::LD_HALF;    // [KEY_TILE][LD_HALF]
    __half *v_tile = k_tile + KEY_TILE * L::LD_HALF;      // [KEY_TILE][LD_HALF]
    float *s_tile = (float *)(v_tile + KEY_TILE * L::LD_HALF);  // [BLOCK_ROWS][LD_SCORE]: S, then P
    float *o_tile = s_tile + BLOCK_ROWS * L::LD_SCORE;    // [BLOCK_ROWS][LD_O]: O accumulator
    float *max_tile = o_tile + BLOCK_ROWS * L::LD_O;      // [BLOCK_ROWS]: row max
    float *sum_tile = max_tile + BLOCK_ROWS;              // [BLOCK_ROWS]: row sum

    const size_t head = head_offset(blockIdx.z, blockIdx.y, gridDim.y, S, D);
    const int q0 = blockIdx.x * BLOCK_ROWS;
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // In the softmax and P V, lanes 2r and 2r+1 of warp w share row 16w + r.
    const int my_row = warp * 16 + lane / 2, half = lane % 2;
    const int query = q0 + my_row;

    load_tile_f16<BLOCK_ROWS, D>(q_tile, L::LD_HALF, q + head, q0, S);
    for (int i = threadIdx.x; i < BLOCK_ROWS * L::LD_O; i += THREADS) o_tile[i] = 0.0f;
    if (threadIdx.x < BLOCK_ROWS) max_tile[threadIdx.x] = -INFINITY, sum_tile[threadIdx.x] = 0.0f;

    for (int k0 = 0; k0 < kv_end; k0 += KEY_TILE) {
        __syncthreads();  // everyone is done with the previous tile (and Q and the state are set)
        load_tile_f16<KEY_TILE, D>(k_tile, L::LD_HALF, k + head, k0, S);
        load_tile_f16<KEY_TILE, D>(v_tile, L::LD_HALF, v + head, k0, S);
        __syncthreads();

        // S = Q K^T for this warp's 16 rows and the tile's keys, on the tensor cores
        // (common/wmma_tiles.cuh: KEY_TILE/16 accumulator fragments, D/16 mma_sync each, K read
        // as Kᵀ).
        wmma_score_tile<D, KEY_TILE>(q_tile + warp * 16 * L::LD_HALF, k_tile, L::LD_HALF,
                                     s_tile + warp * 16 * L::LD_SCORE, L::LD_SCORE);
        __syncwarp();  // the warp's score rows are complete in shared memory

        // Online softmax (stage 04's), each lane over one half of its row's scores.
        constexpr int HALF_TILE = KEY_TILE / 2;
        float *s_row = s_tile + my_row * L::LD_SCORE + half * HALF_TILE;
        float tile_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < HALF_TILE; c++) {
            const int key = k0 + half * HALF_TILE + c;
            const bool masked = key >= S || (causal && key > query);
            s_row[c] = masked ? -INFINITY : scale * s_row[c];
            tile_max = fmaxf(tile_max, s_row[c]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        // Tile 0 holds key 0, which no row masks: the max is finite from the first tile on.
        const float old_max = max_tile[my_row];
        const float new_max = fmaxf(old_max, tile_max);
        const float alpha = expf(old_max - new_max);  // 0 on the first tile
        float tile_sum = 0.0f;
#pragma unroll
        for (int c = 0; c < HALF_TILE; c++) {
            s_row[c] = expf(s_row[c] - new_max);  // now P, unnormalized
            tile_sum += s_row[c];
        }
        tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
        __syncwarp();  // both lanes of a row have read the old max and written their half of P
        if (half == 0) {
            sum_tile[my_row] = sum_tile[my_row] * alpha + tile_sum;
            max_tile[my_row] = new_max;
        }

        // O = alpha O + P V, scalar fp32. Lanes 2r and 2r + 1 take the even and odd columns d, so
        // all 32 lanes read one word of V (a broadcast); the 16 rows' p_row[c] are LD_SCORE floats
        // apart, two rows a bank (a 2-way conflict, where unpadded rows would make it 16-way).
        float *o_row = o_tile + my_row * L::LD_O;
        const float *p_row = s_tile + my_row * L::LD_SCORE;
        for (int d = half; d < D; d += 2) {
            float acc = o_row[d] * alpha;
#pragma unroll 16
            for (int c = 0; c < KEY_TILE; c++) acc += p_row[c] * __half2float(v_tile[c * L::LD_HALF + d]);
            o_row[d] = acc;
        }
    }

    __syncthreads();  // every warp's O rows and sums are final
    for (int i = threadIdx.x; i < BLOCK_ROWS * D; i += THREADS) {  // coalesced stores
        const int r = i / D, d = i % D;
        if (q0 + r < S) o[head + (size_t)(q0 + r) * D + d] = __float2half(o_tile[r * L::LD_O + d] / sum_tile[r]);
    }
}

template <int D>
static cudaError_t launch(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    static_assert(Layout<D>::bytes <= 101376,
                  "101,376 bytes is the per-block opt-in shared-memory limit of sm_86 and sm_89");
    return launch_attention(wmma_qk_kernel<D>, BLOCK_ROWS, THREADS, Layout<D>::bytes, s, t, stream);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch<64>(s, t, stream) : launch<128>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "05_wmma_qk",
    .idea = "S = QK^T on the tensor cores (WMMA, K read column-major), stage 04's softmax, scalar PV",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
};
