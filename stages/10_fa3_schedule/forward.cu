// Stage 10, forward - warp specialization on Hopper: a producer warpgroup feeds K/V tiles with the
// copy engine (TMA), consumer warpgroups multiply with wgmma and run the softmax; mbarriers hand
// the slots of shared-memory rings over, and FlashAttention-3's schedule keeps the tensor cores fed.
//
// The idea: stage 09's frame (a TMA producer warpgroup, wgmma consumer warpgroups, setmaxnreg),
// with FlashAttention-3's schedule on it so that the tensor cores no longer wait for a
// warpgroup's softmax. The frame, as here:
//   producer (warpgroup 0): one thread issues cp.async.bulk.tensor (TMA) for a query tile's Q,
//     then for each key tile K into the K ring and V into the V ring (item n of the block's whole
//     walk, counted across its query tiles, into slots n % K_SLOTS and n % V_SLOTS), each after
//     the consumers released that slot; the copy engine counts the bytes onto the slot's barrier.
//   consumers (warpgroups 1..; 64 query rows each): S = Q Kᵀ with wgmma (both operands in shared
//     memory), mask and online softmax in registers, O += P V with wgmma (P from registers).
// setmaxnreg moves registers from the producer (24 per thread) to the consumers.
// FlashAttention-3's schedule (Shah et al. 2024, sections 3.1 and 3.2), each idea a switch below:
//   intra-warpgroup overlap (kIntraOverlap): S of key tile n is issued before P V of tile n - 1,
//     and the softmax of tile n runs while that P V is in flight;
//   persistent blocks (kPersistent): one block per SM walks many query tiles; the producer loads
//     the next tile's Q as soon as the consumers' last S = Q Kᵀ of this one is done, and K/V
//     continue through the same ring, so a tile's fill overlaps the previous tile's end;
//   a dynamic schedule for causal tiles (kDynamicSchedule, D = 64 with two consumer warpgroups;
//     FlashAttention-3's tile scheduler, from its code rather than the paper): blocks take query
//     tiles, longest first, from a counter in the call's forward scratch;
//   ping-pong (kPingPong, off as built; notes.md measures it): the consumer warpgroups take turns to
//     issue their products (named barriers), so one warpgroup's softmax falls under the other's.
//   a staggered start (kStagger, D = 128): the second consumer warpgroup issues a query
//     tile's first S once the first has its own, so that their softmaxes do not start together;
//   the softmax under P V as compiled (kSoftmaxUnderPv, D = 128): the overlap's softmax as two
//     paths, masked and unmasked, so that ptxas keeps its exponentials ahead of the wait for P V;
//   a head's last tile shared out (kSplitPartialTile, three consumer warpgroups, short heads):
//     where its rows fill one warpgroup, all three walk a third of its key tiles for those rows
//     and merge their row max, row sum and O in shared memory; in that build two Q slots
//     (kTwoQSlots) let the producer load the next query tile's Q while the current one runs.
//   O through shared memory (kTmaStoreO, with one or two consumer warpgroups): a warpgroup
//     writes O / l to a staging tile and one of its threads hands it to the copy engine (TMA
//     stores, one per 64-column slab), so the warpgroup starts its next query tile at once
//     instead of after 4-byte global stores from every thread.
// What changed from stage 09: the schedule above; ex2.approx for 2^x; three consumer warpgroups
// at D = 64 where the mask and length allow, and one where blocks of 64 rows do not outnumber the
// SMs (kSmallOneGroup); the log-sum-exp (log2 units) written to the workspace
// for the backward pass (backward.cu), as stage 08's forward writes it; every tensor read and
// written through its strides (4-D tensor maps, column, row, head and batch: make_tensor_map), so
// that [B, S, H, D] memory, as a model's projections leave Q, K and V, needs no copy; K and V may
// have fewer heads than Q (grouped-query attention: query head h reads K/V head h / (H / H_kv))
// and another length (S_kv keys: a KV cache, cross-attention; the causal mask aligned bottom-right,
// query i seeing keys 0 .. i + S_kv - S, as stage 08's).
// The kernel, wgmma_forward, is a skeleton over named steps: produce (the producer loop), then per
// query tile attend_overlapped or attend_in_order (the consumer loop, over online_softmax) and
// store_query_tile (the epilogue); FwdRings lays out shared memory, and KvReader and
// ring_wait_empty / ring_wait_full (common/mma_ptx.cuh) hold the rings' slot and phase arithmetic.
// Like stage 09's, the kernels take fp16 or bf16 (Elem, common/elem.cuh).
// Limits: Hopper only (sm_90a instructions; the harness skips other GPUs with a message); a
// query tile's first S and softmax and its last P V still have nothing of the same warpgroup to
// overlap with; where the schedule is static (every build but D = 64 with a mask, two consumer
// warpgroups and S_kv = S), it balances whole units of work, not the time they take.
#include <math.h>

#include "kernel_common.cuh"
#include "stage10.h"
#include "wgmma_ptx.cuh"

