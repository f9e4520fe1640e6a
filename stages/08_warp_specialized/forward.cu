// Stage 08, forward - warp specialization: one producer warp moves K/V tiles into a shared-memory
// ring, the consumer warps only multiply and run the softmax; mbarriers hand the ring slots over.
//
// The idea: in stage 07 every warp issued its share of the next tile's cp.async and the whole
// block met at __syncthreads() twice per tile, so the slowest warp set everyone's pace. Here the
// roles are split. The producer warp fills slot s of a ring of SLOTS slots, and its copies arrive
// on full[s] as they land (cp.async.mbarrier.arrive); a consumer warp waits on full[s], computes,
// and arrives on empty[s]; the producer waits on empty[s] before refilling it. No block-wide
// barrier remains inside the loop, and each consumer warp runs ahead as far as the ring allows.
// What changed from stage 07: the producer warp and the full/empty mbarrier pair per slot (wrappers
// in common/mma_ptx.cuh); seven consumer warps per block (224 query rows) and one block per SM
// instead of four warps and 2-3 blocks; 128-key tiles at D = 64, and at D = 128 one slot of 64-key
// tiles whose K and V are released apart (SPLIT_KV, for shared memory); the forward also writes
// each row's log-sum-exp (log2 units) to the workspace, which the backward pass (backward.cu)
// reads. The consumers' math is stage 07's, with the instructions around the MMAs cut as the
// backward cuts them: fragment addresses computed once (kFixedAddresses), 2^x as ex2.approx alone,
// and waits that suspend the waiting warp on sm_90 (kWaitSuspend), so that neither a polling
// producer nor a polling consumer takes issue slots from the warps that compute. The kernels take
// fp16 or bf16 (Elem, common/elem.cuh): only the products' type and the roundings of P and O
// differ. K and V may have fewer heads than Q (query head h reads K/V head h / group) and another
// length, S_kv keys, with the mask aligned bottom-right (query i sees keys 0..i + S_kv - S).
// The steps of warp_specialized_forward: produce (the producer warp), then per key
// tile tile_scores, mask_scores, softmax_step and accumulate_pv (the consumers), and merge_shares
// and store_rows at the end.
// Limits: registers are given per kernel, not per role: the producer warp holds as many as a
// consumer (sm_90a's setmaxnreg, stage 09, moves them), so an SM runs 7 consumer warps where
// stage 07 runs 8 (D = 128) or 12 (D = 64); 224-row blocks pad one block of a head (with the mask
// the one with the shortest walk; without it one that walks every key tile, which its warps
// share out by key tiles and merge) and leave SMs idle on small problems. The tensor cores are
// still fed from registers (ldmatrix + mma.sync), so the consumers, not the loads, set the pace.
#include <math.h>

#include "kernel_common.cuh"
#include "mma_ptx.cuh"
#include "stage08.h"

