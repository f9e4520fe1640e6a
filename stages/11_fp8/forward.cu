// Stage 11, forward - FP8 attention: Q, K and V quantized to e4m3, both products on Hopper's FP8
// wgmma, which does twice the multiply-adds per cycle of fp16's.
//
// The idea: FlashAttention-3's FP8 forward (Shah et al. 2024, section 3.3), in two kernels.
//   quantize (one launch each for K and V): a block takes 128 rows of a head, rotates K's rows by
//     one random-sign Hadamard transform (kHadamard: q.k is unchanged when Q's rows get the same
//     rotation, and an outlier's weight spreads over all D entries), takes their largest
//     magnitude, and stores x / scale in e4m3 with scale = amax / 448 (kBlockScales: one scale per
//     block; otherwise one per tensor, from a pass that only takes the amax). V is stored
//     transposed, [D][keys], because e4m3 wgmma reads both operands K-major, and P V's K is the
//     keys; within every 32 keys its columns are permuted (v_key) so that P's accumulator
//     registers are wgmma's A operand as they are.
//   attend: stage 09's frame, on e4m3 tiles: the two consumer warpgroups first quantize the
//     block's 128 query rows from fp16 Q as the pass quantizes K's (kFusedQ; otherwise the pass
//     quantizes Q too, and TMA loads it), a producer warpgroup loads K and Vᵀ by TMA into rings,
//     and the consumers run S = Q Kᵀ (k = 32 per instruction), the online softmax in fp32 with
//     the blocks' scales folded into its scale, P to e4m3 (P <= 1: no scale), and O += P Vᵀ; O,
//     kept in units of the current V block's scale, goes out as fp16.
// What changed from stage 09: e4m3 operands and wgmma, the quantize pass and Q's quantization in
// the kernel, the scales in the softmax, V transposed and permuted, ex2.approx for 2^x, and stage
// 10's overlap inside a warpgroup (kOverlap); not stage 10's persistent blocks or TMA stores of O.
// Limits: forward only; Hopper only; Q, K and V of one shape, contiguous fp16 [B, H, S, D]; the
// quantize pass is its own kernels, timed in the forward.
#include <math.h>

#include "kernel_common.cuh"
#include "wgmma_ptx.cuh"
#include "fp8.h"
#include "v_transpose.cuh"

#define CONSUMERS 2                          // consumer warpgroups; warpgroup 0 is the producer
#define GROUP_ROWS 64                        // query rows per consumer warpgroup: one wgmma M
#define BLOCK_ROWS (CONSUMERS * GROUP_ROWS)  // query rows per block: one quantization block
#define KEY_TILE 128                         // keys per K or V tile: one quantization block
#define THREADS (128 * (CONSUMERS + 1))
static_assert(BLOCK_ROWS == ATTN_FP8_BLOCK_ROWS && KEY_TILE == ATTN_FP8_BLOCK_ROWS,
              "a tile is one block of the quantization");

// The lesson's ladder (ladder.txt) turns these on one at a time; all are on as built.
#ifndef BLOCK_SCALES
#define BLOCK_SCALES 1  // 0: one scale per tensor
#endif
#ifndef HADAMARD
#define HADAMARD 1      // 0: Q and K quantized as they are
#endif
#ifndef FUSED_Q
#define FUSED_Q 1       // 0: Q quantized by the pass, as K is
#endif
#ifndef OVERLAP
#define OVERLAP 1       // 0: each step of a consumer waits for the one before, as stage 09's
#endif
constexpr bool kBlockScales = BLOCK_SCALES;
constexpr bool kHadamard = HADAMARD;
#ifndef PINGPONG
#define PINGPONG 0      // 1: the consumer warpgroups take turns to issue their products (ablations.txt)
#endif
#ifndef V_IN_KERNEL
#define V_IN_KERNEL 0   // 1: V quantized as K is, and transposed in shared memory by the producer (ablations.txt)
#endif
constexpr bool kVInKernel = V_IN_KERNEL;
constexpr bool kFusedQ = FUSED_Q;
static_assert(!kFusedQ || BLOCK_SCALES, "Q's block is the kernel's query tile: a fused Q takes a scale per block");
#define Q_BARRIER 3     // kFusedQ: the named barrier of the 256 consumer threads (ping-pong's are 1 and 2)
[[maybe_unused]] constexpr bool kOverlap = OVERLAP;  // read in the sm_90a pass only
[[maybe_unused]] constexpr bool kPingPong = PINGPONG;
constexpr int kMethod = ATTN_FP8 | (kBlockScales ? ATTN_FP8_BLOCK_SCALES : 0) | (kHadamard ? ATTN_FP8_HADAMARD : 0);

// Registers per thread after setmaxnreg, as in stage 09: the block is launched with KERNEL_REGS a
// thread (ptxas' most under __launch_bounds__(THREADS, 1)) and holds THREADS x KERNEL_REGS =
// 64,512 from its launch on; setmaxnreg only moves them between warpgroups: 128 x 24 + 256 x 240
// = 64,512, exactly. A producer at more than 24 would leave the consumers' setmaxnreg.inc waiting
// for registers that never come free.
#define KERNEL_REGS 168
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#define TRANSPOSER_THREADS 96                  // kVInKernel: producer warps 1 to 3 transpose V's tiles

