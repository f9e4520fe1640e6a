// wmma_tiles.cuh - the WMMA score tile that stages 05 and 06 share.
#ifndef FLASH_STAGES_WMMA_TILES_CUH
#define FLASH_STAGES_WMMA_TILES_CUH

#include <mma.h>

#include "kernel_common.cuh"

// S = Q K^T for one warp: its 16 query rows (`q_rows`) against the KEY_TILE keys of `k_tile`, both
// fp16 in shared memory with row stride `ld_half` (a multiple of 8), on the tensor cores. The
// 16 x KEY_TILE fp32 result goes to `s_rows` (row stride `ld_score`, a multiple of 4), unscaled.
//
// Kᵀ for free: a col_major matrix_b fragment reads element (k, n) at n * ld + k, which in k_tile
// is K[n][k]; so loading B from K's own rows yields Kᵀ without a transposed copy.
template <int D, int KEY_TILE>
__device__ inline void wmma_score_tile(const __half *q_rows, const __half *k_tile, int ld_half,
                                       float *s_rows, int ld_score) {
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag[KEY_TILE / 16];
#pragma unroll
    for (int n = 0; n < KEY_TILE / 16; n++) wmma::fill_fragment(s_frag[n], 0.0f);
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> q_frag;
        wmma::load_matrix_sync(q_frag, q_rows + kk, ld_half);  // reused for all KEY_TILE/16 columns
#pragma unroll
        for (int n = 0; n < KEY_TILE / 16; n++) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> k_frag;
            wmma::load_matrix_sync(k_frag, k_tile + n * 16 * ld_half + kk, ld_half);
            wmma::mma_sync(s_frag[n], q_frag, k_frag, s_frag[n]);
        }
    }
#pragma unroll
    for (int n = 0; n < KEY_TILE / 16; n++)
        wmma::store_matrix_sync(s_rows + n * 16, s_frag[n], ld_score, wmma::mem_row_major);
}

#endif