// The switches, each flipped by one ablation build (ablations.txt).
// Consumer warpgroups take turns to issue their products (1), or issue when ready (0).
#ifndef PINGPONG
#define PINGPONG 0
#endif
// S of key tile n issued before P V of tile n - 1, the softmax under it (1), or each step
// waiting for the one before (0).
#ifndef INTRA_OVERLAP
#define INTRA_OVERLAP 1
#endif
// The overlap with three consumer warpgroups too (1), or with two only (0, measured faster: with
// three, the other groups' products already fill the tensor cores while one runs its softmax,
// and the overlap's second S in flight costs registers and instructions that 160 a thread lack).
#ifndef OVERLAP_THREE_GROUPS
#define OVERLAP_THREE_GROUPS 0
#endif
// 2^x as ex2.approx alone (1) or exp2f, with its range test and two multiplies (0).
#ifndef EX2_APPROX
#define EX2_APPROX 1
#endif
// One block per SM that walks over many query tiles (1), or one block per query tile (0).
#ifndef PERSISTENT
#define PERSISTENT 1
#endif
// One consumer warpgroup per block (64 query rows) where blocks of 64 rows do not outnumber the
// SMs (1): twice the blocks of two warpgroups, each with half the rows, and a lone warpgroup's
// products do not share the tensor cores, so a block's chain of dependent steps is shorter. Or
// two warpgroups there too (0).
#ifndef SMALL_ONE_GROUP
#define SMALL_ONE_GROUP 1
#endif
// Consumer warpgroups (64 query rows each) at D = 64 where their 192-row tiles give every SM one:
// without a causal mask at any length, with one from S = CAUSAL_THREE_GROUPS_FROM on. Else two:
// at D = 128 a consumer's S, O and P alone take 160 registers, all that three groups would leave
// each; causal and shorter, a 192-row block's masked diagonal and its longer chain per query tile
// (no overlap inside a warpgroup with three) cost more than the third warpgroup wins; and a
// problem too small to fill the GPU with 192-row tiles is better cut into more, shorter blocks.
#ifndef CONSUMERS_D64
#define CONSUMERS_D64 3
#endif
#ifndef CAUSAL_THREE_GROUPS_FROM
#define CAUSAL_THREE_GROUPS_FROM 4096
#endif
// O written through shared memory by TMA stores (1): each thread puts its share of O into a
// staging tile (as many stores as to global memory, but into shared memory, conflict-free in the
// swizzle, and never held up by the memory system), one thread hands the tile to the copy engine,
// which writes whole 128-byte rows, and the warpgroup goes on to its next query tile at once. Or
// each thread stores its O to global memory itself (0): 4-byte stores from registers, which the
// warps must issue before they go on.
#ifndef TMA_STORE_O
#define TMA_STORE_O 1
#endif
// The TMA store with three consumer warpgroups too (1), or with one or two only (0). With three,
// the other two warpgroups' products keep the tensor cores busy while one stores O from
// registers, and the staging's two warpgroup barriers per query tile are not won back (the
// ablation measures it).
#ifndef TMA_STORE_THREE_GROUPS
#define TMA_STORE_THREE_GROUPS 0
#endif
// A query tile whose rows all fall to the first of three consumer warpgroups (a head's last tile,
// S - q0 <= 64) shared out by its key tiles (1): every warpgroup walks every third key tile for
// those 64 rows, and the three partial results (row max, row sum, O) are merged through shared
// memory; the non-causal schedule rotates each head's tiles, so that these cheaper tiles fall to
// every block in turn. Or the tile walked as any other, by the one warpgroup with rows (0), while
// the other two compute rows past S that are never stored. A build of its own (the kernel's SPLIT
// parameter), run only where a head has at most SPLIT_MAX_TILES tiles (the launcher says why).
#ifndef SPLIT_PARTIAL_TILE
#define SPLIT_PARTIAL_TILE 1
#endif
#ifndef SPLIT_MAX_TILES
#define SPLIT_MAX_TILES 8
#endif
// Two Q slots in the build that shares a head's last tile out (1): the producer loads the next
// query tile's Q, and its first K and V, as soon as the ring has room, while the consumers still
// work on the current tile, whose key walk is short there (heads of at most SPLIT_MAX_TILES query
// tiles, so at most 12 key tiles a query tile).
// Or one slot (0), as everywhere else: the producer loads the next Q only once the current
// tile's last S = Q Kᵀ is done (notes.md has the trials of two slots in the other kernels); at
// D = 128 there is no room.
#ifndef TWO_Q_SLOTS
#define TWO_Q_SLOTS 1
#endif
// Causal query tiles handed out by a counter (1): single tiles, longest first within sections
// of heads whose K and V fit the L2 together (SECTION_BYTES), each block taking the next tile
// as it finishes one, so the shortest tiles end the kernel wherever the time went. Or the static
// schedule's pairs (0), which balance the key tiles a block walks but not the time they take. A
// build of its own (the kernel's DYNAMIC parameter), run at D = 64 with a causal mask where
// blocks have two consumer warpgroups (S < CAUSAL_THREE_GROUPS_FROM, or where 192-row tiles
// would not give every SM one). At D = 128, in trials outside the ablation builds, the static
// schedules were as fast with a mask and faster without one (whose units are all alike).
#ifndef DYNAMIC_SCHEDULE
#define DYNAMIC_SCHEDULE 1
#endif
#ifndef SECTION_BYTES
#define SECTION_BYTES (16 << 20)
#endif
// Ring slots. With the overlap, two V slots are taken at once: tile n - 1's, read by the P V in
// flight, and tile n's, loaded with K_n and read a step later; so two V slots would leave the
// producer nothing to prefetch into.
// A K slot is free again as soon as its S = Q Kᵀ is done, early in the same step, so K needs
// fewer: at D = 128 two K slots and three V slots leave room for O's staging tile.
#ifndef SLOTS_D64
#define SLOTS_D64 4
#endif
#ifndef K_SLOTS_D128
#define K_SLOTS_D128 2
#endif
#ifndef V_SLOTS_D128
#define V_SLOTS_D128 3
#endif
// At D = 128 (two consumer warpgroups, with the overlap), the second warpgroup issues a query
// tile's first S only once the first has its own (1), so that their softmaxes start apart and
// each runs under the other's products; or both start together (0), as they leave the same Q
// barrier. Not at D = 64: there the causal two-warpgroup blocks run the dynamic schedule, and
// in trials outside the ablation builds they were slower with the stagger than without. The
// stagger is part of the overlap's loop, so the build without the overlap has none either.
#ifndef STAGGER
#define STAGGER 1
#endif
// In the overlap's loop at D = 128, the softmax compiled as two paths, masked and unmasked (1),
// so that its exponentials run while the tensor cores finish P V, as the schedule means them to:
// compiled as one path (0), ptxas places them after the wait for P V (the notes count the
// SASS), where nothing of the warpgroup's own runs beside them. Not at D = 64: there P V takes
// half as long, and in trials outside the ablation builds the two paths were slower.
#ifndef SOFTMAX_UNDER_PV
#define SOFTMAX_UNDER_PV 1
#endif
// Read only by attend_overlapped, which a build without the overlap never instantiates.
[[maybe_unused]] constexpr bool kStagger = STAGGER;
[[maybe_unused]] constexpr bool kSoftmaxUnderPv = SOFTMAX_UNDER_PV;
constexpr bool kPingPong = PINGPONG;
constexpr bool kIntraOverlap = INTRA_OVERLAP;
constexpr bool kOverlapThreeGroups = OVERLAP_THREE_GROUPS;
constexpr bool kEx2Approx = EX2_APPROX;
constexpr bool kPersistent = PERSISTENT;
constexpr bool kSmallOneGroup = SMALL_ONE_GROUP;
constexpr bool kTmaStoreO = TMA_STORE_O;
constexpr bool kTmaStoreThreeGroups = TMA_STORE_THREE_GROUPS;
constexpr bool kSplitPartialTile = SPLIT_PARTIAL_TILE;
constexpr bool kDynamicSchedule = DYNAMIC_SCHEDULE;
constexpr bool kTwoQSlots = TWO_Q_SLOTS;
__device__ inline float exp2_of(float x) { return kEx2Approx ? exp2_approx(x) : exp2f(x); }

#define GROUP_ROWS 64  // one wgmma M per consumer warpgroup
#define KEY_TILE 128
#define SLAB 64        // 2-byte columns per 128-byte swizzled slab

template <int D, int GROUPS_, bool SPLIT_ = false> struct FwdLayout {
    static constexpr int GROUPS = GROUPS_;                         // consumer warpgroups
    static constexpr int THREADS = 128 * (GROUPS + 1);            // and the producer warpgroup
    static constexpr int BLOCK_ROWS = GROUPS * GROUP_ROWS;        // query rows per block
    // Registers per consumer thread after setmaxnreg, which only shares out what the block was
    // launched with: ptxas' registers a thread times THREADS (168 x 384 = 64,512 with two groups,
    // which 128 x 24 + 256 x 240 fill exactly; 128 x 512 with three; 240 x 256 with one). The
    // producer keeps 24 a thread; the assert checks against the SM's 65,536 only.
    static constexpr int CONSUMER_REGS = GROUPS == 3 ? 160 : 240;
    static_assert(128 * 24 + 128 * GROUPS * CONSUMER_REGS <= 65536, "register file");
    static constexpr int K_SLOTS = D == 64 ? SLOTS_D64 : K_SLOTS_D128;
    static constexpr int V_SLOTS = D == 64 ? SLOTS_D64 : V_SLOTS_D128;
    static constexpr int SLOTS = K_SLOTS + V_SLOTS;
    static constexpr int Q_ELEMS = BLOCK_ROWS * D;
    static constexpr bool TMA_STORE = kTmaStoreO && (GROUPS <= 2 || kTmaStoreThreeGroups);
    static constexpr int O_ELEMS = TMA_STORE ? Q_ELEMS : 0;
    static constexpr int TILE_ELEMS = KEY_TILE * D;
    // The overlap inside a warpgroup (kIntraOverlap) runs with one or two consumer warpgroups.
    static constexpr bool OVERLAP = kIntraOverlap && (GROUPS <= 2 || kOverlapThreeGroups);
    // Partial tiles shared out by key tiles (kSplitPartialTile): three groups, the loop without overlap.
    static constexpr bool SPLIT = SPLIT_ && kSplitPartialTile && GROUPS == 3 && !OVERLAP;
    // Per thread of each warpgroup but the first: its O accumulators, row max and row sum (2 each).
    static constexpr int MERGE_VALUES = D / 2 + 4;
    static constexpr int MERGE_FLOATS = SPLIT ? (GROUPS - 1) * MERGE_VALUES * 128 : 0;
    // The Q slots [Q_SLOTS][D/64][BLOCK_ROWS][64], the K ring [K_SLOTS][D/64][KEY_TILE][64], the
    // V ring likewise, O's staging tile (Q's layout), the merge area [GROUPS-1][MERGE_VALUES][128
    // threads] (fp32), then the mbarriers (full and empty for each K, V and Q slot) and a word per
    // Q slot for the unit the DYNAMIC producer hands the consumers; 1024 spare bytes to align the
    // start to a swizzle atom.
    static constexpr size_t bytes_with(int q_slots) {
        return 1024 + ELEM_BYTES * (q_slots * Q_ELEMS + SLOTS * TILE_ELEMS + O_ELEMS) +
               sizeof(float) * MERGE_FLOATS + sizeof(uint64_t) * (2 * SLOTS + 2 * q_slots) + sizeof(int) * q_slots;
    }
    static constexpr size_t MAX_BYTES = 232448;  // a Hopper block's opt-in limit
    // Q slots (kTwoQSlots, in the SPLIT build where the second fits): query tile n's Q goes to slot
    // n % Q_SLOTS; one slot everywhere else.
    static constexpr int Q_SLOTS = SPLIT && kTwoQSlots && bytes_with(2) <= MAX_BYTES ? 2 : 1;
    static constexpr size_t bytes = bytes_with(Q_SLOTS);
    static_assert(bytes <= MAX_BYTES, "more shared memory than a Hopper block may have");
};

