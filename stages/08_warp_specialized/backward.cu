// Stage 08, backward - FlashAttention-2's backward pass on mma.sync.
//
// The idea: the forward saved only O and each row's log-sum-exp, so P is recomputed tile by tile
// (P = 2^(S scale log2 e - lse_log2)) instead of being stored (S x S). Then
//   delta_i = rowsum(dO ∘ O)                                     (backward_delta, a pre-pass)
//   dV += Pᵀ dO,  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ - delta),  dK += dSᵀ Q       (backward_dk_dv)
//   dQ += dS K
// backward_dk_dv gives each block 128 keys (16 per warp, eight warps) and walks over the query
// tiles, holding dK and dV in registers. dQ's rows are queries, which every key block touches,
// so dQ is summed across blocks in one of two ways (kAtomicDq):
//   atomics (sm_90 and newer, faster there): each block writes dSᵀ to shared memory, multiplies
//     dS K for the walked query tile and adds it to a float dQ accumulator in global memory;
//     backward_dq_convert turns the sums into fp16. Five matrix products; the order of the adds
//     varies from run to run, so dQ's last bits do too.
//   deterministic (before sm_90, or -DATOMIC_DQ=0): backward_dq gives each block 64 queries (128
//     at D = 128) and walks over the key tiles, recomputing S and dP (seven products instead of
//     five), and owns its dQ rows.
// Every product runs on the tensor cores, and each accumulator is reused as the A operand of the
// next product in registers (Pᵀ for dV, dSᵀ for dK, dS for dQ in backward_dq), as in stage 07.
// V (and at D = 64 K) is an A operand of the warp that owns its rows only, so its fragments are
// loaded into registers once per block instead of from shared memory for every tile.
// What changed from the forward: no producer warp. Every warp of backward_dk_dv reads every
// walked tile, so a block-wide cp.async ring (stage 07's pipeline) feeds them all.
// Limits: 16 rows per warp, so each fragment read from shared memory feeds at most two MMAs
// (FlashAttention-2 gives a warp 32 x 32 or larger tiles, and passes P and dS through shared
// memory to do so); dQ's atomics are 128 x D floats per key block and query tile.
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

// backward_dk_dv: warps per block, 16 keys each. Eight give 128-key blocks, which halve the
// atomic dQ traffic of 64-key blocks (every key block adds its share to every dQ row it sees).
#ifndef DKDV_WARPS
#define DKDV_WARPS 8
#endif
// backward_dk_dv at D = 64: K's A fragments stay in registers for the whole block (1), or are
// read from shared memory for every walked tile (0). At D = 128 they do not fit beside dK, dV and V.
#ifndef K_FRAGS_IN_REGS_D64
#define K_FRAGS_IN_REGS_D64 1
#endif
// Atomic dQ: on sm_90 and newer, one instruction adds 4 floats (red.global.add.v4.f32) (1), or
// every float is its own atomicAdd as on sm_80 (0).
#ifndef VECTOR_ATOMICS
#define VECTOR_ATOMICS 1
#endif
[[maybe_unused]] constexpr bool kVectorAtomics = VECTOR_ATOMICS;  // unused with ATOMIC_DQ=0
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

// Rows of a walked tile: 64 at D = 64 with one row tile per warp, else 32.
template <int D, int TILES>
__host__ __device__ constexpr int walk_rows() { return D == 64 && TILES == 1 ? 64 : 32; }

