// Stage 09, forward - warp specialization on Hopper: a producer warpgroup loads tiles with the copy
// engine (TMA), two consumer warpgroups multiply with wgmma, which reads its operands from shared
// memory itself; mbarriers hand the slots of the K and V rings over.
//
// The idea: stage 08's split of the roles, with Hopper's tool for each.
//   producer (warpgroup 0): one thread issues cp.async.bulk.tensor (TMA): the block's Q once, then
//     for each key tile K into a ring of K slots and V into a ring of V slots. Each slot has a
//     `full` mbarrier, on which the copy engine counts the bytes as they land, and an `empty` one,
//     on which every consumer warp arrives when it is done with the slot.
//   consumers (warpgroups 1 and 2, 64 query rows each): per key tile, S = Q Kᵀ with wgmma, both
//     operands in shared memory; the mask and the online softmax in registers; P packed to the
//     element type as wgmma's A operand from registers; O += P V with wgmma, V from shared memory.
//     The tensors are fp16 or bf16 (Elem, common/elem.cuh), the products' type with them.
// setmaxnreg moves registers from the producer (24 a thread, enough to issue copies) to the
// consumers (240 a thread), which hold S, P and O in registers.
// What changed from stage 08: TMA (one thread copies a whole box, in the async proxy) instead of a
// producer warp's cp.async; wgmma reading shared memory instead of ldmatrix + mma.sync; setmaxnreg;
// warpgroups instead of warps; 128-row query tiles (64 rows per warpgroup) and 128-key tiles; the
// 128-byte swizzle that TMA writes and wgmma reads (common/wgmma_ptx.cuh). The online softmax is
// stage 08's, with exp2f for 2^x where stage 08 has ex2.approx. Forward only: no backward pass, so
// no log-sum-exp is kept for one; and Q, K and V of one shape: none of stage 08's grouped K/V heads
// or K/V of another length.
// Limits: no overlap inside a warpgroup: each step waits for the one before, so the tensor cores
// wait while a warpgroup runs its softmax (unless the other warpgroup has a product in flight),
// and the softmax waits for the products (stage 10 overlaps them); one query tile per block, so
// every block pays for its own start and the launch's last blocks leave SMs idle; Hopper only
// (sm_90a instructions; the harness skips other GPUs with a message).
#include <math.h>

#include "kernel_common.cuh"
#include "wgmma_ptx.cuh"

#define CONSUMERS 2                          // consumer warpgroups; warpgroup 0 is the producer
#define GROUP_ROWS 64                        // query rows per consumer warpgroup: one wgmma M
#define BLOCK_ROWS (CONSUMERS * GROUP_ROWS)  // query rows per block
#define KEY_TILE 128                         // keys per K or V tile
#define SLAB 64                              // 2-byte columns per 128-byte swizzled slab (one TMA box)
#define THREADS (128 * (CONSUMERS + 1))

// The lesson's ladder (ladder.txt) turns these ideas on one at a time; both are on as built.
#ifndef RING
#define RING 1        // 0: one K slot and one V slot, so the producer loads only the next K ahead
#endif
#ifndef SETMAXNREG
#define SETMAXNREG 1  // 0: every warpgroup keeps the kernel's 168 registers a thread
#endif
constexpr bool kRing = RING;
constexpr bool kSetmaxnreg = SETMAXNREG;

// Registers per thread after setmaxnreg. The block is launched with KERNEL_REGS a thread (ptxas'
// most under __launch_bounds__(THREADS, 1)), and setmaxnreg only shares that pool out.
#define KERNEL_REGS 168
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
static_assert(!kSetmaxnreg || 128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= THREADS * KERNEL_REGS,
              "setmaxnreg shares out the block's registers, no more");