// The configuration, per head dim, chosen by measurement (lesson; the ablation builds c3_b3 ...
// c7_slots2 of stages/08_warp_specialized/ablations.txt are the others); each number can be set
// with -D to rebuild the stage. An SM's registers sit in four
// quarters, one per warp scheduler, and each warp takes all of its registers from one quarter, so
// the cap per thread is set by the quarter with the most warps: a block of 7 consumers + 1
// producer puts 2 warps on each quarter and lets every thread have 255 registers.
#ifndef CONSUMERS
#define CONSUMERS 7         // consumer warps; warp CONSUMERS is the producer
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1        // blocks per SM the register cap must allow
#endif
// D = 128: K and V released apart (1): each has its own full/empty barriers per slot, and a consumer
// releases K's slot once its S is done, so the producer loads the next K while the consumers run
// the softmax and P V, and the next V while they compute the next S. One slot of 64-key K and V
// tiles then keeps the loads hidden where the pair released together needs two (0): at D = 128
// the shared memory of two 32-key slots holds one 64-key slot, and the softmax's work per tile (row
// maxima, O rescaled) is paid once per 64 keys. (At D = 64, with two 128-key slots, the split's
// extra live values make ptxas spill.)
#ifndef SPLIT_KV_D128
#define SPLIT_KV_D128 1
#endif
#ifndef KEY_TILE_D64
#define KEY_TILE_D64 128    // keys per K/V tile: a tile's softmax work (row max, O rescaled) per 128 keys
#endif
#ifndef KEY_TILE_D128       // at D = 128, 224 rows of Q take 56 KB: one slot of 64 keys fits, or two of 32
#define KEY_TILE_D128 (SPLIT_KV_D128 ? 64 : 32)
#endif
#ifndef SLOTS_D64
#define SLOTS_D64 2         // ring slots: 2 of 128 keys (64 KB) fit beside Q's 28 KB
#endif
#ifndef SLOTS_D128
#define SLOTS_D128 (SPLIT_KV_D128 ? 1 : 2)
#endif
// With the mask, query blocks counted back from the end of the sequence, so that the padded block
// is the shortest (1), or from its start, the padded block the longest (0).
#ifndef CAUSAL_FROM_END
#define CAUSAL_FROM_END 1
#endif
constexpr bool kCausalFromEnd = CAUSAL_FROM_END;
// Without the mask, the padded block of a head shares its key tiles out (1): where only some of
// the consumer warps have rows, the others take the same rows and a share of the key tiles, and
// the partial results (row max, row sum, O) are merged through shared memory at the end. Or the
// warps with rows walk every key tile alone while the rest only hand the slots back (0).
#ifndef SPLIT_PADDED_BLOCK
#define SPLIT_PADDED_BLOCK 1
#endif
constexpr bool kSplitPaddedBlock = SPLIT_PADDED_BLOCK;
// 2^x in the softmax as ex2.approx alone (1), or exp2f, with its range test and two multiplies (0).
#ifndef SOFTMAX_EX2_APPROX
#define SOFTMAX_EX2_APPROX 1
#endif
__device__ __forceinline__ float softmax_exp2(float x) { return SOFTMAX_EX2_APPROX ? exp2_approx(x) : exp2f(x); }
// Waits on the ring's mbarriers: on sm_90 and newer by try_wait, which suspends a waiting warp so
// that its polling leaves the issue slots to the warps that compute (1), or by polling (0).
#ifndef WAIT_SUSPEND
#define WAIT_SUSPEND 1
#endif
#if __CUDA_ARCH__ >= 900
constexpr bool kWaitSuspend = WAIT_SUSPEND;
#else
constexpr bool kWaitSuspend = false;  // try_wait is sm_90's
#endif
// Each consumer lane's fragment addresses computed once, every fragment of a tile then one XOR
// and one add away (swizzled_step) (1), or the swizzle's arithmetic for every fragment (0).
#ifndef FIXED_ADDRESSES
#define FIXED_ADDRESSES 1
#endif
constexpr bool kFixedAddresses = FIXED_ADDRESSES;
#define ROW_TILES 2         // 16-row mma tiles per consumer warp, as in stage 07
#define WARP_ROWS (16 * ROW_TILES)

template <int D> struct Config {
    static constexpr int KEY_TILE = D == 64 ? KEY_TILE_D64 : KEY_TILE_D128;
    static constexpr int SLOTS = D == 64 ? SLOTS_D64 : SLOTS_D128;
    static constexpr bool SPLIT_KV = D == 128 && SPLIT_KV_D128;  // K and V released apart
    static constexpr int BLOCK_ROWS = CONSUMERS * WARP_ROWS;
    static constexpr int THREADS = 32 * (CONSUMERS + 1);
    static constexpr int TILE = KEY_TILE * D;  // elements in one K or V tile
    // HEADER bytes of mbarriers (full[SLOTS], empty[SLOTS], q_full, v_full[SLOTS],
    // v_empty[SLOTS]), then the 2-byte tiles, each at a multiple of its row pitch (ELEM_BYTES D,
    // at most 256 bytes), as swizzled_step needs.
    static constexpr int HEADER = 256;
    static constexpr size_t bytes = HEADER + ELEM_BYTES * (BLOCK_ROWS * D + 2 * SLOTS * TILE);
    static_assert(sizeof(uint64_t) * ((SPLIT_KV ? 4 : 2) * SLOTS + 1) <= HEADER, "mbarriers overflow their header");
    static_assert(bytes <= 101376, "101,376 bytes is the per-block shared memory of sm_86 and sm_89");
    // A split padded block's merge: each warp's partial result (fp32, lane-major) goes where Q and
    // the ring were, which are free once every consumer has left the loop; as many as fit.
    static constexpr int PART_FLOATS = 32 * (ROW_TILES * D / 2 + 4 * ROW_TILES);
    static constexpr int MAX_PARTS = (int)((bytes - HEADER) / (sizeof(float) * PART_FLOATS));
};

