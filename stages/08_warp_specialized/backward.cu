// Stage 08, backward - FlashAttention-2's backward pass on mma.sync.
//
// The idea: the forward saved only O and each row's log-sum-exp, so P is recomputed tile by tile
// (P = 2^(S scale log2 e - lse_log2)) instead of being stored (S x S). Then
//   delta_i = rowsum(dO ∘ O)                                     (backward_delta, a pre-pass)
//   S = Q Kᵀ, P;  dP = dO Vᵀ;  dS = P ∘ (dP - delta);  dV += Pᵀ dO;  dK += dSᵀ Q;  dQ += dS K
// backward_dk_dv gives each block 128 keys and walks over the query tiles of 64 queries (at D =
// 128 in a ring of one slot, the next tile copied under dQ's product), holding dK and dV in
// registers. The five products of a tile have three shapes
// (queries x keys, keys x D, queries x D), and the block's eight warps split each one into warp
// tiles of 32 rows, each warp taking a different piece of each: every fragment read from shared
// memory feeds two to eight MMAs. The price is that P and dS, computed in the warp layout of S,
// must reach the warps that multiply them in the layouts of dV, dK and dQ: they pass through
// shared memory, with a __syncthreads between (FlashAttention-2's layout: Dao 2023, "Parallelism
// and work partitioning"). At this tile size the instructions around the MMAs decide the speed, so
// every address the loop needs is computed once (swizzled_step, cp_async_tile's THREADS), 2^x is
// ex2.approx alone, and the masks cost only the tiles on the diagonal or past S.
// dQ's rows are queries, which every key block touches, so dQ is summed across blocks in one of
// two ways (kAtomicDq):
//   atomics (sm_90 and newer, faster there): each block adds dS K for the walked query tile to a
//     float dQ accumulator in global memory; backward_dq_convert turns the sums into fp16 or bf16. Five
//     matrix products; the order of the adds varies from run to run, so dQ's last bits do too.
//   deterministic (before sm_90, or -DATOMIC_DQ=0): backward_dq gives each block 64 queries (128
//     at D = 128) and walks over the key tiles, recomputing S and dP (seven products instead of
//     five), and owns its dQ rows.
// What changed from the forward: no producer warp. Every warp of backward_dk_dv reads every
// walked tile, so a block-wide cp.async ring (stage 07's pipeline) feeds them all. With grouped
// heads a dK/dV block walks the query tiles of every query head that reads its K/V head, one walk
// after the other, and sums their dK and dV in registers.
// Limits: 101,376 bytes of shared memory allow half of FlashAttention-2's query tile at D = 64 (64
// against its 128), so a block does twice its __syncthreads per FLOP there; at D = 128 its 64 rows
// fit only in a one-slot ring, and ptxas spills about 100 bytes a thread (dK, dV, S, dP and V's
// fragments live together).
#include <math.h>

#include "kernel_common.cuh"
#include "mma_ptx.cuh"
#include "backward_common.cuh"
#include "stage08.h"

// dQ by atomics on sm_90 and newer (1, measured faster there: lesson; dq_by_atomics() below) or
// always by the second, deterministic kernel (0, -DATOMIC_DQ=0).
#ifndef ATOMIC_DQ
#define ATOMIC_DQ 1
#endif
constexpr bool kAtomicDq = ATOMIC_DQ;

// Atomic dQ: on sm_90 and newer, one instruction adds 2 floats (red.global.add.v2.f32) (1), or
// every float is its own atomicAdd as on sm_80 (0).
#ifndef VECTOR_ATOMICS
#define VECTOR_ATOMICS 1
#endif
[[maybe_unused]] constexpr bool kVectorAtomics = VECTOR_ATOMICS;  // unused with ATOMIC_DQ=0
// 2^x as ex2.approx alone (1) or exp2f, with its range test and two multiplies (0).
#ifndef EX2_APPROX
#define EX2_APPROX 1
#endif
// backward_dk_dv's tile copies: each thread's addresses computed once (1, cp_async_tile's THREADS)
// or the general loop's index arithmetic for every 16 bytes (0).
#ifndef FIXED_COPIES
#define FIXED_COPIES 1
#endif
constexpr bool kEx2Approx = EX2_APPROX;
constexpr int kCopyThreads = FIXED_COPIES ? 256 : 0;  // backward_dk_dv's block size, or 0
__device__ inline float exp2_of(float x) { return kEx2Approx ? exp2_approx(x) : exp2f(x); }
// backward_dk_dv's walked query tile at D = 128: 64 rows in a ring of one slot, the next tile's Q
// and dO copied once every warp is done with dK and dV, under dQ's product (1); or 32 rows in a
// ring of two slots (0). 101,376 bytes hold either; the taller tile needs three block barriers per
// 64 rows instead of four, and each Q and dO fragment is loaded by four warps, not eight.
#ifndef TALL_WALK_D128
#define TALL_WALK_D128 1
#endif
#define BWD_WARPS 4
#define BWD_THREADS (32 * BWD_WARPS)
// backward_dq: 16-row mma tiles per warp, as stage 07's ROW_TILES: with two, every fragment of
// the walked tiles read from shared memory feeds two MMAs, but the walked tile must shrink to 32
// rows to leave registers for them. Measured (lesson): two pay at D = 128 only.
#ifndef Q_TILES_D64
#define Q_TILES_D64 1
#endif
#ifndef Q_TILES_D128
#define Q_TILES_D128 2
#endif

