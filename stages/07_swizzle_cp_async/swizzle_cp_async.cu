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

// The block's shared memory: Q's tile, then the K and V rings; every tile unpadded and swizzled.
template <int D> struct SharedTiles {
    __half *q_tile;  // [BLOCK_ROWS][D]
    __half *k_ring;  // [KV_SLOTS][KEY_TILE][D]
    __half *v_ring;  // [KV_SLOTS][KEY_TILE][D]
    __device__ explicit SharedTiles(unsigned char *smem) {
        q_tile = (__half *)smem;
        k_ring = q_tile + BLOCK_ROWS * D;
        v_ring = k_ring + KV_SLOTS * Layout<D>::TILE;
    }
};

// K and V tile `tile` (keys from tile * KEY_TILE) into ring slot `slot`, every thread its share,
// then one commit. A tile past the last commits an empty group, so that every thread counts the
// same groups and cp_async_wait<KV_SLOTS - 1> always means "tile t has landed".
template <int D>
__device__ __forceinline__ void load_kv_tile(const SharedTiles<D> &smem, const __half *k_head, const __half *v_head,
                                             int slot, int tile, int n_tiles, int S) {
    if (tile < n_tiles) {
        cp_async_tile<KEY_TILE, D>(smem.k_ring + slot * Layout<D>::TILE, k_head, tile * KEY_TILE, S);
        cp_async_tile<KEY_TILE, D>(smem.v_ring + slot * Layout<D>::TILE, v_head, tile * KEY_TILE, S);
    }
    cp_async_commit();
}

// A warp's running state for its ROW_TILES x 16 query rows: O for rows g, g + 8 of row tile m and
// columns 8j + 2t, 8j + 2t + 1; each row's max (in log2 units) and the thread's part of its sum.
template <int D> struct RowState {
    float o_acc[ROW_TILES][D / 8][4];
    float row_max[ROW_TILES][2], row_sum[ROW_TILES][2];
    __device__ RowState() {
#pragma unroll
        for (int m = 0; m < ROW_TILES; m++) {
#pragma unroll
            for (int j = 0; j < D / 8; j++) o_acc[m][j][0] = o_acc[m][j][1] = o_acc[m][j][2] = o_acc[m][j][3] = 0.0f;
            row_max[m][0] = row_max[m][1] = -INFINITY;
            row_sum[m][0] = row_sum[m][1] = 0.0f;
        }
    }
};

// S = Q Kᵀ: WARP_ROWS x 64 per warp. Q's A fragments are re-read from shared memory (32 rows of
// them would not fit in registers next to O); one ldmatrix x4 of K rows gives the B fragments of
// two 8-key blocks, each used by ROW_TILES MMAs.
template <int D>
__device__ __forceinline__ void tile_scores(float (&s_acc)[ROW_TILES][KEY_TILE / 8][4], const __half *q_tile,
                                            const __half *k_tile, int warp_row0, int lane) {
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
}

// -inf where a key is past S or, causal, past its query. Only the tail tile and, when causal,
// tiles reaching past the warp's first row (q0 + warp_row0) need it; kEdgeMasksOnly off masks all.
// (The first row is passed as its two terms: summed by the caller, ptxas spills at D = 64.)
__device__ __forceinline__ void mask_scores(float (&s_acc)[ROW_TILES][KEY_TILE / 8][4], int k0, int q0,
                                            int warp_row0, int S, int causal, int g, int t) {
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
}

// The online softmax on the thread's rows; the 4 lanes of a quad share a row. S becomes P in
// place, and O and the row sums are rescaled to the new row max.
template <int D>
__device__ __forceinline__ void softmax_step(float (&s_acc)[ROW_TILES][KEY_TILE / 8][4], RowState<D> &st,
                                             float scale_log2) {
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
            const float new_max = fmaxf(st.row_max[m][r], tile_max * scale_log2);
            const float alpha = softmax_exp(st.row_max[m][r] - new_max);  // 0 on the first tile
            st.row_max[m][r] = new_max;
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    s_acc[m][n][e] = softmax_exp(s_acc[m][n][e] * scale_log2 - new_max);  // now P
                    tile_sum += s_acc[m][n][e];
                }
            st.row_sum[m][r] = st.row_sum[m][r] * alpha + tile_sum;