// The block's shared memory, in Config's order: the mbarriers' header, then Q and the K/V ring.
template <typename Elem, int D> struct FwdSmem {
    uint64_t *full;   // [SLOTS]: slot s holds a landed tile (SPLIT_KV: its K tile)
    uint64_t *empty;  // [SLOTS]: every consumer is done with slot s (SPLIT_KV: with its K tile)
    uint64_t *q_full; // Q has landed
    uint64_t *v_full, *v_empty;  // [SLOTS] each, SPLIT_KV only: the same for the slot's V tile
    Elem *q_tile;     // [BLOCK_ROWS][D], swizzled
    Elem *k_ring;     // [SLOTS][KEY_TILE][D], swizzled
    Elem *v_ring;     // [SLOTS][KEY_TILE][D], swizzled
    __device__ explicit FwdSmem(unsigned char *smem) {
        using L = Config<D>;
        full = (uint64_t *)smem, empty = full + L::SLOTS, q_full = empty + L::SLOTS;
        v_full = q_full + 1, v_empty = v_full + L::SLOTS;
        q_tile = (Elem *)(smem + L::HEADER), k_ring = q_tile + L::BLOCK_ROWS * D, v_ring = k_ring + L::SLOTS * L::TILE;
    }
};

// The block's rows are [q0, rows_end); the rows of its tile from rows_end on are padding. Without
// a mask, block x owns rows [BLOCK_ROWS x, BLOCK_ROWS (x + 1)), every block walks all S keys, and
// the last block of a head is the padded one. With the mask, a block walks the keys up to its
// last row, and block 0 owns the last rows of the sequence (the longest walk, launched first);
// counted back from the end (kCausalFromEnd), the padded block is the one that starts at row 0
// and walks the fewest key tiles, not the one that ends at row S and walks them all.
struct BlockRows {
    int q0, rows_end, n_tiles;
};
// S_kv keys; with the mask, query i sees keys 0..i + S_kv - S (aligned bottom-right).
template <int BLOCK_ROWS, int KEY_TILE>
__device__ __forceinline__ BlockRows block_rows(int S, int S_kv, int causal) {
    const int q0 = !causal          ? blockIdx.x * BLOCK_ROWS
                   : kCausalFromEnd ? max(0, S - (int)(blockIdx.x + 1) * BLOCK_ROWS)
                                    : (gridDim.x - 1 - blockIdx.x) * BLOCK_ROWS;
    const int rows_end = !causal          ? S
                         : kCausalFromEnd ? S - (int)blockIdx.x * BLOCK_ROWS
                                          : min(S, q0 + BLOCK_ROWS);
    // A block's keys end at S_kv, or with the mask where its last row's do.
    return {q0, rows_end, ceil_div(causal ? rows_end + S_kv - S : S_kv, KEY_TILE)};
}

// One K or V tile of KEY_TILE rows from row k0 of a head ([S_kv][D]) into a ring slot, by the
// producer warp's 32 lanes, 16 bytes per cp.async; rows past S_kv are zero-filled. WITH_SECOND:
// the same rows of a second head (V beside K) into a second slot tile, in the same loop.
template <int D, int KEY_TILE, bool WITH_SECOND, typename Elem>
__device__ __forceinline__ void copy_kv_tile(Elem *slot_tile, const Elem *head, Elem *second_tile,
                                             const Elem *second_head, int k0, int S_kv, int lane) {
    for (int i = lane; i < KEY_TILE * (D / 8); i += 32) {
        const int r = i / (D / 8), c = (i % (D / 8)) * 8;
        const bool valid = k0 + r < S_kv;
        const size_t src = (size_t)(valid ? k0 + r : 0) * D + c;
        cp_async_16(slot_tile + swizzle<D>(r, c), head + src, valid);
        if (WITH_SECOND) cp_async_16(second_tile + swizzle<D>(r, c), second_head + src, valid);
    }
}