// The block's shared memory, every tile in the 128-byte swizzle as slabs of 64 columns:
//   q_smem [D/64][BLOCK_ROWS][64], the block's query tile;
//   k_ring [K_SLOTS][D/64][KEY_TILE][64] and v_ring [V_SLOTS][D/64][KEY_TILE][64];
//   the mbarriers full[SLOTS] and empty[SLOTS] (K's slots, then V's) and q_full;
// 1024 bytes more to align the start to a swizzle atom. A K slot is free again early in a step, as
// soon as S = Q Kᵀ is done, a V slot only at its end; at D = 128 the block has two K slots and
// three V slots, the rings stage 10 needs (a third K slot would fit too).
template <int D> struct Layout {
    static constexpr int K_SLOTS = !kRing ? 1 : D == 64 ? 4 : 2;
    static constexpr int V_SLOTS = !kRing ? 1 : D == 64 ? 4 : 3;
    static constexpr int SLOTS = K_SLOTS + V_SLOTS;
    static constexpr int Q_ELEMS = BLOCK_ROWS * D;
    static constexpr int TILE_ELEMS = KEY_TILE * D;
    static constexpr size_t bytes =
        1024 + ELEM_BYTES * (Q_ELEMS + SLOTS * TILE_ELEMS) + sizeof(uint64_t) * (2 * SLOTS + 1);
    static_assert(bytes <= 232448, "more shared memory than a Hopper block may have");
};

// Pointers into the block's shared memory, in Layout's order.
template <typename Elem, int D> struct SharedTiles {
    Elem *q_smem, *k_ring, *v_ring;
    uint64_t *k_full, *v_full, *k_empty, *v_empty, *q_full;
    __device__ explicit SharedTiles(unsigned char *smem_raw) {
        using L = Layout<D>;
        q_smem = (Elem *)smem_align_1024(smem_raw);
        k_ring = q_smem + L::Q_ELEMS;
        v_ring = k_ring + L::K_SLOTS * L::TILE_ELEMS;
        k_full = (uint64_t *)(v_ring + L::V_SLOTS * L::TILE_ELEMS), v_full = k_full + L::K_SLOTS;
        k_empty = k_full + L::SLOTS, v_empty = k_empty + L::K_SLOTS;
        q_full = k_empty + L::SLOTS;
    }
};

// What a block computes: query tile q0 / BLOCK_ROWS of one head and the key tiles it walks, the
// same for both roles. With the mask, a head's tiles are numbered from its last, so that within a
// head the blocks with the longest walks start first; the heads still start one after the other,
// so the launch ends on the last head's short walks.
struct BlockWork {
    int head, q0, n_tiles;
};
__device__ __forceinline__ BlockWork block_work(int S, int causal) {
    const int n_qtiles = ceil_div(S, BLOCK_ROWS), j = blockIdx.x % n_qtiles;
    const int q0 = (causal ? n_qtiles - 1 - j : j) * BLOCK_ROWS;
    const int keys = causal ? min(S, q0 + BLOCK_ROWS) : S;  // causal: up to the tile's diagonal
    return {(int)(blockIdx.x / n_qtiles), q0, ceil_div(keys, KEY_TILE)};
}

// One tile of ROWS rows from row0 of a head into `tile`, one TMA load per 64-column slab. The
// barrier is told the tile's bytes first; rows past S land as zeros and count as well.
template <int ROWS, int D, typename Elem>
__device__ __forceinline__ void load_tile(Elem *tile, const CUtensorMap *map, int row0, int head, uint64_t *full) {
    mbarrier_arrive_expect_tx(full, ELEM_BYTES * ROWS * D);
    for (int c = 0; c < D / SLAB; c++) tma_load_3d(tile + c * ROWS * SLAB, map, c * SLAB, row0, head, full);
}

