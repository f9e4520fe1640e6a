// Stage 08, backward - FlashAttention-2's backward pass on mma.sync.
//
// The idea: the forward saved only O and each row's log-sum-exp, so P is recomputed tile by tile
// (P = 2^(S scale log2 e - lse_log2)) instead of being stored (S x S). Then
//   delta_i = rowsum(dO ∘ O)                                     (backward_delta, a pre-pass)
//   dV += Pᵀ dO,  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ - delta),  dK += dSᵀ Q       (backward_dk_dv)
//   dQ += dS K
// backward_dk_dv gives each block 64 keys and walks over the query tiles, holding dK and dV in
// registers. dQ's rows are queries, which every key block touches, so dQ is summed across
// blocks in one of two ways (kAtomicDq):
//   atomics: each block writes dSᵀ to shared memory, multiplies dS K for the walked query tile
//     and adds it to a float dQ accumulator in global memory with atomicAdd; backward_dq_convert
//     turns the sums into fp16. Five matrix products; the order of the adds varies from run to
//     run, so dQ's last bits do too.
//   deterministic (the default, faster here): backward_dq gives each block 64 queries (128 at
//     D = 128) and walks over the key tiles, recomputing S and dP (seven products instead of
//     five), and owns its dQ rows outright.
// Every product runs on the tensor cores, and each accumulator is reused as the A operand of the
// next product in registers (Pᵀ for dV, dSᵀ for dK, dS for dQ in backward_dq), as in stage 07.
// Limits: 16 rows per warp (32 in backward_dq at D = 128) and a block-wide cp.async ring (stage
// 07's pipeline; the walked tiles are shared by all four warps, so a producer warp would only add
// registers); dQ's atomics are 64 x D floats per key block and query tile.
#include <math.h>

#include "kernel_common.cuh"
#include "mma_ptx.cuh"
#include "backward_common.cuh"
#include "stage08.h"

// dQ by a second, deterministic kernel (0, measured faster: lesson) or by atomics (1, -DATOMIC_DQ=1).
#ifndef ATOMIC_DQ
#define ATOMIC_DQ 0
#endif
constexpr bool kAtomicDq = ATOMIC_DQ;

#define BWD_WARPS 4
#define BWD_THREADS (32 * BWD_WARPS)
// 16-row mma tiles per warp in each kernel, as stage 07's ROW_TILES: with two, every fragment of
// the walked tiles read from shared memory feeds two MMAs, but the walked tile must shrink to 32
// rows to leave registers for them. Measured (lesson): two pay in dq at D = 128 only; dk_dv,
// which holds dK and dV (128 registers per row tile at D = 128), can take two at D = 64 only,
// where they do not pay.
#ifndef KV_TILES_D64
#define KV_TILES_D64 1
#endif
#ifndef Q_TILES_D64
#define Q_TILES_D64 1
#endif
#ifndef Q_TILES_D128
#define Q_TILES_D128 2
#endif

// Shared memory and tiles of the backward kernels. A block owns OWN rows of two tensors (keys of K
// and V in dk_dv, queries of Q and dO in dq) and walks over tiles of WALK rows of the other two,
// through a 2-slot cp.async ring; the walked tile shrinks as the registers per row grow. With
// atomic dQ, dk_dv also keeps dSᵀ of one walked tile, padded by 8 halves a row so that ldmatrix
// reads and the warps' writes spread over the banks.
// Rows of the walked tile: 64 at D = 64 with one row tile per warp, else 32.
template <int D, int TILES>
__host__ __device__ constexpr int walk_rows() { return D == 64 && TILES == 1 ? 64 : 32; }
template <int D> struct DkDvConfig {
    static constexpr int TILES = D == 64 ? KV_TILES_D64 : 1;  // row tiles per warp
    static constexpr int OWN = 16 * TILES * BWD_WARPS;         // keys per block
    static constexpr int WALK = walk_rows<D, TILES>();        // queries per walked tile
    static constexpr int DS_LD = WALK + 8;
    static constexpr size_t bytes = sizeof(__half) * (2 * OWN * D + 2 * 2 * WALK * D) +
                                    (kAtomicDq ? sizeof(__half) * OWN * DS_LD : 0);
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
// where dSᵀ (keys x QT queries, the warp's row tiles) is in the warps' registers. dQ's rows are
// queries, so the product needs every warp's keys: dSᵀ goes to shared memory, and each warp then
// takes 16 query rows and D / (4 / (QT / 16)) columns of the QT x D tile. A = dS comes from dSᵀ
// by ldmatrix.trans, as B = V does in the forward; B = K is the block's own K tile.
template <int D>
__device__ inline void add_dq_tile(float *dq_head, __half *ds_t, const float ds[][DkDvConfig<D>::WALK / 8][4],
                                   const __half *k_tile, int i0, int S, int warp, int lane) {
    using L = DkDvConfig<D>;
    constexpr int QT = L::WALK, ROW_GROUPS = QT / 16, COLS = D / (BWD_WARPS / ROW_GROUPS);
    static_assert(BWD_WARPS % ROW_GROUPS == 0, "the warps split dQ's tile into whole row groups");
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < L::TILES; m++)
#pragma unroll
        for (int n = 0; n < QT / 8; n++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                *(__half2 *)(ds_t + (warp * 16 * L::TILES + 16 * m + g + 8 * r) * L::DS_LD + n * 8 + 2 * t) =
                    __floats2half2_rn(ds[m][n][2 * r], ds[m][n][2 * r + 1]);
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
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int query = i0 + row0 + g + 8 * r;
        if (query >= S) continue;
        float *dst = dq_head + (size_t)query * D + col0 + 2 * t;
#pragma unroll
        for (int j = 0; j < COLS / 8; j++)
            atomicAdd(dst + 8 * j, dq_acc[0][j][2 * r]), atomicAdd(dst + 8 * j + 1, dq_acc[0][j][2 * r + 1]);
    }
}

