// mma_ptx.cuh - thin wrappers over the PTX instructions stage 07 on uses (sm_80 and newer):
// ldmatrix, mma.sync m16n8k16, cp.async, mbarrier, float2 atomics; the XOR swizzle of
// shared-memory tiles and the fragment loads from swizzled tiles.
//
// Register layouts of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4:
//   A (16x16 fp16, row-major), 4 x .b32:  a0 = A[g][2t..2t+1]    a1 = A[g+8][2t..2t+1]
//                                         a2 = A[g][2t+8..2t+9]  a3 = A[g+8][2t+8..2t+9]
//   B (16x8 fp16, "col-major"), 2 x .b32: b0 = B[2t..2t+1][g]    b1 = B[2t+8..2t+9][g]
//   C, D (16x8 fp32), 4 x .f32:           c0,c1 = C[g][2t..2t+1] c2,c3 = C[g+8][2t..2t+1]
// Unlike WMMA's fragments, every thread knows which rows it holds: g and g + 8.
#ifndef FLASH_STAGES_MMA_PTX_CUH
#define FLASH_STAGES_MMA_PTX_CUH

#include <cuda_fp16.h>
#include <stdint.h>

#include "elem.cuh"

__device__ inline uint32_t smem_address(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// Four 8x8 fp16 matrices from shared memory. Lane i gives the address of row i % 8 of matrix
// i / 8 (16 bytes, 16-byte aligned); register j receives matrix j, lane l holding its row l / 4,
// columns 2 (l % 4) and 2 (l % 4) + 1.
__device__ inline void ldmatrix_x4_at(uint32_t r[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
template <typename Elem>
__device__ inline void ldmatrix_x4(uint32_t r[4], const Elem *row_address) {
    ldmatrix_x4_at(r, smem_address(row_address));
}

// The same, each 8x8 matrix transposed on the way: lane l holds its column l / 4, rows
// 2 (l % 4) and 2 (l % 4) + 1. This reads a B operand from a row-major [k][n] tile (V).
__device__ inline void ldmatrix_x4_trans_at(uint32_t r[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
template <typename Elem>
__device__ inline void ldmatrix_x4_trans(uint32_t r[4], const Elem *row_address) {
    ldmatrix_x4_trans_at(r, smem_address(row_address));
}

// 4 bytes (two elements packed in a register) to shared memory at a shared-window address.
__device__ inline void st_shared_b32(uint32_t address, uint32_t value) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(value) : "memory");
}

// D = A B + D for one 16x8x16 tile: fp16 or bf16 inputs, fp32 accumulation, in place. The type is
// the instruction's (a macro, so that both share one text, as wgmma's shapes do).
#define MMA_M16N8K16(TYPE)                                                            \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "       \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename Elem>
__device__ inline void mma_m16n8k16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if constexpr (is_bf16<Elem>) MMA_M16N8K16("bf16");
    else MMA_M16N8K16("f16");
}

// 16 bytes global -> shared without passing through registers. With `valid` false the 16 bytes
// are zero-filled and nothing is read (src-size 0), which masks tail rows for free.
__device__ inline void cp_async_16(void *smem_dst, const void *global_src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(smem_address(smem_dst)), "l"(global_src), "r"(valid ? 16 : 0));
}
// 4 bytes global -> shared (a float of a row vector such as the log-sum-exp); zero-filled when
// `valid` is false. Copies under 16 bytes go through L1 (.ca).
__device__ inline void cp_async_4(void *smem_dst, const void *global_src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :
                 : "r"(smem_address(smem_dst)), "l"(global_src), "r"(valid ? 4 : 0));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// XOR swizzle of an fp16 tile with D columns (D a multiple of 64), no padding: the 16-byte chunk
// c of row r is stored at chunk c ^ (r % 8). The 8 rows that one ldmatrix (or one column of
// cp.async writes) touches at the same logical chunk land in 8 different 16-byte bank groups.
// Returns the offset in halves of element (row, col), col a multiple of 8 for 16-byte accesses.
// -DSWIZZLE=0 builds the plain row-major layout instead: the no_swizzle ablation of stages 07
// and 08, which measures what the swizzle is worth.
#ifndef SWIZZLE
#define SWIZZLE 1
#endif
constexpr bool kSwizzle = SWIZZLE;
template <int D>
__device__ inline int swizzle(int row, int col) {
    if constexpr (kSwizzle)
        return row * D + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
    else
        return row * D + col;
}

// Start copying rows [row0, row0 + ROWS) of one head's [S, D] fp16 matrix into a swizzled tile,
// 16 bytes per cp.async, all threads of the block taking part; rows past S are zero-filled.
// The caller commits and waits. With THREADS (the block's size) given, each thread copies the
// same 16-byte column chunk of rows THREADS / (D / 8) apart, a multiple of 8: the swizzle and
// both addresses are computed once, and each further copy is a constant offset away, where the
// general loop spends some 28 instructions of index arithmetic per copy.
template <int ROWS, int D, int THREADS = 0, typename Elem>
__device__ inline void cp_async_tile(Elem *tile, const Elem *head, int row0, int S) {
    constexpr int CHUNKS = D / 8;
    if constexpr (THREADS > 0) {
        constexpr int STEP = THREADS / CHUNKS;  // rows between one thread's copies
        static_assert(THREADS % (8 * CHUNKS) == 0 && (ROWS * CHUNKS) % THREADS == 0, "whole rows, 8 apart");
        const int r = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * 8;
        Elem *dst = tile + swizzle<D>(r, c);
        const Elem *src = head + (size_t)(row0 + r) * D + c;
#pragma unroll
        for (int i = 0; i < ROWS / STEP; i++) {
            const bool valid = row0 + r + i * STEP < S;
            cp_async_16(dst + i * STEP * D, valid ? src + (size_t)i * STEP * D : head, valid);
        }
    } else {
        for (int i = threadIdx.x; i < ROWS * CHUNKS; i += blockDim.x) {
            const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
            const bool valid = row0 + r < S;
            cp_async_16(tile + swizzle<D>(r, c), head + (size_t)(valid ? row0 + r : 0) * D + c, valid);
        }
    }
}

// Named barriers (bar.sync / bar.arrive with an id, 1..15; id 0 is __syncthreads): `threads`
// counts every thread that takes part, those that wait (sync) and those that only signal
// (arrive). Used to order groups of warps against each other without stopping the whole block.
__device__ inline void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ inline void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// 2^x from the special-function unit alone (ex2.approx.ftz: relative error about 2^-22, results
// below 2^-126 flushed to zero). exp2f adds a range test and two multiplies to every call to keep
// those tiny results, which an fp16 P or dS cannot hold anyway.
__device__ inline float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Swizzled addresses without the swizzle arithmetic in the inner loops. A lane's ldmatrix address
// in a swizzled tile is computed once; the same lane's address `rows` rows (a multiple of 8) and
// `cols` columns (a multiple of 16) further is then one XOR and one add away: rows that are a
// multiple of 8 apart have the same row % 8, and a 16-column step changes only chunk bits that
// the lane's own chunk (0 or 1 of its pair) does not use, so chunk ^ (row % 8) becomes
// (chunk ^ (row % 8)) ^ (cols / 8). The add folds into ldmatrix's immediate offset. The tile must
// start at a multiple of its row pitch (W halves), as every tile in these layouts does.
template <int W>
__device__ inline uint32_t swizzled_step(uint32_t address, int rows, int cols) {
    if constexpr (kSwizzle)
        return (address ^ (uint32_t)(cols * 2)) + rows * W * 2;
    else
        return address + (rows * W + cols) * 2;
}

// The lane addresses of the four fragment loads, in a swizzled row-major [rows][W] tile.
// A operand: the 16 x 16 block at (row0, col0). Lanes 0-7 address rows 0-7 at col0, 8-15 rows
// 8-15 at col0, 16-23 rows 0-7 at col0 + 8, 24-31 rows 8-15 at col0 + 8: a0..a3 in mma's order.
template <int W, typename Elem>
__device__ inline uint32_t a_frag_address(const Elem *tile, int row0, int col0, int lane) {
    return smem_address(tile + swizzle<W>(row0 + lane % 8 + 8 * (lane / 8 % 2), col0 + 8 * (lane / 16)));
}
// A operand Aᵀ (16 x 16 at (m0, k0)) from a tile that stores A transposed, [k][m] (ldmatrix.trans
// hands lane l column l / 4 of each 8 x 8 matrix): matrix j is rows k0 + 8 (j / 2), columns
// m0 + 8 (j % 2).
template <int W, typename Elem>
__device__ inline uint32_t a_frag_trans_address(const Elem *tile, int m0, int k0, int lane) {
    return smem_address(tile + swizzle<W>(k0 + lane % 8 + 8 * (lane / 16), m0 + 8 * (lane / 8 % 2)));
}
// B operands of two neighbouring n8 blocks (n0..n0+7 in b[0], b[1]; n0+8..n0+15 in b[2], b[3]),
// k = k0..k0+15, when B's columns are the tile's rows: B = Tᵀ, as K is for S = Q Kᵀ.
template <int W, typename Elem>
__device__ inline uint32_t b_frags_of_rows_address(const Elem *tile, int n0, int k0, int lane) {
    return smem_address(tile + swizzle<W>(n0 + lane % 8 + 8 * (lane / 16), k0 + 8 * (lane / 8 % 2)));
}
// The same when B's rows are the tile's rows (B = T, as V is for O = P V): .trans reads them.
template <int W, typename Elem>
__device__ inline uint32_t b_frags_trans_address(const Elem *tile, int k0, int n0, int lane) {
    return smem_address(tile + swizzle<W>(k0 + lane % 8 + 8 * (lane / 8 % 2), n0 + 8 * (lane / 16)));
}

// Fragment loads from swizzled row-major [rows][D] tiles, for one warp (lane = its lane id).
template <int D, typename Elem>
__device__ inline void load_a_frag(uint32_t a[4], const Elem *tile, int row0, int col0, int lane) {
    ldmatrix_x4_at(a, a_frag_address<D>(tile, row0, col0, lane));
}
template <int D, typename Elem>
__device__ inline void load_b_frags_of_rows(uint32_t b[4], const Elem *tile, int n0, int k0, int lane) {
    ldmatrix_x4_at(b, b_frags_of_rows_address<D>(tile, n0, k0, lane));
}
template <int D, typename Elem>
__device__ inline void load_b_frags_trans(uint32_t b[4], const Elem *tile, int k0, int n0, int lane) {
    ldmatrix_x4_trans_at(b, b_frags_trans_address<D>(tile, k0, n0, lane));
}

// *dst += v, 2 floats at an 8-byte aligned address: one operation on sm_90 (red.global.add.v2.f32),
// two atomicAdds before (or with kVector false). A warp adding the pairs of an mma accumulator
// fills whole 32-byte sectors: 8 rows x 4 lanes x 2 floats.
template <bool kVector>
__device__ inline void atomic_add_float2(float *dst, float2 v) {
#if __CUDA_ARCH__ >= 900
    if constexpr (kVector) {
        asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(v.x), "f"(v.y) : "memory");
        return;
    }
#endif
    atomicAdd(dst, v.x), atomicAdd(dst + 1, v.y);
}

