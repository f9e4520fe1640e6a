// Stage 10, backward - FlashAttention-2's backward pass and its five products on Hopper, with
// dQ added by bulk reductions as FlashAttention-3 does: wgmma, a TMA producer warpgroup and two
// consumer warpgroups per block (the forward's structure).
//
// The idea: the forward saved only O and each row's log-sum-exp, so P is recomputed tile by tile
// (P = 2^(S scale log2 e - lse_log2)) instead of being stored (S x S). Then
//   δ_i = rowsum(dO ∘ O)      (backward_delta, a small pre-pass)
//   dV += Pᵀ dO,  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ - δ),  dK += dSᵀ Q,  dQ += dS K
// backward_dk_dv gives each block 128 keys (64 per consumer warpgroup) and walks over the query
// tiles, holding dK and dV in registers. Everything is computed transposed (keys as rows), so Pᵀ
// and dSᵀ come out as accumulators that are the A operands of dV += Pᵀ dO and dK += dSᵀ Q straight
// from registers. dQ's rows are queries, which every key block touches, so dQ is summed across
// blocks in one of two ways (kAtomicDq):
//   atomics (as built; the lesson compares the two): dSᵀ also goes to shared memory, where the wgmma of
//     dQ += dS K reads it transposed. A warpgroup stages its dQ of the walked tile in shared
//     memory, in the order its threads hold it, and a writer thread of the producer warpgroup adds
//     the tile to a float dQ in global memory by one bulk reduction (cp.reduce.async.bulk: the L2
//     does the adds), while the consumers go on; backward_dq_unpermute turns the sums into fp16 or bf16,
//     each head's as soon as that head's key blocks are done (kEarlyDqConversion), on the SMs that
//     backward_dk_dv's last blocks leave idle. Five products; the order of the adds varies from
//     run to run, so dQ's last bits do.
//   deterministic (-DATOMIC_DQ=0): backward_dq gives each block 128 queries and walks over the key
//     tiles, recomputing S and dP, and owns its dQ rows: seven products, no atomics, the same bits
//     on every run.
// In a tile, S (or Sᵀ) and dP (or dPᵀ) are two wgmma groups: the exponentials of P run while the
// tensor cores compute dP. Their A operand, the block's own rows (K and V, or Q and dO), is loaded
// into registers once where the registers allow (kOwnInRegisters: not in backward_dk_dv at D = 128,
// where that kernel's wgmma reads them from shared memory), so that the tensor cores read only the
// walked tile from shared memory. Every wait on an mbarrier is a try_wait, which lets the hardware suspend the waiting
// warp instead of spinning on the same issue slots as the consumers. At the end of
// backward_dk_dv the warpgroups write dK and dV into the shared memory of the owned K and V tiles,
// and TMA stores take them to global memory (kTmaStoreDkDv), so that the block frees its SM soon.
// What changed from stage 08's backward: wgmma instead of ldmatrix + mma.sync; a TMA producer
// warpgroup and setmaxnreg instead of a block-wide cp.async ring; P never leaves registers; dQ
// added by bulk reductions from a writer thread instead of by each warp's atomics; dK and dV
// written by TMA stores; every tensor read and written through its strides, as in the forward;
// grouped K/V heads: each query head's blocks write its shares of dK and dV, which
// backward_sum_groups adds over the group (kExpandGroups); K and V of another length (S_kv; causal
// aligned bottom-right), in builds of their own (KV_LENGTHS).
// Limits: Hopper only; with grouped heads the shares take scratch memory of H / H_kv times K and V,
// written and read once; the walked tile is 64 rows; a consumer waits for each tile's dV, dK and
// dQ products before the next tile's S (queuing S behind them is kCrossTileOverlap, off as built;
// the notes measure it); at D = 128 one dQ staging slot fits, so a tile's dQ waits until the previous
// one has been read.
// backward_dk_dv is a skeleton over named steps: bwd_produce (the producer loop), write_dq (the dQ
// writer thread) and dk_dv_consumer (the consumer loop), which per walked tile calls
// pt_and_dst_frags (Pᵀ and dSᵀ, through probabilities_t and ds_t), issue_tile_products (dQ, dV
// and dK on wgmma) and stage_dq (a tile's dQ handed to the writer), then store_dk_dv (the epilogue).
#include <math.h>

#include "kernel_common.cuh"
#include "backward_common.cuh"
#include "stage10.h"
#include "wgmma_ptx.cuh"

#define BWD_GROUPS 2                              // consumer warpgroups
#define BWD_OWN (64 * BWD_GROUPS)                 // rows a block owns: keys (dK/dV) or queries (dQ)
#define BWD_WALK 64                               // rows of the tiles walked over
#define BWD_THREADS (128 * (BWD_GROUPS + 1))

// dQ by atomics from the dK/dV kernel (1, as built; the lesson compares the two), or by the
// second, deterministic kernel (0).
#ifndef ATOMIC_DQ
#define ATOMIC_DQ 1
#endif
constexpr bool kAtomicDq = ATOMIC_DQ;

// With atomic dQ at D = 64: each warpgroup sums dQ over its own 64 keys, all D columns (1), so the
// warpgroups never wait for each other and the wgmma is 64 wide, and the writer adds both
// groups' tiles (twice the adds in the L2); instead of each group taking D/2 columns over all 128
// keys once both groups' dSᵀ are in shared memory (0, and always at D = 128, where a D-wide dQ
// accumulator does not fit in the registers beside dK and dV).
#ifndef DQ_PER_GROUP
#define DQ_PER_GROUP 1
#endif
// With atomic dQ: a walked tile's dQ staged in shared memory and added to global memory by bulk
// reductions that one writer thread issues (1, as built; the lesson compares the two), instead of each
// consumer thread adding its accumulators with vector reductions, four floats each
// (red.global.add.v4.f32, 0), which needs no staging, fence or hand-over.
#ifndef BULK_REDUCE_DQ
#define BULK_REDUCE_DQ 1
#endif
constexpr bool kBulkReduceDq = BULK_REDUCE_DQ;

// The kernels after backward_delta started by dependent launches (1: launch_dependent), so that
// each one's set-up overlaps the end of the one before and the gap between launches, instead of
// ordinary launches, each waiting for the previous kernel to finish (0).
#ifndef DEPENDENT_LAUNCH
#define DEPENDENT_LAUNCH 1
#endif
constexpr bool kDependentLaunch = DEPENDENT_LAUNCH;

// dQ's conversion started head by head (1): backward_dk_dv lets backward_dq_unpermute launch as
// soon as all of its own blocks have started and waited for backward_delta
// (grid_launch_dependents), each of its blocks counts itself on its head's counter once its dQ
// sums are complete in global memory, and a block of backward_dq_unpermute waits for the key
// blocks of its own head only, so that the conversion runs on the SMs that backward_dk_dv's last
// blocks leave idle. Or each block of backward_dq_unpermute waits for the whole of backward_dk_dv
// (0). It needs the dependent launch (without one the conversion starts after backward_dk_dv
// anyway) and the bulk reductions (whose writer thread knows when its block's sums are complete).
#ifndef EARLY_DQ_CONVERSION
#define EARLY_DQ_CONVERSION 1
#endif
constexpr bool kEarlyDqConversion = EARLY_DQ_CONVERSION && kAtomicDq && kBulkReduceDq && kDependentLaunch;

template <int D>
constexpr bool kDqPerGroup = kAtomicDq && DQ_PER_GROUP && D == 64;

// dK and dV of backward_dk_dv written through shared memory by TMA stores (1): once no warpgroup
// reads its rows of the owned K and V tiles any more, each writes its rows of dK and dV as fp16 or bf16
// into their place and one of its threads hands them to the copy engine, which writes whole 128-byte
// rows, so that the block leaves its SM soon after. Or each thread stores its accumulators to
// global memory itself (0): 4-byte stores from registers, eight rows apart, which the SM must issue
// before the block's last warps can exit.
#ifndef TMA_STORE_DK_DV
#define TMA_STORE_DK_DV 1
#endif
constexpr bool kTmaStoreDkDv = TMA_STORE_DK_DV;

// The owned tile's rows as A operands from registers (1), loaded once per block, instead of read
// from shared memory by every wgmma of S and dP (0). Where the registers allow it: both kernels
// at D = 64, backward_dq at D = 128 (dK/dV's two D-wide accumulators leave no room there).
#ifndef OWN_IN_REGISTERS
#define OWN_IN_REGISTERS 1
#endif
template <int D, bool kDkDv>
constexpr bool kOwnInRegisters = OWN_IN_REGISTERS && (D == 64 || !kDkDv);

// Each kernel issues the next walked tile's S and dP right after this tile's last product (1), so
// that the tensor cores have them queued while the warpgroup waits, instead of waiting for that
// product first (0, as built; ptxas serializes the wgmmas of the build with 1, advisory C7515, so
// the lesson's comparison of the two is not of the schedule alone).
#ifndef CROSS_TILE_OVERLAP
#define CROSS_TILE_OVERLAP 0
#endif
constexpr bool kCrossTileOverlap = CROSS_TILE_OVERLAP;