// Rows of backward_dq's walked tile: 64 at D = 64 with one row tile per warp, else 32.
template <int D, int TILES>
__host__ __device__ constexpr int walk_rows() { return D == 64 && TILES == 1 ? 64 : 32; }

// backward_dk_dv's block and its warps' tiles. Shared memory: the block's K tile (S's and dQ's B
// operand), a cp.async ring of SLOTS walked query tiles (2; 1 at D = 128; each Q, dO and the
// tile's lse and delta), and P and dS of one walked tile ([WALK][OWN] each, queries as rows). V is only ever the B
// operand of dP, for the keys of the warp's S tile, so it lives in registers: it passes through
// the ring's memory once, before the walk starts.
template <int D> struct DkDvConfig {
    static constexpr int WARPS = 8, THREADS = 32 * WARPS;
    static_assert(kCopyThreads == 0 || kCopyThreads == THREADS, "cp_async_tile's THREADS is the block size");
    static constexpr int OWN = 128;        // keys per block
    static constexpr int WALK = D == 64 || TALL_WALK_D128 ? 64 : 32;  // queries per walked tile
    static constexpr int SLOTS = D == 128 && TALL_WALK_D128 ? 1 : 2;   // the ring's slots
    // Warp tiles, 32 rows each. S and dP [WALK x OWN], and dQ [WALK x D], as ROW_GROUPS x
    // COL_GROUPS warps of 32 x SDP_COLS keys and 32 x DQ_COLS; dK and dV [OWN x D] as 4 x 2 warps
    // of 32 keys x KV_COLS.
    static constexpr int ROW_GROUPS = WALK / 32, COL_GROUPS = WARPS / ROW_GROUPS;
    static constexpr int SDP_COLS = OWN / COL_GROUPS, DQ_COLS = D / COL_GROUPS, KV_COLS = D / 2;
    static_assert(OWN == 4 * 32 && ROW_GROUPS * COL_GROUPS == WARPS && DQ_COLS % 16 == 0, "the warp tiles cover the products");
    static constexpr size_t SLOT = ELEM_BYTES * 2 * WALK * D + sizeof(float) * 2 * WALK;
    static constexpr int P_BYTES = ELEM_BYTES * WALK * OWN;  // P's tile; dS's follows
    static constexpr size_t bytes = ELEM_BYTES * OWN * D + SLOTS * SLOT + 2 * P_BYTES;
    // Every tile starts at a multiple of its row pitch, as swizzled_step needs.
    static_assert((ELEM_BYTES * OWN * D) % 256 == 0 && SLOT % 256 == 0 && P_BYTES % 256 == 0, "tile alignment");
    static_assert(SLOTS * SLOT >= ELEM_BYTES * OWN * D, "V is staged through the ring");
    static_assert(bytes <= 101376, "101,376 bytes is the per-block shared memory of sm_86 and sm_89");
};
template <int D> struct DqConfig {
    static constexpr int TILES = D == 64 ? Q_TILES_D64 : Q_TILES_D128;
    static constexpr int OWN = 16 * TILES * BWD_WARPS;         // queries per block
    static constexpr int WALK = walk_rows<D, TILES>();        // keys per walked tile
    static constexpr size_t bytes = ELEM_BYTES * (2 * OWN * D + 2 * 2 * WALK * D);
    static_assert(bytes <= 101376, "101,376 bytes is the per-block shared memory of sm_86 and sm_89");
};

// fp32 accumulator blocks 2k and 2k + 1 (each 16 x 8) as one fp16 or bf16 A operand (16 x 16).
template <typename Elem>
__device__ inline void pack_a(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack2<Elem>(lo[0], lo[1]);
    a[1] = pack2<Elem>(lo[2], lo[3]);
    a[2] = pack2<Elem>(hi[0], hi[1]);
    a[3] = pack2<Elem>(hi[2], hi[3]);
}

