// wgmma_ptx.cuh - wrappers over the Hopper (sm_90a) instructions stages 09 to 11 use: wgmma (warpgroup
// matrix multiply-accumulate, operands read from shared memory by the tensor cores), the copy
// engine's tiled loads (TMA, cp.async.bulk.tensor) that complete on an mbarrier, its tiled stores
// and bulk reductions, setmaxnreg, the dependent-launch controls (griddepcontrol), and the
// release/acquire counters by which one kernel's blocks hand data to the next kernel's.
//
// A warpgroup is 4 consecutive warps (128 threads, the first warp index a multiple of 4). One
// wgmma.m64nNk16 computes a 64 x N tile with K = 16; warp w of the group owns rows 16w..16w+15 and
// holds them in exactly the mma.sync C layout (common/mma_ptx.cuh): for each n8 block j,
// d[4j], d[4j+1] = row g, columns 8j+2t, 8j+2t+1 and d[4j+2], d[4j+3] = row g+8 (g = lane / 4,
// t = lane % 4). An A operand from registers uses mma.sync's A layout, so stage 07's S -> P
// packing carries over unchanged.
//
// Shared-memory operands are described by a 64-bit descriptor, not by per-lane addresses. Every
// tile here uses the 128-byte swizzle, which is also what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B: a tile is stored as slabs of 64 two-byte (fp16 or bf16) columns (128 bytes a row),
// and inside a slab the 16-byte chunk c of row r sits at chunk c ^ (r % 8) - stage 07's swizzle,
// with the row pitch fixed at 128 bytes. 8 rows form a 1024-byte atom; tiles start 1024-aligned.
//   K-major operand (rows of the tile are M or N, the 64 contiguous columns are K): the k-th
//     16-column step starts 32 k bytes into the slab; atoms of 8 rows are 1024 bytes apart (SBO).
//   N-major operand (rows of the tile are K, columns are N, as V is for O = P V): a 16-row k step
//     is two atoms (SBO = 1024 between them); 64-column slabs along N are LBO bytes apart.
#ifndef FLASH_STAGES_WGMMA_PTX_CUH
#define FLASH_STAGES_WGMMA_PTX_CUH

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "attn.h"
#include "kernel_common.cuh"
#include "mma_ptx.cuh"

// True in the device pass that targets sm_90a; the other passes (sm_80 and friends) compile the
// Hopper kernels to an empty body, and the host never launches them there.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_STAGES_SM90A 1
#else
#define FLASH_STAGES_SM90A 0
#endif

// The first 1024-byte-aligned byte of a block's dynamic shared memory (the 128-byte swizzle's
// atom). The offset is added to the __shared__ pointer itself, not computed on its integer
// value: a pointer rebuilt from an integer loses its address space, and every load and store
// through it becomes a generic one (LD.E / ST.E), slower than a shared one (LDS / STS).
__device__ inline unsigned char *smem_align_1024(unsigned char *smem_raw) {
    return (unsigned char *)__builtin_assume_aligned(smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023), 1024);
}

// Descriptor of a 128-byte-swizzled shared-memory operand starting at `tile` (16-byte aligned;
// its atom 1024-aligned). Fields: start address >> 4 (bits 0-13), leading byte offset >> 4
// (16-29), stride byte offset >> 4 (32-45), layout 1 = 128-byte swizzle (62-63).
__device__ inline uint64_t smem_desc_sw128(const void *tile, uint32_t leading_bytes, uint32_t stride_bytes) {
    const uint64_t address = smem_address(tile);
    return ((address & 0x3FFFF) >> 4) | ((uint64_t)((leading_bytes >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// Before the first wgmma of a batch (orders earlier register and shared-memory writes before the
// tensor cores read them); after issuing, commit the batch as one group; wait until at most N
// groups are still running.
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// wgmma writes its accumulators asynchronously, but the compiler sees them written when the
// instruction is issued. This empty asm, placed after wgmma_wait, keeps every later use of `x`
// (and every earlier write) on its side of the wait.
__device__ inline void fence_operand(float &x) { asm volatile("" : "+f"(x)::"memory"); }

// fence_operand over an N-register accumulator.
template <int N>
__device__ inline void fence_operands(float *acc) {
#pragma unroll
    for (int i = 0; i < N; i++) fence_operand(acc[i]);
}

// Makes this thread's mbarrier initializations visible to the copy engine (TMA) and the cluster.
__device__ inline void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// The barriers of a producer/consumer ring fed by TMA, set up by thread 0 before the block
// syncs: full[s] completes on the producer's expect_tx arrival plus the bytes; empty[s] on one
// arrival per consumer warp; `once` guards the tiles loaded a single time (one arrival + bytes).
__device__ inline void init_tma_ring(uint64_t *full, uint64_t *empty, int slots, int consumer_warps,
                                     uint64_t *once) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < slots; s++) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], consumer_warps);
        }
        mbarrier_init(once, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
}