// The steps of a consumer warpgroup on one tile.

// Issue S = Q Kᵀ (64 rows x 128 keys) as one wgmma group; both operands in shared memory, K-major:
// step kk starts 32 bytes further into the 128-byte rows of slab kk / 4.
// The Q rows are those of warpgroup q_group (its own, or the first's in a shared-out tile).
template <typename Elem, int D, int BLOCK_ROWS>
__device__ __forceinline__ void issue_qk(float (&s_acc)[KEY_TILE / 2], const Elem *q_tile, const Elem *k_tile,
                                         int q_group) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        wgmma_m64k16_ss<Elem, KEY_TILE>(s_acc, desc_k_major<BLOCK_ROWS>(q_tile, q_group * GROUP_ROWS, kk),
                                  desc_k_major<KEY_TILE>(k_tile, 0, kk), kk > 0);
    wgmma_commit();
}

// Issue O += P V as one wgmma group: P (Elem) is the A operand straight from registers; V is
// N-major, so step kk (16 keys) starts 16 rows = 2 atoms further, its 64-column slabs a tile apart.
template <typename Elem, int D>
__device__ __forceinline__ void issue_pv(float (&o_acc)[D / 2], const uint32_t (&p_frag)[KEY_TILE / 16][4],
                                         const Elem *v_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KEY_TILE / 16; kk++) wgmma_m64k16_rs<Elem, D, 1>(o_acc, p_frag[kk], desc_n_major<KEY_TILE>(v_tile, kk), 1);
    wgmma_commit();
}

// Mask tile k0 if `masked`, then the online softmax of this thread's rows g and g + 8 (stage
// 07's): s_acc becomes P (fp32, unnormalized), row_max and row_sum advance, and alpha[r] is the
// factor by which row r of O must be scaled before this tile's P V is added. Keys past S_kv are
// masked, and with `causal` keys past a row's diagonal: the last key it sees, its query index plus
// S_kv - S (`diagonal` is the warp's first row's).
__device__ __forceinline__ void softmax_step(float (&s_acc)[KEY_TILE / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], bool masked, int k0, int S_kv, int causal,
                                             int diagonal, int g, int t, float scale_log2) {
    if (masked) {
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + 8 * j + 2 * t + (e & 1);
                const int last_key = diagonal + g + (e < 2 ? 0 : 8);
                if (key >= S_kv || (causal && key > last_key)) s_acc[4 * j + e] = -INFINITY;
            }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
            tile_max = fmaxf(tile_max, fmaxf(s_acc[4 * j + 2 * r], s_acc[4 * j + 2 * r + 1]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[r], tile_max * scale_log2);
        alpha[r] = exp2_of(row_max[r] - new_max);
        row_max[r] = new_max;
        float tile_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s_acc[4 * j + e] = exp2_of(s_acc[4 * j + e] * scale_log2 - new_max);
                tile_sum += s_acc[4 * j + e];
            }
        row_sum[r] = row_sum[r] * alpha[r] + tile_sum;
    }
}

// The softmax of key tile k0, masked where the tile reaches past S_kv or, causal, past the warp's
// first row's diagonal. TWO_PATHS (kSoftmaxUnderPv): as two compiled paths, masked and unmasked, on a
// branch the compiler knows to be the same in every thread of the warp (lane 0's condition: it
// depends only on the tile, S_kv, the mask and the warp's first row, which all its lanes share).
// This picks the path; softmax_step above does the work. In one path, with the mask under a
// branch of its own, ptxas scheduled the exponentials after the wait for P V that follows in
// the overlap loop, where nothing of this warpgroup's runs beside them; the two paths end
// before that wait.
template <bool TWO_PATHS = false>
__device__ __forceinline__ void online_softmax(float (&s_acc)[KEY_TILE / 2], float (&row_max)[2], float (&row_sum)[2],
                                               float (&alpha)[2], int k0, int S_kv, int causal, int diagonal,
                                               int g, int t, float scale_log2) {
    const bool masked = k0 + KEY_TILE > S_kv || (causal && k0 + KEY_TILE - 1 > diagonal);
    if constexpr (!TWO_PATHS)
        softmax_step(s_acc, row_max, row_sum, alpha, masked, k0, S_kv, causal, diagonal, g, t, scale_log2);
    else if (__shfl_sync(0xffffffffu, masked, 0))
        softmax_step(s_acc, row_max, row_sum, alpha, true, k0, S_kv, causal, diagonal, g, t, scale_log2);
    else
        softmax_step(s_acc, row_max, row_sum, alpha, false, k0, S_kv, causal, diagonal, g, t, scale_log2);
}

template <int D>
__device__ __forceinline__ void rescale_rows(float (&o_acc)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o_acc[4 * j + e] *= alpha[e / 2];
}

// Named barriers (id 0 is __syncthreads): one per consumer warpgroup for ping-pong's turns and
// one per consumer warpgroup for its O staging tile; the shared-out tile's merge; the staggered
// start.
enum NamedBarrier { kTurnBarrier0 = 1, kOBarrier0 = 4, kMergeWritten = 7, kMergeRead = 8, kStaggerBarrier = 9 };

// Ping-pong: consumer warpgroup c may issue its products once it holds the turn (named barrier
// kTurnBarrier0 + c, which warpgroup c - 1 arrives on when it passes the turn on), so the groups issue in
// the order 0, 1, ..., 0, 1, ... and each one's softmax runs under the others' products. The
// barrier counts 256 threads: the taker's 128, which sync, and the passer's 128, which only arrive.
// A lone consumer warpgroup has no one to take turns with.
template <int GROUPS> struct Turns {
    int consumer;
    __device__ void take() const {
        if (kPingPong && GROUPS > 1) named_barrier_sync(kTurnBarrier0 + consumer, 256);
    }
    __device__ void pass() const {
        if (kPingPong && GROUPS > 1) named_barrier_arrive(kTurnBarrier0 + (consumer + 1) % GROUPS, 256);
    }
};