// ---------------------------------------------------------------------------------------------
// The quantized tensors, in the forward's scratch.
//   q8, k8 [B*H][S][D] e4m3 (q8 written by the pass without kFusedQ only); vt8 [B*H][D][s_pad]
//   e4m3, keys padded to a whole tile with zeros (kVInKernel: V's rows, [B*H][S][D], as K's);
//   q_scale, k_scale, v_scale [B*H][blocks] float (q_scale without kFusedQ only); amax[3]
//   (per-tensor scales only).
struct Fp8Tensors {
    const __half *q;  // kFusedQ: fp16 Q, [B*H][S][D], which the attention kernel quantizes
    uint8_t *q8, *k8, *vt8;
    float *q_scale, *k_scale, *v_scale;
    unsigned *amax;
    int blocks, s_pad;
};

static size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The bytes of Q's (and K's) e4m3 copy, of Vᵀ's, and of one tensor's scales, each 256-aligned.
struct Fp8Sizes {
    size_t qk, vt, scales;
};
static Fp8Sizes fp8_sizes(const attn_shape *s) {
    const size_t heads = (size_t)s->batch * s->heads, blocks = ceil_div(s->seq, KEY_TILE);
    return {align256(heads * s->seq * s->dim), align256(heads * s->dim * blocks * KEY_TILE),
            align256(sizeof(float) * heads * blocks)};
}

static size_t forward_scratch_bytes(const attn_shape *s) {
    const Fp8Sizes z = fp8_sizes(s);
    return 2 * z.qk + z.vt + 3 * z.scales + 256;  // the last 256: amax
}

static Fp8Tensors fp8_tensors(const attn_shape *s, void *scratch) {
    const Fp8Sizes z = fp8_sizes(s);
    char *p = (char *)scratch;
    Fp8Tensors t;
    t.q8 = (uint8_t *)p, t.k8 = (uint8_t *)(p + z.qk), t.vt8 = (uint8_t *)(p + 2 * z.qk);
    t.q_scale = (float *)(p + 2 * z.qk + z.vt), t.k_scale = (float *)(p + 2 * z.qk + z.vt + z.scales);
    t.v_scale = (float *)(p + 2 * z.qk + z.vt + 2 * z.scales);
    t.amax = (unsigned *)(p + 2 * z.qk + z.vt + 3 * z.scales);
    t.blocks = ceil_div(s->seq, KEY_TILE), t.s_pad = t.blocks * KEY_TILE;
    return t;
}

// ---------------------------------------------------------------------------------------------
// The quantize pass.

enum Role { ROLE_Q, ROLE_K, ROLE_V };

// The sign of column d in the rotation (fp8.h's FP8_SIGNS_LO/HI, as the checker's).
__device__ inline bool rotation_negates(int d) {
    return ((d < 64 ? FP8_SIGNS_LO >> d : FP8_SIGNS_HI >> (d - 64)) & 1) != 0;
}

// x <- H diag(signs) x / sqrt(D) for one row spread over a warp, PER = D / 32 values a lane
// (columns lane PER .. lane PER + PER - 1): the butterflies of stride below PER in the lane, the
// others between lanes (the partner of column d across stride h holds column d ^ h).
template <int D>
__device__ inline void rotate_row(float (&x)[D / 32], int lane) {
    constexpr int PER = D / 32;
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (rotation_negates(lane * PER + i)) x[i] = -x[i];
#pragma unroll
    for (int h = 1; h < PER; h *= 2)
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (!(i & h)) {
                const float a = x[i], b = x[i + h];
                x[i] = a + b, x[i + h] = a - b;
            }
#pragma unroll
    for (int m = 1; m < 32; m *= 2)
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const float partner = __shfl_xor_sync(0xffffffffu, x[i], m);
            x[i] = lane & m ? partner - x[i] : x[i] + partner;
        }
    const float norm = FP8_ROTATION_NORM(D);  // the checker's float, not rsqrtf's approximation
#pragma unroll
    for (int i = 0; i < PER; i++) x[i] *= norm;
}

// The largest of every thread's `value` in the block of 256 threads.
__device__ inline float block_max(float value, float *scratch) {
#pragma unroll
    for (int m = 16; m > 0; m /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, m));
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
    __syncthreads();
    value = scratch[0];
    for (int w = 1; w < 8; w++) value = fmaxf(value, scratch[w]);
    return value;
}

// The key that column `column` (0..31 within its group of 32) of a row of Vᵀ holds: the key whose
// P sits in that column of wgmma's A operand. A thread's accumulator holds, for row g, keys
// 8j + 2t and 8j + 2t + 1 of n8 blocks j = 0..3; pack_p packs them four at a time into A's
// columns 4t..4t+3 (blocks 0 and 1) and 16 + 4t.. (blocks 2 and 3). So column 16h + 4t + 2i + e
// holds key 16h + 8i + 2t + e.
__device__ inline int v_key(int column) {
    const int h = column / 16, t = column % 16 / 4;  // which 16 columns; the thread of the quad
    const int i = column % 4 / 2, e = column % 2;    // which of its two blocks; which of the pair
    return 16 * h + 8 * i + 2 * t + e;
}