// The producer warp's whole job: 32 lanes, 16 bytes per cp.async, zero-filling rows past the
// block's rows or past S_kv. Tile t goes to slot t % SLOTS once the consumers have released the
// slot's previous tile (ring_wait_empty, mma_ptx.cuh). q_head and kv_head: where the block's query
// head and the K/V head it reads start.
template <typename Elem, int D>
__device__ __forceinline__ void produce(const FwdSmem<Elem, D> &m, const Elem *q, const Elem *k, const Elem *v,
                                        size_t q_head, size_t kv_head, BlockRows rows, int S_kv, int lane) {
    using L = Config<D>;
    constexpr int KEY_TILE = L::KEY_TILE, SLOTS = L::SLOTS;
    for (int i = lane; i < L::BLOCK_ROWS * (D / 8); i += 32) {
        const int r = i / (D / 8), c = (i % (D / 8)) * 8;
        const bool valid = rows.q0 + r < rows.rows_end;
        cp_async_16(m.q_tile + swizzle<D>(r, c), q + q_head + (size_t)(valid ? rows.q0 + r : 0) * D + c, valid);
    }
    cp_async_mbarrier_arrive(m.q_full);
    for (int tile = 0; tile < rows.n_tiles; tile++) {
        const int slot = ring_wait_empty<SLOTS, kWaitSuspend>(m.empty, tile);
        const int k0 = tile * KEY_TILE;
        // K and V of the tile in one loop, or (SPLIT_KV) K alone, V once its slot is free.
        copy_kv_tile<D, KEY_TILE, !L::SPLIT_KV>(m.k_ring + slot * L::TILE, k + kv_head, m.v_ring + slot * L::TILE,
                                                v + kv_head, k0, S_kv, lane);
        cp_async_mbarrier_arrive(&m.full[slot]);  // fires when this lane's copies have landed
        if constexpr (L::SPLIT_KV) {  // V's slot frees later than K's: after P V, not after S
            ring_wait_empty<SLOTS, kWaitSuspend>(m.v_empty, tile);
            copy_kv_tile<D, KEY_TILE, false>(m.v_ring + slot * L::TILE, v + kv_head, m.v_ring, v, k0, S_kv, lane);
            cp_async_mbarrier_arrive(&m.v_full[slot]);
        }
    }
    cp_async_wait<0>();  // leave no copy in flight when the warp exits
}

// A consumer warp's running state for its ROW_TILES x 16 rows: O, and each row's max and sum.
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

// The lane's address of a fragment `rows` rows and `cols` columns past the warp's first one in
// its tile: from the first's address, computed once (`first`, kFixedAddresses), or from the
// tile's start by the swizzle's arithmetic. A operands (Q), B operands of K's rows, and B operands
// read transposed (V).
template <int D, typename Elem>
__device__ __forceinline__ uint32_t a_frag_at(uint32_t first, const Elem *tile, int row0, int rows, int cols,
                                               int lane) {
    return kFixedAddresses ? swizzled_step<D>(first, rows, cols) : a_frag_address<D>(tile, row0 + rows, cols, lane);
}
template <int D, typename Elem>
__device__ __forceinline__ uint32_t b_rows_at(uint32_t first, const Elem *tile, int rows, int cols, int lane) {
    return kFixedAddresses ? swizzled_step<D>(first, rows, cols) : b_frags_of_rows_address<D>(tile, rows, cols, lane);
}
template <int D, typename Elem>
__device__ __forceinline__ uint32_t b_trans_at(uint32_t first, const Elem *tile, int rows, int cols, int lane) {
    return kFixedAddresses ? swizzled_step<D>(first, rows, cols) : b_frags_trans_address<D>(tile, rows, cols, lane);
}