// Which query tiles a block computes. The work is cut into units; in the static schedule block b
// takes units b, b + gridDim.x, ... (one unit per block when not persistent). A unit is one query
// tile, except in a persistent causal launch with more tiles than SMs: there the tile with the most
// keys of a head is paired with the one with the fewest, the second-most with the second-fewest,
// and so on, so that every unit (but a lone middle tile) walks about as many key tiles
// (n_qblocks + 1 with 128-row blocks) and a static round-robin is balanced. With fewer tiles than
// SMs, pairs would only put two tiles one after the other on an SM while others idle, so every tile
// is its own unit, longest first. Units run head by
// head (DYNAMIC: section by section), so the blocks at work at any moment read the K and V of few
// heads, which stay in L2. Where a head's last tile is cheaper than the others (shared out by its
// key tiles, kSplitPartialTile) and the tiles are not causal, each head's tiles are rotated by the
// round (of gridDim.x units) that the head starts in: with as many SMs as a multiple of the tiles
// per head (132 SMs, 6 tiles at S = 1024), block b would otherwise get tile b % 6 of every head,
// and the cheap ones would all fall to the same blocks.
// DYNAMIC (kDynamicSchedule): every tile is its own unit, in order of length within sections of
// section_heads heads (the last query blocks of the section's heads, then the ones before), and a
// block's next unit is not b + gridDim.x but the next one the counter hands out: blocks whose tiles
// took longer take fewer, and the shortest tiles of each section come last.
struct Schedule {
    int n_qblocks, heads_total, paired;
    int section_heads;  // DYNAMIC: heads per section (the last section may have fewer)
    int *unit_counter;  // DYNAMIC: units handed out after the blocks' first, zero at launch
    __host__ __device__ int units_per_head() const { return paired ? (n_qblocks + 1) / 2 : n_qblocks; }
    __host__ __device__ int units() const { return heads_total * units_per_head(); }
    __device__ int tiles_of(int unit) const {
        if (!paired) return 1;
        return 2 * (unit % units_per_head()) + 1 == n_qblocks ? 1 : 2;  // an odd count's middle tile is alone
    }
    // The query block of the unit's i-th tile (longest first within a head when causal; rotated by
    // the head's round where ROTATED, the build that shares last tiles out).
    template <bool ROTATED, bool DYNAMIC = false>
    __device__ int q_block(int unit, int i, int causal) const {
        if (DYNAMIC) return n_qblocks - 1 - unit % (section_heads * n_qblocks) / heads_in_section(unit);
        const int j = unit % units_per_head();
        if (paired) return i == 0 ? n_qblocks - 1 - j : j;
        if (causal) return n_qblocks - 1 - j;
        return ROTATED ? (j + head(unit) * n_qblocks / gridDim.x) % n_qblocks : j;
    }
    template <bool DYNAMIC = false>
    __device__ int head(int unit) const {
        if (DYNAMIC)
            return unit / (section_heads * n_qblocks) * section_heads +
                   unit % (section_heads * n_qblocks) % heads_in_section(unit);
        return unit / units_per_head();
    }
    // DYNAMIC: a section's tiles run from its heads' last query tiles (the longest with a mask)
    // to their first, head by head within a query block.
    __device__ int heads_in_section(int unit) const {
        return min(section_heads, heads_total - unit / (section_heads * n_qblocks) * section_heads);
    }
};