// Grouped K/V heads (fewer K/V heads than query heads): backward_dk_dv gives each query head
// blocks of its own, which write that head's share of dK and dV into the backward's scratch, and
// backward_sum_groups adds each group's shares (1); or each block owns a K/V head's keys and walks
// the query heads of its group one after the other, dK and dV adding up in registers (0). The walk
// has fewer blocks, each as long as the group is large, so that its last wave is long and, causal,
// unequal; the shares cost one write and one read of them, twice K and V times the group.
#ifndef EXPAND_GROUPS
#define EXPAND_GROUPS 1
#endif
constexpr bool kExpandGroups = EXPAND_GROUPS;

// Shared memory of both kernels: two owned [D/64][BWD_OWN][64] tiles (Q and dO, or K and V), a
// ring of SLOTS pairs of walked [D/64][BWD_WALK][64] tiles, each warpgroup's two slots of the
// walked rows' lse and delta ([BWD_GROUPS][2][2][BWD_WALK] floats, backward_dk_dv); with atomic dQ
// two [BWD_OWN][64] tiles of dSᵀ (keys as rows; one per walked tile, alternating) and, staged for
// the bulk reductions (kBulkReduceDq), DQ_SLOTS slots of a walked tile's dQ in float
// (DQ_GROUP_TILES tiles of DQ_TILE_ELEMS each, in the accumulators' order: see dq_stage_index);
// then the mbarriers.
template <int D> struct BwdLayout {
    // Walked-tile slots: four at D = 64, where they fit beside the dQ staging, so that the
    // producer can run further ahead of the consumers; two at D = 128, where a third does not fit.
    static constexpr int SLOTS = D == 64 ? 4 : 2;
    static constexpr int OWN_ELEMS = BWD_OWN * D;
    static constexpr int WALK_ELEMS = BWD_WALK * D;
    static constexpr int DS_ELEMS = kAtomicDq ? BWD_OWN * BWD_WALK : 0;
    static constexpr int DQ_TILE_ELEMS = BWD_WALK * D;
    static constexpr int DQ_GROUP_TILES = kDqPerGroup<D> ? BWD_GROUPS : 1;  // staged tiles per walked tile
    // Two staging slots where they fit (D = 64), so that a tile's dQ need not wait for the
    // previous one to be read; one at D = 128.
    static constexpr int DQ_SLOTS = D == 64 ? 2 : 1;
    static constexpr int DQ_STAGE_ELEMS = kAtomicDq && kBulkReduceDq ? DQ_SLOTS * DQ_GROUP_TILES * DQ_TILE_ELEMS : 0;
    static constexpr int STATS_ELEMS = BWD_GROUPS * 2 * 2 * BWD_WALK;
    static constexpr size_t bytes = 1024 +
                                    ELEM_BYTES * (2 * OWN_ELEMS + 2 * SLOTS * WALK_ELEMS + 2 * DS_ELEMS) +
                                    sizeof(float) * (DQ_STAGE_ELEMS + STATS_ELEMS) +
                                    sizeof(uint64_t) * (2 * SLOTS + 1 + 2 * DQ_SLOTS);
    static_assert(bytes <= 232448, "more shared memory than a Hopper block may have");
};

// With atomic dQ a walked tile's 64 x D float dQ is staged, and summed in global memory, in the
// order the consumer threads hold it, so that each thread stores float4s that its neighbours
// continue (no bank conflicts) and one bulk reduction adds the whole tile: chunk j (columns 8j..,
// registers 4j..4j+3) of column half w (a warpgroup's share where the groups split the columns)
// held by thread i (of 128) of a warpgroup is at float (w * D/16 + j) * 512 + 4 i.
// Rows past S are summed and never read.
template <int D>
__host__ __device__ inline int dq_stage_index(int row, int col) {
    const int group = col / (D / 2), group_col = col % (D / 2);                    // warpgroup w, its column
    const int thread = row / 16 * 32 + row % 8 * 4 + group_col % 8 / 2;           // warp, g, t
    return ((group * (D / 16) + group_col / 8) * 128 + thread) * 4 + row % 16 / 8 * 2 + col % 2;
}

// The inverse, for backward_dq_unpermute: float4 `vec` of a staged tile holds columns col, col + 1
// of rows row and row + 8 (chunk vec / 128 of thread vec % 128, as dq_stage_index placed them).
template <int D>
__host__ __device__ inline void dq_stage_position(int vec, int *row, int *col) {
    const int chunk = vec / 128, thread = vec % 128, lane = thread % 32;
    *row = thread / 32 * 16 + lane / 4;
    *col = chunk / (D / 16) * (D / 2) + chunk % (D / 16) * 8 + lane % 4 * 2;
}

// The producer/consumer frame both kernels share. The producer thread loads the two owned tiles
// (rows own0.., onto own_full) and then, for each step i = 0, 1, ... of the walk (BwdWalk), that
// step's 64 rows of the two walked tensors into ring slot i % SLOTS.
template <typename Elem> struct BwdSmem {
    Elem *own_a, *own_b, *walk_a, *walk_b;  // walk_*: [SLOTS][tile]
    Elem *ds;                               // [2][BWD_OWN][64]: dSᵀ (atomic dQ only)
    float *dq_stage;                          // [DQ_SLOTS][DQ_GROUP_TILES][DQ_TILE_ELEMS] (atomic dQ)
    float *stats;                             // [BWD_GROUPS][2][2][BWD_WALK]: walked rows' lse, delta
    uint64_t *full, *empty, *own_full;
    uint64_t *dq_full, *dq_empty;             // [DQ_SLOTS] each: a slot staged, and added (atomic dQ)
};

template <typename Elem, int D>
__device__ inline BwdSmem<Elem> bwd_smem(unsigned char *raw) {
    using L = BwdLayout<D>;
    BwdSmem<Elem> m;
    m.own_a = (Elem *)smem_align_1024(raw);
    m.own_b = m.own_a + L::OWN_ELEMS;
    m.walk_a = m.own_b + L::OWN_ELEMS;
    m.walk_b = m.walk_a + L::SLOTS * L::WALK_ELEMS;
    m.ds = m.walk_b + L::SLOTS * L::WALK_ELEMS;
    m.dq_stage = (float *)(m.ds + 2 * L::DS_ELEMS);
    m.stats = m.dq_stage + L::DQ_STAGE_ELEMS;
    m.full = (uint64_t *)(m.stats + L::STATS_ELEMS);
    m.empty = m.full + L::SLOTS;
    m.own_full = m.empty + L::SLOTS;
    m.dq_full = m.own_full + 1;
    m.dq_empty = m.dq_full + L::DQ_SLOTS;
    return m;
}

// The tiles a block walks: n_tiles tiles from first_tile on of `heads` heads one after the other,
// from flat head head0. Step w of the walk (its ring item) is tile tile(w) of head head(w). With
// grouped K/V heads (GROUPED), backward_dk_dv walks the query heads that share its K/V head;
// otherwise one head, and a step is a tile with no division (the loop compiles as for one head).
template <bool GROUPED>
struct BwdWalk {
    int head0, heads, first_tile, n_tiles;
    __device__ int steps() const { return GROUPED ? heads * n_tiles : n_tiles; }
    __device__ int head(int w) const { return GROUPED ? head0 + w / n_tiles : head0; }
    __device__ int tile(int w) const { return first_tile + (GROUPED ? w % n_tiles : w); }
};

// The producer loop: the block's own tiles (own0.., head own_at) once, then every step of the walk
// into the ring; walked_heads is the walked tensors' heads per batch (for their coordinates).
template <typename Elem, int D, typename Walk>
__device__ inline void bwd_produce(const BwdSmem<Elem> &m, const CUtensorMap *own_a, const CUtensorMap *own_b,
                                   const CUtensorMap *walk_a, const CUtensorMap *walk_b, int own0, HeadCoords own_at,
                                   const Walk &walk, int walked_heads) {
    using L = BwdLayout<D>;
    tma_prefetch_descriptor(own_a), tma_prefetch_descriptor(own_b);
    tma_prefetch_descriptor(walk_a), tma_prefetch_descriptor(walk_b);
    mbarrier_arrive_expect_tx(m.own_full, 2 * ELEM_BYTES * L::OWN_ELEMS);
    for (int c = 0; c < D / 64; c++) {
        tma_load_4d(m.own_a + c * BWD_OWN * 64, own_a, c * 64, own0, own_at.head, own_at.batch, m.own_full);
        tma_load_4d(m.own_b + c * BWD_OWN * 64, own_b, c * 64, own0, own_at.head, own_at.batch, m.own_full);
    }
    for (int w = 0; w < walk.steps(); w++) {
        const int slot = ring_wait_empty<L::SLOTS, true>(m.empty, w);
        const HeadCoords at = head_coords(walk.head(w), walked_heads);
        const int row = walk.tile(w) * BWD_WALK;
        mbarrier_arrive_expect_tx(&m.full[slot], 2 * ELEM_BYTES * L::WALK_ELEMS);
        for (int c = 0; c < D / 64; c++) {
            const int dst = slot * L::WALK_ELEMS + c * BWD_WALK * 64;
            tma_load_4d(m.walk_a + dst, walk_a, c * 64, row, at.head, at.batch, &m.full[slot]);
            tma_load_4d(m.walk_b + dst, walk_b, c * 64, row, at.head, at.batch, &m.full[slot]);
        }
    }
}

