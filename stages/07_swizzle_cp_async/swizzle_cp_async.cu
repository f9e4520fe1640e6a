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
//  - WMMA -> ldmatrix + mma.sync (PTX wrappers in common/mma_ptx.cuh); Q's fragments are loaded
//    once and stay in registers;
//  - tiles are stored unpadded with an XOR swizzle (16-byte chunk c of row r at c ^ (r % 8)),
//    which ldmatrix can read conflict-free and WMMA's loads cannot;
//  - K and V tiles arrive by cp.async into a 2-stage ring: tile j + 1 is in flight while tile j
//    is multiplied, so the warps no longer wait for every load;
//  - exp2 with log2(e) folded into the scale; masks only on the tiles that need them.
// Limits: 4 warps of 16 rows each read all of K and V from shared memory (ldmatrix traffic per
// MMA is high); one block's warps all do the same thing, so loads are only overlapped through
// the ring (stage 08 specializes warps).
#include <math.h>

#include "kernel_common.cuh"
#include "mma_ptx.cuh"

#define BLOCK_ROWS 64  // query rows per block
#define KEY_TILE 64    // keys per K/V tile
#define WARPS 4        // warp w owns query rows [16w, 16w + 16)
#define THREADS (32 * WARPS)
#define STAGES 2       // depth of the K/V cp.async ring

template <int D> struct Layout {
    static constexpr int TILE = KEY_TILE * D;  // halves in one K or V tile
    static constexpr size_t bytes = sizeof(__half) * (BLOCK_ROWS * D + 2 * STAGES * TILE);
};

template <int D>
__global__ void __launch_bounds__(THREADS)
swizzle_cp_async_kernel(const __half *q, const __half *k, const __half *v, __half *o, int S,
                        float scale, int causal) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    __half *q_tile = (__half *)smem;                 // [BLOCK_ROWS][D], swizzled
    __half *k_ring = q_tile + BLOCK_ROWS * D;        // [STAGES][KEY_TILE][D], swizzled
    __half *v_ring = k_ring + STAGES * L::TILE;      // [STAGES][KEY_TILE][D], swizzled

    const size_t head = head_offset(blockIdx.z, blockIdx.y, gridDim.y, S, D);
    const int q0 = blockIdx.x * BLOCK_ROWS;
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;
    const int n_tiles = ceil_div(kv_end, KEY_TILE);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // this thread's rows g, g + 8; columns 2t, 2t + 1
    const int query_lo = q0 + warp * 16 + g, query_hi = query_lo + 8;
    const float scale_log2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x log2 e)

    // Prologue: group 0 = Q and tile 0, group s = tile s. Empty groups keep the count uniform.
    cp_async_tile<BLOCK_ROWS, D>(q_tile, q + head, q0, S);
    for (int s = 0; s < STAGES; s++) {
        if (s < n_tiles) {
            cp_async_tile<KEY_TILE, D>(k_ring + s * L::TILE, k + head, s * KEY_TILE, S);
            cp_async_tile<KEY_TILE, D>(v_ring + s * L::TILE, v + head, s * KEY_TILE, S);
        }
        cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();  // group 0 (Q, tile 0) has landed
    __syncthreads();

    // Q's A fragments for the warp's 16 rows, kept in registers for the whole kernel. ldmatrix
    // x4: lanes 0-7 address rows 0-7 at column kk, 8-15 rows 8-15 at kk, 16-23 rows 0-7 at kk + 8,
    // 24-31 rows 8-15 at kk + 8: registers a0..a3 in mma's A order.
    uint32_t q_frag[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        ldmatrix_x4(q_frag[kk], q_tile + swizzle<D>(warp * 16 + lane % 8 + 8 * (lane / 8 % 2),
                                                     kk * 16 + 8 * (lane / 16)));

    float o_acc[D / 8][4];  // O for rows g, g + 8 and columns 8j + 2t, 8j + 2t + 1
#pragma unroll
    for (int j = 0; j < D / 8; j++) o_acc[j][0] = o_acc[j][1] = o_acc[j][2] = o_acc[j][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};  // rows g, g + 8, in log2 units
    float row_sum[2] = {0.0f, 0.0f};            // this thread's part; the quad adds up at the end

    for (int tile = 0; tile < n_tiles; tile++) {
        cp_async_wait<STAGES - 1>();  // this thread's copies of `tile` are done ...
        __syncthreads();              // ... and everyone's
        const __half *k_tile = k_ring + (tile % STAGES) * L::TILE;
        const __half *v_tile = v_ring + (tile % STAGES) * L::TILE;
        const int k0 = tile * KEY_TILE;

        // S = Q K^T: 16 x 64 per warp, 8 accumulators of 16 x 8. One ldmatrix x4 of K rows gives
        // the B fragments of two 8-key blocks (K's rows are B's columns: Kᵀ for free).
        float s_acc[KEY_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; n++) s_acc[n][0] = s_acc[n][1] = s_acc[n][2] = s_acc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int n = 0; n < KEY_TILE / 16; n++) {
                uint32_t b[4];
                ldmatrix_x4(b, k_tile + swizzle<D>(n * 16 + lane % 8 + 8 * (lane / 16),
                                                   kk * 16 + 8 * (lane / 8 % 2)));
                mma_m16n8k16(s_acc[2 * n], q_frag[kk], b[0], b[1]);
                mma_m16n8k16(s_acc[2 * n + 1], q_frag[kk], b[2], b[3]);
            }

        // Masks: only the tail tile and, when causal, tiles that reach past the block's first row.
        if (k0 + KEY_TILE > S || (causal && k0 + KEY_TILE - 1 > q0)) {
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = k0 + n * 8 + 2 * t + (e & 1);
                    const int query = e < 2 ? query_lo : query_hi;
                    if (key >= S || (causal && key > query)) s_acc[n][e] = -INFINITY;
                }
        }

        // Online softmax on the thread's two rows; the 4 lanes of a quad share a row.
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++) tile_max = fmaxf(tile_max, fmaxf(s_acc[n][2 * r], s_acc[n][2 * r + 1]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            // Tile 0 holds key 0, which no row masks: the max is finite from the first tile on.
            const float new_max = fmaxf(row_max[r], tile_max * scale_log2);
            alpha[r] = exp2f(row_max[r] - new_max);  // 0 on the first tile
            row_max[r] = new_max;
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    s_acc[n][e] = exp2f(s_acc[n][e] * scale_log2 - new_max);  // now P
                    tile_sum += s_acc[n][e];
                }
            row_sum[r] = row_sum[r] * alpha[r] + tile_sum;
        }
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            o_acc[j][0] *= alpha[0], o_acc[j][1] *= alpha[0];
            o_acc[j][2] *= alpha[1], o_acc[j][3] *= alpha[1];
        }

        // O += P V. The A fragment for keys 16kk..16kk+15 is accumulators 2kk and 2kk+1 in fp16;
        // V's B fragments come from ldmatrix.trans of V's rows (keys), two 8-column blocks each.