// The block's shared memory: the Q, K and V rings with their barriers, O's staging tile and the
// shared-out tile's merge area (FwdLayout's order). full[s] / empty[s] hand slot s over, the K
// slots' first, then the V slots' (K and V have barriers of their own, so S = Q Kᵀ waits for K
// only); q_full[s] and q_empty[s] hand Q slot s over, once per query tile (query tile n in slot
// n % Q_SLOTS).
template <typename Elem, int D, int GROUPS, bool SPLIT> struct FwdRings {
    using L = FwdLayout<D, GROUPS, SPLIT>;
    Elem *q_ring, *k_ring, *v_ring;
    Elem *o_tile;  // [D/64][BLOCK_ROWS][64], if L::TMA_STORE
    float *merge;    // [GROUPS-1][MERGE_VALUES][128], if L::SPLIT
    uint64_t *k_full, *v_full, *k_empty, *v_empty, *q_full, *q_empty;
    // DYNAMIC: unit_slot[s], the unit whose Q the producer loads into slot s, written before its
    // arrival on q_full[s] (release) and read by the consumers once they have waited for it
    // (acquire); schedule.units() when none is left.
    int *unit_slot;

    __device__ explicit FwdRings(unsigned char *smem_raw) {
        // Rounded up on the integer value, which loses the shared address space: the rings, the
        // staging tile and the barriers are reached through smem_address (PTX's shared space) and
        // lose nothing, but the merge area and unit_slot are read and written in C++, as generic
        // loads and stores (LD.E / ST.E in the SASS), which the backward avoids with smem_align_1024.
        q_ring = (Elem *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
        k_ring = q_ring + L::Q_SLOTS * L::Q_ELEMS;
        v_ring = k_ring + L::K_SLOTS * L::TILE_ELEMS;
        o_tile = v_ring + L::V_SLOTS * L::TILE_ELEMS;
        merge = (float *)(o_tile + L::O_ELEMS);
        uint64_t *full = (uint64_t *)(merge + L::MERGE_FLOATS), *empty = full + L::SLOTS;
        k_full = full, v_full = full + L::K_SLOTS, k_empty = empty, v_empty = empty + L::K_SLOTS;
        q_full = empty + L::SLOTS, q_empty = q_full + L::Q_SLOTS;
        unit_slot = (int *)(q_empty + L::Q_SLOTS);
    }
};

// The producer loop, one thread: for each query tile of the block, in the consumers' order, its Q
// into the Q ring, then each of its key tiles' K and V into their rings, each into a slot the
// consumers have released (ring_wait_empty). One TMA load per 64-column slab; the copy engine
// counts the bytes onto the slot's full barrier (mbarrier_arrive_expect_tx).
template <typename Elem, int D, int GROUPS, bool SPLIT, bool DYNAMIC>
__device__ __forceinline__ void produce(const FwdRings<Elem, D, GROUPS, SPLIT> &r, const CUtensorMap *q_map,
                                        const CUtensorMap *k_map, const CUtensorMap *v_map,
                                        const Schedule &schedule, int S, int S_kv, int heads, int heads_per_kv,
                                        int causal) {
    using L = FwdLayout<D, GROUPS, SPLIT>;
    constexpr int K_SLOTS = L::K_SLOTS, V_SLOTS = L::V_SLOTS, Q_SLOTS = L::Q_SLOTS, BLOCK_ROWS = L::BLOCK_ROWS;
    int tiles_done = 0, ring = 0;  // query tiles and K/V tiles loaded so far
    int fetched = 0;  // DYNAMIC: the next unit, claimed as this one's Q is loaded (below)
    // Query tile n's Q slot, once the last S = Q Kᵀ of the tile that used it before is done.
    auto free_q_slot = [&](int n) { return ring_wait_empty<Q_SLOTS, true>(r.q_empty, n); };
    for (int unit = blockIdx.x; unit < schedule.units(); unit = DYNAMIC ? fetched : unit + gridDim.x) {
        for (int i = 0; i < schedule.tiles_of(unit); i++, tiles_done++) {
            const int q0 = schedule.q_block<L::SPLIT, DYNAMIC>(unit, i, causal) * BLOCK_ROWS;
            const HeadCoords hc = head_coords(schedule.head<DYNAMIC>(unit), heads);
            const HeadCoords kv_at = {hc.head / heads_per_kv, hc.batch};  // the K/V head query head h reads
            // Causal: up to the diagonal of the tile's last row (its query index plus S_kv - S).
            const int n_tiles = ceil_div(causal ? min(S_kv, q0 + BLOCK_ROWS + S_kv - S) : S_kv, KEY_TILE);
            const int q_slot = free_q_slot(tiles_done);
            // DYNAMIC (one tile a unit, one Q slot): the next unit is claimed as this one's Q is
            // loaded, not earlier, so that a block holds at most the unit after the one in hand
            // and the tail balances better; the atomic's round trip hides behind the tile's loads.
            if (DYNAMIC) {
                fetched = gridDim.x + atomicAdd(schedule.unit_counter, 1);
                *(volatile int *)&r.unit_slot[q_slot] = unit;
            }
            mbarrier_arrive_expect_tx(&r.q_full[q_slot], ELEM_BYTES * L::Q_ELEMS);
            for (int c = 0; c < D / SLAB; c++)
                tma_load_4d(r.q_ring + q_slot * L::Q_ELEMS + c * BLOCK_ROWS * SLAB, q_map, c * SLAB, q0, hc.head,
                            hc.batch, &r.q_full[q_slot]);
            for (int tile = 0; tile < n_tiles; tile++, ring++) {
                const int row = tile * KEY_TILE;
                const int k_slot = ring_wait_empty<K_SLOTS, true>(r.k_empty, ring);
                mbarrier_arrive_expect_tx(&r.k_full[k_slot], ELEM_BYTES * L::TILE_ELEMS);
                for (int c = 0; c < D / SLAB; c++)
                    tma_load_4d(r.k_ring + k_slot * L::TILE_ELEMS + c * KEY_TILE * SLAB, k_map, c * SLAB, row,
                                kv_at.head, kv_at.batch, &r.k_full[k_slot]);
                const int v_slot = ring_wait_empty<V_SLOTS, true>(r.v_empty, ring);
                mbarrier_arrive_expect_tx(&r.v_full[v_slot], ELEM_BYTES * L::TILE_ELEMS);
                for (int c = 0; c < D / SLAB; c++)
                    tma_load_4d(r.v_ring + v_slot * L::TILE_ELEMS + c * KEY_TILE * SLAB, v_map, c * SLAB, row,
                                kv_at.head, kv_at.batch, &r.v_full[v_slot]);
            }
        }
    }
    if (DYNAMIC) {  // no unit left: a phase of the next q_full without Q, its word saying so
        const int q_slot = free_q_slot(tiles_done);
        *(volatile int *)&r.unit_slot[q_slot] = schedule.units();
        mbarrier_arrive(&r.q_full[q_slot]);
    }
}

// A shared-out tile's merge: the partial results of every warpgroup into the first warpgroup's
// registers. Thread i of every warpgroup holds the same rows and columns. Each part is scaled from
// its own row max to the largest (2^-inf = 0 for a part with no keys: with one key tile the first
// and the third warpgroup have none, with two the first; but the second owns tile 0 and is merged
// first, so the max is finite from then on and no -inf - -inf arises). kMergeWritten: the other
// warpgroups' parts are written; kMergeRead: the first warpgroup has read them, and the area may
// be written again.
template <int D, int GROUPS, int MERGE_VALUES>
__device__ __forceinline__ void merge_shared_out_parts(float (&o_acc)[D / 2], float (&row_max)[2], float (&row_sum)[2],
                                                       float *merge, int consumer) {
    const int lane128 = threadIdx.x % 128;
    if (consumer > 0) {
        float *mine_out = merge + (consumer - 1) * MERGE_VALUES * 128 + lane128;
#pragma unroll
        for (int e = 0; e < D / 2; e++) mine_out[e * 128] = o_acc[e];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mine_out[(D / 2 + r) * 128] = row_max[r];
            mine_out[(D / 2 + 2 + r) * 128] = row_sum[r];
        }
    }
    named_barrier_sync(kMergeWritten, 128 * GROUPS);
    if (consumer == 0) {
#pragma unroll
        for (int part = 0; part < GROUPS - 1; part++) {
            const float *theirs = merge + part * MERGE_VALUES * 128 + lane128;
            float own_factor[2], their_factor[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float their_max = theirs[(D / 2 + r) * 128];
                const float new_max = fmaxf(row_max[r], their_max);
                own_factor[r] = exp2_of(row_max[r] - new_max);
                their_factor[r] = exp2_of(their_max - new_max);
                row_max[r] = new_max;
                row_sum[r] = row_sum[r] * own_factor[r] + theirs[(D / 2 + 2 + r) * 128] * their_factor[r];
            }
#pragma unroll
            for (int e = 0; e < D / 2; e++)
                o_acc[e] = o_acc[e] * own_factor[(e / 2) % 2] + theirs[e * 128] * their_factor[(e / 2) % 2];
        }
    }
    named_barrier_sync(kMergeRead, 128 * GROUPS);
}

// The epilogue of a query tile: O / l and each row's log-sum-exp in log2 units (log2 sum_j
// 2^(s_ij scale log2 e), which the backward reads). With up to two consumer warpgroups O goes
// through the staging tile, and one thread of the warpgroup (o_storer) issues its TMA stores and
// goes on; with three, every thread stores its rows of O from its registers.
template <typename Elem, int D, int GROUPS, bool SPLIT>
__device__ __forceinline__ void store_query_tile(const float (&o_acc)[D / 2], const float (&row_max)[2],
                                                 const float (&row_sum)[2], const FwdRings<Elem, D, GROUPS, SPLIT> &rings,
                                                 const CUtensorMap *o_map, Elem *o, const RowLayout &o_rows,
                                                 float *lse_log2, int S, int head_index, int q0, int first_query, int warp_row0, int consumer,
                                                 bool o_storer, int o_barrier, int g, int t) {
    using L = FwdLayout<D, GROUPS, SPLIT>;
    constexpr int BLOCK_ROWS = L::BLOCK_ROWS;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = 1.0f / l;
        const int query = first_query + g + 8 * r;
        if (query < S && t == 0) lse_log2[(size_t)head_index * S + query] = row_max[r] + log2f(l);
    }
    if constexpr (L::TMA_STORE) {
        // The staging tile is free once the previous query tile's store has read it.
        if (o_storer) bulk_wait_read<0>();
        named_barrier_sync(o_barrier, 128);
        store_acc_tile<D, BLOCK_ROWS>(rings.o_tile, warp_row0, o_acc, inv, g, t);  // O / l
        fence_proxy_async_shared();
        named_barrier_sync(o_barrier, 128);
        if (o_storer) {  // the warpgroup's 64 rows; rows past S are not written
            const HeadCoords hc = head_coords(head_index, o_rows.heads);
            for (int c = 0; c < D / SLAB; c++)
                tma_store_4d(o_map, rings.o_tile + c * BLOCK_ROWS * SLAB + consumer * GROUP_ROWS * SLAB,
                             c * SLAB, q0 + consumer * GROUP_ROWS, hc.head, hc.batch);
            bulk_commit();
        }
    } else {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int query = first_query + g + 8 * r;
            if (query < S)
#pragma unroll
                for (int j = 0; j < D / 8; j++)
                    *(uint32_t *)(o + o_rows.offset(head_index, query) + j * 8 + 2 * t) =
                        pack2<Elem>(o_acc[4 * j + 2 * r] * inv[r], o_acc[4 * j + 2 * r + 1] * inv[r]);
        }
    }
}