// acc[m][2n], acc[m][2n + 1] += A(m) x the two n8 blocks of b, for every row tile m: each B
// fragment read from shared memory feeds MT pairs of MMAs.
template <typename Elem, int MT, int NT>
__device__ inline void mma_rows_by_b_pair(float acc[MT][NT][4], const uint32_t a[MT][4], const uint32_t b[4], int n) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
        mma_m16n8k16<Elem>(acc[m][2 * n], a[m], b[0], b[1]);
        mma_m16n8k16<Elem>(acc[m][2 * n + 1], a[m], b[2], b[3]);
    }
}

// out[m][j] (j = 0 .. D/8-1) += P(16 x K per row tile, accumulators in registers) x B(K rows of
// b_tile).
template <typename Elem, int D, int K, int RT>
__device__ inline void product_pb(float out[RT][D / 8][4], const float p[RT][K / 8][4], const Elem *b_tile,
                                  int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[RT][4];
#pragma unroll
        for (int m = 0; m < RT; m++) pack_a<Elem>(a[m], p[m][2 * kk], p[m][2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < D / 16; n++) {
            uint32_t b[4];
            load_b_frags_trans<D>(b, b_tile, kk * 16, n * 16, lane);
            mma_rows_by_b_pair<Elem, RT, D / 8>(out, a, b, n);
        }
    }
}

template <int RT, int N>
__device__ inline void zero(float acc[RT][N][4]) {
#pragma unroll
    for (int m = 0; m < RT; m++)
#pragma unroll
        for (int n = 0; n < N; n++) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
}

// Warp-tile products, on swizzled tiles in shared memory: acc is MT x NT blocks of 16 x 8, summed
// over K. The operands are given by this lane's address of the warp tile's first fragment
// (a_frag_address and friends, mma_ptx.cuh), and every other fragment is a swizzled_step away.

// acc += A Bᵀ: A's rows in a [..][WA] tile, B's rows in a [..][WB] tile (S = Q Kᵀ, dP = dO Vᵀ).
template <typename Elem, int K, int MT, int NT, int WA, int WB>
__device__ inline void warp_abt(float acc[MT][NT][4], uint32_t a_address, uint32_t b_address) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++) ldmatrix_x4_at(a[m], swizzled_step<WA>(a_address, 16 * m, 16 * kk));
#pragma unroll
        for (int n = 0; n < NT / 2; n++) {
            uint32_t b[4];
            ldmatrix_x4_at(b, swizzled_step<WB>(b_address, 16 * n, 16 * kk));
            mma_rows_by_b_pair<Elem, MT, NT>(acc, a, b, n);
        }
    }
}

// acc += A B: A's rows in a [..][WA] tile or, A_TRANSPOSED, its columns in a [K][WA] tile (Pᵀ and
// dSᵀ from P and dS); B's rows k in a [K][WB] tile (dV = Pᵀ dO, dK = dSᵀ Q, dQ = dS K).
template <typename Elem, int K, int MT, int NT, int WA, int WB, bool A_TRANSPOSED>
__device__ inline void warp_ab(float acc[MT][NT][4], uint32_t a_address, uint32_t b_address) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++) {
            if constexpr (A_TRANSPOSED) ldmatrix_x4_trans_at(a[m], swizzled_step<WA>(a_address, 16 * kk, 16 * m));
            else ldmatrix_x4_at(a[m], swizzled_step<WA>(a_address, 16 * m, 16 * kk));
        }
#pragma unroll
        for (int n = 0; n < NT / 2; n++) {
            uint32_t b[4];
            ldmatrix_x4_trans_at(b, swizzled_step<WB>(b_address, 16 * kk, 16 * n));
            mma_rows_by_b_pair<Elem, MT, NT>(acc, a, b, n);
        }
    }
}

// Writes a warp tile (rows row0 + g, + 8 of each 16, columns col0..) of a [S, D] fp16 or bf16 matrix,
// times factor; rows past S are not written.
template <int D, int MT, int NT, typename Elem>
__device__ inline void store_warp_tile(Elem *dst, const float acc[MT][NT][4], float factor, int row0, int col0, int S,
                                       int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = row0 + 16 * m + g + 8 * r;
            if (row >= S) continue;
#pragma unroll
            for (int n = 0; n < NT; n++)
                *(uint32_t *)(dst + (size_t)row * D + col0 + 8 * n + 2 * t) =
                    pack2<Elem>(acc[m][n][2 * r] * factor, acc[m][n][2 * r + 1] * factor);
        }
}