// The producer loop, one thread: Q once, then each key tile's K and V, each into a slot that every
// consumer warp has released (ring_wait_empty). Key tile n is item n of both rings.
template <typename Elem, int D>
__device__ __forceinline__ void produce(const SharedTiles<Elem, D> &smem, const CUtensorMap *q_map,
                                        const CUtensorMap *k_map, const CUtensorMap *v_map, const BlockWork &work) {
    using L = Layout<D>;
    load_tile<BLOCK_ROWS, D>(smem.q_smem, q_map, work.q0, work.head, smem.q_full);
    for (int tile = 0; tile < work.n_tiles; tile++) {
        const int k_slot = ring_wait_empty<L::K_SLOTS, true>(smem.k_empty, tile);
        load_tile<KEY_TILE, D>(smem.k_ring + k_slot * L::TILE_ELEMS, k_map, tile * KEY_TILE, work.head,
                               &smem.k_full[k_slot]);
        const int v_slot = ring_wait_empty<L::V_SLOTS, true>(smem.v_empty, tile);
        load_tile<KEY_TILE, D>(smem.v_ring + v_slot * L::TILE_ELEMS, v_map, tile * KEY_TILE, work.head,
                               &smem.v_full[v_slot]);
    }
}

// Issue S = Q Kᵀ (this warpgroup's 64 rows x 128 keys) as one wgmma group; both operands in shared
// memory, K-major: step kk starts 32 bytes further into the 128-byte rows of slab kk / 4.
template <typename Elem, int D>
__device__ __forceinline__ void issue_qk(float (&s_acc)[KEY_TILE / 2], const Elem *q_smem, const Elem *k_tile,
                                         int consumer) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        wgmma_m64k16_ss<Elem, KEY_TILE>(s_acc, desc_k_major<BLOCK_ROWS>(q_smem, consumer * GROUP_ROWS, kk),
                                  desc_k_major<KEY_TILE>(k_tile, 0, kk), kk > 0);
    wgmma_commit();
}

// Issue O += P V as one wgmma group: P (Elem) is the A operand straight from registers; V is
// N-major, so step kk (16 keys) starts 16 rows = 2 atoms further, its 64-column slabs one slab
// (KEY_TILE x 64 elements) apart.
template <typename Elem, int D>
__device__ __forceinline__ void issue_pv(float (&o_acc)[D / 2], const uint32_t (&p_frag)[KEY_TILE / 16][4],
                                         const Elem *v_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KEY_TILE / 16; kk++)
        wgmma_m64k16_rs<Elem, D, 1>(o_acc, p_frag[kk], desc_n_major<KEY_TILE>(v_tile, kk), 1);
    wgmma_commit();
}

// The online softmax of key tile k0 for this thread's rows g and g + 8 of its warp's 16 (first_query
// is the warp's first row), in log2 units: scale_log2 = scale log2(e), so 2^x stands for e^x. The
// mask is applied only where the tile reaches past S or, causal, past the warp's first row. s_acc
// becomes P (fp32, unnormalized); row_max and row_sum advance (row_sum is this thread's share of
// the row); alpha[r] is the factor by which row r of O must be scaled before this tile's P V.
__device__ __forceinline__ void softmax_step(float (&s_acc)[KEY_TILE / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], int k0, int S, int causal, int first_query, int g,
                                             int t, float scale_log2) {
    if (k0 + KEY_TILE > S || (causal && k0 + KEY_TILE - 1 > first_query)) {
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + 8 * j + 2 * t + (e & 1);
                const int query = first_query + g + (e < 2 ? 0 : 8);
                if (key >= S || (causal && key > query)) s_acc[4 * j + e] = -INFINITY;
            }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float tile_max = -INFINITY;  // the row's max over the tile: this thread's 32 keys, then its quad's
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
            tile_max = fmaxf(tile_max, fmaxf(s_acc[4 * j + 2 * r], s_acc[4 * j + 2 * r + 1]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[r], tile_max * scale_log2);
        // Every row sees key 0 in the first tile, so its max is finite from then on. Were a row to
        // see no key, its max would be -inf, and -inf - -inf is NaN: subtract 0 instead, so that
        // its alpha and P are 2^-inf = 0 and its sum stays 0.
        const float base = new_max == -INFINITY ? 0.0f : new_max;
        alpha[r] = exp2f(row_max[r] - base);
        row_max[r] = new_max;
        float tile_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s_acc[4 * j + e] = exp2f(s_acc[4 * j + e] * scale_log2 - base);
                tile_sum += s_acc[4 * j + e];
            }
        row_sum[r] = row_sum[r] * alpha[r] + tile_sum;
    }
}