// The consumer side of the K and V rings: the query tile in hand's key tile n is the rings' item
// ring + n. k(n) and v(n) wait for its K or V to land; release_k(n) and release_v(n) hand the slot
// back (one arrival per warp) once its last reader, S = Q Kᵀ or P V, has completed.
template <typename Elem, int D, int GROUPS, bool SPLIT> struct KvReader {
    using L = FwdLayout<D, GROUPS, SPLIT>;
    const FwdRings<Elem, D, GROUPS, SPLIT> &rings;
    int ring;  // K/V tiles of the block's earlier query tiles
    __device__ const Elem *k(int n) const {
        return rings.k_ring + ring_wait_full<L::K_SLOTS, true>(rings.k_full, ring + n) * L::TILE_ELEMS;
    }
    __device__ const Elem *v(int n) const {
        return rings.v_ring + ring_wait_full<L::V_SLOTS, true>(rings.v_full, ring + n) * L::TILE_ELEMS;
    }
    __device__ void release_k(int n) const { mbarrier_arrive_warp(&rings.k_empty[(ring + n) % L::K_SLOTS]); }
    __device__ void release_v(int n) const { mbarrier_arrive_warp(&rings.v_empty[(ring + n) % L::V_SLOTS]); }
};

// The consumer loop of one query tile with the overlap inside the warpgroup (FlashAttention-3):
// S of key tile n is issued before P V of tile n - 1, and the softmax of tile n runs while that
// P V is on the tensor cores. Leaves O, the row max and the row sum for the epilogue.
template <typename Elem, int D, int GROUPS, bool SPLIT>
__device__ __forceinline__ void attend_overlapped(float (&o_acc)[D / 2], float (&row_max)[2], float (&row_sum)[2],
                                                 const KvReader<Elem, D, GROUPS, SPLIT> &kv, const Elem *q_tile,
                                                 uint64_t *q_released, int n_tiles, int S_kv, int causal,
                                                 int diagonal, int consumer, const Turns<GROUPS> &turns, int g,
                                                 int t, float scale_log2) {
    constexpr int BLOCK_ROWS = FwdLayout<D, GROUPS, SPLIT>::BLOCK_ROWS;
    float s_acc[KEY_TILE / 2], alpha[2];  // S, then P (fp32), of the key tile in hand
    uint32_t p_frag[KEY_TILE / 16][4];    // P (Elem) as wgmma's A operand
    // Key tile 0's S and softmax first; then, per key tile n: issue S_n, then
    // P_{n-1} V_{n-1}; wait for S_n only (the older group) and run its softmax
    // while the tensor cores finish P_{n-1} V_{n-1}; then wait for that, scale O by
    // tile n's alpha and pack P_n. O is never touched while a product writes it.
    const Elem *k_tile = kv.k(0);
    // kStagger: the second warpgroup's first S waits for the first's (kStaggerBarrier, 256
    // threads: the second's 128 sync, the first's 128 arrive), so the two softmaxes start a
    // product apart.
    constexpr bool stagger = kStagger && !kPingPong && GROUPS == 2 && D == 128;
    if (stagger && consumer == 1) named_barrier_sync(kStaggerBarrier, 256);
    turns.take();
    issue_qk<Elem, D, BLOCK_ROWS>(s_acc, q_tile, k_tile, consumer);
    turns.pass();
    wgmma_wait<0>();
    if (stagger && consumer == 0) named_barrier_arrive(kStaggerBarrier, 256);
    fence_operands<KEY_TILE / 2>(s_acc);
    kv.release_k(0);
    if (n_tiles == 1) mbarrier_arrive_warp(q_released);
    online_softmax(s_acc, row_max, row_sum, alpha, 0, S_kv, causal, diagonal, g, t, scale_log2);
    pack_a_frags<Elem, KEY_TILE>(p_frag, s_acc);  // O is still 0: nothing to rescale
    for (int tile = 1; tile < n_tiles; tile++) {
        k_tile = kv.k(tile);
        const Elem *v_tile = kv.v(tile - 1);
        turns.take();
        issue_qk<Elem, D, BLOCK_ROWS>(s_acc, q_tile, k_tile, consumer);
        issue_pv<Elem, D>(o_acc, p_frag, v_tile);
        turns.pass();
        wgmma_wait<1>();
        fence_operands<KEY_TILE / 2>(s_acc);
        kv.release_k(tile);
        if (tile == n_tiles - 1) mbarrier_arrive_warp(q_released);  // the query tile's last read of Q
        online_softmax<kSoftmaxUnderPv && D == 128>(s_acc, row_max, row_sum, alpha, tile * KEY_TILE,
                                                   S_kv, causal, diagonal, g, t, scale_log2);
        wgmma_wait<0>();
        fence_operands<D / 2>(o_acc);
        kv.release_v(tile - 1);
        rescale_rows<D>(o_acc, alpha);
        pack_a_frags<Elem, KEY_TILE>(p_frag, s_acc);
    }
    const Elem *v_tile = kv.v(n_tiles - 1);
    turns.take();
    issue_pv<Elem, D>(o_acc, p_frag, v_tile);
    turns.pass();
    wgmma_wait<0>();
    fence_operands<D / 2>(o_acc);
    kv.release_v(n_tiles - 1);
}

// The consumer loop of one query tile in order: each step waits for the one before (S, softmax,
// P V). In a shared-out tile (split) the warpgroups each walk the key tiles they own for the first
// warpgroup's rows, and merge.
template <typename Elem, int D, int GROUPS, bool SPLIT>
__device__ __forceinline__ void attend_in_order(float (&o_acc)[D / 2], float (&row_max)[2], float (&row_sum)[2],
                                                 const KvReader<Elem, D, GROUPS, SPLIT> &kv, const Elem *q_tile,
                                                 uint64_t *q_released, int n_tiles, int S_kv, int causal,
                                                 int diagonal, int consumer, const Turns<GROUPS> &turns, int g,
                                                 int t, float scale_log2, bool split) {
    using L = FwdLayout<D, GROUPS, SPLIT>;
    constexpr int BLOCK_ROWS = FwdLayout<D, GROUPS, SPLIT>::BLOCK_ROWS;
    float s_acc[KEY_TILE / 2], alpha[2];  // S, then P (fp32), of the key tile in hand
    uint32_t p_frag[KEY_TILE / 16][4];    // P (Elem) as wgmma's A operand
    // Each step waits for the one before: S, softmax, P V. A key tile this warpgroup
    // does not own (in a shared-out tile) is only waited for and released: its
    // slots are free once every warpgroup has arrived.
    const int q_group = split ? 0 : consumer;  // whose Q rows this warpgroup multiplies
    const int walk_diagonal = diagonal - (split ? consumer * GROUP_ROWS : 0);
    for (int tile = 0; tile < n_tiles; tile++) {
        const bool mine = !split || (tile + 1) % GROUPS == consumer;
        const Elem *k_tile = kv.k(tile);
        turns.take();
        if (mine) issue_qk<Elem, D, BLOCK_ROWS>(s_acc, q_tile, k_tile, q_group);
        turns.pass();
        if (mine) {
            wgmma_wait<0>();
            fence_operands<KEY_TILE / 2>(s_acc);
        }
        kv.release_k(tile);
        if (tile == n_tiles - 1) mbarrier_arrive_warp(q_released);
        if (mine) {
            online_softmax(s_acc, row_max, row_sum, alpha, tile * KEY_TILE, S_kv, causal, walk_diagonal, g,
                           t, scale_log2);
            rescale_rows<D>(o_acc, alpha);
            pack_a_frags<Elem, KEY_TILE>(p_frag, s_acc);
        }
        const Elem *v_tile = kv.v(tile);
        turns.take();
        if (mine) issue_pv<Elem, D>(o_acc, p_frag, v_tile);
        turns.pass();
        if (mine) {
            wgmma_wait<0>();
            fence_operands<D / 2>(o_acc);
        }
        kv.release_v(tile);
    }
    if (split) merge_shared_out_parts<D, GROUPS, L::MERGE_VALUES>(o_acc, row_max, row_sum, kv.rings.merge, consumer);
}