// P = 2^(S scale log2 e - lse) and dS = P ∘ (dP - delta) of a warp's 32 x (NT 8) tile of S and
// dP, to shared memory as Elem at p_address (this thread's first pair; dS is ds_offset bytes
// further). The thread's rows are g, g + 8, g + 16, g + 24 (query0 + those, lse_rows and
// delta_rows indexed by them), its keys key0 + 8 n + 2 t (+1). MASKED (tiles on the diagonal, or
// with queries or keys past their ends) zeroes P where the query is past S or, causal, the key is
// past the last one the query sees (query + offset, offset = S_kv - S), and with KEYS_PAST_S where
// the key is past S_kv. Such a key must be masked although its
// K row is zero (cp_async_tile fills it so): its score is then 0 and P = 2^-lse, which overflows
// fp16 wherever a row's scores are all below about -11, and dQ += dS K would turn that Inf times
// the zero row into NaN.
template <typename Elem, int W, int NT, bool MASKED, bool KEYS_PAST_S>
__device__ inline void p_and_ds_to_smem(const float (&s_acc)[2][NT][4], const float (&dp_acc)[2][NT][4],
                                        const float *lse_rows, const float *delta_rows, uint32_t p_address,
                                        int ds_offset, float scale_log2, int query0, int key0, int S, int S_kv,
                                        int causal, int lane) {
    const int offset = S_kv - S;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = 16 * m + 8 * r + g, query = query0 + row;
            const float lse = lse_rows[row], d_i = delta_rows[row];
#pragma unroll
            for (int n = 0; n < NT; n++) {
                float p[2], ds[2];
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const int key = key0 + 8 * n + 2 * t + c;
                    p[c] = exp2_of(s_acc[m][n][2 * r + c] * scale_log2 - lse);
                    if (MASKED && (query >= S || (KEYS_PAST_S && key >= S_kv) || (causal && query + offset < key)))
                        p[c] = 0.0f;
                    ds[c] = p[c] * (dp_acc[m][n][2 * r + c] - d_i);
                }
                // The base's chunk is a multiple of NT, so the 8-column steps n < NT flip chunk
                // bits it does not use: swizzled_step applies.
                const uint32_t at = swizzled_step<W>(p_address, 16 * m + 8 * r, 8 * n);
                st_shared_b32(at, pack2<Elem>(p[0], p[1]));
                st_shared_b32(at + ds_offset, pack2<Elem>(ds[0], ds[1]));
            }
        }
}

// Starts copying the walked query tile `tile` (Q, dO, lse and delta of QT queries) into a slot.
template <int D, int QT, int THREADS, typename Elem>
__device__ inline void load_query_tile(unsigned char *slot, const Elem *q_head, const Elem *do_head,
                                       const float *lse_head, const float *delta_head, int tile, int S) {
    Elem *q_tile = (Elem *)slot, *do_tile = q_tile + QT * D;
    float *lse_tile = (float *)(do_tile + QT * D), *delta_tile = lse_tile + QT;
    const int i0 = tile * QT;
    cp_async_tile<QT, D, THREADS>(q_tile, q_head, i0, S);
    cp_async_tile<QT, D, THREADS>(do_tile, do_head, i0, S);
    for (int i = threadIdx.x; i < QT; i += blockDim.x) {
        const bool valid = i0 + i < S;
        cp_async_4(lse_tile + i, lse_head + (valid ? i0 + i : 0), valid);
        cp_async_4(delta_tile + i, delta_head + (valid ? i0 + i : 0), valid);
    }
}

