// Stage 08, backward - FlashAttention-2's backward pass on mma.sync, in three kernels and with
// no atomics.
//
// The idea: the forward saved only O and each row's log-sum-exp, so P is recomputed tile by tile
// (P = 2^(S scale log2 e - lse_log2)) instead of being stored (S x S). Then
//   D_i = rowsum(dO ∘ O)      (backward_delta, a small pre-pass)
//   dV += Pᵀ dO,  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ - D),  dK += dSᵀ Q     (backward_dk_dv)
//   dP = dO Vᵀ,   dS = P ∘ (dP - D),  dQ += dS K                        (backward_dq)
// backward_dk_dv gives each block 64 keys and walks over all query tiles, holding dK and dV in
// registers; backward_dq gives each block 64 queries and walks over all key tiles, holding dQ.
// Each block owns its output rows, so nothing is accumulated across blocks: no atomics, and the
// result is deterministic. The price is that S and dP are computed twice (once per kernel): 7
// matrix products instead of FlashAttention-2's 5, which instead adds dQ with atomics from the
// dK/dV kernel. Every product runs on the tensor cores, and each accumulator is reused as the A
// operand of the next product in registers (Pᵀ for dV, dSᵀ for dK, dS for dQ), as in stage 07.
// Limits: 16 rows per warp and a block-wide cp.async ring (stage 07's pipeline, not warp
// specialized); 40% more math than the atomic variant.
#include <math.h>

#include "kernel_common.cuh"
#include "mma_ptx.cuh"
#include "stage08.h"

#define BWD_WARPS 4
#define BWD_THREADS (32 * BWD_WARPS)
#define BWD_ROWS (16 * BWD_WARPS)  // rows each block owns: keys in dk_dv, queries in dq
// The tile walked over: 64 at D = 64; 32 at D = 128, where dK and dV (or dQ) already take 128
// (or 64) registers per thread.
template <int D> __host__ __device__ constexpr int walk_tile() { return D == 64 ? 64 : 32; }

// D_i = dO_i . O_i, one warp per row.
__global__ void backward_delta(const __half *o, const __half *d_o, float *delta, int rows, int D) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    float sum = 0.0f;
    for (int d = 2 * lane; d < D; d += 64) {
        const float2 a = __half22float2(*(const __half2 *)(o + (size_t)row * D + d));
        const float2 b = __half22float2(*(const __half2 *)(d_o + (size_t)row * D + d));
        sum += a.x * b.x + a.y * b.y;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) delta[row] = sum;
}

// fp32 accumulator blocks 2k and 2k + 1 (each 16 x 8) as one fp16 A operand (16 x 16).
__device__ inline void pack_a(uint32_t a[4], const float lo[4], const float hi[4]) {
    a[0] = pack_half2(lo[0], lo[1]);
    a[1] = pack_half2(lo[2], lo[3]);
    a[2] = pack_half2(hi[0], hi[1]);
    a[3] = pack_half2(hi[2], hi[3]);
}

// acc[n] (n = 0 .. N/8-1) += A(16 rows of a_tile from row a_row0) x Bᵀ(N rows of b_tile), over D.
template <int D, int N>
__device__ inline void product_abt(float acc[N / 8][4], const __half *a_tile, int a_row0, const __half *b_tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        load_a_frag<D>(a, a_tile, a_row0, kk * 16, lane);
#pragma unroll
        for (int n = 0; n < N / 16; n++) {
            uint32_t b[4];
            load_b_frags_of_rows<D>(b, b_tile, n * 16, kk * 16, lane);
            mma_m16n8k16(acc[2 * n], a, b[0], b[1]);
            mma_m16n8k16(acc[2 * n + 1], a, b[2], b[3]);
        }
    }
}

// out[j] (j = 0 .. D/8-1) += P(16 x K, accumulators in registers) x B(K rows of b_tile).
template <int D, int K>
__device__ inline void product_pb(float out[D / 8][4], const float p[K / 8][4], const __half *b_tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        pack_a(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < D / 16; n++) {
            uint32_t b[4];
            load_b_frags_trans<D>(b, b_tile, kk * 16, n * 16, lane);
            mma_m16n8k16(out[2 * n], a, b[0], b[1]);
            mma_m16n8k16(out[2 * n + 1], a, b[2], b[3]);
        }
    }
}