// Orders this thread's earlier generic-proxy writes to shared memory (st.shared) before later
// async-proxy reads of it (wgmma, TMA): a tile written by the threads themselves needs it, then a
// barrier, before a wgmma reads the tile.
__device__ inline void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// In a kernel started by a dependent launch (launch_dependent, kernel_common.cuh): waits until the
// kernel before it in the stream has finished and its writes are visible. Everything before this
// call may overlap that kernel's end, so it must not read what that kernel writes, nor write what
// that kernel reads. Without a dependent launch (and before sm_90, where there is none) it
// returns at once.
__device__ inline void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the kernel after this one in the stream, if started by a dependent launch, launch its
// blocks once every block of this kernel has executed this (or exited), instead of once they have
// all exited. That kernel must then not rely on grid_dependency_wait's ordering for what it reads
// before calling it; it synchronizes by other means. Nor is the kernel before this one ordered
// before it, unless this block executes it after its own grid_dependency_wait.
__device__ inline void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Orders the global-memory writes of this thread's completed bulk operations (bulk_wait) before
// its later generic-proxy accesses, such as a release that tells other blocks they are done.
__device__ inline void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// A counter in global memory that blocks of different kernels use to hand data over: add with
// release (the writer's earlier writes are visible to whoever sees the new value), read with
// acquire (what the writer wrote before is visible to this thread's later reads).
__device__ inline void counter_add_release(int *counter, int value) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "r"(value) : "memory");
}
__device__ inline int counter_load_acquire(const int *counter) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
    return value;
}
// The GPU's clock in nanoseconds (%globaltimer), for a bound on a wait that should never be long.
__device__ inline unsigned long long globaltimer_ns() {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
    return ns;
}

// Give registers back (producer) or take them (consumers); a whole warpgroup executes it.
template <int N>
__device__ inline void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ inline void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Arrive on `bar` and tell it to also wait for `bytes` of copy-engine writes (its transaction
// count); the phase completes when both the arrivals and the bytes are in.
__device__ inline void mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
                 : "memory");
}
// Start fetching a tensor map (a kernel parameter) into the copy engine's descriptor cache.
__device__ inline void tma_prefetch_descriptor(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
// One box of a 3-D tensor map (coordinates innermost first, in elements) into shared memory;
// elements outside the tensor arrive as zeros. Completion counts its bytes on `bar`.
__device__ inline void tma_load_3d(void *smem_dst, const CUtensorMap *map, int x, int y, int z, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
            "r"(smem_address(smem_dst)),
        "l"(map), "r"(x), "r"(y), "r"(z), "r"(smem_address(bar))
        : "memory");
}

// The reverse: one box of shared memory, laid out as the tensor map's box (in its swizzle, from a
// 1024-byte-aligned start), to the tensor at coordinates (x, y, z); the parts of the box outside
// the tensor are not written. The smem_src writes need fence_proxy_async_shared and a barrier
// first; completion is tracked like the bulk reductions' below (bulk_commit, bulk_wait_read).
__device__ inline void tma_store_3d(const CUtensorMap *map, const void *smem_src, int x, int y, int z) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(map),
                 "r"(smem_address(smem_src)), "r"(x), "r"(y), "r"(z)
                 : "memory");
}

// The same for the 4-D tensor maps of make_tensor_map (coordinates: column, row, head, batch);
// head_coords splits a kernel's flat head index b * heads + h into the last two.
struct HeadCoords {
    int head, batch;
};
__device__ inline HeadCoords head_coords(int head_index, int heads) { return {head_index % heads, head_index / heads}; }
__device__ inline void tma_load_4d(void *smem_dst, const CUtensorMap *map, int x, int y, int z, int w, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::
            "r"(smem_address(smem_dst)),
        "l"(map), "r"(x), "r"(y), "r"(z), "r"(w), "r"(smem_address(bar))
        : "memory");
}
__device__ inline void tma_store_4d(const CUtensorMap *map, const void *smem_src, int x, int y, int z, int w) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(map),
                 "r"(smem_address(smem_src)), "r"(x), "r"(y), "r"(z), "r"(w)
                 : "memory");
}