// This warp's 16 rows (row0..) of an owned tile as the A operands of the D/16 k steps of a
// product over D: ldmatrix from the 128-byte swizzle, which inside a 64-column slab is stage 07's
// swizzle<64>.
template <int D, typename Elem>
__device__ inline void load_own_frags(uint32_t frag[D / 16][4], const Elem *own, int row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) load_a_frag<64>(frag[kk], own + (kk / 4) * BWD_OWN * 64, row0, (kk % 4) * 16, lane);
}

// A warpgroup's rows of the two owned tiles (K and V, or Q and dO) as the A operands of its
// S-like products (S and dP, or Sᵀ and dPᵀ, over D): with REGS (kOwnInRegisters) this warp's 16
// rows are loaded into registers once, so that the tensor cores read only the walked tile;
// without, every wgmma reads them from shared memory.
template <typename Elem, int D, bool REGS> struct OwnOperands {
    uint32_t a_frag[REGS ? D / 16 : 1][4], b_frag[REGS ? D / 16 : 1][4];  // of own_a, own_b
    int group_row0;                                                       // the group's first row

    __device__ OwnOperands(const BwdSmem<Elem> &m, int group_row0_, int warp_row0, int lane) : group_row0(group_row0_) {
        if constexpr (REGS) {
            load_own_frags<D>(a_frag, m.own_a, group_row0 + warp_row0, lane);
            load_own_frags<D>(b_frag, m.own_b, group_row0 + warp_row0, lane);
        }
    }

    // acc (64 x 64) = the group's rows of `own` (frag in registers) times walkᵀ, over D: both
    // K-major. Issued, not waited for.
    __device__ void product(float acc[32], const uint32_t frag[][4], const Elem *own, const Elem *walk) const {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            if constexpr (REGS)
                wgmma_m64n64k16_rs<Elem, 0>(acc, frag[kk], desc_k_major<BWD_WALK>(walk, 0, kk), kk > 0);
            else
                wgmma_m64k16_ss<Elem, BWD_WALK>(acc, desc_k_major<BWD_OWN>(own, group_row0, kk),
                                          desc_k_major<BWD_WALK>(walk, 0, kk), kk > 0);
        }
    }

    // The two S-like products of walked tile `tile`, once its slot is full, as two wgmma groups:
    // the exponentials of P can run while the tensor cores compute dP.
    __device__ void issue_s_and_dp(float s_acc[32], float dp_acc[32], const BwdSmem<Elem> &m, int tile) const {
        constexpr int SLOTS = BwdLayout<D>::SLOTS;
        const int slot = ring_wait_full<SLOTS, true>(m.full, tile);
        wgmma_fence();
        product(s_acc, a_frag, m.own_a, m.walk_a + slot * BwdLayout<D>::WALK_ELEMS);
        wgmma_commit();
        product(dp_acc, b_frag, m.own_b, m.walk_b + slot * BwdLayout<D>::WALK_ELEMS);
        wgmma_commit();
    }
};

// Rows g and g + 8 of this warp (row0..) of a 64 x D accumulator, times factor, to head
// `head_index` of a tensor laid out by `rows`.
template <typename Elem, int D>
__device__ inline void store_rows(Elem *dst, const RowLayout &rows, int head_index, const float acc[D / 2], float factor,
                                  int row0, int S, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        if (row >= S) continue;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *(uint32_t *)(dst + rows.offset(head_index, row) + j * 8 + 2 * t) =
                pack2<Elem>(acc[4 * j + 2 * r] * factor, acc[4 * j + 2 * r + 1] * factor);
    }
}

// The 16-row half-pairs of an Elem (fp16 or bf16) A operand (pack_a_frags) are the values of dSᵀ this thread
// holds: frag[kk][i] is row g + 8 (i % 2) of the warp's 16, columns 16 kk + 8 (i / 2) + 2t, +1.
// They go to a 128-byte-swizzled [rows][64] tile at the warp's first row (ds_row0): 16-byte chunk
// c of row r at c ^ (r % 8), as TMA would have written it, so a wgmma descriptor can read it.
template <typename Elem>
__device__ inline void store_ds_frags(Elem *ds_tile, int ds_row0, const uint32_t frag[BWD_WALK / 16][4], int lane) {
    const int g = lane / 4, t = lane % 4;
    const uint32_t row_address = smem_address(ds_tile + (ds_row0 + g) * 64) + 4 * t;
#pragma unroll
    for (int kk = 0; kk < BWD_WALK / 16; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int chunk = 2 * kk + i / 2;  // row % 8 is g: rows start at multiples of 8
            st_shared_b32(row_address + 1024 * (i % 2) + ((chunk ^ g) << 4), frag[kk][i]);
        }
}

// The dQ writer, one thread of the producer warpgroup: each staged tile of dQ is added to the
// float dQ by one bulk reduction of 64 x D floats (the L2 does the adds), and its slot handed back
// once it is read.
template <typename Elem, int D, typename Walk>
__device__ __forceinline__ void write_dq(const BwdSmem<Elem> &m, float *dq_accum, int *dq_heads_done, int S,
                                         const Walk &walk) {
    using L = BwdLayout<D>;
    grid_dependency_wait();  // backward_delta has zeroed the float dQ
    const int tiles_per_head = ceil_div(S, BWD_WALK);
    for (int w = 0; w < walk.steps(); w++) {
        const int dq_slot = ring_wait_full<L::DQ_SLOTS, true>(m.dq_full, w);
        const size_t tile_index = (size_t)walk.head(w) * tiles_per_head + walk.tile(w);
        for (int part = 0; part < L::DQ_GROUP_TILES; part++)
            bulk_reduce_add_f32(dq_accum + tile_index * L::DQ_TILE_ELEMS,
                                m.dq_stage + (dq_slot * L::DQ_GROUP_TILES + part) * L::DQ_TILE_ELEMS,
                                sizeof(float) * L::DQ_TILE_ELEMS);
        bulk_commit();
        bulk_wait_read<0>();
        mbarrier_arrive(&m.dq_empty[dq_slot]);
    }
    bulk_wait<0>();  // the adds are done before the block's shared memory goes
    if (kEarlyDqConversion) {  // and this key block's share of its heads' dQ is in place
        fence_proxy_async_global();
        for (int h = walk.head0; h < walk.head0 + walk.heads; h++) counter_add_release(&dq_heads_done[h], 1);
    }
}

// A walked tile's share of dQ, from this warpgroup's accumulators (DQ_COLS columns from dq_col0 of
// the warp's 16 rows). With bulk reductions, it goes into its staging slot once the writer thread
// has added the slot's last tile (write_dq), then is handed to the writer, which adds it to the
// float dQ in global memory. Without, each thread adds its accumulators to the float dQ itself,
// four floats per reduction, where the staged tile has them.
template <typename Elem, int D, int DQ_COLS, bool PER_GROUP, typename Walk>
__device__ __forceinline__ void stage_dq(const float (&dq_acc)[DQ_COLS / 2], const BwdSmem<Elem> &m, float *dq_accum, int w,
                                         const Walk &walk, int S, int consumer, int warp_row0, int dq_col0, int g,
                                         int t) {
    constexpr int DQ_SLOTS = BwdLayout<D>::DQ_SLOTS;
    int dq_slot = 0;  // with bulk reductions, the staging slot
    float *dq_tile;   // the staging slot's tile, or the walked tile's in the float dQ
    if constexpr (kBulkReduceDq) {
        dq_slot = ring_wait_empty<DQ_SLOTS, true>(m.dq_empty, w);
        dq_tile = m.dq_stage + (dq_slot * BwdLayout<D>::DQ_GROUP_TILES + (PER_GROUP ? consumer : 0)) *
                                   BwdLayout<D>::DQ_TILE_ELEMS;
    } else {
        const size_t tile_index = (size_t)walk.head(w) * ceil_div(S, BWD_WALK) + walk.tile(w);
        dq_tile = dq_accum + tile_index * BwdLayout<D>::DQ_TILE_ELEMS;
    }
#pragma unroll
    for (int j = 0; j < DQ_COLS / 8; j++) {
        float *dst = dq_tile + dq_stage_index<D>(warp_row0 + g, dq_col0 + 8 * j + 2 * t);
        const float4 sums = make_float4(dq_acc[4 * j], dq_acc[4 * j + 1], dq_acc[4 * j + 2], dq_acc[4 * j + 3]);
        if constexpr (kBulkReduceDq)
            *(float4 *)dst = sums;
        else
            red_add_v4_f32(dst, sums);
    }
    if constexpr (kBulkReduceDq) {
        fence_proxy_async_shared();
        mbarrier_arrive_warp(&m.dq_full[dq_slot]);
    }
}

