// Stage 07 - ldmatrix + mma.sync with S and P in registers, swizzled shared memory, and a
// cp.async pipeline: the FlashAttention-2 forward on Ampere-style tensor-core instructions.
//
// The idea: mma.sync.m16n8k16 has a documented register layout (common/mma_ptx.cuh): each thread
// holds rows g = lane / 4 and g + 8 of every 16x8 accumulator, at columns 2t, 2t+1 (t = lane % 4).
// Knowing that, the whole softmax runs in registers: row max and row sum reduce over the 4 lanes
// of a quad with two shuffles, alpha multiplies the thread's own two rows of O, and the S
// accumulator, converted to fp16, *is* the A operand of P V (an A fragment holds rows g, g+8 at
// columns 2t.. and 2t+8.., exactly two neighbouring 8-key accumulator blocks). S and P never
// touch shared memory.
// What changed from stage 06:
//  - WMMA -> ldmatrix + mma.sync (PTX wrappers in common/mma_ptx.cuh);
//  - tiles are stored unpadded with an XOR swizzle (16-byte chunk c of row r at c ^ (r % 8)),
//    which ldmatrix (one address per row) reads conflict-free; WMMA's load_matrix_sync, with its
//    fixed row stride, cannot read it at all;
//  - K and V tiles arrive by cp.async into a 2-slot ring: tile j + 1 is in flight while tile j
//    is multiplied (on the H100 within noise: the SM's other resident blocks already hide the
//    copies);
//  - each warp owns 32 query rows (two 16-row mma tiles), so every K or V fragment read from
//    shared memory feeds two MMAs: with 16 rows per warp, ldmatrix bandwidth, not the tensor
//    cores, set the pace;
//  - exp2 with log2(e) folded into the scale; masks only on the tiles that need them; causal
//    blocks launched longest first; a warp skips a causal tile fully masked for its rows.
// Limits: 128-row blocks leave SMs idle on small problems (B = 1, H = 8, S = 512 is 32 blocks for
// 132 SMs); at D = 128 the 255-register cap allows only 2 blocks (8 warps) per SM and spills a
// few registers; all warps load and compute in turn, so loads overlap math only through the ring
// and the other resident block (stage 08 specializes warps).
#include <math.h>

#include "kernel_common.cuh"
#include "mma_ptx.cuh"

// The ideas of this stage beyond the fragment layout, each of which an ablation build switches
// off with -D (stages/07_swizzle_cp_async/ablations.txt; the swizzle's switch, SWIZZLE, is in
// common/mma_ptx.cuh). The ladder and notes.md's ablation table measure what each is worth.
#ifndef ROW_TILES
#define ROW_TILES 2     // 16-row mma tiles per warp: each K/V fragment feeds ROW_TILES MMAs
#endif
#ifndef KV_SLOTS
#define KV_SLOTS 2      // depth of the K/V cp.async ring (1: no copy in flight during math)
#endif
#ifndef EXP2
#define EXP2 1          // exp2 with log2(e) folded into the scale (0: expf)
#endif
#ifndef EDGE_MASKS_ONLY
#define EDGE_MASKS_ONLY 1  // mask only the tiles that need it (0: every tile)
#endif
#ifndef LONGEST_FIRST
#define LONGEST_FIRST 1    // causal: launch the longest query blocks first (0: in order)
#endif
#ifndef WARP_SKIP
#define WARP_SKIP 1        // causal: a warp skips a tile wholly above its rows (0: computes it)
#endif
constexpr bool kExp2 = EXP2, kEdgeMasksOnly = EDGE_MASKS_ONLY, kLongestFirst = LONGEST_FIRST,
               kWarpSkip = WARP_SKIP;

#define WARPS 4         // warp w owns query rows [WARP_ROWS w, WARP_ROWS (w + 1))
#define WARP_ROWS (16 * ROW_TILES)
#define BLOCK_ROWS (WARPS * WARP_ROWS)  // 128 query rows per block
#define KEY_TILE 64     // keys per K/V tile
#define THREADS (32 * WARPS)

__device__ inline float softmax_exp(float x) { return kExp2 ? exp2f(x) : expf(x); }

template <int D> struct Layout {
    static constexpr int TILE = KEY_TILE * D;  // halves in one K or V tile
    static constexpr size_t bytes = sizeof(__half) * (BLOCK_ROWS * D + 2 * KV_SLOTS * TILE);
};

// Blocks per SM the registers must allow: at D = 64 a cap of 168 registers (no spills) fits 3
// blocks; at D = 128, O alone is 128 registers per thread, and 2 blocks (255 registers) is the most.
template <int D> constexpr int min_blocks_per_sm() { return D == 64 ? 3 : 2; }