// dK, dV (and with ATOMIC dQ's share) for the OWN keys of a block of one K/V head; the query tiles
// of every query head that reads it (`group` of them, grouped-query attention) stream through a
// cp.async ring (SLOTS slots), one walk after the other. KEYS_PAST_S: S_kv is not a multiple of OWN, so
// each head's last key block has keys past S_kv to mask in every tile; chosen per launch, as
// FlashAttention-2's Is_even_MN, so that the blocks of a length with no such keys carry no test.
template <typename Elem, int D, bool ATOMIC, bool KEYS_PAST_S>
__global__ void __launch_bounds__(DkDvConfig<D>::THREADS, 1)
backward_dk_dv(const Elem *q, const Elem *k, const Elem *v, const Elem *d_o, const float *lse_log2,
               const float *delta, Elem *dk, Elem *dv, float *dq_accum, int S, int S_kv, int group,
               int first_kv_head, float scale, int causal) {
    using L = DkDvConfig<D>;
    constexpr int QT = L::WALK, OWN = L::OWN, SDP_NT = L::SDP_COLS / 8, DQ_NT = L::DQ_COLS / 8, KV_NT = L::KV_COLS / 8;
    extern __shared__ __align__(1024) unsigned char smem[];
    Elem *k_tile = (Elem *)smem;                            // [OWN][D]
    unsigned char *ring = (unsigned char *)(k_tile + OWN * D);  // [SLOTS][Q tile, dO tile, lse, delta]
    Elem *p_tile = (Elem *)(ring + L::SLOTS * L::SLOT);     // [QT][OWN]: P, queries as rows
    Elem *ds_tile = p_tile + QT * OWN;                        // [QT][OWN]: dS

    const int kv_index = first_kv_head + blockIdx.z * gridDim.y + blockIdx.y;
    const size_t kv_head = (size_t)kv_index * S_kv * D;
    const int j0 = blockIdx.x * OWN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // This warp's tile in each layout: S and dP (queries x keys), dK and dV (keys x D), dQ (queries x D).
    const int sdp_row0 = (warp / L::COL_GROUPS) * 32, sdp_col0 = (warp % L::COL_GROUPS) * L::SDP_COLS;
    const int dq_row0 = sdp_row0, dq_col0 = (warp % L::COL_GROUPS) * L::DQ_COLS;
    const int kv_row0 = (warp % 4) * 32, kv_col0 = (warp / 4) * L::KV_COLS;
    const float scale_log2 = scale * 1.4426950408889634f;
    // Causal: queries before j0 - (S_kv - S) see none of these keys. Walk w is query tile
    // first_tile + w % tiles of query head kv_index group + w / tiles.
    const int first_tile = causal ? max(0, j0 - (S_kv - S)) / QT : 0, n_tiles = ceil_div(S, QT);
    const int tiles = n_tiles - first_tile, n_walks = group * tiles;
    auto q_head_of = [&](int w) { return (size_t)(kv_index * group + w / tiles) * S; };  // its first row

    // K stays in shared memory; V's B fragments for this warp's keys move into registers.
    Elem *v_stage = (Elem *)ring;
    cp_async_tile<OWN, D, kCopyThreads>(k_tile, k + kv_head, j0, S_kv);
    cp_async_tile<OWN, D, kCopyThreads>(v_stage, v + kv_head, j0, S_kv);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t v_frags[D / 16][SDP_NT / 2][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int n = 0; n < SDP_NT / 2; n++) load_b_frags_of_rows<D>(v_frags[kk][n], v_stage, sdp_col0 + 16 * n, 16 * kk, lane);
    __syncthreads();  // the ring's memory is free for the query tiles

    if (n_walks > 0)
        load_query_tile<D, QT, kCopyThreads>(ring, q + q_head_of(0) * D, d_o + q_head_of(0) * D, lse_log2 + q_head_of(0),
                                             delta + q_head_of(0), first_tile, S);
    cp_async_commit();

    // This lane's fragment addresses, computed once (the swizzle's arithmetic stays out of the
    // loop): S's A = Q and dP's A = dO (of slot 0; a slot is SLOT bytes further), S's B = K; dV's
    // A = Pᵀ and dK's A = dSᵀ, dV's B = dO and dK's B = Q; dQ's A = dS and B = K; and where this
    // thread's P and dS pairs go.
    const Elem *q_tile0 = (const Elem *)ring, *do_tile0 = q_tile0 + QT * D;
    const uint32_t q_a = a_frag_address<D>(q_tile0, sdp_row0, 0, lane), do_a = a_frag_address<D>(do_tile0, sdp_row0, 0, lane);
    const uint32_t k_b = b_frags_of_rows_address<D>(k_tile, sdp_col0, 0, lane);
    const uint32_t p_at = a_frag_trans_address<OWN>(p_tile, kv_row0, 0, lane), ds_at = p_at + L::P_BYTES;
    const uint32_t do_bt = b_frags_trans_address<D>(do_tile0, 0, kv_col0, lane), q_bt = do_bt - QT * D * 2;
    const uint32_t ds_a = a_frag_address<OWN>(ds_tile, dq_row0, 0, lane);
    const uint32_t k_bt = b_frags_trans_address<D>(k_tile, 0, dq_col0, lane);
    const uint32_t p_st = smem_address(p_tile + swizzle<OWN>(sdp_row0 + g, sdp_col0 + 2 * t));

    float dk_acc[2][KV_NT][4], dv_acc[2][KV_NT][4];
    zero<2, KV_NT>(dk_acc);
    zero<2, KV_NT>(dv_acc);

    for (int w = 0; w < n_walks; w++) {
        // The next walked tile's copies into `slot_index`, committed as one group (empty at the end).
        auto load_next = [&](int slot_index) {
            if (w + 1 < n_walks) {
                const size_t next = q_head_of(w + 1);
                load_query_tile<D, QT, kCopyThreads>(ring + slot_index * L::SLOT, q + next * D, d_o + next * D,
                                                     lse_log2 + next, delta + next, first_tile + (w + 1) % tiles, S);
            }
            cp_async_commit();
        };
        // One barrier makes this tile's copies visible to every warp and tells that every warp is
        // done with the previous tile: its slot, P and dS. With two slots the next tile's copies
        // then go into the other slot and land while this one is computed; with one, once every
        // warp is done with this tile's Q and dO (after dK), under dQ's product.
        cp_async_wait<0>();
        __syncthreads();
        if (L::SLOTS == 2) load_next((w + 1) % 2);
        const int tile = first_tile + w % tiles;
        const size_t head = q_head_of(w) * D;  // the query head's Q, dO and dQ
        const uint32_t slot_offset = (w % L::SLOTS) * L::SLOT;
        unsigned char *slot = ring + slot_offset;
        const Elem *do_tile = (const Elem *)slot + QT * D;
        const float *lse_tile = (const float *)(do_tile + QT * D), *delta_tile = lse_tile + QT;
        const int i0 = tile * QT;

        // S = Q Kᵀ and dP = dO Vᵀ for this warp's 32 queries x SDP_COLS keys.
        float s_acc[2][SDP_NT][4], dp_acc[2][SDP_NT][4];
        zero<2, SDP_NT>(s_acc);
        zero<2, SDP_NT>(dp_acc);
        warp_abt<Elem, D, 2, SDP_NT, D, D>(s_acc, q_a + slot_offset, k_b);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++) ldmatrix_x4_at(a[m], swizzled_step<D>(do_a + slot_offset, 16 * m, 16 * kk));
#pragma unroll
            for (int n = 0; n < SDP_NT / 2; n++) mma_rows_by_b_pair<Elem, 2, SDP_NT>(dp_acc, a, v_frags[kk][n], n);
        }

        // P and dS to shared memory; the masks cost only the tiles on the diagonal or past S
        // (every tile of a head's last key block, whose keys end past S_kv).
        const int query0 = i0 + sdp_row0, key0 = j0 + sdp_col0;
        const float *lse_rows = lse_tile + sdp_row0, *delta_rows = delta_tile + sdp_row0;
        if (i0 + QT > S || (KEYS_PAST_S && j0 + OWN > S_kv) || (causal && i0 + (S_kv - S) < j0 + OWN))
            p_and_ds_to_smem<Elem, OWN, SDP_NT, true, KEYS_PAST_S>(s_acc, dp_acc, lse_rows, delta_rows, p_st, L::P_BYTES,
                                                              scale_log2, query0, key0, S, S_kv, causal, lane);
        else
            p_and_ds_to_smem<Elem, OWN, SDP_NT, false, KEYS_PAST_S>(s_acc, dp_acc, lse_rows, delta_rows, p_st, L::P_BYTES,
                                                               scale_log2, query0, key0, S, S_kv, causal, lane);
        __syncthreads();  // P and dS of the whole tile are in shared memory

        // dV += Pᵀ dO and dK += dSᵀ Q for this warp's 32 keys x KV_COLS columns.
        warp_ab<Elem, QT, 2, KV_NT, OWN, D, true>(dv_acc, p_at, do_bt + slot_offset);
        warp_ab<Elem, QT, 2, KV_NT, OWN, D, true>(dk_acc, ds_at, q_bt + slot_offset);
        if (L::SLOTS == 1) {
            __syncthreads();  // every warp is done with the slot's Q and dO
            load_next(0);
        }
        if constexpr (ATOMIC) {
            // dQ += dS K for this warp's 32 queries x DQ_COLS columns, added to the float sums.
            float dq_acc[2][DQ_NT][4];
            zero<2, DQ_NT>(dq_acc);
            warp_ab<Elem, OWN, 2, DQ_NT, OWN, D, false>(dq_acc, ds_a, k_bt);
            // This thread's first float of the tile, and how many of its rows (g + 16 m + 8 r) exist.
            float *dq_rows = dq_accum + head + (size_t)(i0 + dq_row0 + g) * D + dq_col0 + 2 * t;
            const int rows_left = S - (i0 + dq_row0 + g);
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int r = 0; r < 2; r++)
                    if (16 * m + 8 * r < rows_left)