// S = Q Kᵀ for the warp's rows and one key tile, as stage 07. q_a and k_b: the lane's addresses
// of the warp's first Q fragment and of the tile's first K fragment.
template <typename Elem, int D, int KEY_TILE>
__device__ __forceinline__ void tile_scores(float (&s_acc)[ROW_TILES][KEY_TILE / 8][4], const Elem *q_tile,
                                            uint32_t q_a, const Elem *k_tile, uint32_t k_b, int warp_row0, int lane) {
#pragma unroll
    for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; n++) s_acc[m][n][0] = s_acc[m][n][1] = s_acc[m][n][2] = s_acc[m][n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t q_frag[ROW_TILES][4];
#pragma unroll
        for (int m = 0; m < ROW_TILES; m++)
            ldmatrix_x4_at(q_frag[m], a_frag_at<D>(q_a, q_tile, warp_row0, 16 * m, kk * 16, lane));
#pragma unroll
        for (int n = 0; n < KEY_TILE / 16; n++) {
            uint32_t b[4];
            ldmatrix_x4_at(b, b_rows_at<D>(k_b, k_tile, n * 16, kk * 16, lane));
#pragma unroll
            for (int m = 0; m < ROW_TILES; m++) {
                mma_m16n8k16<Elem>(s_acc[m][2 * n], q_frag[m], b[0], b[1]);
                mma_m16n8k16<Elem>(s_acc[m][2 * n + 1], q_frag[m], b[2], b[3]);
            }
        }
    }
}

// -inf where a key is past S_kv or, causal, past the last key its query sees: only the tail tile
// and, when causal, tiles reaching past the last key of the warp's first row (first_last_key, its
// query index plus S_kv - S) need it.
template <int KEY_TILE>
__device__ __forceinline__ void mask_scores(float (&s_acc)[ROW_TILES][KEY_TILE / 8][4], int k0, int first_last_key,
                                            int S_kv, int causal, int g, int t) {
    if (k0 + KEY_TILE > S_kv || (causal && k0 + KEY_TILE - 1 > first_last_key)) {
#pragma unroll
        for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = k0 + n * 8 + 2 * t + (e & 1);
                    const int last_key = first_last_key + 16 * m + g + (e < 2 ? 0 : 8);
                    if (key >= S_kv || (causal && key > last_key)) s_acc[m][n][e] = -INFINITY;
                }
    }
}

// The online softmax on the thread's rows (the 4 lanes of a quad share a row): S becomes P in
// place, and O and the row sums are rescaled to the new row max.
template <int D, int KEY_TILE>
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
            const float new_max = fmaxf(st.row_max[m][r], tile_max * scale_log2);
            const float alpha = softmax_exp2(st.row_max[m][r] - new_max);
            st.row_max[m][r] = new_max;
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    s_acc[m][n][e] = softmax_exp2(s_acc[m][n][e] * scale_log2 - new_max);
                    tile_sum += s_acc[m][n][e];
                }
            st.row_sum[m][r] = st.row_sum[m][r] * alpha + tile_sum;
#pragma unroll
            for (int j = 0; j < D / 8; j++) st.o_acc[m][j][2 * r] *= alpha, st.o_acc[m][j][2 * r + 1] *= alpha;
        }
}