template <int N>
__device__ inline void zero(float acc[N][4]) {
#pragma unroll
    for (int n = 0; n < N; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Writes 16 rows (g, g + 8 of the warp's tile starting at row0) of a [S, D] fp16 matrix.
template <int D>
__device__ inline void store_rows(__half *dst, const float acc[D / 8][4], float factor, int row0, int S, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        if (row >= S) continue;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *(__half2 *)(dst + (size_t)row * D + j * 8 + 2 * t) =
                __floats2half2_rn(acc[j][2 * r] * factor, acc[j][2 * r + 1] * factor);
    }
}

// dK, dV for BWD_ROWS keys per block. Each warp holds 16 keys; the query tiles (Q and dO, QT rows
// each) stream through a 2-slot cp.async ring. Everything is computed transposed (keys as rows),
// so that Pᵀ and dSᵀ come out as accumulators with keys as rows: the A operands of dV and dK.
template <int D>
__global__ void __launch_bounds__(BWD_THREADS)
backward_dk_dv(const __half *q, const __half *k, const __half *v, const __half *d_o, const float *lse_log2,
               const float *delta, __half *dk, __half *dv, int S, float scale, int causal) {
    constexpr int QT = walk_tile<D>();
    constexpr int SLOT = 2 * QT * D;  // halves: Q tile then dO tile
    extern __shared__ __align__(128) unsigned char smem[];
    __half *k_tile = (__half *)smem;         // [BWD_ROWS][D]
    __half *v_tile = k_tile + BWD_ROWS * D;  // [BWD_ROWS][D]
    __half *ring = v_tile + BWD_ROWS * D;    // [2][Q tile, dO tile]

    const int head_index = blockIdx.z * gridDim.y + blockIdx.y;
    const size_t head = (size_t)head_index * S * D;
    const float *lse_head = lse_log2 + (size_t)head_index * S, *delta_head = delta + (size_t)head_index * S;
    const int j0 = blockIdx.x * BWD_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float scale_log2 = scale * 1.4426950408889634f;
    // Causal: queries before j0 see none of these keys.
    const int first_tile = causal ? j0 / QT : 0, n_tiles = ceil_div(S, QT);

    cp_async_tile<BWD_ROWS, D>(k_tile, k + head, j0, S);
    cp_async_tile<BWD_ROWS, D>(v_tile, v + head, j0, S);
    for (int s = 0; s < 2; s++) {
        if (first_tile + s < n_tiles) {
            cp_async_tile<QT, D>(ring + s * SLOT, q + head, (first_tile + s) * QT, S);
            cp_async_tile<QT, D>(ring + s * SLOT + QT * D, d_o + head, (first_tile + s) * QT, S);
        }
        cp_async_commit();
    }

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
    zero<D / 8>(dk_acc);
    zero<D / 8>(dv_acc);
    const int key_lo = j0 + warp * 16 + g;  // this thread's keys: key_lo, key_lo + 8

    for (int tile = first_tile; tile < n_tiles; tile++) {
        cp_async_wait<1>();
        __syncthreads();
        const __half *q_tile = ring + ((tile - first_tile) % 2) * SLOT, *do_tile = q_tile + QT * D;
        const int i0 = tile * QT;

        // Sᵀ = K Qᵀ (16 keys x QT queries per warp), then Pᵀ in place.
        float p[QT / 8][4];
        zero<QT / 8>(p);
        product_abt<D, QT>(p, k_tile, warp * 16, q_tile, lane);
        const bool masked = i0 + QT > S || (causal && i0 < j0 + BWD_ROWS);
#pragma unroll
        for (int n = 0; n < QT / 8; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int query = i0 + n * 8 + 2 * t + c;
                // Past S: lse = +inf makes P = 0 (those Q and dO rows are zero-filled anyway).
                const float lse = query < S ? lse_head[query] : INFINITY;
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float x = exp2f(p[n][2 * r + c] * scale_log2 - lse);
                    if (masked && causal && query < key_lo + 8 * r) x = 0.0f;
                    p[n][2 * r + c] = x;
                }
            }

        // dV += Pᵀ dO.
        product_pb<D, QT>(dv_acc, p, do_tile, lane);

        // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ∘ (dPᵀ - D_query) in place, then dK += dSᵀ Q.
        float ds[QT / 8][4];
        zero<QT / 8>(ds);
        product_abt<D, QT>(ds, v_tile, warp * 16, do_tile, lane);
#pragma unroll
        for (int n = 0; n < QT / 8; n++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int query = i0 + n * 8 + 2 * t + c;
                const float d_i = query < S ? delta_head[query] : 0.0f;
                ds[n][c] = p[n][c] * (ds[n][c] - d_i);
                ds[n][2 + c] = p[n][2 + c] * (ds[n][2 + c] - d_i);
            }
        product_pb<D, QT>(dk_acc, ds, q_tile, lane);

        __syncthreads();  // everyone is done with this slot: refill it with tile + 2
        if (tile + 2 < n_tiles) {
            cp_async_tile<QT, D>(ring + ((tile - first_tile) % 2) * SLOT, q + head, (tile + 2) * QT, S);
            cp_async_tile<QT, D>(ring + ((tile - first_tile) % 2) * SLOT + QT * D, d_o + head, (tile + 2) * QT, S);
        }
        cp_async_commit();
    }
    cp_async_wait<0>();

    // S = scale Q Kᵀ, so dK = scale dSᵀ Q; dV needs no factor.
    store_rows<D>(dk + head, dk_acc, scale, j0 + warp * 16, S, lane);
    store_rows<D>(dv + head, dv_acc, 1.0f, j0 + warp * 16, S, lane);
}

// dQ for BWD_ROWS queries per block. Each warp holds 16 queries; K and V tiles (KT rows each)
// stream through a 2-slot cp.async ring.
template <int D>
__global__ void __launch_bounds__(BWD_THREADS)
backward_dq(const __half *q, const __half *k, const __half *v, const __half *d_o, const float *lse_log2,
            const float *delta, __half *dq, int S, float scale, int causal) {
    constexpr int KT = walk_tile<D>();
    constexpr int SLOT = 2 * KT * D;  // K tile then V tile
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;           // [BWD_ROWS][D]
    __half *do_tile = q_tile + BWD_ROWS * D;   // [BWD_ROWS][D]
    __half *ring = do_tile + BWD_ROWS * D;     // [2][K tile, V tile]

    const int head_index = blockIdx.z * gridDim.y + blockIdx.y;
    const size_t head = (size_t)head_index * S * D;
    const int q_block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // longest first
    const int i0 = q_block * BWD_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int kv_end = causal ? min(S, i0 + BWD_ROWS) : S, n_tiles = ceil_div(kv_end, KT);

    cp_async_tile<BWD_ROWS, D>(q_tile, q + head, i0, S);
    cp_async_tile<BWD_ROWS, D>(do_tile, d_o + head, i0, S);
    for (int s = 0; s < 2; s++) {
        if (s < n_tiles) {
            cp_async_tile<KT, D>(ring + s * SLOT, k + head, s * KT, S);
            cp_async_tile<KT, D>(ring + s * SLOT + KT * D, v + head, s * KT, S);
        }
        cp_async_commit();
    }

    // This thread's rows: query_lo and query_lo + 8, with their lse and D.
    const int query_lo = i0 + warp * 16 + g;
    float lse[2], d_i[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int query = query_lo + 8 * r;
        lse[r] = query < S ? lse_log2[(size_t)head_index * S + query] : INFINITY;
        d_i[r] = query < S ? delta[(size_t)head_index * S + query] : 0.0f;
    }
    float dq_acc[D / 8][4];
    zero<D / 8>(dq_acc);

    for (int tile = 0; tile < n_tiles; tile++) {
        cp_async_wait<1>();
        __syncthreads();
        const __half *k_tile = ring + (tile % 2) * SLOT, *v_tile = k_tile + KT * D;
        const int k0 = tile * KT;

        // S = Q Kᵀ, P in place; dP = dO Vᵀ; dS = P ∘ (dP - D) in place; dQ += dS K.
        float p[KT / 8][4], ds[KT / 8][4];
        zero<KT / 8>(p);
        zero<KT / 8>(ds);
        product_abt<D, KT>(p, q_tile, warp * 16, k_tile, lane);
        product_abt<D, KT>(ds, do_tile, warp * 16, v_tile, lane);
        const bool masked = k0 + KT > S || (causal && k0 + KT - 1 > i0);
#pragma unroll
        for (int n = 0; n < KT / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + n * 8 + 2 * t + (e & 1), r = e / 2;
                float x = exp2f(p[n][e] * scale_log2 - lse[r]);
                if (masked && (key >= S || (causal && key > query_lo + 8 * r))) x = 0.0f;
                ds[n][e] = x * (ds[n][e] - d_i[r]);
            }
        product_pb<D, KT>(dq_acc, ds, k_tile, lane);

        __syncthreads();
        if (tile + 2 < n_tiles) {
            cp_async_tile<KT, D>(ring + (tile % 2) * SLOT, k + head, (tile + 2) * KT, S);
            cp_async_tile<KT, D>(ring + (tile % 2) * SLOT + KT * D, v + head, (tile + 2) * KT, S);
        }
        cp_async_commit();
    }
    cp_async_wait<0>();
    store_rows<D>(dq + head, dq_acc, scale, i0 + warp * 16, S, lane);
}

template <int D>
static cudaError_t launch_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    const int rows = (int)stage08_rows(s);
    float *lse = stage08_lse(s, t), *delta = stage08_delta(s, t);
    backward_delta<<<ceil_div(rows, 4), 128, 0, stream>>>((const __half *)t->o, (const __half *)t->d_o,
                                                          delta, rows, D);
    const size_t smem = sizeof(__half) * (2 * BWD_ROWS * D + 2 * 2 * walk_tile<D>() * D);
    cudaError_t err = allow_dynamic_smem(backward_dk_dv<D>, smem);
    if (err == cudaSuccess) err = allow_dynamic_smem(backward_dq<D>, smem);
    if (err != cudaSuccess) return err;
    const dim3 grid(ceil_div(s->seq, BWD_ROWS), s->heads, s->batch);
    const float scale = 1.0f / sqrtf((float)D);
    const __half *q = (const __half *)t->q, *k = (const __half *)t->k, *v = (const __half *)t->v;
    const __half *d_o = (const __half *)t->d_o;
    backward_dk_dv<D><<<grid, BWD_THREADS, smem, stream>>>(q, k, v, d_o, lse, delta, (__half *)t->dk,
                                                           (__half *)t->dv, s->seq, scale, s->causal);
    backward_dq<D><<<grid, BWD_THREADS, smem, stream>>>(q, k, v, d_o, lse, delta, (__half *)t->dq,
                                                        s->seq, scale, s->causal);
    return cudaGetLastError();
}

cudaError_t stage08_backward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch_backward<64>(s, t, stream) : launch_backward<128>(s, t, stream);
}
