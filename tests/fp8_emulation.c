// fp8_emulation.c - how much error FP8 inputs add to attention, emulated on the CPU: the RMSE of
// O against float64 attention on the same fp16 inputs, for the methods of FlashAttention-3's
// accuracy experiment (Shah et al. 2024, section 4.3): fp16; P alone in e4m3; e4m3 with one scale
// per head (the kernel's per-tensor method takes one across all heads); e4m3 with one scale per
// block of 128 rows; and block scales after incoherent processing (Q and K rotated by one
// random-sign Hadamard transform, which leaves every score unchanged). P goes
// to the products in the kernel's format (fp16, or e4m3 unscaled, as FlashAttention-3's FP8
// forward does: P <= 1), and each row's sum is taken from P before that rounding.
//
// What it emulates is the rounding of the kernel's operands; the products and sums run in
// float64 here, where a kernel accumulates in fp32. It is the model the FP8 stage is measured
// against, and an estimate of its error before any kernel exists.
//
//   fp8_emulation [--outliers] [--heads H] [--seq S] [--dim D]
// --outliers: Q, K and V drawn from N(0, 1) + N(0, 100) * Bernoulli(0.001), the experiment's
// distribution with 0.1% large entries; otherwise N(0, 1).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"
#include "half.h"

// The methods of the experiment, then three that take it apart: what the rotation does without
// block scales, what e4m3 does with no scale at all, and block scales whose largest value is not
// stored exactly (amax maps to 437, which rounds to 448, where as built it maps to 448 itself).
enum { FP16, P_ONLY, PER_HEAD, PER_BLOCK, BLOCK_HADAMARD, HEAD_HADAMARD, NO_SCALE, BLOCK_INEXACT_MAX, METHODS };
static const char *METHOD_NAMES[METHODS] = {"fp16", "fp16 Q, K, V; P in e4m3 (P's share)",
                                            "e4m3, one scale per head", "e4m3, a scale per 128 rows",
                                            "e4m3, a scale per 128 rows, Hadamard on Q and K",
                                            "e4m3, one scale per head, Hadamard on Q and K",
                                            "e4m3, no scale (scale 1)",
                                            "e4m3, a scale per 128 rows, amax to 437"};
#define BLOCK_ROWS 128

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double uniform(void) {  // [0, 1), splitmix64
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}
static double normal(void) { return sqrt(-2.0 * log(1.0 - uniform())) * cos(6.283185307179586 * uniform()); }

// One head's [S, D] rows: drawn, then rounded to fp16, the inputs a kernel is handed.
static void draw(double *x, size_t n, int outliers) {
    for (size_t i = 0; i < n; i++) {
        double v = normal();
        if (outliers && uniform() < 0.001) v += 10.0 * normal();  // N(0, 100): standard deviation 10
        x[i] = half_to_float(float_to_half((float)v));
    }
}

// x [rows, D] quantized to e4m3 with one scale per block of `block` rows (block = rows: one per
// tensor), the block's amax mapped to `top` (E4M3_MAX as built; 0: no scale at all).
static void quantize(double *x, int rows, int D, int block, double top) {
    for (int r0 = 0; r0 < rows; r0 += block) {
        const size_t begin = (size_t)r0 * D, end = (size_t)(r0 + block < rows ? r0 + block : rows) * D;
        double amax = 0.0;
        for (size_t i = begin; i < end; i++) amax = fmax(amax, fabs(x[i]));
        const double scale = amax > 0.0 && top > 0.0 ? amax / top : 1.0;
        for (size_t i = begin; i < end; i++) x[i] = e4m3_round(x[i] / scale) * scale;
    }
}