// The block's dK (times the softmax scale) and dV, once every walked tile is done. Through
// shared memory by TMA stores (kTmaStoreDkDv), or by every thread from its registers.
// BOTH_GROUPS: a group's dQ product has read the keys of both groups.
template <typename Elem, int D, bool BOTH_GROUPS>
__device__ __forceinline__ void store_dk_dv(const float (&dk_acc)[D / 2], const float (&dv_acc)[D / 2], const BwdSmem<Elem> &m,
                                            const CUtensorMap *dk_map, const CUtensorMap *dv_map, Elem *dk, Elem *dv,
                                            const RowLayout &dk_rows, const RowLayout &dv_rows, float scale, int S_kv, int head_index, int k0, int consumer, int group_row0,
                                            int warp_row0, int warp_key0, int lane, int g, int t) {
    if constexpr (kTmaStoreDkDv) {
        // The owned tiles become the staging tiles once no warpgroup reads them: where a
        // group's dQ product reads the keys of both (atomic dQ at D = 128, or at D = 64 too
        // with DQ_PER_GROUP=0), once both are done; else each group's own rows once it is.
        // Rows past S_kv are not written (the tensor map ends there).
        if (BOTH_GROUPS)
            named_barrier_sync(1, 128 * BWD_GROUPS);
        else
            named_barrier_sync(2 + consumer, 128);
        store_acc_tile<D, BWD_OWN>(m.own_a, group_row0 + warp_row0, dk_acc, {scale, scale}, g, t);
        store_acc_tile<D, BWD_OWN>(m.own_b, group_row0 + warp_row0, dv_acc, {1.0f, 1.0f}, g, t);
        fence_proxy_async_shared();
        named_barrier_sync(2 + consumer, 128);
        if (threadIdx.x % 128 == 0) {
            const HeadCoords at = head_coords(head_index, dk_rows.heads);
            for (int c = 0; c < D / 64; c++) {
                const int offset = c * BWD_OWN * 64 + group_row0 * 64;
                tma_store_4d(dk_map, m.own_a + offset, c * 64, k0 + group_row0, at.head, at.batch);
                tma_store_4d(dv_map, m.own_b + offset, c * 64, k0 + group_row0, at.head, at.batch);
            }
            bulk_commit();
            bulk_wait_read<0>();  // the block's shared memory must outlive the stores' reads
        }
    } else {
        store_rows<Elem, D>(dk, dk_rows, head_index, dk_acc, scale, warp_key0, S_kv, lane);
        store_rows<Elem, D>(dv, dv_rows, head_index, dv_acc, 1.0f, warp_key0, S_kv, lane);
    }
}

// Pᵀ, in place of Sᵀ (64 keys x 64 queries of a walked tile, this thread's 32 values: keys
// warp_key0 + g and + 8, queries q_start + 8j + 2t and + 1), from each query's lse in log2 units
// (col_lse). Keys after their query's diagonal (causal: query i sees keys 0 .. i + S_kv - S, so
// first_diagonal = q_start + S_kv - S) are masked where the tile reaches it (diagonal), and keys
// past S_kv where the block has them (KEYS_PAST_S).
template <bool KEYS_PAST_S>
__device__ __forceinline__ void probabilities_t(float (&st_acc)[32], const float *col_lse, float scale_log2, bool diagonal,
                                                int warp_key0, int first_diagonal, int S_kv, int g, int t) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float2 lse_pair = *(const float2 *)&col_lse[8 * j + 2 * t];  // queries 8j + 2t, + 1
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = warp_key0 + g + (e < 2 ? 0 : 8), last_key = first_diagonal + 8 * j + 2 * t + (e & 1);
            const float p = exp2_approx(st_acc[4 * j + e] * scale_log2 - (e & 1 ? lse_pair.y : lse_pair.x));
            st_acc[4 * j + e] = (diagonal && key > last_key) || (KEYS_PAST_S && key >= S_kv) ? 0.0f : p;
        }
    }
}

// dSᵀ = Pᵀ ∘ (dPᵀ - δ), in place of dPᵀ, with each query's δ (col_delta).
__device__ __forceinline__ void ds_t(float (&dpt_acc)[32], const float (&pt_acc)[32], const float *col_delta, int t) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float2 delta_pair = *(const float2 *)&col_delta[8 * j + 2 * t];
#pragma unroll
        for (int e = 0; e < 4; e++)
            dpt_acc[4 * j + e] = pt_acc[4 * j + e] * (dpt_acc[4 * j + e] - (e & 1 ? delta_pair.y : delta_pair.x));
    }
}

// Pᵀ and dSᵀ of a walked tile as A fragments, once S's wgmma group is done (dP's is waited for
// here). Pᵀ in place of Sᵀ: a key after its query's diagonal (causal) is masked only in the tiles
// that reach the block's keys (diagonal); queries past S have lse = infinity, so P = 0 there
// already. Keys past S_kv (KEYS_PAST_S, in a head's last key block) have the zero rows of K that TMA fills in, so
// their scores are 0 and P = 2^-lse, which overflows fp16 wherever a row's scores are all below
// about -11: dQ += dS K would turn that Inf times the zero row into NaN, so they are masked too.
// With ATOMIC, dSᵀ also goes to shared memory (ds_tile, rows from ds_row0) before the wgmma that
// reads dst_frag is issued (registers of an A operand must not be touched while it runs).
template <typename Elem, bool ATOMIC, bool KEYS_PAST_S>
__device__ __forceinline__ void pt_and_dst_frags(uint32_t (&pt_frag)[BWD_WALK / 16][4],
                                                 uint32_t (&dst_frag)[BWD_WALK / 16][4], float (&st_acc)[32],
                                                 float (&dpt_acc)[32], Elem *ds_tile, const float *col_lse,
                                                 const float *col_delta, float scale_log2, bool diagonal, int warp_key0,
                                                 int first_diagonal, int S_kv, int ds_row0, int lane) {
    const int g = lane / 4, t = lane % 4;
    probabilities_t<KEYS_PAST_S>(st_acc, col_lse, scale_log2, diagonal, warp_key0, first_diagonal, S_kv, g, t);
    wgmma_wait<0>();
    fence_operands<32>(dpt_acc);
    ds_t(dpt_acc, st_acc, col_delta, t);  // dSᵀ = Pᵀ ∘ (dPᵀ - δ), in place of dPᵀ
    pack_a_frags<Elem, BWD_WALK>(pt_frag, st_acc);
    pack_a_frags<Elem, BWD_WALK>(dst_frag, dpt_acc);
    if constexpr (ATOMIC) {
        store_ds_frags(ds_tile, ds_row0, dst_frag, lane);
        fence_proxy_async_shared();
    }
}

// A walked tile's products after Pᵀ and dSᵀ: with ATOMIC, dQ = dS K for this group's DQ_COLS
// columns over DQ_KEYS keys (issued first, so that it is staged while dV and dK run), then
// dV += Pᵀ dO and dK += dSᵀ Q, each its own wgmma group. The keys' dSᵀ are in ds_tile (this
// group's, or both groups' where BOTH_GROUPS); the other dSᵀ tile is written next, so this one is
// free again once the groups have passed the next tile's barrier.
template <typename Elem, int D, bool ATOMIC, int DQ_COLS, int DQ_KEYS, bool BOTH_GROUPS>
__device__ __forceinline__ void issue_tile_products(float (&dq_acc)[DQ_COLS / 2], float (&dv_acc)[D / 2],
                                                    float (&dk_acc)[D / 2], const uint32_t (&pt_frag)[BWD_WALK / 16][4],
                                                    const uint32_t (&dst_frag)[BWD_WALK / 16][4], const Elem *ds_tile,
                                                    const Elem *k_cols, const Elem *q_tile, const Elem *do_tile,
                                                    int dq_key0, int consumer) {
    wgmma_fence();
    if constexpr (ATOMIC) {
        if (BOTH_GROUPS)
            named_barrier_sync(1, 128 * BWD_GROUPS);
        else
            named_barrier_sync(2 + consumer, 128);
#pragma unroll
        for (int kk = 0; kk < DQ_KEYS / 16; kk++)
            wgmma_m64k16_ss<Elem, DQ_COLS, 1, 1>(dq_acc, desc_n_major<BWD_OWN>(ds_tile + dq_key0 * 64, kk),
                                        desc_n_major<BWD_OWN>(k_cols, kk), kk > 0);
        wgmma_commit();
    }
#pragma unroll
    for (int kk = 0; kk < BWD_WALK / 16; kk++)  // dV += Pᵀ dO
        wgmma_m64k16_rs<Elem, D, 1>(dv_acc, pt_frag[kk], desc_n_major<BWD_WALK>(do_tile, kk), 1);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < BWD_WALK / 16; kk++)  // dK += dSᵀ Q
        wgmma_m64k16_rs<Elem, D, 1>(dk_acc, dst_frag[kk], desc_n_major<BWD_WALK>(q_tile, kk), 1);
    wgmma_commit();
}