template <int D>
__global__ void __launch_bounds__(THREADS, min_blocks_per_sm<D>())
swizzle_cp_async_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S,
                        float scale, int causal) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;                 // [BLOCK_ROWS][D], swizzled
    __half *k_ring = q_tile + BLOCK_ROWS * D;        // [KV_SLOTS][KEY_TILE][D], swizzled
    __half *v_ring = k_ring + KV_SLOTS * L::TILE;    // [KV_SLOTS][KEY_TILE][D], swizzled

    const size_t head = head_offset(blockIdx.z, blockIdx.y, gridDim.y, S, D);
    // Causal blocks near the end of the sequence have the most tiles: launch them first, so the
    // short ones fill the gaps at the end of the grid instead of the long ones making a tail.
    const int q_block = causal && kLongestFirst ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = q_block * BLOCK_ROWS;
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;
    const int n_tiles = ceil_div(kv_end, KEY_TILE);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // rows g, g + 8 of each row tile; columns 2t, 2t + 1
    const int warp_row0 = warp * WARP_ROWS;  // first row of this warp inside the block
    const int warp_last_query = q0 + warp_row0 + WARP_ROWS - 1;
    // exp(x) = exp2(x log2 e): with log2 e folded into the scale, each exponential is one ex2.
    // row_max is then in log2 units (in natural units with kExp2 off).
    const float scale_log2 = kExp2 ? scale * 1.4426950408889634f : scale;

    // Prologue: group 0 = Q and tile 0, group s = tile s. Empty groups keep the count uniform.
    cp_async_tile<BLOCK_ROWS, D>(q_tile, q + head, q0, S);
    for (int s = 0; s < KV_SLOTS; s++) {
        if (s < n_tiles) {
            cp_async_tile<KEY_TILE, D>(k_ring + s * L::TILE, k + head, s * KEY_TILE, S);
            cp_async_tile<KEY_TILE, D>(v_ring + s * L::TILE, v + head, s * KEY_TILE, S);
        }
        cp_async_commit();
    }

    // O for rows g, g + 8 of row tile m and columns 8j + 2t, 8j + 2t + 1.
    float o_acc[ROW_TILES][D / 8][4];
    float row_max[ROW_TILES][2], row_sum[ROW_TILES][2];  // max in log2 units; sum is the thread's part