// A warp's 16 rows of the block, from row `first` of a head ([S][D] fp16), as floats, PER = D / 32
// columns a lane (lane PER ..); rows past S are 0. Every row's load is issued before any is used.
template <int D>
__device__ inline void load_rows(float (&values)[16][D / 32], const __half *head_rows, int first, int S, int lane) {
    constexpr int PER = D / 32;
    __half2 pairs[16][PER / 2];
#pragma unroll
    for (int r = 0; r < 16; r++) {
        const __half *src = head_rows + (size_t)(first + r) * D + lane * PER;
        if (first + r >= S) {
#pragma unroll
            for (int i = 0; i < PER / 2; i++) pairs[r][i] = __floats2half2_rn(0.0f, 0.0f);
        } else if constexpr (PER == 4) {
            *(uint2 *)pairs[r] = *(const uint2 *)src;
        } else {
            *(uint32_t *)pairs[r] = *(const uint32_t *)src;
        }
    }
#pragma unroll
    for (int r = 0; r < 16; r++)
#pragma unroll
        for (int i = 0; i < PER / 2; i++) {
            const float2 f = __half22float2(pairs[r][i]);
            values[r][2 * i] = f.x, values[r][2 * i + 1] = f.y;
        }
}

// PER floats times `inv` as PER e4m3 bytes, the first in the lowest.
template <int PER>
__device__ inline uint32_t to_e4m3(const float (&x)[PER], float inv) {
    if constexpr (PER == 4) return pack4_e4m3(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv);
    else return pack4_e4m3(x[0] * inv, x[1] * inv, 0.0f, 0.0f) & 0xffffu;
}

// V's block of 128 keys to Vᵀ ([D][s_pad] of the head): its rows into shared memory as they are
// (a pitch of D + 4 bytes spreads one column's bytes over the banks), then each thread gathers
// 16 bytes of one row of Vᵀ, in v_key's order, and stores them; a warp's 32 threads take 32
// rows d, so that their reads of one key's row hit 8 words, each shared by 4 threads.
template <int D>
__device__ inline void store_transposed(const float (&values)[16][D / 32], float inv, uint8_t *vt_head, int s_pad,
                                        int block, int lane) {
    constexpr int PER = D / 32, PITCH = D + 4;
    __shared__ __align__(16) uint8_t rows[KEY_TILE * PITCH];
    const int warp_first = threadIdx.x / 32 * 16;
#pragma unroll
    for (int r = 0; r < 16; r++) {
        const uint32_t bytes = to_e4m3<PER>(values[r], inv);
        uint8_t *dst = rows + (warp_first + r) * PITCH + lane * PER;
        if constexpr (PER == 4) *(uint32_t *)dst = bytes;
        else *(uint16_t *)dst = (uint16_t)bytes;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D * KEY_TILE / 16; c += blockDim.x) {
        const int d = c % D, first_column = c / D * 16;
        uint32_t words[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            words[w] = 0;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const int column = first_column + 4 * w + b;
                words[w] |= (uint32_t)rows[(column / 32 * 32 + v_key(column % 32)) * PITCH + d] << (8 * b);
            }
        }
        *(uint4 *)(vt_head + (size_t)d * s_pad + block * KEY_TILE + first_column) =
            make_uint4(words[0], words[1], words[2], words[3]);
    }
}

// One block of 128 rows of one head of Q, K or V, 8 warps of 16 rows: loaded, Q's and K's rotated
// (kHadamard), scaled by the block's amax (or, without kBlockScales, the tensor's) and stored as
// e4m3. AMAX_ONLY: only the block's amax, into the tensor's (atomicMax on the float's bits: they
// order as the values do).
template <int D, int ROLE, bool AMAX_ONLY>
__global__ void __launch_bounds__(256) quantize(const __half *x, Fp8Tensors out, int S) {
    constexpr int PER = D / 32;
    __shared__ float warp_max[8];
    const int block = blockIdx.x % out.blocks, head = blockIdx.x / out.blocks;
    const int lane = threadIdx.x % 32, first = block * KEY_TILE + threadIdx.x / 32 * 16;
    float values[16][PER];
    load_rows<D>(values, x + (size_t)head * S * D, first, S, lane);
    float amax = 0.0f;
#pragma unroll
    for (int r = 0; r < 16; r++) {
        if (ROLE != ROLE_V && kHadamard) rotate_row<D>(values[r], lane);
#pragma unroll
        for (int i = 0; i < PER; i++) amax = fmaxf(amax, fabsf(values[r][i]));
    }
    amax = block_max(amax, warp_max);
    unsigned *tensor_amax = out.amax + ROLE;
    if constexpr (AMAX_ONLY) {
        if (threadIdx.x == 0) atomicMax(tensor_amax, __float_as_uint(amax));
        return;
    }
    if (!kBlockScales) amax = __uint_as_float(*tensor_amax);
    const float scale = amax > 0.0f ? amax / (float)E4M3_MAX : 1.0f, inv = 1.0f / scale;
    float *scales = ROLE == ROLE_Q ? out.q_scale : ROLE == ROLE_K ? out.k_scale : out.v_scale;
    if (threadIdx.x == 0) scales[(size_t)head * out.blocks + block] = scale;
    if constexpr (ROLE == ROLE_V && !kVInKernel) {
        store_transposed<D>(values, inv, out.vt8 + (size_t)head * D * out.s_pad, out.s_pad, block, lane);
    } else {
        uint8_t *head_rows = (ROLE == ROLE_Q ? out.q8 : ROLE == ROLE_K ? out.k8 : out.vt8) + (size_t)head * S * D;
#pragma unroll
        for (int r = 0; r < 16; r++) {
            if (first + r >= S) continue;
            const uint32_t bytes = to_e4m3<PER>(values[r], inv);
            uint8_t *dst = head_rows + (size_t)(first + r) * D + lane * PER;
            if constexpr (PER == 4) *(uint32_t *)dst = bytes;
            else *(uint16_t *)dst = (uint16_t)bytes;
        }
    }
}