// O [S, D] of one head: softmax(Q K^T / sqrt(D)) V, P rounded by p_round before P V.
static void attention(const double *q, const double *k, const double *v, double *o, int S, int D,
                      double (*p_round)(double)) {
    double *p = malloc(sizeof(double) * S);
    const double scale = 1.0 / sqrt((double)D);
    for (int i = 0; i < S; i++) {
        double row_max = -INFINITY, row_sum = 0.0;
        for (int j = 0; j < S; j++) {
            double s = 0.0;
            for (int d = 0; d < D; d++) s += q[(size_t)i * D + d] * k[(size_t)j * D + d];
            p[j] = s * scale;
            row_max = fmax(row_max, p[j]);
        }
        for (int j = 0; j < S; j++) p[j] = exp(p[j] - row_max), row_sum += p[j];
        for (int d = 0; d < D; d++) o[(size_t)i * D + d] = 0.0;
        for (int j = 0; j < S; j++) {
            const double pj = p_round ? p_round(p[j]) : p[j];
            for (int d = 0; d < D; d++) o[(size_t)i * D + d] += pj * v[(size_t)j * D + d];
        }
        for (int d = 0; d < D; d++) o[(size_t)i * D + d] /= row_sum;
    }
    free(p);
}

static double fp16_round(double x) { return half_to_float(float_to_half((float)x)); }

static int parse(int argc, char **argv, int i, const char *name, int *value) {
    if (strcmp(argv[i], name) != 0) return 0;
    if (i + 1 >= argc || (*value = atoi(argv[i + 1])) < 1) {
        fprintf(stderr, "fp8_emulation: %s needs a positive integer\n", name);
        exit(2);
    }
    return 1;
}

int main(int argc, char **argv) {
    int outliers = 0, heads = 2, S = 1024, D = 128;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--outliers")) outliers = 1;
        else if (parse(argc, argv, i, "--heads", &heads) || parse(argc, argv, i, "--seq", &S) ||
                 parse(argc, argv, i, "--dim", &D)) i++;
        else {
            fprintf(stderr, "usage: fp8_emulation [--outliers] [--heads H] [--seq S] [--dim D]\n");
            return 2;
        }
    }
    if (D & (D - 1)) {
        fprintf(stderr, "fp8_emulation: --dim must be a power of two (the Hadamard transform), got %d\n", D);
        return 2;
    }
    const size_t n = (size_t)S * D;
    double *q = malloc(sizeof(double) * n), *k = malloc(sizeof(double) * n), *v = malloc(sizeof(double) * n);
    double *qm = malloc(sizeof(double) * n), *km = malloc(sizeof(double) * n), *vm = malloc(sizeof(double) * n);
    double *o_ref = malloc(sizeof(double) * n), *o = malloc(sizeof(double) * n), *signs = malloc(sizeof(double) * D);
    double squares[METHODS] = {0};
    for (int h = 0; h < heads; h++) {
        draw(q, n, outliers), draw(k, n, outliers), draw(v, n, outliers);
        for (int d = 0; d < D; d++) signs[d] = uniform() < 0.5 ? -1.0 : 1.0;
        attention(q, k, v, o_ref, S, D, NULL);
        for (int m = 0; m < METHODS; m++) {
            memcpy(qm, q, sizeof(double) * n), memcpy(km, k, sizeof(double) * n), memcpy(vm, v, sizeof(double) * n);
            if (m == BLOCK_HADAMARD || m == HEAD_HADAMARD)
                for (int r = 0; r < S; r++) incoherent_row(qm + (size_t)r * D, signs, D), incoherent_row(km + (size_t)r * D, signs, D);
            if (m != FP16 && m != P_ONLY) {
                const int block = m == PER_HEAD || m == HEAD_HADAMARD ? S : BLOCK_ROWS;
                const double top = m == NO_SCALE ? 0.0 : m == BLOCK_INEXACT_MAX ? 437.0 : E4M3_MAX;
                quantize(qm, S, D, block, top), quantize(km, S, D, block, top), quantize(vm, S, D, block, top);
            }
            attention(qm, km, vm, o, S, D, m == FP16 ? fp16_round : e4m3_round);
            for (size_t i = 0; i < n; i++) squares[m] += (o[i] - o_ref[i]) * (o[i] - o_ref[i]);
        }
    }
    printf("RMSE of O against float64, %s inputs, %d heads of S = %d, D = %d:\n",
           outliers ? "N(0,1) + N(0,100)*Bernoulli(0.001)" : "N(0,1)", heads, S, D);
    for (int m = 0; m < METHODS; m++)
        printf("  %-50s %.3e\n", METHOD_NAMES[m], sqrt(squares[m] / ((double)n * heads)));
    free(q), free(k), free(v), free(qm), free(km), free(vm), free(o_ref), free(o), free(signs);
    return 0;
}