#pragma unroll
            for (int j = 0; j < D / 8; j++) st.o_acc[m][j][2 * r] *= alpha, st.o_acc[m][j][2 * r + 1] *= alpha;
        }
}

// O += P V. The A fragment for keys 16kk..16kk+15 is accumulators 2kk and 2kk+1 in fp16; V's B
// fragments come from ldmatrix.trans of V's rows (keys), two 8-column blocks each, and each
// feeds ROW_TILES MMAs.
template <int D>
__device__ __forceinline__ void accumulate_pv(float (&o_acc)[ROW_TILES][D / 8][4],
                                              const float (&s_acc)[ROW_TILES][KEY_TILE / 8][4], const __half *v_tile,
                                              int lane) {
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

// The epilogue: add the quad's four parts of each row sum, then O / l straight to global memory
// as fp16 pairs; rows past S are not written.
template <int D>
__device__ __forceinline__ void store_rows(const RowState<D> &st, __half *o_head, int first_query, int S, int g,
                                           int t) {
#pragma unroll
    for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = st.row_sum[m][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = 1.0f / l;
            const int query = first_query + 16 * m + g + 8 * r;
            if (query < S) {
#pragma unroll
                for (int j = 0; j < D / 8; j++)
                    *(__half2 *)(o_head + (size_t)query * D + j * 8 + 2 * t) =
                        __floats2half2_rn(st.o_acc[m][j][2 * r] * inv, st.o_acc[m][j][2 * r + 1] * inv);
            }
        }
}

// Blocks per SM the registers must allow: at D = 64 a cap of 168 registers (no spills) fits 3
// blocks; at D = 128, O alone is 128 registers per thread, and 2 blocks (255 registers) is the most.
template <int D> constexpr int min_blocks_per_sm() { return D == 64 ? 3 : 2; }

// The kernel: every warp loads its share of each tile into the ring and computes on the tile
// that has landed; two block-wide barriers a tile hand each slot from the copies to the math and back.
template <int D>
__global__ void __launch_bounds__(THREADS, min_blocks_per_sm<D>())
swizzle_cp_async_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S,
                        float scale, int causal) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const SharedTiles<D> smem(smem_raw);
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
    const int first_query = q0 + warp_row0, warp_last_query = first_query + WARP_ROWS - 1;
    // exp(x) = exp2(x log2 e): with log2 e folded into the scale, each exponential is one ex2.
    // row_max is then in log2 units (in natural units with kExp2 off).
    const float scale_log2 = kExp2 ? scale * 1.4426950408889634f : scale;

    // Prologue: group 0 = Q and tile 0, group s = tile s (load_kv_tile: one group a tile).
    cp_async_tile<BLOCK_ROWS, D>(smem.q_tile, q + head, q0, S);
    for (int s = 0; s < KV_SLOTS; s++) load_kv_tile<D>(smem, k + head, v + head, s, s, n_tiles, S);

    RowState<D> st;
    for (int tile = 0; tile < n_tiles; tile++) {
        cp_async_wait<KV_SLOTS - 1>();  // this thread's copies of `tile` (and Q) are done ...
        __syncthreads();                // ... and everyone's
        const int slot = tile % KV_SLOTS, k0 = tile * KEY_TILE;
        const __half *k_tile = smem.k_ring + slot * Layout<D>::TILE, *v_tile = smem.v_ring + slot * Layout<D>::TILE;
        // Causal: on a block's last tile every key can come after this warp's last query. Skip
        // only the math: every warp must still reach both __syncthreads(), and the condition is
        // the same for the whole warp, as ldmatrix and mma.sync require. Tile 0 is never
        // skipped: key 0 is every row's.
        if (!causal || !kWarpSkip || k0 <= warp_last_query) {
            float s_acc[ROW_TILES][KEY_TILE / 8][4];
            tile_scores<D>(s_acc, smem.q_tile, k_tile, warp_row0, lane);
            mask_scores(s_acc, k0, q0, warp_row0, S, causal, g, t);
            softmax_step<D>(s_acc, st, scale_log2);
            accumulate_pv<D>(st.o_acc, s_acc, v_tile, lane);
        }
        __syncthreads();  // every warp is done with this slot: refill it with tile + KV_SLOTS
        load_kv_tile<D>(smem, k + head, v + head, slot, tile + KV_SLOTS, n_tiles, S);
    }
    store_rows<D>(st, o + head, first_query, S, g, t);
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