template <int D>
static cudaError_t launch_quantize(const attn_shape *s, const attn_tensors *t, const Fp8Tensors &out,
                                   cudaStream_t stream) {
    const int grid = out.blocks * s->batch * s->heads;
    const __half *q = (const __half *)t->q, *k = (const __half *)t->k, *v = (const __half *)t->v;
    if (!kBlockScales) {  // the tensors' amax first
        cudaError_t err = cudaMemsetAsync(out.amax, 0, 3 * sizeof(unsigned), stream);
        if (err != cudaSuccess) return err;
        if (!kFusedQ) quantize<D, ROLE_Q, true><<<grid, 256, 0, stream>>>(q, out, s->seq);
        quantize<D, ROLE_K, true><<<grid, 256, 0, stream>>>(k, out, s->seq);
        quantize<D, ROLE_V, true><<<grid, 256, 0, stream>>>(v, out, s->seq);
    }
    if (!kFusedQ) quantize<D, ROLE_Q, false><<<grid, 256, 0, stream>>>(q, out, s->seq);
    quantize<D, ROLE_K, false><<<grid, 256, 0, stream>>>(k, out, s->seq);
    quantize<D, ROLE_V, false><<<grid, 256, 0, stream>>>(v, out, s->seq);
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// The attention kernel: stage 09's frame on e4m3 tiles.

// The block's shared memory: q_smem [BLOCK_ROWS][D], k_ring [K_SLOTS][KEY_TILE][D], v_ring
// [V_SLOTS][D][KEY_TILE] (Vᵀ) and, with kVInKernel, v_rows [ROW_SLOTS][KEY_TILE][D] (V's tiles as
// loaded), one byte an element, each row one swizzled row; the mbarriers full[SLOTS] and
// empty[SLOTS] (K's slots, then V's), q_full, rows_full[ROW_SLOTS] and rows_empty[ROW_SLOTS];
// 1024 bytes to align the start.
template <int D> struct Layout {
    static constexpr int K_SLOTS = D == 64 ? 4 : 2;
    static constexpr int V_SLOTS = D == 64 ? 4 : 3;
    static constexpr int SLOTS = K_SLOTS + V_SLOTS;
    static constexpr int ROW_SLOTS = kVInKernel ? 2 : 0;
    static constexpr int Q_BYTES = BLOCK_ROWS * D, TILE_BYTES = KEY_TILE * D;
    static constexpr size_t bytes = 1024 + Q_BYTES + (SLOTS + ROW_SLOTS) * TILE_BYTES +
                                    sizeof(uint64_t) * (2 * SLOTS + 1 + 2 * ROW_SLOTS) + sizeof(float) * 8;
    static_assert(bytes <= 232448, "more shared memory than a Hopper block may have");
};

template <int D> struct SharedTiles {
    uint8_t *q_smem, *k_ring, *v_ring, *v_rows;
    uint64_t *k_full, *v_full, *k_empty, *v_empty, *q_full, *rows_full, *rows_empty;
    float *q_warp_max;  // kFusedQ: each consumer warp's amax of Q's tile
    __device__ explicit SharedTiles(unsigned char *smem_raw) {
        using L = Layout<D>;
        q_smem = smem_align_1024(smem_raw);
        k_ring = q_smem + L::Q_BYTES;
        v_ring = k_ring + L::K_SLOTS * L::TILE_BYTES;
        v_rows = v_ring + L::V_SLOTS * L::TILE_BYTES;
        k_full = (uint64_t *)(v_rows + L::ROW_SLOTS * L::TILE_BYTES), v_full = k_full + L::K_SLOTS;
        k_empty = k_full + L::SLOTS, v_empty = k_empty + L::K_SLOTS;
        q_full = k_empty + L::SLOTS, rows_full = q_full + 1, rows_empty = rows_full + L::ROW_SLOTS;
        q_warp_max = (float *)(rows_empty + L::ROW_SLOTS);
    }
};

// The block's mbarriers. As built, those of stage 09's rings (init_tma_ring): a full slot is one
// TMA load, an empty one the consumer warps' arrivals. With kVInKernel, a Vᵀ slot is full once
// every transposing thread has arrived, and V's loaded tiles have a ring of their own.
template <int D>
__device__ inline void init_barriers(const SharedTiles<D> &smem) {
    using L = Layout<D>;
    if constexpr (!kVInKernel) {
        init_tma_ring(smem.k_full, smem.k_empty, L::SLOTS, 4 * CONSUMERS, smem.q_full);
    } else {
        if (threadIdx.x == 0) {
            for (int s = 0; s < L::SLOTS; s++) {
                mbarrier_init(&smem.k_full[s], s < L::K_SLOTS ? 1 : TRANSPOSER_THREADS);
                mbarrier_init(&smem.k_empty[s], 4 * CONSUMERS);
            }
            for (int s = 0; s < L::ROW_SLOTS; s++) {
                mbarrier_init(&smem.rows_full[s], 1);
                mbarrier_init(&smem.rows_empty[s], TRANSPOSER_THREADS);
            }
            mbarrier_init(smem.q_full, 1);
            fence_mbarrier_init();
        }
        __syncthreads();
    }
}

// A block's query tile and the key tiles it walks; with the mask, each head's longest walks first.
struct BlockWork {
    int head, q0, n_tiles;
};
__device__ __forceinline__ BlockWork block_work(int S, int causal) {
    const int n_qtiles = ceil_div(S, BLOCK_ROWS), j = blockIdx.x % n_qtiles;
    const int q0 = (causal ? n_qtiles - 1 - j : j) * BLOCK_ROWS;
    const int keys = causal ? min(S, q0 + BLOCK_ROWS) : S;
    return {(int)(blockIdx.x / n_qtiles), q0, ceil_div(keys, KEY_TILE)};
}

// The producer loop, one thread: Q once (unless kFusedQ), then each key tile's K and Vᵀ (with
// kVInKernel, V's rows, for the transposing warps) into free slots.
template <int D>
__device__ __forceinline__ void produce(const SharedTiles<D> &smem, const CUtensorMap *q_map, const CUtensorMap *k_map,
                                        const CUtensorMap *vt_map, const BlockWork &work) {
    using L = Layout<D>;
    if (!kFusedQ) {
        mbarrier_arrive_expect_tx(smem.q_full, L::Q_BYTES);
        tma_load_3d(smem.q_smem, q_map, 0, work.q0, work.head, smem.q_full);
    }
    for (int tile = 0; tile < work.n_tiles; tile++) {
        const int k_slot = ring_wait_empty<L::K_SLOTS, true>(smem.k_empty, tile);
        mbarrier_arrive_expect_tx(&smem.k_full[k_slot], L::TILE_BYTES);
        tma_load_3d(smem.k_ring + k_slot * L::TILE_BYTES, k_map, 0, tile * KEY_TILE, work.head, &smem.k_full[k_slot]);
        if constexpr (kVInKernel) {  // V's rows, for the transposing warps
            const int row_slot = ring_wait_empty<L::ROW_SLOTS, true>(smem.rows_empty, tile);
            mbarrier_arrive_expect_tx(&smem.rows_full[row_slot], L::TILE_BYTES);
            tma_load_3d(smem.v_rows + row_slot * L::TILE_BYTES, vt_map, 0, tile * KEY_TILE, work.head,
                        &smem.rows_full[row_slot]);
        } else {
            const int v_slot = ring_wait_empty<L::V_SLOTS, true>(smem.v_empty, tile);
            mbarrier_arrive_expect_tx(&smem.v_full[v_slot], L::TILE_BYTES);
            tma_load_3d(smem.v_ring + v_slot * L::TILE_BYTES, vt_map, tile * KEY_TILE, 0, work.head,
                        &smem.v_full[v_slot]);
        }
    }
}

// kVInKernel, producer warps 1 to 3: each loaded V tile into a free Vᵀ slot (v_transpose.cuh),
// within the producer's 24 registers a thread. Every thread fences its shared-memory writes for
// wgmma's reads and arrives on the slot itself.
template <int D>
__device__ __forceinline__ void transpose_v(const SharedTiles<D> &smem, int n_tiles, int warp, int lane) {
    using L = Layout<D>;
    for (int tile = 0; tile < n_tiles; tile++) {
        const int row_slot = ring_wait_full<L::ROW_SLOTS, true>(smem.rows_full, tile);
        const int v_slot = ring_wait_empty<L::V_SLOTS, true>(smem.v_empty, tile);
        transpose_v_tile<D, KEY_TILE>(smem.v_rows + row_slot * L::TILE_BYTES, smem.v_ring + v_slot * L::TILE_BYTES,
                                      warp, TRANSPOSER_THREADS / 32, lane);
        fence_proxy_async_shared();
        mbarrier_arrive(&smem.v_full[v_slot]);
        mbarrier_arrive(&smem.rows_empty[row_slot]);
    }
}

// S = Q Kᵀ for this warpgroup's 64 rows x 128 keys: D / 32 e4m3 wgmma, one group.
template <int D>
__device__ __forceinline__ void issue_qk(float (&s_acc)[KEY_TILE / 2], const uint8_t *q_smem, const uint8_t *k_tile,
                                         int consumer) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 32; kk++)
        wgmma_m64n128k32_e4m3_ss(s_acc, desc_k_major_fp8<D>(q_smem, consumer * GROUP_ROWS, kk),
                                 desc_k_major_fp8<D>(k_tile, 0, kk), kk > 0);
    wgmma_commit();
}