// A consumer warpgroup of backward_dk_dv: its 64 keys' dK and dV in registers over the walked
// query tiles (with ATOMIC, dQ's share staged for the writer thread), then the epilogue.
template <typename Elem, int D, bool ATOMIC, bool KEYS_PAST_S, typename Walk>
__device__ __forceinline__ void dk_dv_consumer(const BwdSmem<Elem> &m, const CUtensorMap *dk_map, const CUtensorMap *dv_map,
                                               const float *lse_log2, const float *delta, Elem *dk, Elem *dv,
                                               const RowLayout &dk_rows, const RowLayout &dv_rows, float *dq_accum, int S,
                                               int S_kv, float scale, int causal, int head_index, int k0, const Walk &walk) {
    const int consumer = threadIdx.x / 128 - 1, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int warp_row0 = (threadIdx.x % 128) / 32 * 16;  // the warp's 16 rows in its group's 64
    const int group_row0 = consumer * 64, warp_key0 = k0 + group_row0 + warp_row0;
    const float scale_log2 = scale * 1.4426950408889634f;
    // A walked tile's lse and delta (queries past S: lse = infinity, so P = 0 there, and
    // delta = 0): each thread of the group loads one of the 128 values a tile ahead and
    // stores it to the group's slot for the tile, so that the 16 queries of a thread's
    // columns are read from shared memory instead of held in registers.
    const int stat = threadIdx.x % 128, stat_query = stat % BWD_WALK;  // stat < 64: lse, else delta
    grid_dependency_wait();  // backward_delta has written delta (and zeroed the float dQ)
    // Once every block of this kernel has got here, backward_dq_unpermute may launch
    // (kEarlyDqConversion), onto the SMs that the last blocks leave idle. Not earlier: its
    // blocks read the heads' counters, which backward_delta zeroes, and only this kernel's
    // wait orders them after backward_delta.
    if (kEarlyDqConversion) grid_launch_dependents();
    auto load_stat = [&](int w) {
        const int query = walk.tile(w) * BWD_WALK + stat_query;
        if (query >= S) return stat < BWD_WALK ? INFINITY : 0.0f;
        const size_t row = (size_t)walk.head(w) * S + query;
        return stat < BWD_WALK ? lse_log2[row] : delta[row];
    };
    float next_stat = load_stat(0);
    // dQ (queries x D) of a walked tile: this warpgroup's DQ_COLS columns from dq_col0 over
    // DQ_KEYS keys from dq_key0: B = those rows and columns of the owned K tile (N-major).
    constexpr bool kPerGroup = kDqPerGroup<D>;
    // Where a group's dQ product reads the keys of both groups (atomic dQ without kPerGroup),
    // both groups' dSᵀ must be stored before it runs, and both must be done with the owned K
    // before its rows become dK/dV's staging tile.
    constexpr bool kDqReadsBothGroups = ATOMIC && !kPerGroup;
    constexpr int DQ_COLS = kPerGroup ? D : D / 2, DQ_KEYS = kPerGroup ? 64 : BWD_OWN;
    const int dq_col0 = kPerGroup ? 0 : consumer * DQ_COLS, dq_key0 = kPerGroup ? group_row0 : 0;
    const Elem *k_cols = m.own_a + (dq_col0 / 64) * BWD_OWN * 64 + dq_key0 * 64 + dq_col0 % 64;
    float dk_acc[D / 2], dv_acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) dk_acc[i] = dv_acc[i] = 0.0f;
    mbarrier_wait<true>(m.own_full, 0);
    const OwnOperands<Elem, D, kOwnInRegisters<D, true>> k_and_v(m, group_row0, warp_row0, lane);

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (64 keys x 64 queries) of a walked tile.
    float st_acc[32], dpt_acc[32];
    auto issue_st_dpt = [&](int tile) { k_and_v.issue_s_and_dp(st_acc, dpt_acc, m, tile); };
    auto release = [&](int tile) { mbarrier_arrive_warp(&m.empty[tile % BwdLayout<D>::SLOTS]); };
    // The cross-tile overlap as in backward_dq; not with atomic dQ, whose dQ is staged
    // between the tile's products.
    constexpr bool kOverlap = kCrossTileOverlap && !ATOMIC;

    if (kOverlap) issue_st_dpt(0);
    for (int tile = 0; tile < walk.steps(); tile++) {  // the walk's steps: the ring's items
        const int slot = tile % BwdLayout<D>::SLOTS, q_start = walk.tile(tile) * BWD_WALK;
        const Elem *q_tile = m.walk_a + slot * BwdLayout<D>::WALK_ELEMS;
        const Elem *do_tile = m.walk_b + slot * BwdLayout<D>::WALK_ELEMS;
        // This thread's columns (queries) are q_start + 8j + 2t + {0, 1}: their lse and delta.
        // The group's barrier also orders the slot's reads two tiles ago before this write.
        float *col_lse = m.stats + (consumer * 2 + tile % 2) * 2 * BWD_WALK, *col_delta = col_lse + BWD_WALK;
        col_lse[stat] = next_stat;
        named_barrier_sync(2 + consumer, 128);
        if (tile + 1 < walk.steps()) next_stat = load_stat(tile + 1);
        if (!kOverlap) issue_st_dpt(tile);
        wgmma_wait<1>();  // with the overlap, also the previous tile's dV and dK products
        fence_operands<32>(st_acc);
        if (kOverlap && tile > 0) release(tile - 1);
        uint32_t pt_frag[BWD_WALK / 16][4], dst_frag[BWD_WALK / 16][4];
        Elem *ds_tile = m.ds + (tile % 2) * BwdLayout<D>::DS_ELEMS;
        // The last key the tile's first query sees (causal); the tile reaches the block's keys
        // where that is before the block's last key.
        const int first_diagonal = q_start + S_kv - S;
        pt_and_dst_frags<Elem, ATOMIC, KEYS_PAST_S>(pt_frag, dst_frag, st_acc, dpt_acc, ds_tile, col_lse, col_delta, scale_log2,
                                              causal && first_diagonal < k0 + BWD_OWN - 1, warp_key0, first_diagonal,
                                              S_kv, group_row0 + warp_row0, lane);
        float dq_acc[DQ_COLS / 2];
        issue_tile_products<Elem, D, ATOMIC, DQ_COLS, DQ_KEYS, kDqReadsBothGroups>(
            dq_acc, dv_acc, dk_acc, pt_frag, dst_frag, ds_tile, k_cols, q_tile, do_tile, dq_key0, consumer);
        if (kOverlap) {
            if (tile + 1 < walk.steps()) issue_st_dpt(tile + 1);
            continue;
        }
        if constexpr (ATOMIC) {
            wgmma_wait<2>();  // dQ; dV and dK still run
            fence_operands<DQ_COLS / 2>(dq_acc);
            stage_dq<Elem, D, DQ_COLS, kPerGroup>(dq_acc, m, dq_accum, tile, walk, S, consumer, warp_row0, dq_col0, g, t);
        }
        wgmma_wait<0>();
        fence_operands<D / 2>(dv_acc), fence_operands<D / 2>(dk_acc);
        release(tile);
    }
    wgmma_wait<0>();
    fence_operands<D / 2>(dv_acc), fence_operands<D / 2>(dk_acc);
    store_dk_dv<Elem, D, kDqReadsBothGroups>(dk_acc, dv_acc, m, dk_map, dv_map, dk, dv, dk_rows, dv_rows, scale, S_kv, head_index,
                                       k0, consumer,
                                       group_row0, warp_row0, warp_key0, lane, g, t);
}

