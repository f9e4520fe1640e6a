// Stage 09, forward - warp specialization on Hopper: a producer warpgroup feeds K/V tiles with the
// copy engine (TMA), two consumer warpgroups multiply with wgmma and run the softmax; mbarriers
// hand the slots of a shared-memory ring over.
//
// The idea: stage 08 already splits the roles (a producer warp fills a K/V ring with cp.async,
// consumer warps compute, mbarriers hand the slots over), but its consumers pull every K and V
// fragment through their own registers with ldmatrix before mma.sync can use it, and its producer
// warp holds as many registers as a consumer. Here the copy engine fills shared memory, the tensor
// cores read it themselves, and the producer gives its registers away:
//   producer (warpgroup 0): one thread issues cp.async.bulk.tensor (TMA) for Q once, then for
//     each K/V tile into ring slot t % STAGES, after the consumers released it (empty[slot]);
//     the copy engine counts the bytes onto full[slot].
//   consumers (warpgroups 1, 2; 64 query rows each): wait full[slot], S = Q Kᵀ with wgmma
//     (both operands in shared memory), mask and online softmax in registers, O += P V with wgmma
//     (P from registers, V from shared memory), arrive on empty[slot].
// setmaxnreg moves registers from the producer (24 per thread) to the consumers (240).
// What changed from stage 08: TMA (one thread copies a whole box, in the async proxy) instead of
// a producer warp's cp.async; wgmma reading shared memory instead of ldmatrix + mma.sync;
// setmaxnreg; warpgroups instead of warps; 128 x 128 tiles (128 query rows per block, 128-key
// tiles); the 128-byte swizzle that TMA writes and wgmma reads (common/wgmma_ptx.cuh). The online
// softmax and the log-sum-exp (log2 units) written to the workspace for the backward pass
// (backward.cu) are stage 08's.
// Limits: Hopper only (sm_90a instructions; the harness skips older GPUs with a message); inside
// a consumer warpgroup the softmax waits for its S product and the P V product for the softmax:
// only the other warpgroup overlaps them (FlashAttention-3 also pipelines within a group).
#include <math.h>

#include "kernel_common.cuh"
#include "stage09.h"
#include "wgmma_ptx.cuh"

#define CONSUMER_GROUPS 2
#define GROUP_ROWS 64                                // one wgmma M per consumer warpgroup
#define BLOCK_ROWS (CONSUMER_GROUPS * GROUP_ROWS)  // 128 query rows per block
#define KEY_TILE 128
#define THREADS (128 * (CONSUMER_GROUPS + 1))      // producer warpgroup + consumer warpgroups
#define SLAB 64                                      // fp16 columns per 128-byte swizzled slab

template <int D> struct FwdLayout {
    static constexpr int STAGES = D == 64 ? 3 : 2;  // ring slots: as many as fit next to Q
    static constexpr int Q_ELEMS = BLOCK_ROWS * D;
    static constexpr int TILE_ELEMS = KEY_TILE * D;
    // Q [D/64][BLOCK_ROWS][64], K and V rings [STAGES][D/64][KEY_TILE][64], then the mbarriers;
    // 1024 spare bytes to align the start to a swizzle atom.
    static constexpr size_t bytes =
        1024 + sizeof(__half) * (Q_ELEMS + 2 * STAGES * TILE_ELEMS) + sizeof(uint64_t) * (2 * STAGES + 1);
};