template <int D>
__device__ __forceinline__ void rescale_rows(float (&o_acc)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o_acc[4 * j + e] *= alpha[e / 2];
}

// The consumer loop: the block's key tiles in order, each step waiting for the one before. O is
// rescaled only between products, while no wgmma writes it. A slot is released (one arrival per
// warp) as soon as its last reader, S = Q Kᵀ for K and P V for V, has completed.
template <typename Elem, int D>
__device__ __forceinline__ void attend(float (&o_acc)[D / 2], float (&row_max)[2], float (&row_sum)[2],
                                       const SharedTiles<Elem, D> &smem, int n_tiles, int S, int causal, int first_query,
                                       int consumer, int g, int t, float scale_log2) {
    using L = Layout<D>;
    float s_acc[KEY_TILE / 2], alpha[2];  // S, then P (fp32), of the key tile in hand
    uint32_t p_frag[KEY_TILE / 16][4];    // P (Elem) as wgmma's A operand
    for (int tile = 0; tile < n_tiles; tile++) {
        const int k_slot = ring_wait_full<L::K_SLOTS, true>(smem.k_full, tile);
        issue_qk<Elem, D>(s_acc, smem.q_smem, smem.k_ring + k_slot * L::TILE_ELEMS, consumer);
        wgmma_wait<0>();
        fence_operands<KEY_TILE / 2>(s_acc);
        mbarrier_arrive_warp(&smem.k_empty[k_slot]);
        softmax_step(s_acc, row_max, row_sum, alpha, tile * KEY_TILE, S, causal, first_query, g, t, scale_log2);
        rescale_rows<D>(o_acc, alpha);
        pack_a_frags<Elem, KEY_TILE>(p_frag, s_acc);
        const int v_slot = ring_wait_full<L::V_SLOTS, true>(smem.v_full, tile);
        issue_pv<Elem, D>(o_acc, p_frag, smem.v_ring + v_slot * L::TILE_ELEMS);
        wgmma_wait<0>();
        fence_operands<D / 2>(o_acc);
        mbarrier_arrive_warp(&smem.v_empty[v_slot]);
    }
}

// The epilogue: O / l from registers to the head's rows in global memory ([S, D] of [B, H, S, D]),
// rows past S not stored. A row's sum l is the four shares of the lanes that hold it (4g..4g+3).
// A row that saw no key (l = 0) is stored as zeros, not 0 / 0; with these masks every row below S
// sees key 0 at least.
template <typename Elem, int D>
__device__ __forceinline__ void store_o(const float (&o_acc)[D / 2], const float (&row_sum)[2], Elem *o_head, int S,
                                        int first_query, int g, int t) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int query = first_query + g + 8 * r;
        if (query < S)
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *(uint32_t *)(o_head + (size_t)query * D + j * 8 + 2 * t) =
                    pack2<Elem>(o_acc[4 * j + 2 * r] * inv, o_acc[4 * j + 2 * r + 1] * inv);
    }
}