// O += P Vᵀ: P from registers, Vᵀ's rows (D of them, 128 keys each) K-major in shared memory.
template <int D>
__device__ __forceinline__ void issue_pv(float (&o_acc)[D / 2], const uint32_t (&p_frag)[KEY_TILE / 32][4],
                                         const uint8_t *vt_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KEY_TILE / 32; kk++)
        wgmma_m64k32_e4m3_rs<D>(o_acc, p_frag[kk], desc_k_major_fp8<KEY_TILE>(vt_tile, 0, kk), 1);
    wgmma_commit();
}

// P (fp32, <= 1) as e4m3 A operands: for k step kk (keys 32kk..), n8 blocks 4kk..4kk+3 packed
// four values at a time, in the column order v_key puts Vᵀ in.
__device__ __forceinline__ void pack_p(uint32_t (&p_frag)[KEY_TILE / 32][4], const float (&p)[KEY_TILE / 2]) {
#pragma unroll
    for (int kk = 0; kk < KEY_TILE / 32; kk++) {
        const float *b = p + 16 * kk;  // blocks j = 4kk .. 4kk + 3, four values each
        p_frag[kk][0] = pack4_e4m3(b[0], b[1], b[4], b[5]);     // row g: blocks 0, 1
        p_frag[kk][1] = pack4_e4m3(b[2], b[3], b[6], b[7]);     // row g + 8
        p_frag[kk][2] = pack4_e4m3(b[8], b[9], b[12], b[13]);   // row g: blocks 2, 3
        p_frag[kk][3] = pack4_e4m3(b[10], b[11], b[14], b[15]); // row g + 8
    }
}