#pragma unroll
                        for (int n = 0; n < DQ_NT; n++)
                            atomic_add_float2<kVectorAtomics>(dq_rows + (16 * m + 8 * r) * D + 8 * n,
                                                              make_float2(dq_acc[m][n][2 * r], dq_acc[m][n][2 * r + 1]));
        }
    }
    cp_async_wait<0>();

    // S = scale Q Kᵀ, so dK = scale dSᵀ Q; dV needs no factor.
    store_warp_tile<D, 2, KV_NT>(dk + kv_head, dk_acc, scale, j0 + kv_row0, kv_col0, S_kv, lane);
    store_warp_tile<D, 2, KV_NT>(dv + kv_head, dv_acc, 1.0f, j0 + kv_row0, kv_col0, S_kv, lane);
}

// dQ for OWN queries per block, 16 * TILES per warp; the K and V tiles (KT rows each) of the K/V
// head the query head reads stream through a 2-slot cp.async ring.
template <typename Elem, int D>
__global__ void __launch_bounds__(BWD_THREADS)
backward_dq(const Elem *q, const Elem *k, const Elem *v, const Elem *d_o, const float *lse_log2,
            const float *delta, Elem *dq, int S, int S_kv, int group, int first_head, float scale, int causal) {
    using L = DqConfig<D>;
    constexpr int KT = L::WALK, RT = L::TILES, OWN = L::OWN;
    constexpr int SLOT = 2 * KT * D;  // K tile then V tile
    extern __shared__ __align__(1024) unsigned char smem[];
    Elem *q_tile = (Elem *)smem;      // [OWN][D]
    Elem *do_tile = q_tile + OWN * D;   // [OWN][D]
    Elem *ring = do_tile + OWN * D;     // [2][K tile, V tile]

    const int head_index = first_head + blockIdx.z * gridDim.y + blockIdx.y, offset = S_kv - S;
    const size_t head = (size_t)head_index * S * D, kv_head = (size_t)(head_index / group) * S_kv * D;
    const int q_block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // longest first
    const int i0 = q_block * OWN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int kv_end = causal ? min(S_kv, i0 + OWN + offset) : S_kv, n_tiles = ceil_div(kv_end, KT);

    cp_async_tile<OWN, D>(q_tile, q + head, i0, S);
    cp_async_tile<OWN, D>(do_tile, d_o + head, i0, S);
    for (int s = 0; s < 2; s++) {
        if (s < n_tiles) {
            cp_async_tile<KT, D>(ring + s * SLOT, k + kv_head, s * KT, S_kv);
            cp_async_tile<KT, D>(ring + s * SLOT + KT * D, v + kv_head, s * KT, S_kv);
        }
        cp_async_commit();
    }

    // This thread's rows: warp_query0 + 16 m + g and + 8, with their lse and delta.
    const int warp_query0 = i0 + warp * 16 * RT;
    float lse[RT][2], d_i[RT][2];
#pragma unroll
    for (int m = 0; m < RT; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int query = warp_query0 + 16 * m + g + 8 * r;
            lse[m][r] = query < S ? lse_log2[(size_t)head_index * S + query] : INFINITY;
            d_i[m][r] = query < S ? delta[(size_t)head_index * S + query] : 0.0f;
        }
    float dq_acc[RT][D / 8][4];
    zero<RT, D / 8>(dq_acc);

    for (int tile = 0; tile < n_tiles; tile++) {
        cp_async_wait<1>();
        __syncthreads();
        const Elem *k_tile = ring + (tile % 2) * SLOT, *v_tile = k_tile + KT * D;
        const int k0 = tile * KT;

        // S = Q Kᵀ, P in place; dP = dO Vᵀ; dS = P ∘ (dP - delta) in place; dQ += dS K.
        float p[RT][KT / 8][4], ds[RT][KT / 8][4];
        zero<RT, KT / 8>(p);
        zero<RT, KT / 8>(ds);
        warp_abt<Elem, D, RT, KT / 8, D, D>(p, a_frag_address<D>(q_tile, warp * 16 * RT, 0, lane),
                                        b_frags_of_rows_address<D>(k_tile, 0, 0, lane));
        warp_abt<Elem, D, RT, KT / 8, D, D>(ds, a_frag_address<D>(do_tile, warp * 16 * RT, 0, lane),
                                        b_frags_of_rows_address<D>(v_tile, 0, 0, lane));
        const bool masked = k0 + KT > S_kv || (causal && k0 + KT - 1 > i0 + offset);
#pragma unroll
        for (int m = 0; m < RT; m++)
#pragma unroll
            for (int n = 0; n < KT / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = k0 + n * 8 + 2 * t + (e & 1), r = e / 2;
                    float x = exp2_of(p[m][n][e] * scale_log2 - lse[m][r]);
                    if (masked && (key >= S_kv || (causal && key > warp_query0 + 16 * m + g + 8 * r + offset))) x = 0.0f;
                    ds[m][n][e] = x * (ds[m][n][e] - d_i[m][r]);
                }
        product_pb<Elem, D, KT, RT>(dq_acc, ds, k_tile, lane);

        __syncthreads();
        if (tile + 2 < n_tiles) {
            cp_async_tile<KT, D>(ring + (tile % 2) * SLOT, k + kv_head, (tile + 2) * KT, S_kv);
            cp_async_tile<KT, D>(ring + (tile % 2) * SLOT + KT * D, v + kv_head, (tile + 2) * KT, S_kv);
        }
        cp_async_commit();
    }
    cp_async_wait<0>();
    store_warp_tile<D, RT, D / 8>(dq + head, dq_acc, scale, warp_query0, 0, S, lane);
}