// One block per query tile and head: the producer warpgroup feeds the rings, each consumer
// warpgroup computes 64 rows of the tile.
template <typename Elem, int D>
__global__ void __launch_bounds__(THREADS, 1)
wgmma_forward(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
              const __grid_constant__ CUtensorMap v_map, Elem *o, int S, float scale, int causal) {
#if FLASH_STAGES_SM90A
    extern __shared__ unsigned char smem_raw[];
    const SharedTiles<Elem, D> smem(smem_raw);
    // full[s]: the producer's expect_tx arrival and the bytes; empty[s]: one arrival per consumer
    // warp; q_full: once, for Q. Thread 0 sets them up, and the block syncs. v_full follows k_full
    // and v_empty follows k_empty in shared memory, so SLOTS = K_SLOTS + V_SLOTS covers both rings.
    init_tma_ring(smem.k_full, smem.k_empty, Layout<D>::SLOTS, 4 * CONSUMERS, smem.q_full);
    const BlockWork work = block_work(S, causal);

    if (threadIdx.x / 128 == 0) {
        // Producer. One thread is enough: a TMA instruction moves a whole 64-column slab. The whole
        // warpgroup executes setmaxnreg (it is .sync.aligned), so it comes before that thread's branch.
        if constexpr (kSetmaxnreg) setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            tma_prefetch_descriptor(&q_map), tma_prefetch_descriptor(&k_map), tma_prefetch_descriptor(&v_map);
            produce<Elem, D>(smem, &q_map, &k_map, &v_map, work);
        }
    } else {
        if constexpr (kSetmaxnreg) setmaxnreg_inc<CONSUMER_REGS>();
        const int consumer = threadIdx.x / 128 - 1;
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        // Warp w of the warpgroup holds rows 16w .. 16w + 15 of its 64, in the mma.sync C layout.
        const int first_query = work.q0 + consumer * GROUP_ROWS + (threadIdx.x % 128) / 32 * 16;  // the warp's
        float o_acc[D / 2];  // [D/8 n8 blocks][4], the wgmma accumulator layout
#pragma unroll
        for (int e = 0; e < D / 2; e++) o_acc[e] = 0.0f;
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
        mbarrier_wait<true>(smem.q_full, 0);  // Q's first and only phase
        attend<Elem, D>(o_acc, row_max, row_sum, smem, work.n_tiles, S, causal, first_query, consumer, g, t,
                  scale * 1.4426950408889634f);
        store_o<Elem, D>(o_acc, row_sum, o + (size_t)work.head * S * D, S, first_query, g, t);
    }
#else
    (void)q_map, (void)k_map, (void)v_map, (void)o, (void)S, (void)scale, (void)causal;
#endif
}

template <typename Elem, int D>
static cudaError_t launch_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    const int heads_total = s->batch * s->heads;
    CUtensorMap q_map, k_map, v_map;  // [B*H, S, D], boxes of a query or key tile's rows x 64 columns
    cudaError_t err = make_tensor_map_bhsd(&q_map, t->q, s->dtype, heads_total, s->seq, D, BLOCK_ROWS);
    if (err == cudaSuccess) err = make_tensor_map_bhsd(&k_map, t->k, s->dtype, heads_total, s->seq, D, KEY_TILE);
    if (err == cudaSuccess) err = make_tensor_map_bhsd(&v_map, t->v, s->dtype, heads_total, s->seq, D, KEY_TILE);
    if (err == cudaSuccess) err = allow_dynamic_smem(wgmma_forward<Elem, D>, Layout<D>::bytes);
    if (err != cudaSuccess) return err;
    // A one-dimensional grid (up to 2^31 - 1 blocks) holds any number of heads.
    const int blocks = ceil_div(s->seq, BLOCK_ROWS) * heads_total;
    wgmma_forward<Elem, D><<<blocks, THREADS, Layout<D>::bytes, stream>>>(q_map, k_map, v_map, (Elem *)t->o, s->seq,
                                                                         1.0f / sqrtf((float)s->dim), s->causal);
    return cudaGetLastError();
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    if (s->dtype == ATTN_BF16)
        return s->dim == 128 ? launch_forward<__nv_bfloat16, 128>(s, t, stream)
                             : launch_forward<__nv_bfloat16, 64>(s, t, stream);
    return s->dim == 128 ? launch_forward<__half, 128>(s, t, stream) : launch_forward<__half, 64>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "09_tma_wgmma",
    .idea = "producer warpgroup (TMA) and two consumer warpgroups (wgmma) with mbarrier hand-off, "
        "each step waiting for the one before",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
    .needs_sm90a = 1,  // wgmma, setmaxnreg: compute capability 9.0 only
    .runs_bf16 = 1,
};