// dK, dV (and with ATOMIC dQ's share) for BWD_OWN keys per block; query tiles (Q and dO) stream
// through the ring. Everything is computed transposed (keys as rows), so that Pᵀ and dSᵀ come out
// as accumulators with keys as rows: the A operands of dV += Pᵀ dO and dK += dSᵀ Q. KEYS_PAST_S:
// S_kv is not a multiple of BWD_OWN, so each head's last key block has keys past S_kv to mask; chosen
// per launch, as FlashAttention-2's Is_even_MN, so that the blocks of a length with no such keys
// carry no test for them. KV_LENGTHS: K and V may have another length than Q; a build of its own
// for the same reason (where the lengths are equal, S_kv is S at compile time). EXPANDED
// (kExpandGroups): the block's head is a query head, which it walks, and its keys those of the
// K/V head it reads; dK and dV are its shares, written at the query head (dk_rows: the shares').
template <typename Elem, int D, bool ATOMIC, bool KEYS_PAST_S, bool GROUPED, bool KV_LENGTHS, bool EXPANDED>
__global__ void __launch_bounds__(BWD_THREADS, 1)
backward_dk_dv(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
               const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
               const __grid_constant__ CUtensorMap dk_map, const __grid_constant__ CUtensorMap dv_map,
               const float *lse_log2, const float *delta, Elem *dk, Elem *dv, RowLayout dk_rows, RowLayout dv_rows,
               float *dq_accum, int *dq_heads_done, int first_head, int heads_per_kv, int S, int S_kv_given, float scale,
               int causal) {
    const int S_kv = KV_LENGTHS ? S_kv_given : S;
#if FLASH_STAGES_SM90A
    extern __shared__ unsigned char smem_raw[];
    const BwdSmem<Elem> m = bwd_smem<Elem, D>(smem_raw);  // own: K, V; walked: Q, dO
    // The block's K/V head, b * H_kv + h_kv (head_chunk); it walks the heads_per_kv query heads
    // that read it, b * H + h_kv * heads_per_kv + i, which are head_index * heads_per_kv + i.
    // EXPANDED: the block's query head b * H + h, the one it walks, reading K/V head h / heads_per_kv.
    const int head_index = first_head + blockIdx.z * gridDim.y + blockIdx.y;
    const HeadCoords at = head_coords(head_index, dk_rows.heads);
    const HeadCoords kv_at = EXPANDED ? HeadCoords{at.head / heads_per_kv, at.batch} : at;
    const int walked_heads = EXPANDED ? 1 : heads_per_kv;  // per block
    const int k0 = blockIdx.x * BWD_OWN;
    // Causal: queries before k0 - (S_kv - S) see none of these keys.
    const int first_tile = causal ? max(0, k0 - (S_kv - S)) / BWD_WALK : 0;
    const BwdWalk<GROUPED> walk = {head_index * walked_heads, walked_heads, first_tile, ceil_div(S, BWD_WALK) - first_tile};
    if (ATOMIC && threadIdx.x == 0) {  // published by init_tma_ring's fence and __syncthreads
        for (int slot = 0; slot < BwdLayout<D>::DQ_SLOTS; slot++)
            mbarrier_init(&m.dq_full[slot], 4 * BWD_GROUPS), mbarrier_init(&m.dq_empty[slot], 1);
    }
    init_tma_ring(m.full, m.empty, BwdLayout<D>::SLOTS, 4 * BWD_GROUPS, m.own_full);

    if (threadIdx.x < 128) {
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0)
            bwd_produce<Elem, D>(m, &k_map, &v_map, &q_map, &do_map, k0, kv_at, walk, dk_rows.heads * walked_heads);
        if (ATOMIC && kBulkReduceDq && threadIdx.x == 32) write_dq<Elem, D>(m, dq_accum, dq_heads_done, S, walk);
    } else {
        setmaxnreg_inc<240>();
        dk_dv_consumer<Elem, D, ATOMIC, KEYS_PAST_S>(m, &dk_map, &dv_map, lse_log2, delta, dk, dv, dk_rows, dv_rows, dq_accum,
                                               S, S_kv, scale, causal, head_index, k0, walk);
    }
#else
    (void)q_map, (void)k_map, (void)v_map, (void)do_map, (void)dk_map, (void)dv_map, (void)lse_log2, (void)delta;
    (void)dk, (void)dv, (void)dk_rows, (void)dv_rows, (void)dq_accum, (void)dq_heads_done, (void)first_head, (void)heads_per_kv,
        (void)S, (void)S_kv, (void)scale, (void)causal, (void)kTmaStoreDkDv;
#endif
}

// dQ for BWD_OWN queries per block; key tiles (K and V) stream through the ring. KV_LENGTHS as in
// backward_dk_dv.
template <typename Elem, int D, bool KV_LENGTHS>
__global__ void __launch_bounds__(BWD_THREADS, 1)
backward_dq(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
            const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
            const float *lse_log2, const float *delta, Elem *dq, RowLayout dq_rows, int first_head, int heads_per_kv, int S,
            int S_kv_given, float scale, int causal) {
    const int S_kv = KV_LENGTHS ? S_kv_given : S;
#if FLASH_STAGES_SM90A
    extern __shared__ unsigned char smem_raw[];
    const BwdSmem<Elem> m = bwd_smem<Elem, D>(smem_raw);  // own: Q, dO; walked: K, V
    const int head_index = first_head + blockIdx.z * gridDim.y + blockIdx.y;  // b * H + h (head_chunk)
    const int q_block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // longest first
    const int q0 = q_block * BWD_OWN;
    // Causal: up to the diagonal of the block's last query (its index plus S_kv - S).
    const int n_tiles = ceil_div(causal ? min(S_kv, q0 + BWD_OWN + S_kv - S) : S_kv, BWD_WALK);
    init_tma_ring(m.full, m.empty, BwdLayout<D>::SLOTS, 4 * BWD_GROUPS, m.own_full);

    if (threadIdx.x < 128) {
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0)
            bwd_produce<Elem, D>(m, &q_map, &do_map, &k_map, &v_map, q0, head_coords(head_index, dq_rows.heads),
                                 BwdWalk<false>{head_index / heads_per_kv, 1, 0, n_tiles}, dq_rows.heads / heads_per_kv);
    } else {
        setmaxnreg_inc<240>();
        const int consumer = threadIdx.x / 128 - 1, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        const int warp_row0 = (threadIdx.x % 128) / 32 * 16;  // the warp's 16 rows in its group's 64
        const int group_row0 = consumer * 64, warp_query0 = q0 + group_row0 + warp_row0;
        const float scale_log2 = scale * 1.4426950408889634f;
        float row_lse[2], row_delta[2];  // rows g and g + 8 (rows past S: never stored)
        grid_dependency_wait();           // the kernels before have written delta
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int query = min(warp_query0 + g + 8 * r, S - 1);
            row_lse[r] = lse_log2[(size_t)head_index * S + query];
            row_delta[r] = delta[(size_t)head_index * S + query];
        }
        float dq_acc[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; i++) dq_acc[i] = 0.0f;
        mbarrier_wait<true>(m.own_full, 0);
        const OwnOperands<Elem, D, kOwnInRegisters<D, false>> q_and_do(m, group_row0, warp_row0, lane);

        // S = Q Kᵀ and dP = dO Vᵀ (64 queries x 64 keys) of a walked tile.
        float s_acc[32], dp_acc[32];
        auto issue_s_dp = [&](int tile) { q_and_do.issue_s_and_dp(s_acc, dp_acc, m, tile); };
        auto release = [&](int tile) { mbarrier_arrive_warp(&m.empty[tile % BwdLayout<D>::SLOTS]); };
        uint32_t ds_frag[BWD_WALK / 16][4];  // dS (Elem), the A operand of dQ += dS K

        if (kCrossTileOverlap) issue_s_dp(0);
        for (int tile = 0; tile < n_tiles; tile++) {
            const int k0 = tile * BWD_WALK;
            const Elem *k_tile = m.walk_a + (tile % BwdLayout<D>::SLOTS) * BwdLayout<D>::WALK_ELEMS;
            if (!kCrossTileOverlap) issue_s_dp(tile);
            // With the overlap the previous tile's dQ product is older than S: this waits for it
            // too, and its K and V slot is free.
            wgmma_wait<1>();
            fence_operands<32>(s_acc);
            if (kCrossTileOverlap && tile > 0) release(tile - 1);
            // P in place; masked keys (past S_kv, or causal past the query's diagonal) give 0.
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e / 2, key = k0 + 8 * j + 2 * t + (e & 1);
                    const int last_key = warp_query0 + g + 8 * r + S_kv - S;
                    const float p = exp2_approx(s_acc[4 * j + e] * scale_log2 - row_lse[r]);
                    s_acc[4 * j + e] = key >= S_kv || (causal && key > last_key) ? 0.0f : p;
                }
            wgmma_wait<0>();
            fence_operands<32>(dp_acc);
            // dS = P ∘ (dP - δ), in place in s_acc.
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s_acc[4 * j + e] *= dp_acc[4 * j + e] - row_delta[e / 2];
            pack_a_frags<Elem, BWD_WALK>(ds_frag, s_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BWD_WALK / 16; kk++)  // dQ += dS K
                wgmma_m64k16_rs<Elem, D, 1>(dq_acc, ds_frag[kk], desc_n_major<BWD_WALK>(k_tile, kk), 1);
            wgmma_commit();
            if (kCrossTileOverlap) {
                if (tile + 1 < n_tiles) issue_s_dp(tile + 1);
            } else {
                wgmma_wait<0>();
                fence_operands<D / 2>(dq_acc);
                release(tile);
            }
        }
        wgmma_wait<0>();
        fence_operands<D / 2>(dq_acc);
        store_rows<Elem, D>(dq, dq_rows, head_index, dq_acc, scale, warp_query0, S, lane);
    }