// The online softmax of one key tile for this thread's rows g and g + 8 of its warp's 16, in log2
// units: scale_log2 includes the Q and K blocks' scales. As stage 09's, with ex2.approx.
__device__ __forceinline__ void softmax_step(float (&s_acc)[KEY_TILE / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], int k0, int S, int causal, int first_query, int g,
                                             int t, float scale_log2) {
    if (k0 + KEY_TILE > S || (causal && k0 + KEY_TILE - 1 > first_query)) {
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + 8 * j + 2 * t + (e & 1), query = first_query + g + (e < 2 ? 0 : 8);
                if (key >= S || (causal && key > query)) s_acc[4 * j + e] = -INFINITY;
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
        const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row that saw no key yet
        alpha[r] = exp2_approx(row_max[r] - base);
        row_max[r] = new_max;
        float tile_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < KEY_TILE / 8; j++)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s_acc[4 * j + e] = exp2_approx(s_acc[4 * j + e] * scale_log2 - base);
                tile_sum += s_acc[4 * j + e];
            }
        row_sum[r] = row_sum[r] * alpha[r] + tile_sum;
    }
}

// O is kept in units of the current V block's scale: before key tile n's P V it is scaled by the
// softmax's alpha times v_scale[n - 1] / v_scale[n] (v_now / v_next).
template <int D>
__device__ __forceinline__ void rescale_o(float (&o_acc)[D / 2], const float (&alpha)[2], float v_now, float v_next) {
    const float ratio = v_now / v_next, factor[2] = {alpha[0] * ratio, alpha[1] * ratio};
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o_acc[4 * j + e] *= factor[e / 2];
}

// What a consumer's loop reads besides the tiles: the block's K and V scales, and the scale of
// the softmax in log2 units with Q's block scale in it (K's is multiplied in per tile).
struct TileScales {
    const float *k, *v;
    float q_scale_log2;
};

// Ping-pong (kPingPong): consumer warpgroup c issues its products once it holds the turn (named
// barrier 1 + c, on which the other warpgroup arrives when it passes the turn on), so that one
// warpgroup's softmax runs under the other's products. Warpgroup 1 hands warpgroup 0 the first
// turn. Each barrier counts 256 threads: the taker's 128, which sync, and the passer's 128, which
// only arrive.
struct Turns {
    int consumer;
    __device__ void take() const {
        if (kPingPong) named_barrier_sync(1 + consumer, 256);
    }
    __device__ void pass() const {
        if (kPingPong) named_barrier_arrive(1 + (consumer + 1) % CONSUMERS, 256);
    }
};

// The consumer loop in order (kOverlap off): each step waits for the one before. Returns the V
// scale O is in.
template <int D>
__device__ __forceinline__ float attend_in_order(float (&o_acc)[D / 2], float (&row_max)[2], float (&row_sum)[2],
                                                 const SharedTiles<D> &smem, const TileScales &scales, int n_tiles,
                                                 int S, int causal, int first_query, int consumer, int g, int t) {
    using L = Layout<D>;
    float s_acc[KEY_TILE / 2], alpha[2], v_now = 1.0f;
    uint32_t p_frag[KEY_TILE / 32][4];
    for (int tile = 0; tile < n_tiles; tile++) {
        const int k_slot = ring_wait_full<L::K_SLOTS, true>(smem.k_full, tile);
        issue_qk<D>(s_acc, smem.q_smem, smem.k_ring + k_slot * L::TILE_BYTES, consumer);
        wgmma_wait<0>();
        fence_operands<KEY_TILE / 2>(s_acc);
        mbarrier_arrive_warp(&smem.k_empty[k_slot]);
        softmax_step(s_acc, row_max, row_sum, alpha, tile * KEY_TILE, S, causal, first_query, g, t,
                     scales.q_scale_log2 * __ldg(&scales.k[tile]));
        const float v_next = __ldg(&scales.v[tile]);
        rescale_o<D>(o_acc, alpha, v_now, v_next);
        v_now = v_next;
        pack_p(p_frag, s_acc);
        const int v_slot = ring_wait_full<L::V_SLOTS, true>(smem.v_full, tile);
        issue_pv<D>(o_acc, p_frag, smem.v_ring + v_slot * L::TILE_BYTES);
        wgmma_wait<0>();
        fence_operands<D / 2>(o_acc);
        mbarrier_arrive_warp(&smem.v_empty[v_slot]);
    }
    return v_now;
}