// dQ = scale * the float sums of the atomic path, as fp16; n is even (D is).
__global__ void backward_dq_convert(const float *dq_accum, __half *dq, size_t n, float scale) {
    for (size_t i = 2 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 2 * (size_t)gridDim.x * blockDim.x) {
        const float2 x = *(const float2 *)(dq_accum + i);
        *(__half2 *)(dq + i) = __floats2half2_rn(x.x * scale, x.y * scale);
    }
}

// dK, dV for OWN keys per block, 16 * TILES per warp; the query tiles (Q and dO, QT rows each)
// stream through a 2-slot cp.async ring. Everything is computed transposed (keys as rows), so
// that Pᵀ and dSᵀ come out as accumulators with keys as rows: the A operands of dV and dK.
template <int D>
__global__ void __launch_bounds__(BWD_THREADS)
backward_dk_dv(const __half *q, const __half *k, const __half *v, const __half *d_o, const float *lse_log2,
               const float *delta, __half *dk, __half *dv, float *dq_accum, int S, float scale, int causal) {
    using L = DkDvConfig<D>;
    constexpr int QT = L::WALK, RT = L::TILES, OWN = L::OWN;
    constexpr int SLOT = 2 * QT * D;  // halves: Q tile then dO tile
    extern __shared__ __align__(128) unsigned char smem[];
    __half *k_tile = (__half *)smem;     // [OWN][D]
    __half *v_tile = k_tile + OWN * D;   // [OWN][D]
    __half *ring = v_tile + OWN * D;     // [2][Q tile, dO tile]
    __half *ds_t = ring + 2 * SLOT;      // [OWN][DS_LD]: dSᵀ, keys as rows (atomic dQ only)

    const int head_index = blockIdx.z * gridDim.y + blockIdx.y;
    const size_t head = (size_t)head_index * S * D;
    const float *lse_head = lse_log2 + (size_t)head_index * S, *delta_head = delta + (size_t)head_index * S;
    const int j0 = blockIdx.x * OWN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float scale_log2 = scale * 1.4426950408889634f;
    // Causal: queries before j0 see none of these keys.
    const int first_tile = causal ? j0 / QT : 0, n_tiles = ceil_div(S, QT);

    cp_async_tile<OWN, D>(k_tile, k + head, j0, S);
    cp_async_tile<OWN, D>(v_tile, v + head, j0, S);
    for (int s = 0; s < 2; s++) {
        if (first_tile + s < n_tiles) {
            cp_async_tile<QT, D>(ring + s * SLOT, q + head, (first_tile + s) * QT, S);
            cp_async_tile<QT, D>(ring + s * SLOT + QT * D, d_o + head, (first_tile + s) * QT, S);
        }
        cp_async_commit();
    }

    float dk_acc[RT][D / 8][4], dv_acc[RT][D / 8][4];
    zero<RT, D / 8>(dk_acc);
    zero<RT, D / 8>(dv_acc);
    const int warp_row0 = warp * 16 * RT;  // this thread's keys: j0 + warp_row0 + 16 m + g (+ 8)

    for (int tile = first_tile; tile < n_tiles; tile++) {
        cp_async_wait<1>();
        __syncthreads();
        const __half *q_tile = ring + ((tile - first_tile) % 2) * SLOT, *do_tile = q_tile + QT * D;
        const int i0 = tile * QT;

        // Sᵀ = K Qᵀ (keys x QT queries), then Pᵀ in place.
        float p[RT][QT / 8][4];
        zero<RT, QT / 8>(p);
        product_abt<D, QT, RT>(p, k_tile, warp_row0, q_tile, lane);
        const bool masked = i0 + QT > S || (causal && i0 < j0 + OWN);
#pragma unroll
        for (int n = 0; n < QT / 8; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int query = i0 + n * 8 + 2 * t + c;
                // Past S: lse = +inf makes P = 0 (those Q and dO rows are zero-filled anyway).
                const float lse = query < S ? lse_head[query] : INFINITY;
#pragma unroll
                for (int m = 0; m < RT; m++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        float x = exp2f(p[m][n][2 * r + c] * scale_log2 - lse);
                        if (masked && causal && query < j0 + warp_row0 + 16 * m + g + 8 * r) x = 0.0f;
                        p[m][n][2 * r + c] = x;
                    }
            }

        // dV += Pᵀ dO.
        product_pb<D, QT, RT>(dv_acc, p, do_tile, lane);

        // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ - delta_query) in place, then dK += dSᵀ Q.
        float ds[RT][QT / 8][4];
        zero<RT, QT / 8>(ds);
        product_abt<D, QT, RT>(ds, v_tile, warp_row0, do_tile, lane);
#pragma unroll
        for (int n = 0; n < QT / 8; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int query = i0 + n * 8 + 2 * t + c;
                const float d_i = query < S ? delta_head[query] : 0.0f;
#pragma unroll
                for (int m = 0; m < RT; m++) {
                    ds[m][n][c] = p[m][n][c] * (ds[m][n][c] - d_i);
                    ds[m][n][2 + c] = p[m][n][2 + c] * (ds[m][n][2 + c] - d_i);
                }
            }
        product_pb<D, QT, RT>(dk_acc, ds, q_tile, lane);
        if constexpr (kAtomicDq) add_dq_tile<D>(dq_accum + head, ds_t, ds, k_tile, i0, S, warp, lane);

        __syncthreads();  // everyone is done with this slot: refill it with tile + 2
        if (tile + 2 < n_tiles) {
            cp_async_tile<QT, D>(ring + ((tile - first_tile) % 2) * SLOT, q + head, (tile + 2) * QT, S);
            cp_async_tile<QT, D>(ring + ((tile - first_tile) % 2) * SLOT + QT * D, d_o + head, (tile + 2) * QT, S);
        }
        cp_async_commit();
    }
    cp_async_wait<0>();

    // S = scale Q Kᵀ, so dK = scale dSᵀ Q; dV needs no factor.
    store_rows<D, RT>(dk + head, dk_acc, scale, j0 + warp_row0, S, lane);
    store_rows<D, RT>(dv + head, dv_acc, 1.0f, j0 + warp_row0, S, lane);
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

size_t stage08_workspace_bytes(const attn_shape *s) {
    return lse_delta_workspace_bytes(s) + (kAtomicDq ? sizeof(float) * attn_elems(s) : 0);
}

size_t stage08_backward_shared_bytes(const attn_shape *s) {
    const size_t dk_dv = s->dim == 64 ? DkDvConfig<64>::bytes : DkDvConfig<128>::bytes;
    const size_t dq = kAtomicDq ? 0 : s->dim == 64 ? DqConfig<64>::bytes : DqConfig<128>::bytes;
    return dk_dv > dq ? dk_dv : dq;
}

template <int D>
static cudaError_t launch_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    using DkDv = DkDvConfig<D>;
    using Dq = DqConfig<D>;
    const float *lse = workspace_lse(s, t), *delta = workspace_delta(s, t);
    float *dq_accum = (float *)((char *)t->workspace + lse_delta_workspace_bytes(s));
    launch_backward_delta(s, t, stream);
    cudaError_t err = allow_dynamic_smem(backward_dk_dv<D>, DkDv::bytes);
    if (err == cudaSuccess && !kAtomicDq) err = allow_dynamic_smem(backward_dq<D>, Dq::bytes);
    if (err == cudaSuccess && kAtomicDq) err = cudaMemsetAsync(dq_accum, 0, sizeof(float) * attn_elems(s), stream);
    if (err != cudaSuccess) return err;
    const float scale = 1.0f / sqrtf((float)D);
    const __half *q = (const __half *)t->q, *k = (const __half *)t->k, *v = (const __half *)t->v;
    const __half *d_o = (const __half *)t->d_o;
    backward_dk_dv<D><<<dim3(ceil_div(s->seq, DkDv::OWN), s->heads, s->batch), BWD_THREADS, DkDv::bytes, stream>>>(
        q, k, v, d_o, lse, delta, (__half *)t->dk, (__half *)t->dv, dq_accum, s->seq, scale, s->causal);
    if (kAtomicDq) {
        backward_dq_convert<<<1024, 256, 0, stream>>>(dq_accum, (__half *)t->dq, attn_elems(s), scale);
    } else {
        backward_dq<D><<<dim3(ceil_div(s->seq, Dq::OWN), s->heads, s->batch), BWD_THREADS, Dq::bytes, stream>>>(
            q, k, v, d_o, lse, delta, (__half *)t->dq, s->seq, scale, s->causal);
    }
    return cudaGetLastError();
}

cudaError_t stage08_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch_backward<64>(s, t, stream) : launch_backward<128>(s, t, stream);
}