// O += P V, P straight from the S accumulators, as stage 07.
template <typename Elem, int D, int KEY_TILE>
__device__ __forceinline__ void accumulate_pv(float (&o_acc)[ROW_TILES][D / 8][4],
                                              const float (&s_acc)[ROW_TILES][KEY_TILE / 8][4], const Elem *v_tile,
                                              uint32_t v_b, int lane) {
#pragma unroll
    for (int kk = 0; kk < KEY_TILE / 16; kk++) {
        uint32_t p_frag[ROW_TILES][4];
#pragma unroll
        for (int m = 0; m < ROW_TILES; m++) {
            p_frag[m][0] = pack2<Elem>(s_acc[m][2 * kk][0], s_acc[m][2 * kk][1]);
            p_frag[m][1] = pack2<Elem>(s_acc[m][2 * kk][2], s_acc[m][2 * kk][3]);
            p_frag[m][2] = pack2<Elem>(s_acc[m][2 * kk + 1][0], s_acc[m][2 * kk + 1][1]);
            p_frag[m][3] = pack2<Elem>(s_acc[m][2 * kk + 1][2], s_acc[m][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < D / 16; n++) {
            uint32_t b[4];
            ldmatrix_x4_trans_at(b, b_trans_at<D>(v_b, v_tile, kk * 16, n * 16, lane));
#pragma unroll
            for (int m = 0; m < ROW_TILES; m++) {
                mma_m16n8k16<Elem>(o_acc[m][2 * n], p_frag[m], b[0], b[1]);
                mma_m16n8k16<Elem>(o_acc[m][2 * n + 1], p_frag[m], b[2], b[3]);
            }
        }
    }
}

// In the padded block of a head only `working` warps have rows: S is rarely a multiple of 224.
// Without the mask (kSplitPaddedBlock) the block splits its key tiles `splits` ways: warp w takes
// the rows of warp w % working and every splits-th key tile from tile w / working (its share),
// and share 0 merges the others' results (merge_shares). Warps left over, and all warps without
// rows when not split, only hand the slots back: their math would keep the SM busy for nothing.
struct WarpShare {
    int working, splits, share, warp_row0;
    bool split, has_rows;
};
template <int D>
__device__ __forceinline__ WarpShare warp_share(BlockRows rows, int warp, int causal) {
    using L = Config<D>;
    WarpShare w;
    w.working = min(CONSUMERS, ceil_div(rows.rows_end - rows.q0, WARP_ROWS));
    w.split = kSplitPaddedBlock && !causal && w.working < CONSUMERS;
    w.splits = w.split ? min(CONSUMERS / w.working, 1 + L::MAX_PARTS / w.working) : 1;
    w.share = w.split ? warp / w.working : 0;
    w.warp_row0 = (w.split ? warp % w.working : warp) * WARP_ROWS;
    w.has_rows = rows.q0 + w.warp_row0 < rows.rows_end && w.share < w.splits;
    return w;
}

// A split block's merge into share 0's registers: lane i of every warp of a row group holds the
// same rows and columns. The first barrier frees Q and the ring for the partial results. Part of
// share s (s >= 1): value e of a lane at [32 e + lane]; row tile m's values start at
// e = m (D / 2 + 4): its O (index 4 j + i), then row max and row sum of its rows r = 0, 1.
template <int D>
__device__ __forceinline__ void merge_shares(RowState<D> &st, const WarpShare &w, unsigned char *smem, int warp,
                                             int lane) {
    using L = Config<D>;
    float *parts = (float *)(smem + L::HEADER);  // [(share - 1) * working + row group][PART_FLOATS]
    auto part_of = [&](int s) { return parts + ((s - 1) * w.working + warp % w.working) * L::PART_FLOATS + lane; };
    named_barrier_sync(1, 32 * CONSUMERS);
    if (w.has_rows && w.share > 0) {
        float *mine_out = part_of(w.share);
#pragma unroll
        for (int m = 0; m < ROW_TILES; m++) {
            const int e0 = m * (D / 2 + 4);
#pragma unroll
            for (int j = 0; j < D / 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) mine_out[32 * (e0 + 4 * j + i)] = st.o_acc[m][j][i];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mine_out[32 * (e0 + D / 2 + 2 * r)] = st.row_max[m][r];
                mine_out[32 * (e0 + D / 2 + 2 * r + 1)] = st.row_sum[m][r];
            }
        }
    }
    named_barrier_sync(1, 32 * CONSUMERS);
    if (w.has_rows && w.share == 0)
        for (int from = 1; from < w.splits; from++) {
            // Tile 0 is share 0's, so its row max is finite; a share without tiles (-inf, 0, 0)
            // adds nothing.
            const float *theirs = part_of(from);
#pragma unroll
            for (int m = 0; m < ROW_TILES; m++) {
                const int e0 = m * (D / 2 + 4);
                float own_factor[2], their_factor[2];
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const float their_max = theirs[32 * (e0 + D / 2 + 2 * r)];
                    const float new_max = fmaxf(st.row_max[m][r], their_max);
                    own_factor[r] = exp2f(st.row_max[m][r] - new_max);
                    their_factor[r] = exp2f(their_max - new_max);
                    st.row_max[m][r] = new_max;
                    st.row_sum[m][r] = st.row_sum[m][r] * own_factor[r] + theirs[32 * (e0 + D / 2 + 2 * r + 1)] * their_factor[r];
                }
#pragma unroll
                for (int j = 0; j < D / 8; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        st.o_acc[m][j][i] = st.o_acc[m][j][i] * own_factor[i / 2] + theirs[32 * (e0 + 4 * j + i)] * their_factor[i / 2];
            }
        }
}

// The epilogue: O / l, and the row's log-sum-exp in log2 units, log2 sum_j 2^(s_ij scale log2 e).
template <typename Elem, int D>
__device__ __forceinline__ void store_rows(const RowState<D> &st, Elem *o_head, float *lse_head, int first_query,
                                           int rows_end, bool writes, int g, int t) {
#pragma unroll
    for (int m = 0; m < ROW_TILES; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = st.row_sum[m][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = 1.0f / l;
            const int query = first_query + 16 * m + g + 8 * r;
            if (query < rows_end && writes) {
#pragma unroll
                for (int j = 0; j < D / 8; j++)
                    *(uint32_t *)(o_head + (size_t)query * D + j * 8 + 2 * t) =
                        pack2<Elem>(st.o_acc[m][j][2 * r] * inv, st.o_acc[m][j][2 * r + 1] * inv);
                if (t == 0) lse_head[query] = st.row_max[m][r] + log2f(l);
            }
        }
}

// The kernel: set up the ring, then the producer warp fills it and the consumer warps walk it.
template <typename Elem, int D>
__global__ void __launch_bounds__(Config<D>::THREADS, MIN_BLOCKS)
warp_specialized_forward(const Elem *q, const Elem *k, const Elem *v, Elem *o, float *lse_log2, int S, int S_kv,
                         int group, int first_head, float scale, int causal) {
    using L = Config<D>;
    constexpr int KEY_TILE = L::KEY_TILE, SLOTS = L::SLOTS;
    extern __shared__ __align__(1024) unsigned char smem[];
    const FwdSmem<Elem, D> m(smem);
    // Query head head_index reads K/V head head_index / group (grouped-query attention).
    const int head_index = first_head + blockIdx.z * gridDim.y + blockIdx.y;
    const size_t head = (size_t)head_index * S * D, kv_head = (size_t)(head_index / group) * S_kv * D;
    const BlockRows rows = block_rows<L::BLOCK_ROWS, KEY_TILE>(S, S_kv, causal);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        for (int s = 0; s < SLOTS; s++) {
            mbarrier_init(&m.full[s], 32);              // one arrival per producer lane
            mbarrier_init(&m.empty[s], 32 * CONSUMERS);  // one arrival per consumer thread
            if constexpr (L::SPLIT_KV) mbarrier_init(&m.v_full[s], 32), mbarrier_init(&m.v_empty[s], 32 * CONSUMERS);
        }
        mbarrier_init(m.q_full, 32);
    }
    __syncthreads();  // the only block-wide barrier: the mbarriers exist before anyone uses them

    if (warp == CONSUMERS) {
        produce<Elem, D>(m, q, k, v, head, kv_head, rows, S_kv, lane);
        return;
    }

    // Consumers: stage 07's math, with waits on mbarriers instead of __syncthreads().
    const int g = lane / 4, t = lane % 4;
    const WarpShare w = warp_share<D>(rows, warp, causal);
    const int first_query = rows.q0 + w.warp_row0, first_last_key = first_query + S_kv - S;
    const float scale_log2 = scale * 1.4426950408889634f;
    RowState<D> st;
    // The lane's fragment addresses: Q's first, and K's and V's first in slot 0 (a slot is TILE
    // elements further).
    const uint32_t q_a = a_frag_address<D>(m.q_tile, w.warp_row0, 0, lane);
    const uint32_t k_b = b_frags_of_rows_address<D>(m.k_ring, 0, 0, lane);
    const uint32_t v_b = b_frags_trans_address<D>(m.v_ring, 0, 0, lane);
    mbarrier_wait<kWaitSuspend>(m.q_full, 0);
    for (int tile = 0, my_next = w.share; tile < rows.n_tiles; tile++) {
        const int slot = ring_wait_full<SLOTS, kWaitSuspend>(m.full, tile);
        const int k0 = tile * KEY_TILE;
        const bool mine = tile == my_next;  // this warp's share of the key tiles (all when not split)
        if (mine) my_next += w.splits;
        // Done reading the slot (SPLIT_KV: its K tile, then its V tile). Every thread arrives, a
        // warp without work too (its arrival releases its own reads), so the slot is refilled
        // only after each consumer thread has finished with it; and each waits for a tile before
        // it releases it, so no arrival can count towards the phase before.
        if constexpr (!L::SPLIT_KV) {
            if (w.has_rows && mine && (!causal || k0 <= first_last_key + WARP_ROWS - 1)) {
                float s_acc[ROW_TILES][KEY_TILE / 8][4];
                const uint32_t slot_bytes = slot * L::TILE * ELEM_BYTES;
                tile_scores<Elem, D, KEY_TILE>(s_acc, m.q_tile, q_a, m.k_ring + slot * L::TILE, k_b + slot_bytes,
                                               w.warp_row0, lane);
                mask_scores<KEY_TILE>(s_acc, k0, first_last_key, S_kv, causal, g, t);
                softmax_step<D, KEY_TILE>(s_acc, st, scale_log2);
                accumulate_pv<Elem, D, KEY_TILE>(st.o_acc, s_acc, m.v_ring + slot * L::TILE, v_b + slot_bytes, lane);
            }
            mbarrier_arrive(&m.empty[slot]);
        } else {
            const bool works = w.has_rows && mine && (!causal || k0 <= first_last_key + WARP_ROWS - 1);
            const uint32_t slot_bytes = slot * L::TILE * ELEM_BYTES;
            float s_acc[ROW_TILES][KEY_TILE / 8][4];
            if (works)
                tile_scores<Elem, D, KEY_TILE>(s_acc, m.q_tile, q_a, m.k_ring + slot * L::TILE, k_b + slot_bytes,
                                               w.warp_row0, lane);
            mbarrier_arrive(&m.empty[slot]);
            if (works) {
                mask_scores<KEY_TILE>(s_acc, k0, first_last_key, S_kv, causal, g, t);
                softmax_step<D, KEY_TILE>(s_acc, st, scale_log2);
            }
            ring_wait_full<SLOTS, kWaitSuspend>(m.v_full, tile);
            if (works)
                accumulate_pv<Elem, D, KEY_TILE>(st.o_acc, s_acc, m.v_ring + slot * L::TILE, v_b + slot_bytes, lane);
            mbarrier_arrive(&m.v_empty[slot]);
        }
    }
    if (w.split) merge_shares<D>(st, w, smem, warp, lane);
    store_rows<Elem, D>(st, o + head, lse_log2 + (size_t)head_index * S, first_query, rows.rows_end, w.share == 0, g, t);
}

template <typename Elem, int D>
static cudaError_t launch_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    using L = Config<D>;
    cudaError_t err = allow_dynamic_smem(warp_specialized_forward<Elem, D>, L::bytes);
    if (err != cudaSuccess) return err;
    const int heads_total = s->batch * s->heads;
    for (int first = 0; first < heads_total;) {  // in chunks of heads (head_chunk)
        const head_chunk c = head_chunk_from(first, heads_total, ceil_div(s->seq, L::BLOCK_ROWS));
        warp_specialized_forward<Elem, D><<<c.grid, L::THREADS, L::bytes, stream>>>(
            (const Elem *)t->q, (const Elem *)t->k, (const Elem *)t->v, (Elem *)t->o, workspace_lse(s, t), s->seq,
            attn_kv_seq(s), attn_group(s), first, 1.0f / sqrtf((float)s->dim), s->causal);
        first += c.count;
    }
    return cudaGetLastError();
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    if (s->dtype == ATTN_BF16)
        return s->dim == 64 ? launch_forward<__nv_bfloat16, 64>(s, t, stream)
                            : launch_forward<__nv_bfloat16, 128>(s, t, stream);
    return s->dim == 64 ? launch_forward<__half, 64>(s, t, stream) : launch_forward<__half, 128>(s, t, stream);
}

static size_t shared_bytes(const attn_shape *s) {
    const size_t fwd = s->dim == 64 ? Config<64>::bytes : Config<128>::bytes;
    const size_t bwd = stage08_backward_shared_bytes(s);
    return fwd > bwd ? fwd : bwd;
}

extern "C" const attn_stage STAGE = {
    .name = "08_warp_specialized",
    .idea = "a producer warp (cp.async) and consumer warps (mma.sync) hand a K/V ring over with mbarriers; "
        "FlashAttention-2 backward",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = lse_workspace_bytes,
    .shared_bytes = shared_bytes,
    .forward = forward,
    .backward = stage08_backward,
    .backward_scratch_bytes = stage08_backward_scratch_bytes,
    .runs_bf16 = 1,
    .runs_gqa = 1,     // forward and backward (backward.cu)
    .runs_kv_seq = 1,  // the same
};