#else
    (void)q_map, (void)k_map, (void)v_map, (void)do_map, (void)lse_log2, (void)delta, (void)dq, (void)dq_rows, (void)first_head,
        (void)heads_per_kv;
    (void)S, (void)S_kv, (void)scale, (void)causal, (void)kCrossTileOverlap;
#endif
}

// dQ = scale * the float sums of the atomic dQ, un-permuted from the staging order (dq_stage_index)
// into dQ's rows (wherever its strides put them) as fp16 or bf16, one block per staged 64 x D tile:
// the block reads the tile in order (16-byte loads, coalesced), each float4 being columns c, c + 1
// of rows r and r + 8, writes them as fp16 or bf16 into the tile's place in shared memory, then stores
// whole rows (16-byte stores, coalesced); the padded rows past S are not stored. With
// kEarlyDqConversion it starts while backward_dk_dv's last blocks still run, and waits until all
// key blocks of its head (BWD_OWN keys each, as backward_dk_dv's grid has them) have counted
// themselves done in dq_heads_done.
template <typename Elem, int D>
__global__ void __launch_bounds__(256) backward_dq_unpermute(const float *dq_accum, const int *dq_heads_done,
                                                             Elem *dq, RowLayout dq_rows, int S, int S_kv, float scale) {
    // Rows 16 bytes longer than D: the 8 rows a warp's fp16 pairs fall in start in other banks.
    constexpr int PITCH = D + 8;
    __shared__ __align__(16) Elem tile_rows[BWD_WALK * PITCH];
    const int tiles_per_head = ceil_div(S, BWD_WALK);
    const int head_index = blockIdx.x / tiles_per_head, row0 = blockIdx.x % tiles_per_head * BWD_WALK;
    const float4 *sums = (const float4 *)(dq_accum + (size_t)blockIdx.x * BWD_WALK * D);
    if constexpr (kEarlyDqConversion) {  // this head's sums are complete
        // A key block takes milliseconds; a count still missing after a minute means a broken
        // hand-over, and the trap fails the launch (an error the program sees at its next CUDA
        // call, after which the context is unusable) instead of hanging it.
        if (threadIdx.x == 0) {
            const unsigned long long start = globaltimer_ns();
            while (counter_load_acquire(&dq_heads_done[head_index]) < ceil_div(S_kv, BWD_OWN)) {
                if (globaltimer_ns() - start > 60ull * 1000000000ull) __trap();
                __nanosleep(64);
            }
        }
        __syncthreads();
    } else {
        grid_dependency_wait();  // backward_dk_dv's sums are complete
    }
    for (int i = threadIdx.x; i < BWD_WALK * D / 4; i += blockDim.x) {
        int row, col;
        dq_stage_position<D>(i, &row, &col);
        const float4 x = __ldcg(&sums[i]);  // from L2, where the reductions were done
        *(uint32_t *)&tile_rows[row * PITCH + col] = pack2<Elem>(x.x * scale, x.y * scale);
        *(uint32_t *)&tile_rows[(row + 8) * PITCH + col] = pack2<Elem>(x.z * scale, x.w * scale);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < BWD_WALK * D / 8; i += blockDim.x) {
        const int row = i / (D / 8), col = i % (D / 8) * 8;
        if (row0 + row < S)
            *(uint4 *)(dq + dq_rows.offset(head_index, row0 + row) + col) = *(const uint4 *)&tile_rows[row * PITCH + col];
    }
    // The stream's next kernel starts once this one has finished: with its last block waiting
    // for backward_dk_dv here, not before backward_dk_dv has finished too (its dK and dV stores).
    if (kEarlyDqConversion && blockIdx.x == gridDim.x - 1) grid_dependency_wait();
}

// Eight elements (16 bytes) added into float sums, and float sums packed back into eight elements.
template <typename Elem>
__device__ inline void add_elems8(float (&sum)[8], uint4 bits) {
    const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 pair = unpack2<Elem>(words[j]);
        sum[2 * j] += pair.x, sum[2 * j + 1] += pair.y;
    }
}
template <typename Elem>
__device__ inline uint4 pack_elems8(const float (&sum)[8]) {
    return make_uint4(pack2<Elem>(sum[0], sum[1]), pack2<Elem>(sum[2], sum[3]), pack2<Elem>(sum[4], sum[5]),
                      pack2<Elem>(sum[6], sum[7]));
}

// dK and dV of grouped K/V heads from their query heads' shares (kExpandGroups): row s of K/V
// head (b, h_kv) is the sum of row s of query heads (b, h_kv * heads_per_kv + i), i < heads_per_kv,
// in the shares' [B, H, S_kv, D], added in float and stored once, through dK's and dV's strides.
// One thread per 8 columns of a row: 16-byte loads and stores.
template <typename Elem, int D>
__global__ void __launch_bounds__(256) backward_sum_groups(const Elem *dk_parts, const Elem *dv_parts, Elem *dk, Elem *dv,
                                                           RowLayout dk_rows, RowLayout dv_rows, int S_kv,
                                                           int heads_per_kv, long long chunks) {
    grid_dependency_wait();  // the kernels before have written the shares
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    const int col = (int)(i % (D / 8)) * 8;
    const long long row = i / (D / 8);  // (b * H_kv + h_kv) * S_kv + s
    const int s = (int)(row % S_kv), kv_head = (int)(row / S_kv);
    const long long first_share = ((long long)kv_head * heads_per_kv * S_kv + s) * D + col;  // query head kv_head * heads_per_kv
    float k_sum[8] = {0.0f}, v_sum[8] = {0.0f};
    for (int g = 0; g < heads_per_kv; g++) {
        const long long at = first_share + (long long)g * S_kv * D;
        add_elems8<Elem>(k_sum, *(const uint4 *)(dk_parts + at));
        add_elems8<Elem>(v_sum, *(const uint4 *)(dv_parts + at));
    }
    *(uint4 *)(dk + dk_rows.offset(kv_head, s) + col) = pack_elems8<Elem>(k_sum);
    *(uint4 *)(dv + dv_rows.offset(kv_head, s) + col) = pack_elems8<Elem>(v_sum);
}

// The float dQ of the atomic build: BWD_WALK-row tiles per head, the last one padded.
static size_t dq_accum_elems(const attn_shape *s) {
    return (size_t)s->batch * s->heads * ceil_div(s->seq, BWD_WALK) * BWD_WALK * s->dim;
}
// After it, with kEarlyDqConversion, a counter per head (rounded up to four, zeroed with the sums
// as float4s): how many of the head's key blocks have added their dQ.
static size_t dq_heads_done_count(const attn_shape *s) {
    return kEarlyDqConversion ? ((size_t)s->batch * s->heads + 3) / 4 * 4 : 0;
}
// Whether grouped K/V heads run as query heads of their own, with dK and dV shares (kExpandGroups).
static bool expands_groups(const attn_shape *s) { return kExpandGroups && attn_group(s) > 1; }
// Where the shares start in the scratch (after the float dQ and the counters, or after delta), and
// their elements, each of dK's and dV's: [B, H, S_kv, D].
static size_t group_shares_offset(const attn_shape *s) {
    const size_t end = kAtomicDq ? dq_accum_offset(s) + sizeof(float) * dq_accum_elems(s) + sizeof(int) * dq_heads_done_count(s)
                                 : delta_scratch_bytes(s);
    return (end + 255) / 256 * 256;
}
static size_t group_shares_elems(const attn_shape *s) {
    return expands_groups(s) ? (size_t)s->batch * s->heads * attn_kv_seq(s) * s->dim : 0;
}

// backward_dk_dv's build for this shape, chosen per launch: keys past S_kv to mask (KEYS_PAST_S;
// with K/V lengths always, in one build), query heads walked in groups on a K/V head (GROUPED), or
// as heads of their own with dK and dV shares (EXPANDED), and K/V lengths (KV_LENGTHS).
template <typename Elem, int D, bool KEYS_PAST_S, bool KV_LENGTHS>
static auto dk_dv_kernel_of_groups(const attn_shape *s) {
    const bool expanded = expands_groups(s), walked = attn_group(s) > 1 && !expanded;
    return walked     ? backward_dk_dv<Elem, D, kAtomicDq, KEYS_PAST_S, true, KV_LENGTHS, false>
           : expanded ? backward_dk_dv<Elem, D, kAtomicDq, KEYS_PAST_S, false, KV_LENGTHS, true>
                      : backward_dk_dv<Elem, D, kAtomicDq, KEYS_PAST_S, false, KV_LENGTHS, false>;
}
template <typename Elem, int D>
static auto dk_dv_kernel(const attn_shape *s) {
    const bool kv_lengths = attn_kv_seq(s) != s->seq, keys_past_s = kv_lengths || attn_kv_seq(s) % BWD_OWN != 0;
    return kv_lengths    ? dk_dv_kernel_of_groups<Elem, D, true, true>(s)
           : keys_past_s ? dk_dv_kernel_of_groups<Elem, D, true, false>(s)
                         : dk_dv_kernel_of_groups<Elem, D, false, false>(s);
}