// mbarrier (sm_80+): a shared-memory barrier object that counts arrivals and flips a phase bit
// each time the expected count is reached. Producer and consumer warps hand ring slots over
// with two of them per slot, without stopping the whole block as __syncthreads() does.
__device__ inline void mbarrier_init(uint64_t *bar, unsigned expected_arrivals) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(expected_arrivals));
}
__device__ inline void mbarrier_arrive(uint64_t *bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(smem_address(bar))
                 : "memory");
}
// One arrival for the whole warp, once all of its lanes have got here: for a barrier that counts
// warps (a consumer warp done with a ring slot).
__device__ inline void mbarrier_arrive_warp(uint64_t *bar) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(bar);
}
// The arrival of this thread happens when all of its cp.async copies issued so far have landed.
// .noinc: the arrival counts against the barrier's expected count (one per producer thread).
__device__ inline void cp_async_mbarrier_arrive(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
// Wait until the phase with parity `parity` has completed. SUSPEND = false polls with test_wait
// (sm_80+). SUSPEND = true uses try_wait (sm_90+): a thread whose phase is not complete yet may be
// suspended by the hardware until it completes (or a time limit passes) instead of spinning, so a
// waiting warp leaves its issue slots to the others.
template <bool SUSPEND = false>
__device__ inline void mbarrier_wait(uint64_t *bar, unsigned parity) {
    uint32_t done = 0;
    while (!done) {
        if constexpr (SUSPEND)
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(smem_address(bar)), "r"(parity)
                         : "memory");
        else
            asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(smem_address(bar)), "r"(parity)
                         : "memory");
    }
}