// KV_LENGTHS: K and V may have another length than Q (S_kv keys per head). A build of its own,
// chosen per launch as KEYS_PAST_S is in the backward, so that where the lengths are equal S_kv is
// S at compile time and the kernel compiles to the instructions it had without them (with S_kv
// known only at run time, the three-warpgroup build measured 1.5% slower at S = 4096).
template <typename Elem, int D, int GROUPS, bool SPLIT, bool DYNAMIC, bool KV_LENGTHS>
__global__ void __launch_bounds__(FwdLayout<D, GROUPS, SPLIT>::THREADS, 1)
wgmma_forward(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
              const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap o_map, Elem *o,
              RowLayout o_rows, float *lse_log2, int S, int S_kv_given, int heads_per_kv, float scale, int causal,
              Schedule schedule) {
    const int S_kv = KV_LENGTHS ? S_kv_given : S;
#if FLASH_STAGES_SM90A
    using L = FwdLayout<D, GROUPS, SPLIT>;
    constexpr int Q_SLOTS = L::Q_SLOTS, BLOCK_ROWS = L::BLOCK_ROWS;
    extern __shared__ unsigned char smem_raw[];
    const FwdRings<Elem, D, GROUPS, SPLIT> rings(smem_raw);
    uint64_t *q_full = rings.q_full, *q_empty = rings.q_empty;
    // In the SPLIT build, read through a shuffle from lane 0: the compiler then knows the
    // warpgroup's index is the same in every thread of a warp, so the shared-out tile's branches
    // on it are not divergent (from threadIdx.x alone, that build kept the ring's counters and the
    // wgmma descriptors in per-thread registers instead of uniform ones, and was slower at every
    // length). The other builds branch on it only outside their loops and keep threadIdx.x / 128:
    // with the shuffle, the two-warpgroup builds measured slower at D = 128.
    const int group = SPLIT ? __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) : threadIdx.x / 128;

    if (threadIdx.x == 0)  // q_full[0] is the ring's, whose set-up syncs the block
        for (int s = 0; s < Q_SLOTS; s++) {
            if (s > 0) mbarrier_init(&q_full[s], 1);
            mbarrier_init(&q_empty[s], 4 * L::GROUPS);
        }
    init_tma_ring(rings.k_full, rings.k_empty, L::SLOTS, 4 * L::GROUPS, q_full);  // the K barriers, then V's

    // Both roles walk the same tiles in the same order; ring slots are numbered across them.
    if (group == 0) {
        // Producer. One thread is enough: a TMA instruction moves a whole 64-column slab.
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) {
            tma_prefetch_descriptor(&q_map), tma_prefetch_descriptor(&k_map), tma_prefetch_descriptor(&v_map);
            if (L::TMA_STORE) tma_prefetch_descriptor(&o_map);
            produce<Elem, D, GROUPS, SPLIT, DYNAMIC>(rings, &q_map, &k_map, &v_map, schedule, S, S_kv, o_rows.heads,
                                                     heads_per_kv, causal);
        }
    } else {
        setmaxnreg_inc<L::CONSUMER_REGS>();
        const int consumer = group - 1;
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        const int warp_row0 = consumer * GROUP_ROWS + (threadIdx.x % 128) / 32 * 16;  // in the block
        const float scale_log2 = scale * 1.4426950408889634f;
        const Turns<L::GROUPS> turns{consumer};
        // The last group's turn passes to group 0 first, as if it had just issued: group 0 starts.
        if (consumer == L::GROUPS - 1) turns.pass();
        int tiles_done = 0, ring = 0;

        // One thread of each warpgroup issues its O stores; the warpgroup's own named barrier
        // orders its threads' writes of the staging tile around them.
        const bool o_storer = threadIdx.x % 128 == 0;
        const int o_barrier = kOBarrier0 + consumer;
        // Query tile n's Q slot, once its Q (or, DYNAMIC, the word saying no unit is left) is there.
        auto landed_q_slot = [&](int n) { return ring_wait_full<Q_SLOTS, true>(q_full, n); };
        // DYNAMIC: the next unit is the one the producer wrote, read once its Q phase has come.
        // Lane 0 reads it and hands it to its warp: the thread that reads the slot is the one
        // whose arrival on q_empty later lets the producer write it again, and the shuffle lets
        // the compiler know the unit is the same in every thread.
        auto producers_unit = [&]() {
            const int q_slot = landed_q_slot(tiles_done);
            const int written = threadIdx.x % 32 == 0 ? *(volatile int *)&rings.unit_slot[q_slot] : 0;
            return __shfl_sync(0xffffffffu, written, 0);
        };
        for (int unit = DYNAMIC ? producers_unit() : blockIdx.x; unit < schedule.units();
             unit = DYNAMIC ? producers_unit() : unit + gridDim.x)
            for (int i = 0; i < schedule.tiles_of(unit); i++, tiles_done++) {
                const int q0 = schedule.q_block<L::SPLIT, DYNAMIC>(unit, i, causal) * BLOCK_ROWS;
                const int head_index = schedule.head<DYNAMIC>(unit);
                const int n_tiles = ceil_div(causal ? min(S_kv, q0 + BLOCK_ROWS + S_kv - S) : S_kv, KEY_TILE);
                // Only the first warpgroup has rows below S: all of them work on its rows, each on
                // the key tiles it owns (tile n is group (n + 1) % GROUPS's, so the first, which
                // merges, walks the fewest), and the others only release the rest of the ring.
                const bool split = L::SPLIT && S - q0 <= GROUP_ROWS;
                const int first_query = q0 + warp_row0, diagonal = first_query + S_kv - S;
                float o_acc[D / 2];  // [D/8 n8 blocks][4], the wgmma accumulator layout
#pragma unroll
                for (int e = 0; e < D / 2; e++) o_acc[e] = 0.0f;
                float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
                const int q_slot = landed_q_slot(tiles_done);
                const Elem *q_tile = rings.q_ring + q_slot * L::Q_ELEMS;
                uint64_t *q_released = &q_empty[q_slot];

                const KvReader<Elem, D, GROUPS, SPLIT> kv{rings, ring};
                if constexpr (L::OVERLAP)
                    attend_overlapped<Elem, D, GROUPS, SPLIT>(o_acc, row_max, row_sum, kv, q_tile, q_released, n_tiles, S_kv,
                                                        causal, diagonal, consumer, turns, g, t, scale_log2);
                else
                    attend_in_order<Elem, D, GROUPS, SPLIT>(o_acc, row_max, row_sum, kv, q_tile, q_released, n_tiles, S_kv,
                                                      causal, diagonal, consumer, turns, g, t, scale_log2, split);
                ring += n_tiles;
                // In a shared-out tile the other warpgroups' rows are all past S: their epilogue
                // below stores nothing.

                store_query_tile<Elem, D, GROUPS, SPLIT>(o_acc, row_max, row_sum, rings, &o_map, o, o_rows, lse_log2, S, head_index, q0,
                                                   first_query, warp_row0, consumer, o_storer, o_barrier, g, t);
            }
        // The block's shared memory must outlive the last store's reads of it.
        if (L::TMA_STORE && o_storer) bulk_wait_read<0>();
        // Group 0 takes the turn the last group passed after its last products, so that no
        // arrival is left pending on a named barrier when the block exits.
        if (consumer == 0) turns.take();
    }
#else
    (void)q_map, (void)k_map, (void)v_map, (void)o_map, (void)o, (void)o_rows, (void)lse_log2, (void)S, (void)S_kv,
        (void)heads_per_kv,
        (void)scale, (void)causal,
        (void)schedule, (void)kPingPong, (void)kIntraOverlap, (void)kOverlapThreeGroups, (void)kStagger,
        (void)kSoftmaxUnderPv;
#endif
}