template <int D>
__global__ void __launch_bounds__(THREADS, 1)
wgmma_forward(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
              const __grid_constant__ CUtensorMap v_map, __half *o, float *lse_log2, int S, float scale,
              int causal) {
#if FLASH_STAGES_SM90A
    using L = FwdLayout<D>;
    constexpr int STAGES = L::STAGES;
    extern __shared__ unsigned char smem_raw[];
    __half *q_tile = (__half *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    __half *k_ring = q_tile + L::Q_ELEMS;
    __half *v_ring = k_ring + STAGES * L::TILE_ELEMS;
    uint64_t *full = (uint64_t *)(v_ring + STAGES * L::TILE_ELEMS);  // [STAGES]: K/V tile landed
    uint64_t *empty = full + STAGES;                                // [STAGES]: consumers done
    uint64_t *q_full = empty + STAGES;

    const int head_index = blockIdx.z * gridDim.y + blockIdx.y;
    const int q_block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // longest first
    const int q0 = q_block * BLOCK_ROWS;
    const int kv_end = causal ? min(S, q0 + BLOCK_ROWS) : S;
    const int n_tiles = ceil_div(kv_end, KEY_TILE);
    const int group = threadIdx.x / 128;

    init_tma_ring(full, empty, STAGES, 4 * CONSUMER_GROUPS, q_full);

    if (group == 0) {
        // Producer. One thread is enough: a TMA instruction moves a whole 64-column slab.
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) {
            tma_prefetch_descriptor(&q_map), tma_prefetch_descriptor(&k_map), tma_prefetch_descriptor(&v_map);
            mbarrier_arrive_expect_tx(q_full, sizeof(__half) * L::Q_ELEMS);
            for (int c = 0; c < D / SLAB; c++)
                tma_load_3d(q_tile + c * BLOCK_ROWS * SLAB, &q_map, c * SLAB, q0, head_index, q_full);
            for (int tile = 0; tile < n_tiles; tile++) {
                const int slot = tile % STAGES;
                if (tile >= STAGES) mbarrier_wait(&empty[slot], (tile / STAGES - 1) & 1);
                mbarrier_arrive_expect_tx(&full[slot], 2 * sizeof(__half) * L::TILE_ELEMS);
                for (int c = 0; c < D / SLAB; c++) {
                    const int dst = slot * L::TILE_ELEMS + c * KEY_TILE * SLAB;
                    tma_load_3d(k_ring + dst, &k_map, c * SLAB, tile * KEY_TILE, head_index, &full[slot]);
                    tma_load_3d(v_ring + dst, &v_map, c * SLAB, tile * KEY_TILE, head_index, &full[slot]);
                }
            }
        }
    } else {
        setmaxnreg_inc<240>();
        const int consumer = group - 1;
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        const int warp_row0 = consumer * GROUP_ROWS + (threadIdx.x % 128) / 32 * 16;  // in the block
        const float scale_log2 = scale * 1.4426950408889634f;

        float o_acc[D / 2];  // [D/8 n8 blocks][4], the wgmma accumulator layout
#pragma unroll
        for (int i = 0; i < D / 2; i++) o_acc[i] = 0.0f;
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
        mbarrier_wait(q_full, 0);

        for (int tile = 0; tile < n_tiles; tile++) {
            const int slot = tile % STAGES;
            const int k0 = tile * KEY_TILE;
            const __half *k_tile = k_ring + slot * L::TILE_ELEMS;
            const __half *v_tile = v_ring + slot * L::TILE_ELEMS;
            mbarrier_wait(&full[slot], (tile / STAGES) & 1);

            // S = Q Kᵀ: 64 rows x 128 keys, k = 16 columns of D per instruction. Both operands are
            // K-major: step kk starts 32 bytes further into the 128-byte rows of slab kk / 4.
            float s_acc[KEY_TILE / 2];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_m64k16_ss<KEY_TILE>(s_acc, desc_k_major<BLOCK_ROWS>(q_tile, consumer * GROUP_ROWS, kk),
                                          desc_k_major<KEY_TILE>(k_tile, 0, kk), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands<KEY_TILE / 2>(s_acc);

            if (k0 + KEY_TILE > S || (causal && k0 + KEY_TILE - 1 > q0 + warp_row0)) {
#pragma unroll
                for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int key = k0 + 8 * j + 2 * t + (e & 1);
                        const int query = q0 + warp_row0 + g + (e < 2 ? 0 : 8);
                        if (key >= S || (causal && key > query)) s_acc[4 * j + e] = -INFINITY;
                    }
            }
            // Online softmax for this thread's two rows (g and g + 8), as in stage 07.
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float tile_max = -INFINITY;
#pragma unroll
                for (int j = 0; j < KEY_TILE / 8; j++)
                    tile_max = fmaxf(tile_max, fmaxf(s_acc[4 * j + 2 * r], s_acc[4 * j + 2 * r + 1]));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
                const float new_max = fmaxf(row_max[r], tile_max * scale_log2);
                const float alpha = exp2f(row_max[r] - new_max);
                row_max[r] = new_max;
                float tile_sum = 0.0f;
#pragma unroll
                for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; e++) {
                        s_acc[4 * j + e] = exp2f(s_acc[4 * j + e] * scale_log2 - new_max);
                        tile_sum += s_acc[4 * j + e];
                    }
                row_sum[r] = row_sum[r] * alpha + tile_sum;
#pragma unroll
                for (int j = 0; j < D / 8; j++) o_acc[4 * j + 2 * r] *= alpha, o_acc[4 * j + 2 * r + 1] *= alpha;
            }

            // O += P V: P (fp16) is the A operand straight from registers; V is N-major, so step kk
            // (16 keys) starts 16 rows = 2 atoms further, and its 64-column slabs are a tile apart.
            uint32_t p_frag[KEY_TILE / 16][4];
            pack_a_frags<KEY_TILE>(p_frag, s_acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KEY_TILE / 16; kk++)
                wgmma_m64k16_rs_tn<D>(o_acc, p_frag[kk], desc_n_major<KEY_TILE>(v_tile, kk));
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands<D / 2>(o_acc);
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&empty[slot]);  // this warp no longer reads the slot
        }

        // O / l, and the row's log-sum-exp in log2 units: log2 sum_j 2^(s_ij scale log2 e).
        const size_t head = (size_t)head_index * S * D;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = row_sum[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = 1.0f / l;
            const int query = q0 + warp_row0 + g + 8 * r;
            if (query < S) {
#pragma unroll
                for (int j = 0; j < D / 8; j++)
                    *(__half2 *)(o + head + (size_t)query * D + j * 8 + 2 * t) =
                        __floats2half2_rn(o_acc[4 * j + 2 * r] * inv, o_acc[4 * j + 2 * r + 1] * inv);
                if (t == 0) lse_log2[(size_t)head_index * S + query] = row_max[r] + log2f(l);
            }
        }
    }