#pragma unroll
        for (int kk = 0; kk < KEY_TILE / 16; kk++) {
            const uint32_t p_frag[4] = {pack_half2(s_acc[2 * kk][0], s_acc[2 * kk][1]),
                                        pack_half2(s_acc[2 * kk][2], s_acc[2 * kk][3]),
                                        pack_half2(s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1]),
                                        pack_half2(s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 16; n++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, v_tile + swizzle<D>(kk * 16 + lane % 8 + 8 * (lane / 8 % 2),
                                                         n * 16 + 8 * (lane / 16)));
                mma_m16n8k16(o_acc[2 * n], p_frag, b[0], b[1]);
                mma_m16n8k16(o_acc[2 * n + 1], p_frag, b[2], b[3]);
            }
        }

        __syncthreads();  // every warp is done with this stage: refill it with tile + STAGES
        if (tile + STAGES < n_tiles) {
            const int next = (tile + STAGES) * KEY_TILE;
            cp_async_tile<KEY_TILE, D>(k_ring + (tile % STAGES) * L::TILE, k + head, next, S);
            cp_async_tile<KEY_TILE, D>(v_ring + (tile % STAGES) * L::TILE, v + head, next, S);
        }
        cp_async_commit();
    }

    // Row sums: add the quad's four parts, then O / l straight to global memory as fp16 pairs.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
    const float inv_lo = 1.0f / row_sum[0], inv_hi = 1.0f / row_sum[1];
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        const int col = j * 8 + 2 * t;
        if (query_lo < S)
            *(__half2 *)(o + head + (size_t)query_lo * D + col) = __floats2half2_rn(o_acc[j][0] * inv_lo, o_acc[j][1] * inv_lo);
        if (query_hi < S)
            *(__half2 *)(o + head + (size_t)query_hi * D + col) = __floats2half2_rn(o_acc[j][2] * inv_hi, o_acc[j][3] * inv_hi);
    }
}

template <int D>
static cudaError_t launch(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return launch_attention(swizzle_cp_async_kernel<D>, BLOCK_ROWS, THREADS, Layout<D>::bytes, s, t, stream);
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch<64>(s, t, stream) : launch<128>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    "07_swizzle_cp_async",
    "ldmatrix + mma.sync with S and P in registers, XOR-swizzled tiles, a 2-stage cp.async ring",
    unsupported_head_dim,
    no_workspace,
    forward,
};