// Atomic dQ pays where one instruction adds 2 floats (sm_90 and newer). With one float per atomic
// it is slower than the deterministic kernel on the H100 (lesson: bwd_scalar_atomics), so GPUs
// before sm_90 take the deterministic kernel. -DVECTOR_ATOMICS=0 forces scalar atomics everywhere,
// to measure exactly that.
static bool dq_by_atomics() {
    if (!kAtomicDq) return false;
    if (!kVectorAtomics) return true;
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
        return false;
    return major >= 9;
}

// Sized by the build (kAtomicDq), not by dq_by_atomics(): the size must not depend on which
// device happens to be current when a caller asks for it.
size_t stage08_backward_scratch_bytes(const attn_shape *s) {
    return kAtomicDq ? delta_and_dq_accum_scratch_bytes(s) : delta_scratch_bytes(s);
}

template <int D>
static size_t backward_shared_bytes() {
    if (dq_by_atomics()) return DkDvConfig<D>::bytes;
    return DkDvConfig<D>::bytes > DqConfig<D>::bytes ? DkDvConfig<D>::bytes : DqConfig<D>::bytes;
}

size_t stage08_backward_shared_bytes(const attn_shape *s) {
    return s->dim == 64 ? backward_shared_bytes<64>() : backward_shared_bytes<128>();
}

