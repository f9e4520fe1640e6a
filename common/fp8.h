// fp8.h - FP8 (e4m3) rounding and the Walsh-Hadamard transform, on the host: the numerics of
// FlashAttention-3's FP8 forward (block quantization, incoherent processing), for the CPU
// emulation that the FP8 stage's checker and accuracy experiment stand on.
//
// e4m3 (the "fn" variant the tensor cores use): 1 sign bit, 4 exponent bits with bias 7, 3
// mantissa bits; no infinities; the largest finite value is 448 (0 1111 110), and 0 1111 111 is
// NaN. The smallest normal is 2^-6, and subnormals step by 2^-9. Conversion rounds to the nearest
// value, ties to the even mantissa, and saturates to +-448 (PTX cvt.rn.satfinite.e4m3x2.f32).
#ifndef FLASH_STAGES_FP8_H
#define FLASH_STAGES_FP8_H

#include <math.h>
#include <stdint.h>

#define E4M3_MAX 448.0
// e4m3's unit roundoff (3 mantissa bits: half a step, relative) and its smallest normal.
#define E4M3_U 0x1p-4
#define E4M3_MIN_NORMAL 0x1p-6

// The random signs of incoherent processing, shared by the kernel and the checker: column d
// (d < 128) is negated before the transform where bit d of this pair is set (splitmix64 of 1
// and 2: random, and fixed so that every run rotates alike).
#define FP8_SIGNS_LO 0x910a2dec89025cc1ull
#define FP8_SIGNS_HI 0x975835de1c9756ceull
static inline int fp8_sign_bit(int d) {
    return (int)(((d < 64 ? FP8_SIGNS_LO >> d : FP8_SIGNS_HI >> (d - 64))) & 1);
}

// x rounded to the nearest e4m3 value (ties to even), saturated to +-448; NaN stays NaN.
static inline double e4m3_round(double x) {
    if (isnan(x)) return x;
    const double magnitude = fabs(x);
    if (magnitude >= E4M3_MAX) return copysign(E4M3_MAX, x);
    // The spacing of e4m3 values around x: 2^(e - 3) for x in [2^e, 2^(e+1)), and 2^-9 below 2^-6.
    int e = magnitude > 0.0 ? ilogb(magnitude) : -6;
    if (e < -6) e = -6;
    const double step = ldexp(1.0, e - 3);
    return copysign(nearbyint(magnitude / step) * step, x);  // nearbyint: ties to even (default mode)
}

// The e4m3 bit pattern of a value already on the e4m3 grid (e4m3_round's result), and back.
static inline uint8_t e4m3_bits(double v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    if (isnan(v)) return 0x7f;
    const double magnitude = fabs(v);
    if (magnitude < ldexp(1.0, -6)) return sign | (uint8_t)(magnitude / ldexp(1.0, -9));  // subnormal
    const int e = ilogb(magnitude);
    const int mantissa = (int)(magnitude / ldexp(1.0, e - 3)) - 8;
    return sign | (uint8_t)((e + 7) << 3) | (uint8_t)mantissa;
}

static inline double e4m3_value(uint8_t bits) {
    const int exponent = (bits >> 3) & 0xf, mantissa = bits & 7;
    const double sign = bits & 0x80 ? -1.0 : 1.0;
    if (exponent == 0xf && mantissa == 7) return NAN;
    if (exponent == 0) return sign * ldexp(mantissa, -9);
    return sign * ldexp(8 + mantissa, exponent - 10);
}

// x <- H x for one row of length n (a power of two), H the unnormalized Walsh-Hadamard matrix
// (H H = n I): log2(n) passes of butterflies (a, b) -> (a + b, a - b).
static inline void walsh_hadamard(double *x, int n) {
    for (int half = 1; half < n; half *= 2)
        for (int i = 0; i < n; i += 2 * half)
            for (int j = i; j < i + half; j++) {
                const double a = x[j], b = x[j + half];
                x[j] = a + b, x[j + half] = a - b;
            }
}

// 1 / sqrt(D) as the float both the kernel and the checker multiply by after the transform.
#define FP8_ROTATION_NORM(D) ((D) == 128 ? 0.08838834764831845f : 0.125f)

// The rotation as stage 11's quantize kernel computes it, operation for operation in float (the
// signs, the butterflies of stride 1, 2, 4, ... each a + b and a - b, then FP8_ROTATION_NORM), so
// that the checker rounds the very values the kernel rounds. n is 64 or 128.
static inline void fp8_rotate_row_f32(float *x, int n) {
    for (int i = 0; i < n; i++)
        if (fp8_sign_bit(i)) x[i] = -x[i];
    for (int half = 1; half < n; half *= 2)
        for (int i = 0; i < n; i += 2 * half)
            for (int j = i; j < i + half; j++) {
                const float a = x[j], b = x[j + half];
                x[j] = a + b, x[j + half] = a - b;
            }
    for (int i = 0; i < n; i++) x[i] *= FP8_ROTATION_NORM(n);
}

// Incoherent processing with the course's signs (fp8_sign_bit): x <- H diag(signs) x / sqrt(n).
static inline void fp8_rotate_row(double *x, int n) {
    for (int i = 0; i < n; i++)
        if (fp8_sign_bit(i)) x[i] = -x[i];
    walsh_hadamard(x, n);
    const double norm = 1.0 / sqrt((double)n);
    for (int i = 0; i < n; i++) x[i] *= norm;
}

// Incoherent processing of one row of Q or K: x <- H diag(signs) x / sqrt(n). The matrix is
// orthogonal, and Q and K go through the same one, so every score q.k is unchanged while an
// outlier's weight spreads across all n entries.
static inline void incoherent_row(double *x, const double *signs, int n) {
    for (int i = 0; i < n; i++) x[i] *= signs[i];
    walsh_hadamard(x, n);
    const double norm = 1.0 / sqrt((double)n);
    for (int i = 0; i < n; i++) x[i] *= norm;
}

#endif