// The consumer loop with FlashAttention-3's intra-warpgroup overlap (kOverlap, stage 10's):
// tile 0's S and softmax first; then per key tile n, S_n and P_{n-1} V_{n-1} issued together, so
// that P_{n-1} V_{n-1} runs while the warpgroup waits for S_n and runs its softmax; then O rescaled
// and P_n packed once P V is done. The source lets the softmax run before the wait for P V, but
// ptxas places that wait after the first row maxima, ahead of every exponential
// (docs/profiles/11_fp8_h200_loop_order.txt): only the other warpgroup's products can run under
// them, while the two warpgroups are out of step. O and P's registers are never touched while a
// product uses them.
template <int D>
__device__ __forceinline__ float attend_overlapped(float (&o_acc)[D / 2], float (&row_max)[2], float (&row_sum)[2],
                                                   const SharedTiles<D> &smem, const TileScales &scales, int n_tiles,
                                                   int S, int causal, int first_query, int consumer, int g, int t) {
    using L = Layout<D>;
    float s_acc[KEY_TILE / 2], alpha[2];
    uint32_t p_frag[KEY_TILE / 32][4];
    const Turns turns{consumer};
    if (consumer == CONSUMERS - 1) turns.pass();
    int k_slot = ring_wait_full<L::K_SLOTS, true>(smem.k_full, 0);
    turns.take();
    issue_qk<D>(s_acc, smem.q_smem, smem.k_ring + k_slot * L::TILE_BYTES, consumer);
    turns.pass();
    wgmma_wait<0>();
    fence_operands<KEY_TILE / 2>(s_acc);
    mbarrier_arrive_warp(&smem.k_empty[k_slot]);
    softmax_step(s_acc, row_max, row_sum, alpha, 0, S, causal, first_query, g, t,
                 scales.q_scale_log2 * __ldg(&scales.k[0]));
    float v_now = __ldg(&scales.v[0]);  // O is still 0: nothing to rescale
    pack_p(p_frag, s_acc);
    for (int tile = 1; tile < n_tiles; tile++) {
        k_slot = ring_wait_full<L::K_SLOTS, true>(smem.k_full, tile);
        const int v_slot = ring_wait_full<L::V_SLOTS, true>(smem.v_full, tile - 1);
        turns.take();
        issue_qk<D>(s_acc, smem.q_smem, smem.k_ring + k_slot * L::TILE_BYTES, consumer);
        issue_pv<D>(o_acc, p_frag, smem.v_ring + v_slot * L::TILE_BYTES);
        turns.pass();
        wgmma_wait<1>();  // S_n, the older group, is done; P_{n-1} V_{n-1} may still run
        fence_operands<KEY_TILE / 2>(s_acc);
        mbarrier_arrive_warp(&smem.k_empty[k_slot]);
        softmax_step(s_acc, row_max, row_sum, alpha, tile * KEY_TILE, S, causal, first_query, g, t,
                     scales.q_scale_log2 * __ldg(&scales.k[tile]));
        wgmma_wait<0>();
        fence_operands<D / 2>(o_acc);
        mbarrier_arrive_warp(&smem.v_empty[v_slot]);
        const float v_next = __ldg(&scales.v[tile]);
        rescale_o<D>(o_acc, alpha, v_now, v_next);
        v_now = v_next;
        pack_p(p_frag, s_acc);
    }
    const int v_slot = ring_wait_full<L::V_SLOTS, true>(smem.v_full, n_tiles - 1);
    turns.take();
    issue_pv<D>(o_acc, p_frag, smem.v_ring + v_slot * L::TILE_BYTES);
    turns.pass();
    wgmma_wait<0>();
    fence_operands<D / 2>(o_acc);
    mbarrier_arrive_warp(&smem.v_empty[v_slot]);
    return v_now;
}

// O = o_acc v_scale / l to the head's rows, rows past S not stored.
template <int D>
__device__ __forceinline__ void store_o(const float (&o_acc)[D / 2], const float (&row_sum)[2], float v_scale,
                                        __half *o_head, int S, int first_query, int g, int t) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float factor = l > 0.0f ? v_scale / l : 0.0f;
        const int query = first_query + g + 8 * r;
        if (query < S)
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *(uint32_t *)(o_head + (size_t)query * D + j * 8 + 2 * t) =
                    pack2<__half>(o_acc[4 * j + 2 * r] * factor, o_acc[4 * j + 2 * r + 1] * factor);
    }
}