// global_dst[i] += smem_src[i] for `bytes` (a multiple of 16, both addresses 16-byte aligned) of
// floats, done by the copy engine and the L2 as one bulk operation instead of one atomic per
// element. The smem_src writes need fence_proxy_async_shared and a barrier first. Completion is
// tracked per thread: bulk_commit closes a group of this thread's operations, bulk_wait_read<N>
// waits until at most N groups may still read their shared memory, bulk_wait<N> until at most N
// groups are unfinished.
__device__ inline void bulk_reduce_add_f32(float *global_dst, const float *smem_src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(global_dst),
                 "r"(smem_address(smem_src)), "r"(bytes)
                 : "memory");
}
// global_dst[0..3] += v, one reduction in the L2 for four floats (sm_90; global_dst 16-byte
// aligned); relaxed, nothing returned: the sums are complete at the end of the kernel.
__device__ inline void red_add_v4_f32(float *global_dst, float4 v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(global_dst), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w)
                 : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ inline void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
template <int N>
__device__ inline void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

// A 64 x D wgmma accumulator, row r of this thread's two scaled by factor[r], as Elem into a
// staging tile [D/64][TILE_ROWS][64] in the 128-byte swizzle that a TMA store reads:
// acc[4j + 2r], acc[4j + 2r + 1] are row g + 8r of the warp's 16 (from `row0` in the tile),
// columns 8j + 2t, +1, that is chunk j % 8 of 64-column slab j / 8. The chunk goes to
// c ^ (row % 8) = c ^ g; one instruction's 32 lanes hit 32 different banks.
template <int D, int TILE_ROWS, typename Elem>
__device__ __forceinline__ void store_acc_tile(Elem *tile, int row0, const float (&acc)[D / 2],
                                               const float (&factor)[2], int g, int t) {
    const uint32_t row_address = smem_address(tile + (row0 + g) * 64) + 4 * t;
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint32_t address = row_address + (j / 8) * TILE_ROWS * 64 * ELEM_BYTES +
                                     8 * r * 64 * ELEM_BYTES + (((j % 8) ^ g) << 4);
            st_shared_b32(address, pack2<Elem>(acc[4 * j + 2 * r] * factor[r], acc[4 * j + 2 * r + 1] * factor[r]));
        }
}

// The wgmma shapes stages 09 and 10 need, for fp16 or bf16 operands (Elem), written out (one
// operand per accumulator register; a macro per shape, so that the two types share one text). scale_d = 0
// overwrites D (the first k step), 1 accumulates. The transposes are the instruction's immediates:
//   TRANS_A (shared-memory A only) = 0: A K-major (its rows are M, as Q's are for S = Q Kᵀ);
//     1: M-major (A's columns are the tile's rows, as dS's are in a stored dSᵀ).
//   TRANS_B = 0: B K-major (B's columns are the tile's rows, as K is for S = Q Kᵀ);
//     1: N-major (B's rows are the tile's rows, as V's are for O = P V).
// The accumulator of an m64nN wgmma as asm operands, one float register each ("+f"(d[i]), i < N / 2),
// and their names in the instruction (%0 .. %(N / 2 - 1)): the operand list every shape below starts
// with.
#define WGMMA_D16                                                                                        \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),      \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WGMMA_D32                                                                              \
    WGMMA_D16,                                                                                 \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), \
    "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
    "+f"(d[30]), "+f"(d[31])
#define WGMMA_D64                                                                              \
    WGMMA_D32,                                                                                 \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
    "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), \
    "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), \
    "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
    "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_R32 WGMMA_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_R64                                                                                  \
    WGMMA_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
              ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// D[64 x N] (+)= A B, A and B both from shared memory (descriptors).
