// v_transpose.cuh - stage 11's V tile transposed in shared memory (the .v_in_kernel build): the
// quantize pass writes V's rows as it writes K's, TMA loads a tile of 128 keys x D, and warps of
// the producer warpgroup write it as Vᵀ, D rows of 128 keys, with the keys of every 32 in v_key's
// order, into the slot the consumers' P V reads. The stage as built writes Vᵀ in its quantize pass.
#ifndef FLASH_STAGES_V_TRANSPOSE_CUH
#define FLASH_STAGES_V_TRANSPOSE_CUH

#include <stdint.h>

#include "wgmma_ptx.cuh"

// One 4 x 4 block: V's keys k0, k0 + 1, k0 + 8 and k0 + 9 (k0 = 32g + 16h + 2t) at columns
// d0 .. d0 + 3, read as one 32-bit word a key, to Vᵀ's rows d0 .. d0 + 3 at the four columns from
// c0 = 32g + 16h + 4t, where v_key puts exactly those keys, in that order. Two rounds of byte
// permutes transpose the block: pairs of keys' bytes interleaved, then the pairs' halves joined.
// key0 and key1 are the byte offsets of keys k0 and k0 + 1 at column d0 (k0 + 8 and k0 + 9 lie 8
// rows further, with the same swizzle phase); vt_row is that of Vᵀ's row d0 at column c0. d0 is a
// multiple of 4, so row d0 + i has the phase of row d0 XOR i: its chunk is row d0's XOR i.
template <int D, int KEYS>
__host__ __device__ inline void transpose_block(const uint8_t *v_rows, uint8_t *vt, uint32_t key0, uint32_t key1,
                                                uint32_t vt_row) {
    static_assert(KEYS == 128, "Vᵀ's rows are 128 keys: the 128-byte swizzle");
    const uint32_t w0 = *(const uint32_t *)(v_rows + key0), w1 = *(const uint32_t *)(v_rows + key1);
    const uint32_t w8 = *(const uint32_t *)(v_rows + key0 + 8 * D), w9 = *(const uint32_t *)(v_rows + key1 + 8 * D);
    // low01: columns d0 and d0 + 1 of keys k0 and k0 + 1, interleaved; high01: columns d0 + 2, d0 + 3
    const uint32_t low01 = byte_perm(w0, w1, 0x5140), high01 = byte_perm(w0, w1, 0x7362);
    const uint32_t low89 = byte_perm(w8, w9, 0x5140), high89 = byte_perm(w8, w9, 0x7362);
    *(uint32_t *)(vt + vt_row) = byte_perm(low01, low89, 0x5410);
    *(uint32_t *)(vt + ((vt_row ^ 1 << 4) + KEYS)) = byte_perm(low01, low89, 0x7632);
    *(uint32_t *)(vt + ((vt_row ^ 2 << 4) + 2 * KEYS)) = byte_perm(high01, high89, 0x5410);
    *(uint32_t *)(vt + ((vt_row ^ 3 << 4) + 3 * KEYS)) = byte_perm(high01, high89, 0x7632);
}

// This warp's share of one tile: v_rows [KEYS][D] (TMA's D-byte swizzle) to vt [D][KEYS] (the
// 128-byte swizzle the P V wgmma reads), warp `warp` of `warps` taking every warps-th pass of 32
// blocks. In pass (g, dq), lane = 16h + 4t + dl takes the block of keys from k0 = 32g + 16h + 2t
// and of columns from d0 = 16 dq + 4 dl, so that a load instruction reads 16 banks twice over and
// a store writes 16 banks twice over. A swizzle XORs a row's 16-byte chunk index with a phase that
// repeats every 8 rows, so the lane's offsets are computed once, for pass (0, 0). In V, moving 32g
// keys adds whole rows and moving 16 dq columns XORs the chunk index with dq; in Vᵀ the roles
// swap: 16 dq rows are whole rows, and 32g keys XOR the chunk index with 2g.
template <int D, int KEYS>
__host__ __device__ inline void transpose_v_tile(const uint8_t *v_rows, uint8_t *vt, int warp, int warps, int lane) {
    const uint32_t h = lane / 16, t = lane / 4 % 4, dl = lane % 4;
    const uint32_t key0 = swizzled_byte<D>(16 * h + 2 * t, 4 * dl), key1 = swizzled_byte<D>(16 * h + 2 * t + 1, 4 * dl);
    const uint32_t vt_row = swizzled_byte<KEYS>(4 * dl, 16 * h + 4 * t);
#ifdef __CUDA_ARCH__
#pragma unroll 1  // unrolled, the passes' offsets would not fit the producer's 24 registers
#endif
    for (uint32_t pass = warp; pass < KEYS / 32 * (D / 16); pass += warps) {
        const uint32_t g = pass % (KEYS / 32), dq = pass / (KEYS / 32);
        transpose_block<D, KEYS>(v_rows, vt, (key0 ^ dq << 4) + 32 * g * D, (key1 ^ dq << 4) + 32 * g * D,
                                 (vt_row ^ 2 * g << 4) + 16 * dq * KEYS);
    }
}

#endif