template <typename Elem, int D, int GROUPS, bool SPLIT = false, bool DYNAMIC = false, bool KV_LENGTHS = false>
static cudaError_t launch_forward(const attn_shape *s, const attn_tensors *t, int sms, cudaStream_t stream) {
    using L = FwdLayout<D, GROUPS, SPLIT>;
    const int heads_total = s->batch * s->heads, B = s->batch, H = s->heads, H_kv = attn_kv_heads(s), S = s->seq,
              S_kv = attn_kv_seq(s);
    // Each tensor through its own strides (attn_tensors; zero: contiguous [B, H, S, D]); K and V
    // have H_kv heads of S_kv keys, each head read by H / H_kv query heads.
    const RowLayout o_rows = row_layout(t->o_strides, H, S, D);
    CUtensorMap q_map, k_map, v_map, o_map;  // O's box: one warpgroup's rows
    cudaError_t err = make_tensor_map(&q_map, t->q, s->dtype, row_layout(t->q_strides, H, S, D), B, S, D, L::BLOCK_ROWS);
    if (err == cudaSuccess)
        err = make_tensor_map(&k_map, t->k, s->dtype, row_layout(t->k_strides, H_kv, S_kv, D), B, S_kv, D, KEY_TILE);
    if (err == cudaSuccess)
        err = make_tensor_map(&v_map, t->v, s->dtype, row_layout(t->v_strides, H_kv, S_kv, D), B, S_kv, D, KEY_TILE);
    if (err == cudaSuccess) err = make_tensor_map(&o_map, t->o, s->dtype, o_rows, B, S, D, GROUP_ROWS);
    if (err == cudaSuccess) err = allow_dynamic_smem(wgmma_forward<Elem, D, GROUPS, SPLIT, DYNAMIC, KV_LENGTHS>, L::bytes);
    if (err != cudaSuccess) return err;
    const int n_qblocks = ceil_div(s->seq, L::BLOCK_ROWS);
    const size_t head_bytes = 2 * ELEM_BYTES * (size_t)S_kv * D;  // its K and V (shared with its group)
    const int section_heads = (int)max((size_t)1, (size_t)SECTION_BYTES / head_bytes);
    Schedule schedule = {n_qblocks, heads_total, !DYNAMIC && kPersistent && s->causal && n_qblocks * heads_total > sms,
                         section_heads, NULL};
    const int blocks = kPersistent ? min(schedule.units(), sms) : schedule.units();  // one block per SM fits
    if (DYNAMIC) {  // the call's own counter (forward scratch, in any state on entry)
        schedule.unit_counter = (int *)t->forward_scratch;
        err = cudaMemsetAsync(schedule.unit_counter, 0, sizeof(int), stream);
        if (err != cudaSuccess) return err;
    }
    wgmma_forward<Elem, D, GROUPS, SPLIT, DYNAMIC, KV_LENGTHS><<<blocks, L::THREADS, L::bytes, stream>>>(
        q_map, k_map, v_map, o_map, (Elem *)t->o, o_rows, workspace_lse(s, t), S, S_kv, attn_group(s),
        1.0f / sqrtf((float)s->dim), s->causal, schedule);
    return cudaGetLastError();
}

// Whether the mask and length allow D = 64 blocks of CONSUMERS_D64 warpgroups (the launcher also
// asks that their 192-row tiles give every SM one); shared_bytes follows the same rule.
static bool wide_by_mask(const attn_shape *s) { return !s->causal || s->seq >= CAUSAL_THREE_GROUPS_FROM; }

// Whether D = 64 blocks of three warpgroups run the build that shares a head's last tile out by its
// key tiles (kSplitPartialTile): without a mask, where that tile has rows for the first warpgroup
// only and is one of at most SPLIT_MAX_TILES tiles of its head. The build costs a few percent on
// every other tile (its branches and merge change the compiled loop, and the rotated schedule
// reads K and V in another order), so it pays only where the tile it saves is a large share.
static bool shares_out_last_tile(const attn_shape *s) {
    const int rows = FwdLayout<64, CONSUMERS_D64>::BLOCK_ROWS, n_qblocks = ceil_div(s->seq, rows);
    return FwdLayout<64, CONSUMERS_D64, true>::SPLIT && !s->causal &&
           s->seq - (n_qblocks - 1) * rows <= GROUP_ROWS && n_qblocks <= SPLIT_MAX_TILES;
}

template <typename Elem>
static cudaError_t forward_of_type(const attn_shape *s, const attn_tensors *t, int sms, cudaStream_t stream) {
    // K and V of another length than Q: blocks of two consumer warpgroups, statically scheduled.
    if (attn_kv_seq(s) != s->seq)
        return s->dim == 128 ? launch_forward<Elem, 128, 2, false, false, true>(s, t, sms, stream)
                             : launch_forward<Elem, 64, 2, false, false, true>(s, t, sms, stream);
    const int tiles_of_64_rows = ceil_div(s->seq, GROUP_ROWS) * s->batch * s->heads;
    if (kSmallOneGroup && tiles_of_64_rows <= sms)  // every block an SM of its own
        return s->dim == 128 ? launch_forward<Elem, 128, 1>(s, t, sms, stream)
                             : launch_forward<Elem, 64, 1>(s, t, sms, stream);
    if (s->dim == 128) return launch_forward<Elem, 128, 2>(s, t, sms, stream);
    const int wide_tiles = ceil_div(s->seq, FwdLayout<64, CONSUMERS_D64>::BLOCK_ROWS) * s->batch * s->heads;
    if (wide_by_mask(s) && wide_tiles >= sms)
        return shares_out_last_tile(s) ? launch_forward<Elem, 64, CONSUMERS_D64, true>(s, t, sms, stream)
                                       : launch_forward<Elem, 64, CONSUMERS_D64>(s, t, sms, stream);
    if (kDynamicSchedule && s->causal) return launch_forward<Elem, 64, 2, false, true>(s, t, sms, stream);
    return launch_forward<Elem, 64, 2>(s, t, sms, stream);
}

cudaError_t stage10_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    return s->dtype == ATTN_BF16 ? forward_of_type<__nv_bfloat16>(s, t, sms, stream)
                                 : forward_of_type<__half>(s, t, sms, stream);
}

// The most a block may ask for at this shape (which configuration runs depends on the GPU's SMs).
static size_t shared_bytes(const attn_shape *s) {
    const size_t wide = FwdLayout<64, CONSUMERS_D64, true>::bytes, narrow = FwdLayout<64, 2>::bytes;
    const size_t fwd = s->dim == 128 ? FwdLayout<128, 2>::bytes : !wide_by_mask(s) ? narrow : wide > narrow ? wide : narrow;
    const size_t bwd = stage10_backward_shared_bytes(s);
    return fwd > bwd ? fwd : bwd;
}

// The dynamic schedule's counter, one per call (attn.h): the launcher zeroes it before the kernel.
static size_t forward_scratch_bytes(const attn_shape *) { return kDynamicSchedule ? sizeof(int) : 0; }

extern "C" const attn_stage STAGE = {
    .name = "10_fa3_schedule",
    .idea = "FlashAttention-3's schedule on stage 09's frame: the softmax under the previous key tile's P V, "
        "persistent blocks, TMA stores; the backward's five products with dQ added by bulk reductions",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = lse_workspace_bytes,
    .shared_bytes = shared_bytes,
    .forward = stage10_forward,
    .backward = stage10_backward,
    .backward_scratch_bytes = stage10_backward_scratch_bytes,
    .forward_scratch_bytes = forward_scratch_bytes,
    .needs_sm90a = 1,  // wgmma, setmaxnreg: compute capability 9.0 only
    .runs_bf16 = 1,
    .runs_gqa = 1,      // K/V heads read by their groups of query heads
    .runs_strided = 1,  // every tensor read and written through its strides (TMA maps, RowLayout)
    .runs_kv_seq = 1,   // K and V of their own length, the causal mask aligned bottom-right
};