// Shared memory of backward_dk_dv: the block's K tile (OWN keys; dQ's B operand, and S's A
// operand unless kept in registers), a 2-slot cp.async ring of walked query tiles (Q, dO and the
// tile's lse and delta), and with atomic dQ (ATOMIC) the warps' dSᵀ of one walked tile, padded by
// 8 halves a row so that ldmatrix reads and the warps' writes spread over the banks, and each
// warp's dQ piece (add_dq_tile). V is only ever an A operand of the warp that owns its rows, so
// it lives in registers: it passes through the ring's memory once, before the ring starts.
template <int D, bool ATOMIC> struct DkDvConfig {
    static constexpr int WARPS = DKDV_WARPS, THREADS = 32 * WARPS;
    static constexpr int OWN = 16 * WARPS;          // keys per block
    static constexpr int WALK = walk_rows<D, 1>();  // queries per walked tile
    static constexpr bool K_IN_REGS = D == 64 && K_FRAGS_IN_REGS_D64;
    static constexpr int DS_LD = WALK + 8;
    static constexpr size_t SLOT = sizeof(__half) * 2 * WALK * D + sizeof(float) * 2 * WALK;
    // add_dq_tile: each warp takes 16 query rows and DQ_COLS columns of a walked tile's dQ, and
    // passes them to the atomics through shared memory in rows of DQ_COLS + 8 floats, which
    // spread the warp's float2 writes over the banks.
    static constexpr int DQ_ROW_GROUPS = WALK / 16, DQ_COLS = D / (WARPS / DQ_ROW_GROUPS), STAGE_LD = DQ_COLS + 8;
    static_assert(WARPS % DQ_ROW_GROUPS == 0 && DQ_COLS % 32 == 0, "the warps split dQ's tile into whole pieces");
    static constexpr size_t bytes = sizeof(__half) * OWN * D + 2 * SLOT +
                                    (ATOMIC ? sizeof(__half) * OWN * DS_LD + sizeof(float) * WARPS * 16 * STAGE_LD : 0);
    static_assert(2 * SLOT >= sizeof(__half) * OWN * D, "V is staged through the ring");
    static_assert(bytes <= 101376, "101,376 bytes is the per-block shared memory of sm_86 and sm_89");
};
template <int D> struct DqConfig {
    static constexpr int TILES = D == 64 ? Q_TILES_D64 : Q_TILES_D128;
    static constexpr int OWN = 16 * TILES * BWD_WARPS;         // queries per block
    static constexpr int WALK = walk_rows<D, TILES>();        // keys per walked tile
    static constexpr size_t bytes = sizeof(__half) * (2 * OWN * D + 2 * 2 * WALK * D);
    static_assert(bytes <= 101376, "101,376 bytes is the per-block shared memory of sm_86 and sm_89");
};

// fp32 accumulator blocks 2k and 2k + 1 (each 16 x 8) as one fp16 A operand (16 x 16).
__device__ inline void pack_a(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack_half2(lo[0], lo[1]);
    a[1] = pack_half2(lo[2], lo[3]);
    a[2] = pack_half2(hi[0], hi[1]);
    a[3] = pack_half2(hi[2], hi[3]);
}

// acc[m][n] (n = 0 .. N/8-1) += A(16 rows of a_tile from row a_row0 + 16 m) x Bᵀ(N rows of
// b_tile), over D, for RT row tiles: each B fragment read from shared memory feeds RT MMAs.
template <int D, int N, int RT>
__device__ inline void product_abt(float acc[RT][N / 8][4], const __half *a_tile, int a_row0, const __half *b_tile,
                                   int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[RT][4];
#pragma unroll
        for (int m = 0; m < RT; m++) load_a_frag<D>(a[m], a_tile, a_row0 + 16 * m, kk * 16, lane);
#pragma unroll
        for (int n = 0; n < N / 16; n++) {
            uint32_t b[4];
            load_b_frags_of_rows<D>(b, b_tile, n * 16, kk * 16, lane);
#pragma unroll
            for (int m = 0; m < RT; m++) {
                mma_m16n8k16(acc[m][2 * n], a[m], b[0], b[1]);
                mma_m16n8k16(acc[m][2 * n + 1], a[m], b[2], b[3]);
            }
        }
    }
}

// The same for one row tile whose A fragments (16 x D) are already in registers.
template <int D, int N>
__device__ inline void product_abt_regs(float acc[1][N / 8][4], const uint32_t a[D / 16][4], const __half *b_tile,
                                        int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int n = 0; n < N / 16; n++) {
            uint32_t b[4];
            load_b_frags_of_rows<D>(b, b_tile, n * 16, kk * 16, lane);
            mma_m16n8k16(acc[0][2 * n], a[kk], b[0], b[1]);
            mma_m16n8k16(acc[0][2 * n + 1], a[kk], b[2], b[3]);
        }
}

