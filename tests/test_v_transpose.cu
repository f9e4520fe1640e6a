// test_v_transpose.cu - stage 11's V tile transposed in shared memory (stages/11_fp8/v_transpose.cuh,
// the .v_in_kernel build), run on the CPU: swizzled_byte against the swizzles' definition as XOR
// patterns of address bits, then every warp's share of a tile, from V's rows as TMA lays them out
// to the Vᵀ slot P V reads, checked element by element against the key order v_key describes
// (column 16h + 4t + 2i + e of every 32 holds key 16h + 8i + 2t + e). Needs no GPU.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "v_transpose.cuh"

// The swizzles as TMA defines them on a tile's byte offset: the 16-byte chunk (bits 4-6) XOR
// bits 7-9 for 128 bytes, bits 4-5 XOR bits 7-8 for 64 bytes.
static int xor_swizzle(int row_bytes, int offset) {
    return row_bytes == 128 ? offset ^ ((offset >> 7) & 7) << 4 : offset ^ ((offset >> 7) & 3) << 4;
}

template <int ROW_BYTES>
static int check_swizzle(void) {
    int bad = 0;
    for (int row = 0; row < 128; row++)
        for (int byte = 0; byte < ROW_BYTES; byte++)
            bad += swizzled_byte<ROW_BYTES>(row, byte) != xor_swizzle(ROW_BYTES, row * ROW_BYTES + byte);
    printf("swizzled_byte<%d>: %d offsets differ from the XOR pattern\n", ROW_BYTES, bad);
    return bad;
}

template <int D>
static int check_transpose(int warps) {
    constexpr int KEYS = 128;
    static uint8_t v[KEYS][D], v_rows[KEYS * D], vt[D * KEYS];
    for (int k = 0; k < KEYS; k++)
        for (int d = 0; d < D; d++) v[k][d] = (uint8_t)rand(), v_rows[swizzled_byte<D>(k, d)] = v[k][d];
    memset(vt, 0xff, sizeof vt);
    for (int warp = 0; warp < warps; warp++)
        for (int lane = 0; lane < 32; lane++) transpose_v_tile<D, KEYS>(v_rows, vt, warp, warps, lane);
    int bad = 0;
    for (int d = 0; d < D; d++)
        for (int c = 0; c < KEYS; c++) {
            const int h = c % 32 / 16, t = c % 16 / 4, i = c % 4 / 2, e = c % 2;
            const int key = c / 32 * 32 + 16 * h + 8 * i + 2 * t + e;
            bad += vt[swizzled_byte<KEYS>(d, c)] != v[key][d];
        }
    printf("transpose_v_tile<%d>, %d warps: %d of %d bytes of Vt wrong\n", D, warps, bad, D * KEYS);
    return bad;
}

int main(void) {
    srand(11);
    const int bad = check_swizzle<128>() + check_swizzle<64>() + check_transpose<128>(3) + check_transpose<64>(3) +
                    check_transpose<128>(1);
    printf("%s\n", bad ? "FAILED" : "passed");
    return bad ? 1 : 0;
}