#define WGMMA_M64N32K16_SS(TYPE)                                              \
    asm volatile(                                                             \
        "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                        \
        " wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "      \
        "{" WGMMA_R16 "}, %16, %17, p, 1, 1, %19, %20;\n}\n"                  \
        : WGMMA_D16                                                           \
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
template <typename Elem, int TRANS_A, int TRANS_B>
__device__ inline void wgmma_m64n32k16_ss(float d[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (is_bf16<Elem>) WGMMA_M64N32K16_SS("bf16");
    else WGMMA_M64N32K16_SS("f16");
}

#define WGMMA_M64N64K16_SS(TYPE)                                              \
    asm volatile(                                                             \
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"                        \
        " wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "      \
        "{" WGMMA_R32 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"                  \
        : WGMMA_D32                                                           \
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
template <typename Elem, int TRANS_A, int TRANS_B>
__device__ inline void wgmma_m64n64k16_ss(float d[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (is_bf16<Elem>) WGMMA_M64N64K16_SS("bf16");
    else WGMMA_M64N64K16_SS("f16");
}

#define WGMMA_M64N128K16_SS(TYPE)                                             \
    asm volatile(                                                             \
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                        \
        " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "     \
        "{" WGMMA_R64 "}, %64, %65, p, 1, 1, %67, %68;\n}\n"                  \
        : WGMMA_D64                                                           \
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
template <typename Elem, int TRANS_A, int TRANS_B>
__device__ inline void wgmma_m64n128k16_ss(float d[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (is_bf16<Elem>) WGMMA_M64N128K16_SS("bf16");
    else WGMMA_M64N128K16_SS("f16");
}

// D[64 x N] (+)= A B, A (fp16 or bf16) from registers in mma.sync's A layout (each warp its 16 rows), B
// from shared memory.
#define WGMMA_M64N64K16_RS(TYPE)                                                               \
    asm volatile(                                                                              \
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                         \
        " wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                       \
        "{" WGMMA_R32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                       \
        : WGMMA_D32                                                                            \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B))
template <typename Elem, int TRANS_B>
__device__ inline void wgmma_m64n64k16_rs(float d[32], const uint32_t a[4], uint64_t desc_b, int scale_d) {
    if constexpr (is_bf16<Elem>) WGMMA_M64N64K16_RS("bf16");
    else WGMMA_M64N64K16_RS("f16");
}

#define WGMMA_M64N128K16_RS(TYPE)                                                              \
    asm volatile(                                                                              \
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                         \
        " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                      \
        "{" WGMMA_R64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                       \
        : WGMMA_D64                                                                            \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B))
template <typename Elem, int TRANS_B>
__device__ inline void wgmma_m64n128k16_rs(float d[64], const uint32_t a[4], uint64_t desc_b, int scale_d) {
    if constexpr (is_bf16<Elem>) WGMMA_M64N128K16_RS("bf16");
    else WGMMA_M64N128K16_RS("f16");
}

// The same, N picked at compile time.
template <typename Elem, int N, int TRANS_A = 0, int TRANS_B = 0>
__device__ inline void wgmma_m64k16_ss(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (N == 32)
        wgmma_m64n32k16_ss<Elem, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else if constexpr (N == 64)
        wgmma_m64n64k16_ss<Elem, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else
        wgmma_m64n128k16_ss<Elem, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
}
template <typename Elem, int N, int TRANS_B>
__device__ inline void wgmma_m64k16_rs(float *d, const uint32_t a[4], uint64_t desc_b, int scale_d) {
    if constexpr (N == 64)
        wgmma_m64n64k16_rs<Elem, TRANS_B>(d, a, desc_b, scale_d);
    else
        wgmma_m64n128k16_rs<Elem, TRANS_B>(d, a, desc_b, scale_d);
}

// Descriptors of the k-th 16-wide step of an operand kept in a [D/64][ROWS][64] swizzled tile.
// K-major (the tile's columns are K; rows row0.. are M or N, row0 a multiple of 8). A 16-wide step
// lies inside one 128-byte row, so the leading byte offset is ignored (16, encoded 1, as CUTLASS
// writes it); the stride byte offset, 1024, steps from one 8-row atom to the next.
template <int ROWS, typename Elem>
__device__ inline uint64_t desc_k_major(const Elem *tile, int row0, int kk) {
    return smem_desc_sw128(tile + (kk / 4) * ROWS * 64 + row0 * 64 + (kk % 4) * 16, 16, 1024);
}
// N-major (the tile's rows are K, its columns N): 16 rows further per step, slabs a tile apart.
template <int ROWS, typename Elem>
__device__ inline uint64_t desc_n_major(const Elem *tile, int kk) {
    return smem_desc_sw128(tile + kk * 16 * 64, ROWS * 64 * ELEM_BYTES, 1024);
}

// A 64 x N fp32 accumulator as the fp16 or bf16 A operands of N/16 k steps (the wgmma A layout from
// registers is mma.sync's, so accumulator blocks 2k and 2k + 1 make k step k).
template <typename Elem, int N>
__device__ inline void pack_a_frags(uint32_t frag[N / 16][4], const float *acc) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) frag[kk][i] = pack2<Elem>(acc[8 * kk + 2 * i], acc[8 * kk + 2 * i + 1]);
}

// FP8 (e4m3) operands, stage 11. An e4m3 wgmma takes K = 32 per instruction and both operands
// K-major (the instruction has no transpose for 8-bit types). A row of 128 one-byte values is one
// 128-byte swizzled row; a row of 64 uses the 64-byte swizzle (atoms of 8 rows x 64 bytes, 512
// bytes apart), which TMA writes with CU_TENSOR_MAP_SWIZZLE_64B. The k-th 32-wide step starts 32 k
// bytes into the row, as fp16's 16-wide steps do. As in desc_k_major, the leading byte offset is
// ignored (1 << 16: 16 bytes), and the stride byte offset is one atom of 8 rows (8 ROW_BYTES).
template <int ROW_BYTES>
__device__ inline uint64_t desc_k_major_fp8(const uint8_t *tile, int row0, int kk) {
    static_assert(ROW_BYTES == 64 || ROW_BYTES == 128, "one 64- or 128-byte swizzled row");
    const uint64_t address = smem_address(tile + row0 * ROW_BYTES + kk * 32);
    const uint64_t layout = ROW_BYTES == 128 ? 1 : 2;  // 128-byte or 64-byte swizzle
    return ((address & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)((8 * ROW_BYTES) >> 4) << 32) | (layout << 62);
}

// The offset of byte `byte` of row `row` in a tile of ROW_BYTES-byte rows (128 or 64) as TMA
// writes it with the swizzle of that width, for threads that read or write such a tile themselves:
// a row's 16-byte chunks are permuted by XOR with the row's phase in its 1024-byte atom (8 rows of
// 128 bytes) or 512-byte atom (8 rows of 64 bytes, two rows a phase).
template <int ROW_BYTES>
__host__ __device__ inline int swizzled_byte(int row, int byte) {
    static_assert(ROW_BYTES == 64 || ROW_BYTES == 128, "a 64- or 128-byte swizzled row");
    const int phase = ROW_BYTES == 128 ? row % 8 : row / 2 % 4;
    return row * ROW_BYTES + ((byte / 16) ^ phase) * 16 + byte % 16;
}

// Bytes of x (0-3) and y (4-7) picked by the four nibbles of `selector`, the lowest nibble for the
// lowest byte: PTX prmt (__byte_perm), and the same on the host for tests.
__host__ __device__ inline uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, selector);
#else
    const uint64_t bytes = (uint64_t)y << 32 | x;
    uint32_t picked = 0;
    for (int i = 0; i < 4; i++) picked |= (uint32_t)(bytes >> (8 * ((selector >> (4 * i)) & 7)) & 0xff) << (8 * i);
    return picked;
#endif
}

// D[64 x 128] (+)= A B in e4m3, both from shared memory: S = Q Kᵀ of a 128-key tile.
__device__ inline void wgmma_m64n128k32_e4m3_ss(float d[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WGMMA_R64 "}, %64, %65, p, 1, 1;\n}\n"
        : WGMMA_D64
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x N] (+)= A B in e4m3, A from registers (four .b32 of four e4m3: a[0] row g, columns
// 4t..4t+3 of the 32; a[1] row g + 8, the same; a[2], a[3] columns 16 + 4t.. of rows g, g + 8 -
// mma.sync m16n8k32's 8-bit A layout), B from shared memory: O += P V, N = D.
#define WGMMA_M64N64K32_E4M3_RS                                                                  \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                   \
                 " wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" WGMMA_R32 "}, "        \
                 "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"                                        \
                 : WGMMA_D32                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
#define WGMMA_M64N128K32_E4M3_RS                                                                 \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                   \
                 " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WGMMA_R64 "}, "       \
                 "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"                                        \
                 : WGMMA_D64                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
template <int N>
__device__ inline void wgmma_m64k32_e4m3_rs(float *d, const uint32_t a[4], uint64_t desc_b, int scale_d) {
    if constexpr (N == 64) WGMMA_M64N64K32_E4M3_RS;
    else WGMMA_M64N128K32_E4M3_RS;
}

// Four floats as four e4m3 bytes, x0 in the lowest (round to nearest even, saturating at +-448).
// (sm_89 and newer; the other device passes compile it to 0, and never run it.)
__device__ inline uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
#if __CUDA_ARCH__ >= 890
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));  // the first source: upper byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return (uint32_t)lo | ((uint32_t)hi << 16);
#else
    (void)x0, (void)x1, (void)x2, (void)x3;
    return 0;
#endif
}

// Host: the driver's cuTensorMapEncodeTiled, found through the runtime, so the programs need no -lcuda.
static inline cudaError_t tensor_map_encoder(PFN_cuTensorMapEncodeTiled_v12000 *encode_out) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
    if (!encode) {
        cudaDriverEntryPointQueryResult found;
        cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void **)&encode, 12000,
                                                           cudaEnableDefault, &found);
        if (err != cudaSuccess) return err;
        if (found != cudaDriverEntryPointSuccess || !encode) return cudaErrorNotSupported;
    }
    *encode_out = encode;
    return cudaSuccess;
}

// Host: a tensor map of `rank` dimensions (dims and byte strides innermost first) of `dtype`
// (attn_dtype: fp16 or bf16), read or written in boxes of `box_rows` rows x 64 columns (one
// 128-byte swizzled slab).
static inline cudaError_t encode_tensor_map(CUtensorMap *map, const void *tensor, int dtype, int rank,
                                            const cuuint64_t *dims, const cuuint64_t *byte_strides, int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 encode;
    const cudaError_t err = tensor_map_encoder(&encode);
    if (err != cudaSuccess) return err;
    const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1};
    const cuuint32_t element_strides[4] = {1, 1, 1, 1};
    const CUtensorMapDataType type = dtype == ATTN_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    const CUresult r = encode(map, type, (cuuint32_t)rank, (void *)tensor, dims, byte_strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Host: a TMA tensor map for one contiguous [B*H, S, D] tensor, coordinates (column, row, head).
static inline cudaError_t make_tensor_map_bhsd(CUtensorMap *map, const void *tensor, int dtype, int heads_total,
                                               int S, int D, int box_rows) {
    const cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)S, (cuuint64_t)heads_total};
    const cuuint64_t strides[2] = {(cuuint64_t)D * 2, (cuuint64_t)S * D * 2};  // bytes, dims 1 and 2
    return encode_tensor_map(map, tensor, dtype, 3, dims, strides, box_rows);
}