// The slot and phase arithmetic of every mbarrier ring in the course, written once. A ring has
// SLOTS buffers, each with a `full` mbarrier (the item in it has landed) and an `empty` one (its
// readers are done with it). Item n, counted from 0 over the ring's whole life, goes to slot
// n % SLOTS as that slot's fill number n / SLOTS, whose landing completes phase n / SLOTS of
// full[slot]; a wait names a phase by its parity (docs/primer.md#mbarrier-phases).
//
// Producer, before writing item n: wait until the readers have released the slot's previous fill,
// phase n / SLOTS - 1 of empty[slot] (a slot's first fill finds it free). Returns the slot.
template <int SLOTS, bool SUSPEND = false>
__device__ inline int ring_wait_empty(uint64_t *empty, int n) {
    const int slot = n % SLOTS;
    if (n >= SLOTS) mbarrier_wait<SUSPEND>(&empty[slot], (n / SLOTS - 1) & 1);
    return slot;
}
// Reader, before reading item n: wait until it has landed, phase n / SLOTS of full[slot].
// Returns the slot.
template <int SLOTS, bool SUSPEND = false>
__device__ inline int ring_wait_full(uint64_t *full, int n) {
    const int slot = n % SLOTS;
    mbarrier_wait<SUSPEND>(&full[slot], (n / SLOTS) & 1);
    return slot;
}

#endif