// kFusedQ: the block's query tile quantized by its consumers as the pass would (load_rows,
// rotate_row, the 128 rows' amax, to_e4m3), into q_smem in TMA's swizzled layout; consumer warp w
// takes rows 16w .. 16w + 15. Returns Q's scale. Every consumer thread fences its writes for
// wgmma and meets the others at Q_BARRIER before any product reads the tile.
template <int D>
__device__ float quantize_q_tile(const SharedTiles<D> &smem, const __half *q_head, int q0, int S) {
    constexpr int PER = D / 32;
    const int warp = threadIdx.x / 32 - 4, lane = threadIdx.x % 32;
    float values[16][PER];
    load_rows<D>(values, q_head, q0 + 16 * warp, S, lane);
    float amax = 0.0f;
#pragma unroll
    for (int r = 0; r < 16; r++) {
        if (kHadamard) rotate_row<D>(values[r], lane);
#pragma unroll
        for (int i = 0; i < PER; i++) amax = fmaxf(amax, fabsf(values[r][i]));
    }
#pragma unroll
    for (int m = 16; m > 0; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    if (lane == 0) smem.q_warp_max[warp] = amax;
    named_barrier_sync(Q_BARRIER, 128 * CONSUMERS);
    for (int w = 0; w < 8; w++) amax = fmaxf(amax, smem.q_warp_max[w]);
    const float q_scale = amax > 0.0f ? amax / (float)E4M3_MAX : 1.0f, inv = 1.0f / q_scale;
#pragma unroll
    for (int r = 0; r < 16; r++) {
        const uint32_t bytes = to_e4m3<PER>(values[r], inv);
        uint8_t *dst = smem.q_smem + swizzled_byte<D>(16 * warp + r, lane * PER);
        if constexpr (PER == 4) *(uint32_t *)dst = bytes;
        else *(uint16_t *)dst = (uint16_t)bytes;
    }
    fence_proxy_async_shared();
    named_barrier_sync(Q_BARRIER, 128 * CONSUMERS);
    return q_scale;
}

template <int D>
__global__ void __launch_bounds__(THREADS, 1)
fp8_forward(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
            const __grid_constant__ CUtensorMap vt_map, const Fp8Tensors fp8, __half *o, int S, float scale,
            int causal) {
#if FLASH_STAGES_SM90A
    extern __shared__ unsigned char smem_raw[];
    const SharedTiles<D> smem(smem_raw);
    init_barriers<D>(smem);
    const BlockWork work = block_work(S, causal);
    if (threadIdx.x / 128 == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            tma_prefetch_descriptor(&q_map), tma_prefetch_descriptor(&k_map), tma_prefetch_descriptor(&vt_map);
            produce<D>(smem, &q_map, &k_map, &vt_map, work);
        } else if (kVInKernel && threadIdx.x >= 32) {
            if constexpr (kVInKernel) transpose_v<D>(smem, work.n_tiles, threadIdx.x / 32 - 1, threadIdx.x % 32);
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int consumer = threadIdx.x / 128 - 1;
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        const int first_query = work.q0 + consumer * GROUP_ROWS + (threadIdx.x % 128) / 32 * 16;
        float o_acc[D / 2];
#pragma unroll
        for (int e = 0; e < D / 2; e++) o_acc[e] = 0.0f;
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
        const size_t head_blocks = (size_t)work.head * fp8.blocks;
        float q_scale;
        if constexpr (kFusedQ) {
            q_scale = quantize_q_tile<D>(smem, fp8.q + (size_t)work.head * S * D, work.q0, S);
        } else {
            q_scale = __ldg(&fp8.q_scale[head_blocks + work.q0 / BLOCK_ROWS]);
            mbarrier_wait<true>(smem.q_full, 0);
        }
        const TileScales scales = {fp8.k_scale + head_blocks, fp8.v_scale + head_blocks,
                                   scale * 1.4426950408889634f * q_scale};
        const float v_scale =
            kOverlap ? attend_overlapped<D>(o_acc, row_max, row_sum, smem, scales, work.n_tiles, S, causal, first_query,
                                            consumer, g, t)
                     : attend_in_order<D>(o_acc, row_max, row_sum, smem, scales, work.n_tiles, S, causal, first_query,
                                          consumer, g, t);
        store_o<D>(o_acc, row_sum, v_scale, o + (size_t)work.head * S * D, S, first_query, g, t);
    }
#else
    (void)q_map, (void)k_map, (void)vt_map, (void)fp8, (void)o, (void)S, (void)scale, (void)causal;
#endif
}

template <int D>
static cudaError_t launch_forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    Fp8Tensors fp8 = fp8_tensors(s, t->forward_scratch);
    fp8.q = (const __half *)t->q;
    cudaError_t err = launch_quantize<D>(s, t, fp8, stream);
    const int heads_total = s->batch * s->heads;
    // Boxes of a tile's rows x D bytes, and D rows x 128 keys; with kFusedQ nothing reads q_map.
    CUtensorMap q_map, k_map, vt_map;
    if (err == cudaSuccess) err = make_tensor_map_bytes(&q_map, fp8.q8, heads_total, s->seq, D, BLOCK_ROWS, D);
    if (err == cudaSuccess) err = make_tensor_map_bytes(&k_map, fp8.k8, heads_total, s->seq, D, KEY_TILE, D);
    if (err == cudaSuccess)  // Vᵀ, or with kVInKernel V's rows as K's
        err = kVInKernel ? make_tensor_map_bytes(&vt_map, fp8.vt8, heads_total, s->seq, D, KEY_TILE, D)
                         : make_tensor_map_bytes(&vt_map, fp8.vt8, heads_total, D, fp8.s_pad, D, KEY_TILE);
    if (err == cudaSuccess) err = allow_dynamic_smem(fp8_forward<D>, Layout<D>::bytes);
    if (err != cudaSuccess) return err;
    const int blocks = ceil_div(s->seq, BLOCK_ROWS) * heads_total;
    fp8_forward<D><<<blocks, THREADS, Layout<D>::bytes, stream>>>(q_map, k_map, vt_map, fp8, (__half *)t->o, s->seq,
                                                                  1.0f / sqrtf((float)s->dim), s->causal);
    return cudaGetLastError();
}

static cudaError_t forward(const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    return s->dim == 128 ? launch_forward<128>(s, t, stream) : launch_forward<64>(s, t, stream);
}

extern "C" const attn_stage STAGE = {
    .name = "11_fp8",
    .idea = "Q, K and V quantized to e4m3 (a scale per 128 rows, Q and K rotated by a Hadamard transform), "
        "both products on FP8 wgmma, in stage 09's frame",
    .unsupported = unsupported_head_dim,
    .workspace_bytes = no_workspace,
    .shared_bytes = layout_shared_bytes<Layout>,
    .forward = forward,
    .forward_scratch_bytes = forward_scratch_bytes,
    .needs_sm90a = 1,
    .fp8 = kMethod,
};