#pragma unroll
    for (int m = 0; m < ROW_TILES; m++) {
#pragma unroll
        for (int j = 0; j < D / 8; j++) o_acc[m][j][0] = o_acc[m][j][1] = o_acc[m][j][2] = o_acc[m][j][3] = 0.0f;
        row_max[m][0] = row_max[m][1] = -INFINITY;
        row_sum[m][0] = row_sum[m][1] = 0.0f;
    }

    for (int tile = 0; tile < n_tiles; tile++) {
        cp_async_wait<KV_SLOTS - 1>();  // this thread's copies of `tile` (and Q) are done ...
        __syncthreads();                // ... and everyone's
        const __half *k_tile = k_ring + (tile % KV_SLOTS) * L::TILE;
        const __half *v_tile = v_ring + (tile % KV_SLOTS) * L::TILE;
        const int k0 = tile * KEY_TILE;

        // Causal: a diagonal tile can lie wholly above this warp's rows. Skip its math (the
        // barriers below still see every warp). Tile 0 is never skipped: key 0 is every row's.
        if (!causal || !kWarpSkip || k0 <= warp_last_query) {
            // S = Q K^T: WARP_ROWS x 64 per warp. Q's A fragments are re-read from shared memory
            // (32 rows of them would not fit in registers next to O); one ldmatrix x4 of K rows
            // gives the B fragments of two 8-key blocks, each used by ROW_TILES MMAs.
            float s_acc[ROW_TILES][KEY_TILE / 8][4];
#pragma unroll
            for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
                for (int n = 0; n < KEY_TILE / 8; n++) s_acc[m][n][0] = s_acc[m][n][1] = s_acc[m][n][2] = s_acc[m][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t q_frag[ROW_TILES][4];
#pragma unroll
                for (int m = 0; m < ROW_TILES; m++) load_a_frag<D>(q_frag[m], q_tile, warp_row0 + 16 * m, kk * 16, lane);
#pragma unroll
                for (int n = 0; n < KEY_TILE / 16; n++) {
                    uint32_t b[4];
                    load_b_frags_of_rows<D>(b, k_tile, n * 16, kk * 16, lane);
#pragma unroll
                    for (int m = 0; m < ROW_TILES; m++) {
                        mma_m16n8k16<__half>(s_acc[m][2 * n], q_frag[m], b[0], b[1]);
                        mma_m16n8k16<__half>(s_acc[m][2 * n + 1], q_frag[m], b[2], b[3]);
                    }
                }
            }

            // Masks: only the tail tile and, when causal, tiles reaching past the warp's first row.
            if (!kEdgeMasksOnly || k0 + KEY_TILE > S || (causal && k0 + KEY_TILE - 1 > q0 + warp_row0)) {
#pragma unroll
                for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
                    for (int n = 0; n < KEY_TILE / 8; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int key = k0 + n * 8 + 2 * t + (e & 1);
                            const int query = q0 + warp_row0 + 16 * m + g + (e < 2 ? 0 : 8);
                            if (key >= S || (causal && key > query)) s_acc[m][n][e] = -INFINITY;
                        }
            }

            // Online softmax on the thread's rows; the 4 lanes of a quad share a row.
#pragma unroll
            for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float tile_max = -INFINITY;
#pragma unroll
                    for (int n = 0; n < KEY_TILE / 8; n++)
                        tile_max = fmaxf(tile_max, fmaxf(s_acc[m][n][2 * r], s_acc[m][n][2 * r + 1]));
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
                    // Tile 0 holds key 0, which no row masks: the max is finite from the first tile on.
                    const float new_max = fmaxf(row_max[m][r], tile_max * scale_log2);
                    const float alpha = softmax_exp(row_max[m][r] - new_max);  // 0 on the first tile
                    row_max[m][r] = new_max;
                    float tile_sum = 0.0f;
#pragma unroll
                    for (int n = 0; n < KEY_TILE / 8; n++)
#pragma unroll
                        for (int e = 2 * r; e < 2 * r + 2; e++) {
                            s_acc[m][n][e] = softmax_exp(s_acc[m][n][e] * scale_log2 - new_max);  // now P
                            tile_sum += s_acc[m][n][e];
                        }
                    row_sum[m][r] = row_sum[m][r] * alpha + tile_sum;
#pragma unroll
                    for (int j = 0; j < D / 8; j++) o_acc[m][j][2 * r] *= alpha, o_acc[m][j][2 * r + 1] *= alpha;
                }

            // O += P V. The A fragment for keys 16kk..16kk+15 is accumulators 2kk and 2kk+1 in
            // fp16; V's B fragments come from ldmatrix.trans of V's rows (keys), two 8-column
            // blocks each, and each feeds ROW_TILES MMAs.
#pragma unroll
            for (int kk = 0; kk < KEY_TILE / 16; kk++) {
                uint32_t p_frag[ROW_TILES][4];
#pragma unroll
                for (int m = 0; m < ROW_TILES; m++) {
                    p_frag[m][0] = pack2<__half>(s_acc[m][2 * kk][0], s_acc[m][2 * kk][1]);
                    p_frag[m][1] = pack2<__half>(s_acc[m][2 * kk][2], s_acc[m][2 * kk][3]);
                    p_frag[m][2] = pack2<__half>(s_acc[m][2 * kk + 1][0], s_acc[m][2 * kk + 1][1]);
                    p_frag[m][3] = pack2<__half>(s_acc[m][2 * kk + 1][2], s_acc[m][2 * kk + 1][3]);
                }
#pragma unroll
                for (int n = 0; n < D / 16; n++) {
                    uint32_t b[4];
                    load_b_frags_trans<D>(b, v_tile, kk * 16, n * 16, lane);
#pragma unroll
                    for (int m = 0; m < ROW_TILES; m++) {
                        mma_m16n8k16<__half>(o_acc[m][2 * n], p_frag[m], b[0], b[1]);
                        mma_m16n8k16<__half>(o_acc[m][2 * n + 1], p_frag[m], b[2], b[3]);
                    }
                }
            }
        }

        __syncthreads();  // every warp is done with this slot: refill it with tile + KV_SLOTS
        if (tile + KV_SLOTS < n_tiles) {
            const int next = (tile + KV_SLOTS) * KEY_TILE;
            cp_async_tile<KEY_TILE, D>(k_ring + (tile % KV_SLOTS) * L::TILE, k + head, next, S);
            cp_async_tile<KEY_TILE, D>(v_ring + (tile % KV_SLOTS) * L::TILE, v + head, next, S);
        }
        cp_async_commit();
    }

    // Row sums: add the quad's four parts, then O / l straight to global memory as fp16 pairs.
#pragma unroll
    for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = row_sum[m][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = 1.0f / l;
            const int query = q0 + warp_row0 + 16 * m + g + 8 * r;
            if (query < S) {
#pragma unroll
                for (int j = 0; j < D / 8; j++)
                    *(__half2 *)(o + head + (size_t)query * D + j * 8 + 2 * t) =
                        __floats2half2_rn(o_acc[m][j][2 * r] * inv, o_acc[m][j][2 * r + 1] * inv);
            }
        }
}

template <int D>
static cudaError_t launch(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    static_assert(Layout<D>::bytes <= 101376, "101,376 bytes is the per-block shared memory of sm_86 and sm_89");
    return launch_attention(swizzle_cp_async_kernel<D>, BLOCK_ROWS, THREADS, Layout<D>::bytes, s, t, stream);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch<64>(s, t, stream) : launch<128>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "07_swizzle_cp_async",
    .idea = "ldmatrix + mma.sync with S and P in registers, XOR-swizzled tiles, a 2-slot cp.async ring",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
};