// A fragments of rows row0 .. row0 + 15 of a swizzled [rows][D] tile, all D columns.
template <int D>
__device__ inline void load_row_frags(uint32_t a[D / 16][4], const __half *tile, int row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) load_a_frag<D>(a[kk], tile, row0, kk * 16, lane);
}

// out[m][j] (j = 0 .. D/8-1) += P(16 x K per row tile, accumulators in registers) x B(K rows of
// b_tile).
template <int D, int K, int RT>
__device__ inline void product_pb(float out[RT][D / 8][4], const float p[RT][K / 8][4], const __half *b_tile,
                                  int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[RT][4];
#pragma unroll
        for (int m = 0; m < RT; m++) pack_a(a[m], p[m][2 * kk], p[m][2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < D / 16; n++) {
            uint32_t b[4];
            load_b_frags_trans<D>(b, b_tile, kk * 16, n * 16, lane);
#pragma unroll
            for (int m = 0; m < RT; m++) {
                mma_m16n8k16(out[m][2 * n], a[m], b[0], b[1]);
                mma_m16n8k16(out[m][2 * n + 1], a[m], b[2], b[3]);
            }
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

// Writes the warp's rows (g, g + 8 of each row tile, from row0) of a [S, D] fp16 matrix.
template <int D, int RT>
__device__ inline void store_rows(__half *dst, const float acc[RT][D / 8][4], float factor, int row0, int S, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < RT; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = row0 + 16 * m + g + 8 * r;
            if (row >= S) continue;
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *(__half2 *)(dst + (size_t)row * D + j * 8 + 2 * t) =
                    __floats2half2_rn(acc[m][j][2 * r] * factor, acc[m][j][2 * r + 1] * factor);
        }
}

// Atomic dQ for one walked query tile (QT queries from i0): dQ += dS K over this block's keys,
// where dSᵀ (keys x QT queries, 16 keys per warp) is in the warps' registers. dQ's rows are
// queries, so the product needs every warp's keys: dSᵀ goes to shared memory, and each warp then
// takes 16 query rows and DQ_COLS columns of the QT x D tile. A = dS comes from
// dSᵀ by ldmatrix.trans, as B = V does in the forward; B = K is the block's own K tile.
template <int D>
__device__ inline void add_dq_tile(float *dq_head, __half *ds_t, const float ds[1][DkDvConfig<D, true>::WALK / 8][4],
                                   const __half *k_tile, float *dq_stage, int i0, int S, int warp, int lane) {
    using L = DkDvConfig<D, true>;
    constexpr int QT = L::WALK, ROW_GROUPS = L::DQ_ROW_GROUPS, COLS = L::DQ_COLS;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < QT / 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            *(__half2 *)(ds_t + (warp * 16 + g + 8 * r) * L::DS_LD + n * 8 + 2 * t) =
                __floats2half2_rn(ds[0][n][2 * r], ds[0][n][2 * r + 1]);
    __syncthreads();  // every warp's dSᵀ is in shared memory

    const int row0 = (warp % ROW_GROUPS) * 16, col0 = (warp / ROW_GROUPS) * COLS;
    float dq_acc[1][COLS / 8][4];
    zero<1, COLS / 8>(dq_acc);
#pragma unroll
    for (int kk = 0; kk < L::OWN / 16; kk++) {
        // Lane l addresses row l % 8 of 8x8 matrix l / 8 of dS (rows row0.., keys 16kk..): stored
        // transposed at dSᵀ row 16kk + 8 (l / 16) + l % 8, column row0 + 8 ((l / 8) % 2).
        uint32_t a[4];
        ldmatrix_x4_trans(a, ds_t + (kk * 16 + 8 * (lane / 16) + lane % 8) * L::DS_LD + row0 + 8 * (lane / 8 % 2));
#pragma unroll
        for (int n = 0; n < COLS / 16; n++) {
            uint32_t b[4];
            load_b_frags_trans<D>(b, k_tile, kk * 16, col0 + n * 16, lane);
            mma_m16n8k16(dq_acc[0][2 * n], a, b[0], b[1]);
            mma_m16n8k16(dq_acc[0][2 * n + 1], a, b[2], b[3]);
        }
    }
    // Atomics from the fragments would give each instruction 8 rows x 4 of 8 floats in a 32-byte
    // sector. The warp's piece goes through shared memory instead, so that a row's lanes cover
    // it 4 floats each: whole sectors, and a quarter of the atomic operations where the GPU adds
    // 4 floats at once (sm_90).
    constexpr int LANES_PER_ROW = COLS / 4, ROWS_PER_STEP = 32 / LANES_PER_ROW;
    float *stage = dq_stage + warp * 16 * L::STAGE_LD;
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int j = 0; j < COLS / 8; j++)
            *(float2 *)(stage + (g + 8 * r) * L::STAGE_LD + 8 * j + 2 * t) =
                make_float2(dq_acc[0][j][2 * r], dq_acc[0][j][2 * r + 1]);
    __syncwarp();
    const int col = 4 * (lane % LANES_PER_ROW);
#pragma unroll
    for (int i = 0; i < 16 / ROWS_PER_STEP; i++) {
        const int row = ROWS_PER_STEP * i + lane / LANES_PER_ROW, query = i0 + row0 + row;
        if (query < S)
            atomic_add_float4<kVectorAtomics>(dq_head + (size_t)query * D + col0 + col,
                                              *(const float4 *)(stage + row * L::STAGE_LD + col));
    }
}

// dQ = scale * the float sums of the atomic path, as fp16; n is even (D is).
__global__ void backward_dq_convert(const float *dq_accum, __half *dq, size_t n, float scale) {
    for (size_t i = 2 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 2 * (size_t)gridDim.x * blockDim.x) {
        const float2 x = *(const float2 *)(dq_accum + i);
        *(__half2 *)(dq + i) = __floats2half2_rn(x.x * scale, x.y * scale);
    }
}

// Starts copying the walked query tile `tile` (Q, dO, lse and delta of QT queries) into a slot.
template <int D>
__device__ inline void load_query_tile(unsigned char *slot, const __half *q_head, const __half *do_head,
                                       const float *lse_head, const float *delta_head, int tile, int S) {
    constexpr int QT = walk_rows<D, 1>();
    __half *q_tile = (__half *)slot, *do_tile = q_tile + QT * D;
    float *lse_tile = (float *)(do_tile + QT * D), *delta_tile = lse_tile + QT;
    const int i0 = tile * QT;
    cp_async_tile<QT, D>(q_tile, q_head, i0, S);
    cp_async_tile<QT, D>(do_tile, do_head, i0, S);
    for (int i = threadIdx.x; i < QT; i += blockDim.x) {
        const bool valid = i0 + i < S;
        cp_async_4(lse_tile + i, lse_head + (valid ? i0 + i : 0), valid);
        cp_async_4(delta_tile + i, delta_head + (valid ? i0 + i : 0), valid);
    }
}

// dK, dV for OWN keys per block, 16 per warp; the query tiles (Q, dO, lse and delta; QT rows
// each) stream through a 2-slot cp.async ring. Everything is computed transposed (keys as rows),
// so that Pᵀ and dSᵀ come out as accumulators with keys as rows: the A operands of dV and dK.
template <int D, bool ATOMIC>
__global__ void __launch_bounds__(DkDvConfig<D, ATOMIC>::THREADS, 1)
backward_dk_dv(const __half *q, const __half *k, const __half *v, const __half *d_o, const float *lse_log2,
               const float *delta, __half *dk, __half *dv, float *dq_accum, int S, float scale, int causal) {
    using L = DkDvConfig<D, ATOMIC>;
    constexpr int QT = L::WALK, OWN = L::OWN;
    extern __shared__ __align__(128) unsigned char smem[];
    __half *k_tile = (__half *)smem;                     // [OWN][D]
    unsigned char *ring = (unsigned char *)(k_tile + OWN * D);  // [2][Q tile, dO tile, lse, delta]
    __half *ds_t = (__half *)(ring + 2 * L::SLOT);       // [OWN][DS_LD]: dSᵀ, keys as rows (atomic dQ only)
    float *dq_stage = (float *)(ds_t + (ATOMIC ? OWN * L::DS_LD : 0));

    const int head_index = blockIdx.z * gridDim.y + blockIdx.y;
    const size_t head = (size_t)head_index * S * D;
    const float *lse_head = lse_log2 + (size_t)head_index * S, *delta_head = delta + (size_t)head_index * S;
    const int j0 = blockIdx.x * OWN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int warp_row0 = warp * 16;  // this thread's keys: j0 + warp_row0 + g (+ 8)
    const float scale_log2 = scale * 1.4426950408889634f;
    // Causal: queries before j0 see none of these keys.
    const int first_tile = causal ? j0 / QT : 0, n_tiles = ceil_div(S, QT);

    // K stays in shared memory; V (and at D = 64 K) moves into this warp's A fragments.
    __half *v_stage = (__half *)ring;
    cp_async_tile<OWN, D>(k_tile, k + head, j0, S);
    cp_async_tile<OWN, D>(v_stage, v + head, j0, S);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t v_frags[D / 16][4], k_frags[L::K_IN_REGS ? D / 16 : 1][4];
    load_row_frags<D>(v_frags, v_stage, warp_row0, lane);
    if constexpr (L::K_IN_REGS) load_row_frags<D>(k_frags, k_tile, warp_row0, lane);
    __syncthreads();  // the ring's memory is free for the query tiles

    for (int s = 0; s < 2; s++) {
        if (first_tile + s < n_tiles)
            load_query_tile<D>(ring + s * L::SLOT, q + head, d_o + head, lse_head, delta_head, first_tile + s, S);
        cp_async_commit();
    }

    float dk_acc[1][D / 8][4], dv_acc[1][D / 8][4];
    zero<1, D / 8>(dk_acc);
    zero<1, D / 8>(dv_acc);

    for (int tile = first_tile; tile < n_tiles; tile++) {
        cp_async_wait<1>();
        __syncthreads();
        unsigned char *slot = ring + ((tile - first_tile) % 2) * L::SLOT;
        const __half *q_tile = (const __half *)slot, *do_tile = q_tile + QT * D;
        const float *lse_tile = (const float *)(do_tile + QT * D), *delta_tile = lse_tile + QT;
        const int i0 = tile * QT;

        // Sᵀ = K Qᵀ (keys x QT queries), then Pᵀ in place.
        float p[1][QT / 8][4];
        zero<1, QT / 8>(p);
        if constexpr (L::K_IN_REGS) product_abt_regs<D, QT>(p, k_frags, q_tile, lane);
        else product_abt<D, QT, 1>(p, k_tile, warp_row0, q_tile, lane);
        const bool masked = i0 + QT > S || (causal && i0 < j0 + OWN);
#pragma unroll
        for (int n = 0; n < QT / 8; n++) {
            const float2 lse = *(const float2 *)(lse_tile + n * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int query = i0 + n * 8 + 2 * t + (e & 1), key = j0 + warp_row0 + g + 8 * (e / 2);
                float x = exp2f(p[0][n][e] * scale_log2 - ((e & 1) ? lse.y : lse.x));
                if (masked && (query >= S || (causal && query < key))) x = 0.0f;
                p[0][n][e] = x;
            }
        }

        // dV += Pᵀ dO.
        product_pb<D, QT, 1>(dv_acc, p, do_tile, lane);

        // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ - delta_query) in place, then dK += dSᵀ Q.
        float ds[1][QT / 8][4];
        zero<1, QT / 8>(ds);
        product_abt_regs<D, QT>(ds, v_frags, do_tile, lane);
#pragma unroll
        for (int n = 0; n < QT / 8; n++) {
            const float2 d_i = *(const float2 *)(delta_tile + n * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; e++) ds[0][n][e] = p[0][n][e] * (ds[0][n][e] - ((e & 1) ? d_i.y : d_i.x));
        }
        product_pb<D, QT, 1>(dk_acc, ds, q_tile, lane);
        if constexpr (ATOMIC) add_dq_tile<D>(dq_accum + head, ds_t, ds, k_tile, dq_stage, i0, S, warp, lane);

        __syncthreads();  // everyone is done with this slot: refill it with tile + 2
        if (tile + 2 < n_tiles) load_query_tile<D>(slot, q + head, d_o + head, lse_head, delta_head, tile + 2, S);
        cp_async_commit();
    }
    cp_async_wait<0>();

    // S = scale Q Kᵀ, so dK = scale dSᵀ Q; dV needs no factor.
    store_rows<D, 1>(dk + head, dk_acc, scale, j0 + warp_row0, S, lane);
    store_rows<D, 1>(dv + head, dv_acc, 1.0f, j0 + warp_row0, S, lane);
}

// dQ for OWN queries per block, 16 * TILES per warp; K and V tiles (KT rows each) stream through
// a 2-slot cp.async ring.
template <int D>
__global__ void __launch_bounds__(BWD_THREADS)
backward_dq(const __half *q, const __half *k, const __half *v, const __half *d_o, const float *lse_log2,
            const float *delta, __half *dq, int S, float scale, int causal) {
    using L = DqConfig<D>;
    constexpr int KT = L::WALK, RT = L::TILES, OWN = L::OWN;
    constexpr int SLOT = 2 * KT * D;  // K tile then V tile
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;      // [OWN][D]
    __half *do_tile = q_tile + OWN * D;   // [OWN][D]
    __half *ring = do_tile + OWN * D;     // [2][K tile, V tile]

    const int head_index = blockIdx.z * gridDim.y + blockIdx.y;
    const size_t head = (size_t)head_index * S * D;
    const int q_block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // longest first
    const int i0 = q_block * OWN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int kv_end = causal ? min(S, i0 + OWN) : S, n_tiles = ceil_div(kv_end, KT);

    cp_async_tile<OWN, D>(q_tile, q + head, i0, S);
    cp_async_tile<OWN, D>(do_tile, d_o + head, i0, S);
    for (int s = 0; s < 2; s++) {
        if (s < n_tiles) {
            cp_async_tile<KT, D>(ring + s * SLOT, k + head, s * KT, S);
            cp_async_tile<KT, D>(ring + s * SLOT + KT * D, v + head, s * KT, S);
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
        const __half *k_tile = ring + (tile % 2) * SLOT, *v_tile = k_tile + KT * D;
        const int k0 = tile * KT;

        // S = Q Kᵀ, P in place; dP = dO Vᵀ; dS = P ∘ (dP - delta) in place; dQ += dS K.
        float p[RT][KT / 8][4], ds[RT][KT / 8][4];
        zero<RT, KT / 8>(p);
        zero<RT, KT / 8>(ds);
        product_abt<D, KT, RT>(p, q_tile, warp * 16 * RT, k_tile, lane);
        product_abt<D, KT, RT>(ds, do_tile, warp * 16 * RT, v_tile, lane);
        const bool masked = k0 + KT > S || (causal && k0 + KT - 1 > i0);
#pragma unroll
        for (int m = 0; m < RT; m++)
#pragma unroll
            for (int n = 0; n < KT / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = k0 + n * 8 + 2 * t + (e & 1), r = e / 2;
                    float x = exp2f(p[m][n][e] * scale_log2 - lse[m][r]);
                    if (masked && (key >= S || (causal && key > warp_query0 + 16 * m + g + 8 * r))) x = 0.0f;
                    ds[m][n][e] = x * (ds[m][n][e] - d_i[m][r]);
                }
        product_pb<D, KT, RT>(dq_acc, ds, k_tile, lane);

        __syncthreads();
        if (tile + 2 < n_tiles) {
            cp_async_tile<KT, D>(ring + (tile % 2) * SLOT, k + head, (tile + 2) * KT, S);
            cp_async_tile<KT, D>(ring + (tile % 2) * SLOT + KT * D, v + head, (tile + 2) * KT, S);
        }
        cp_async_commit();
    }
    cp_async_wait<0>();
    store_rows<D, RT>(dq + head, dq_acc, scale, warp_query0, S, lane);
}

// The dQ accumulator follows lse and delta, 256-byte aligned for the vector atomics.
static size_t dq_accum_offset(const attn_shape *s) { return (lse_delta_workspace_bytes(s) + 255) / 256 * 256; }

// Atomic dQ pays where one instruction adds 4 floats (sm_90 and newer). With one float per atomic
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

size_t stage08_workspace_bytes(const attn_shape *s) {
    return kAtomicDq ? dq_accum_offset(s) + sizeof(float) * attn_elems(s) : lse_delta_workspace_bytes(s);
}

template <int D>
static size_t backward_shared_bytes() {
    if (dq_by_atomics()) return DkDvConfig<D, true>::bytes;
    return DkDvConfig<D, false>::bytes > DqConfig<D>::bytes ? DkDvConfig<D, false>::bytes : DqConfig<D>::bytes;
}

size_t stage08_backward_shared_bytes(const attn_shape *s) {
    return s->dim == 64 ? backward_shared_bytes<64>() : backward_shared_bytes<128>();
}

template <int D, bool ATOMIC>
static cudaError_t launch_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    using DkDv = DkDvConfig<D, ATOMIC>;
    using Dq = DqConfig<D>;
    const float *lse = workspace_lse(s, t), *delta = workspace_delta(s, t);
    float *dq_accum = ATOMIC ? (float *)((char *)t->workspace + dq_accum_offset(s)) : NULL;
    launch_backward_delta(s, t, stream);
    cudaError_t err = allow_dynamic_smem(backward_dk_dv<D, ATOMIC>, DkDv::bytes);
    if (err == cudaSuccess && !ATOMIC) err = allow_dynamic_smem(backward_dq<D>, Dq::bytes);
    if (err == cudaSuccess && ATOMIC) err = cudaMemsetAsync(dq_accum, 0, sizeof(float) * attn_elems(s), stream);
    if (err != cudaSuccess) return err;
    const float scale = 1.0f / sqrtf((float)D);
    const __half *q = (const __half *)t->q, *k = (const __half *)t->k, *v = (const __half *)t->v;
    const __half *d_o = (const __half *)t->d_o;
    backward_dk_dv<D, ATOMIC><<<dim3(ceil_div(s->seq, DkDv::OWN), s->heads, s->batch), DkDv::THREADS, DkDv::bytes,
                                stream>>>(q, k, v, d_o, lse, delta, (__half *)t->dk, (__half *)t->dv, dq_accum, s->seq,
                                          scale, s->causal);
    if (ATOMIC) {
        backward_dq_convert<<<1024, 256, 0, stream>>>(dq_accum, (__half *)t->dq, attn_elems(s), scale);
    } else {
        backward_dq<D><<<dim3(ceil_div(s->seq, Dq::OWN), s->heads, s->batch), BWD_THREADS, Dq::bytes, stream>>>(
            q, k, v, d_o, lse, delta, (__half *)t->dq, s->seq, scale, s->causal);
    }
    return cudaGetLastError();
}

cudaError_t stage08_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    if (dq_by_atomics()) return s->dim == 64 ? launch_backward<64, true>(s, t, stream) : launch_backward<128, true>(s, t, stream);
    return s->dim == 64 ? launch_backward<64, false>(s, t, stream) : launch_backward<128, false>(s, t, stream);
}