#else
    (void)q_map, (void)k_map, (void)v_map, (void)o, (void)lse_log2, (void)S, (void)scale, (void)causal;
#endif
}

template <int D>
static cudaError_t launch_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    const int heads_total = s->batch * s->heads;
    CUtensorMap q_map, k_map, v_map;
    cudaError_t err = make_tensor_map_bhsd(&q_map, t->q, heads_total, s->seq, D, BLOCK_ROWS);
    if (err == cudaSuccess) err = make_tensor_map_bhsd(&k_map, t->k, heads_total, s->seq, D, KEY_TILE);
    if (err == cudaSuccess) err = make_tensor_map_bhsd(&v_map, t->v, heads_total, s->seq, D, KEY_TILE);
    const size_t smem = FwdLayout<D>::bytes;
    if (err == cudaSuccess) err = allow_dynamic_smem(wgmma_forward<D>, smem);
    if (err != cudaSuccess) return err;
    const dim3 grid(ceil_div(s->seq, BLOCK_ROWS), s->heads, s->batch);
    wgmma_forward<D><<<grid, THREADS, smem, stream>>>(q_map, k_map, v_map, (__half *)t->o, workspace_lse(s, t),
                                                      s->seq, 1.0f / sqrtf((float)s->dim), s->causal);
    return cudaGetLastError();
}

cudaError_t stage09_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 64 ? launch_forward<64>(s, t, stream) : launch_forward<128>(s, t, stream);
}

static size_t shared_bytes(const attn_shape *s) {
    const size_t fwd = s->dim == 64 ? FwdLayout<64>::bytes : FwdLayout<128>::bytes;
    const size_t bwd = stage09_backward_shared_bytes(s);
    return fwd > bwd ? fwd : bwd;
}

extern "C" const attn_stage STAGE = {
    "09_tma_wgmma",
    "producer warpgroup (TMA) and consumer warpgroups (wgmma) with mbarrier hand-off; FlashAttention-2 "
    "backward (dK/dV and dQ kernels)",
    unsupported_head_dim,
    lse_workspace_bytes,
    shared_bytes,
    stage09_forward,
    stage09_backward,
    1,  // wgmma, setmaxnreg: sm_90a
    stage09_backward_scratch_bytes,
};