// Where backward_dk_dv writes dK and dV: the outputs, through their strides; or with expanded
// groups each query head's shares, contiguous [B, H, S_kv, D] in the scratch, which
// backward_sum_groups then adds into the outputs.
template <typename Elem>
struct DkDvOut {
    Elem *dk, *dv;
    RowLayout dk_rows, dv_rows;
};
template <typename Elem>
static DkDvOut<Elem> dk_dv_out(const attn_shape *s, const attn_tensors *t, const RowLayout &dk_rows,
                               const RowLayout &dv_rows) {
    if (!expands_groups(s)) return {(Elem *)t->dk, (Elem *)t->dv, dk_rows, dv_rows};
    Elem *shares = (Elem *)((char *)t->backward_scratch + group_shares_offset(s));
    const RowLayout share_rows = row_layout(attn_strides{0, 0, 0}, s->heads, attn_kv_seq(s), s->dim);
    return {shares, shares + group_shares_elems(s), share_rows, share_rows};
}

// The TMA maps of the whole tensors, each through its strides (attn_tensors): Q, K, V and dO in
// boxes of BWD_OWN rows (owned tiles) and of BWD_WALK rows (walked tiles), and dK and dV, stored a
// warpgroup's 64 rows at a time (kTmaStoreDkDv).
struct BwdMaps {
    CUtensorMap own[4], walk[4];  // q, k, v, do
    CUtensorMap dk, dv;
};

// Each tensor's RowLayout, from its strides in attn_tensors: Q, dO and dQ of H heads, K, V, dK and
// dV of H_kv.
struct BwdRows {
    RowLayout q, k, v, d_o, dq, dk, dv;
};

static BwdRows bwd_rows(const attn_shape *s, const attn_tensors *t) {
    const int H = s->heads, H_kv = attn_kv_heads(s), S = s->seq, S_kv = attn_kv_seq(s), D = s->dim;
    return {row_layout(t->q_strides, H, S, D),          row_layout(t->k_strides, H_kv, S_kv, D),
            row_layout(t->v_strides, H_kv, S_kv, D),    row_layout(t->d_o_strides, H, S, D),
            row_layout(t->dq_strides, H, S, D),         row_layout(t->dk_strides, H_kv, S_kv, D),
            row_layout(t->dv_strides, H_kv, S_kv, D)};
}

template <typename Elem, int D>
static cudaError_t make_bwd_maps(BwdMaps *maps, const attn_shape *s, const attn_tensors *t, const BwdRows &rows,
                                 const DkDvOut<Elem> &out) {
    const void *tensors[4] = {t->q, t->k, t->v, t->d_o};
    const RowLayout layouts[4] = {rows.q, rows.k, rows.v, rows.d_o};
    const int B = s->batch, S = s->seq, S_kv = attn_kv_seq(s), lengths[4] = {S, S_kv, S_kv, S};
    cudaError_t err = cudaSuccess;
    for (int i = 0; i < 4 && err == cudaSuccess; i++) {
        err = make_tensor_map(&maps->own[i], tensors[i], s->dtype, layouts[i], B, lengths[i], D, BWD_OWN);
        if (err == cudaSuccess)
            err = make_tensor_map(&maps->walk[i], tensors[i], s->dtype, layouts[i], B, lengths[i], D, BWD_WALK);
    }
    if (err == cudaSuccess) err = make_tensor_map(&maps->dk, out.dk, s->dtype, out.dk_rows, B, S_kv, D, 64);
    if (err == cudaSuccess) err = make_tensor_map(&maps->dv, out.dv, s->dtype, out.dv_rows, B, S_kv, D, 64);
    return err;
}

template <typename Elem, int D>
static cudaError_t launch_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    const int heads_total = s->batch * s->heads;
    const float *lse = workspace_lse(s, t), *delta = scratch_delta(s, t);
    float *dq_accum = kAtomicDq ? scratch_dq_accum(s, t) : NULL;
    int *dq_heads_done = kEarlyDqConversion ? (int *)(dq_accum + dq_accum_elems(s)) : NULL;
    // The delta pre-pass also zeroes dQ's sums and the heads' counters.
    cudaError_t err =
        launch_backward_delta<Elem>(s, t, stream, dq_accum, kAtomicDq ? dq_accum_elems(s) + dq_heads_done_count(s) : 0);
    const size_t smem = BwdLayout<D>::bytes;
    const int S = s->seq, S_kv = attn_kv_seq(s);
    const auto dk_dv = dk_dv_kernel<Elem, D>(s);
    const auto dq_kernel = S_kv != S ? backward_dq<Elem, D, true> : backward_dq<Elem, D, false>;
    if (err == cudaSuccess) err = allow_dynamic_smem(dk_dv, smem);
    if (err == cudaSuccess && !kAtomicDq) err = allow_dynamic_smem(dq_kernel, smem);
    const float scale = 1.0f / sqrtf((float)D);
    const BwdRows rows = bwd_rows(s, t);
    BwdMaps maps;
    const bool expanded = expands_groups(s);
    const DkDvOut<Elem> out = dk_dv_out<Elem>(s, t, rows.dk, rows.dv);
    if (err == cudaSuccess) err = make_bwd_maps<Elem, D>(&maps, s, t, rows, out);
    // After backward_delta, each kernel is a dependent launch (kDependentLaunch): its blocks set up
    // (barriers, the owned tiles' TMA loads) while the kernel before finishes, and wait for it
    // (grid_dependency_wait) only where they read what it wrote.
    auto launch = [&](auto kernel, dim3 blocks, int threads, size_t shared_bytes, auto... args) {
        if (kDependentLaunch) return launch_dependent(kernel, blocks, threads, shared_bytes, stream, args...);
        kernel<<<blocks, threads, shared_bytes, stream>>>(args...);
        return cudaGetLastError();
    };
    // In chunks of heads (head_chunk); the kernels number heads b * H + h from the chunk's first
    // on: backward_dk_dv K/V heads (b * H_kv + h_kv; expanded groups: query heads), backward_dq
    // query heads.
    const int heads_per_kv = attn_group(s), dk_dv_heads = expanded ? heads_total : s->batch * attn_kv_heads(s);
    for (int first = 0; first < dk_dv_heads && err == cudaSuccess;) {
        const head_chunk c = head_chunk_from(first, dk_dv_heads, ceil_div(S_kv, BWD_OWN));
        err = launch(dk_dv, c.grid, BWD_THREADS, smem, maps.walk[0], maps.own[1], maps.own[2], maps.walk[3], maps.dk,
                     maps.dv, lse, delta, out.dk, out.dv, out.dk_rows, out.dv_rows, dq_accum, dq_heads_done, first,
                     heads_per_kv, S, S_kv, scale, s->causal);
        first += c.count;
    }
    for (int first = 0; first < heads_total && err == cudaSuccess && !kAtomicDq;) {
        const head_chunk c = head_chunk_from(first, heads_total, ceil_div(S, BWD_OWN));
        err = launch(dq_kernel, c.grid, BWD_THREADS, smem, maps.own[0], maps.walk[1], maps.walk[2],
                     maps.own[3], lse, delta, (Elem *)t->dq, rows.dq, first, heads_per_kv, S, S_kv, scale, s->causal);
        first += c.count;
    }
    if (err == cudaSuccess && kAtomicDq)
        err = launch(backward_dq_unpermute<Elem, D>, dim3(heads_total * ceil_div(S, BWD_WALK)), 256, 0,
                     (const float *)dq_accum, (const int *)dq_heads_done, (Elem *)t->dq, rows.dq, S, S_kv, scale);
    if (err == cudaSuccess && expanded) {
        const long long chunks = (long long)s->batch * attn_kv_heads(s) * S_kv * (D / 8);
        err = launch(backward_sum_groups<Elem, D>, dim3((unsigned)((chunks + 255) / 256)), 256, 0, (const Elem *)out.dk,
                     (const Elem *)out.dv, (Elem *)t->dk, (Elem *)t->dv, rows.dk, rows.dv, S_kv, heads_per_kv, chunks);
    }
    return err;
}

// The backward's scratch: delta (kernel_common.cuh), then with atomic dQ the float dQ and the
// heads' counters (kEarlyDqConversion), then with expanded groups dK's and dV's shares.
size_t stage10_backward_scratch_bytes(const attn_shape *s) {
    return group_shares_offset(s) + 2 * ELEM_BYTES * group_shares_elems(s);
}

size_t stage10_backward_shared_bytes(const attn_shape *s) {
    return s->dim == 64 ? BwdLayout<64>::bytes : BwdLayout<128>::bytes;
}

cudaError_t stage10_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    if (s->dtype == ATTN_BF16)
        return s->dim == 64 ? launch_backward<__nv_bfloat16, 64>(s, t, stream)
                            : launch_backward<__nv_bfloat16, 128>(s, t, stream);
    return s->dim == 64 ? launch_backward<__half, 64>(s, t, stream) : launch_backward<__half, 128>(s, t, stream);
}