template <typename Elem, int D, bool ATOMIC>
static cudaError_t launch_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    using DkDv = DkDvConfig<D>;
    using Dq = DqConfig<D>;
    const float *lse = workspace_lse(s, t), *delta = scratch_delta(s, t);
    float *dq_accum = ATOMIC ? scratch_dq_accum(s, t) : NULL;
    // The delta pre-pass also zeroes dQ's sums.
    cudaError_t err = launch_backward_delta<Elem>(s, t, stream, dq_accum, ATOMIC ? attn_elems(s) : 0);
    const int S_kv = attn_kv_seq(s), group = attn_group(s);
    const bool keys_past_s = S_kv % DkDv::OWN != 0;
    const auto dk_dv = keys_past_s ? backward_dk_dv<Elem, D, ATOMIC, true> : backward_dk_dv<Elem, D, ATOMIC, false>;
    if (err == cudaSuccess) err = allow_dynamic_smem(dk_dv, DkDv::bytes);
    if (err == cudaSuccess && !ATOMIC) err = allow_dynamic_smem(backward_dq<Elem, D>, Dq::bytes);
    if (err != cudaSuccess) return err;
    const float scale = 1.0f / sqrtf((float)D);
    const Elem *q = (const Elem *)t->q, *k = (const Elem *)t->k, *v = (const Elem *)t->v;
    const Elem *d_o = (const Elem *)t->d_o;
    // dK and dV: a block per key block of each K/V head, in chunks of K/V heads (head_chunk).
    const int kv_heads_total = s->batch * attn_kv_heads(s);
    for (int first = 0; first < kv_heads_total;) {
        const head_chunk c = head_chunk_from(first, kv_heads_total, ceil_div(S_kv, DkDv::OWN));
        dk_dv<<<c.grid, DkDv::THREADS, DkDv::bytes, stream>>>(q, k, v, d_o, lse, delta, (Elem *)t->dk, (Elem *)t->dv,
                                                              dq_accum, s->seq, S_kv, group, first, scale, s->causal);
        first += c.count;
    }
    // dQ without atomics: a block per query block of each query head.
    const int heads_total = s->batch * s->heads;
    for (int first = 0; !ATOMIC && first < heads_total;) {
        const head_chunk c = head_chunk_from(first, heads_total, ceil_div(s->seq, Dq::OWN));
        backward_dq<Elem, D><<<c.grid, BWD_THREADS, Dq::bytes, stream>>>(
            q, k, v, d_o, lse, delta, (Elem *)t->dq, s->seq, S_kv, group, first, scale, s->causal);
        first += c.count;
    }
    if (ATOMIC) launch_backward_dq_convert<Elem>(s, t, scale, stream);
    return cudaGetLastError();
}

template <typename Elem>
static cudaError_t launch_backward_of_type(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    if (dq_by_atomics())
        return s->dim == 64 ? launch_backward<Elem, 64, true>(s, t, stream) : launch_backward<Elem, 128, true>(s, t, stream);
    return s->dim == 64 ? launch_backward<Elem, 64, false>(s, t, stream) : launch_backward<Elem, 128, false>(s, t, stream);
}

cudaError_t stage08_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dtype == ATTN_BF16 ? launch_backward_of_type<__nv_bfloat16>(s, t, stream)
                                 : launch_backward_of_type<__half>(s, t, stream);
}