// Host: a TMA tensor map for a [B, H, S, D] tensor laid out by `rows` (its strides, RowLayout),
// coordinates (column, row, head, batch): any strides that are multiples of 16 bytes, so that
// [B, S, H, D] memory reads as [B, H, S, D] without a copy.
static inline cudaError_t make_tensor_map(CUtensorMap *map, const void *tensor, int dtype, const RowLayout &rows,
                                          int batch, int S, int D, int box_rows) {
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)S, (cuuint64_t)rows.heads, (cuuint64_t)batch};
    const cuuint64_t strides[3] = {(cuuint64_t)rows.row * 2, (cuuint64_t)rows.head * 2, (cuuint64_t)rows.batch * 2};
    return encode_tensor_map(map, tensor, dtype, 4, dims, strides, box_rows);
}

// Host: a TMA tensor map for a [heads, rows, cols] tensor of bytes (e4m3), read in boxes of
// box_rows x box_cols (64 or 128 columns: one 64- or 128-byte swizzled row).
static inline cudaError_t make_tensor_map_bytes(CUtensorMap *map, const void *tensor, int heads_total, int rows,
                                                int cols, int box_rows, int box_cols) {
    PFN_cuTensorMapEncodeTiled_v12000 encode;
    const cudaError_t err = tensor_map_encoder(&encode);
    if (err != cudaSuccess) return err;
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)heads_total};
    const cuuint64_t strides[2] = {(cuuint64_t)cols, (cuuint64_t)rows * cols};
    const cuuint32_t box[3] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows, 1}, element_strides[3] = {1, 1, 1};
    const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)tensor, dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              box_cols == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

#endif
