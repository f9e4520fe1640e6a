// test_fp8.c - the e4m3 rounding and the Walsh-Hadamard transform of common/fp8.h.
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "fp8.h"
#include "reference.h"
#include "test_util.h"

// Every finite e4m3 value, ascending (the 126 positive ones, zero, and their negatives).
static int all_values(double *values) {
    int n = 0;
    for (int bits = 0; bits < 256; bits++) {
        const double v = e4m3_value((uint8_t)bits);
        if (!isnan(v) && !(v == 0.0 && bits == 0x80)) values[n++] = v;
    }
    for (int i = 1; i < n; i++)  // insertion sort
        for (int j = i; j > 0 && values[j - 1] > values[j]; j--) {
            const double t = values[j];
            values[j] = values[j - 1], values[j - 1] = t;
        }
    return n;
}

static void test_codes(void) {
    EXPECT(e4m3_value(0x7e) == 448.0, "largest finite %g", e4m3_value(0x7e));
    EXPECT(isnan(e4m3_value(0x7f)) && isnan(e4m3_value(0xff)), "0x7f and 0xff are NaN");
    EXPECT(e4m3_value(0x08) == ldexp(1.0, -6), "smallest normal %g", e4m3_value(0x08));
    EXPECT(e4m3_value(0x01) == ldexp(1.0, -9), "smallest subnormal %g", e4m3_value(0x01));
    for (int bits = 0; bits < 256; bits++) {
        const double v = e4m3_value((uint8_t)bits);
        if (isnan(v)) continue;
        EXPECT(e4m3_round(v) == v, "code 0x%02x (%g) is not on the grid", bits, v);
        EXPECT(e4m3_bits(v) == bits || (v == 0.0), "code 0x%02x (%g) encodes as 0x%02x", bits, v, e4m3_bits(v));
    }
}

// Against the brute-force nearest of all values, with ties to the even code (mantissa bit 0 clear).
static void test_rounding(void) {
    double values[256];
    const int n = all_values(values);
    EXPECT(n == 253, "%d finite values (zero once)", n);
    uint64_t state = 12345;
    for (int trial = 0; trial < 200000; trial++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const double u = (double)(state >> 11) / 9007199254740992.0;  // [0, 1)
        double x = (u - 0.5) * 1000.0 * pow(10.0, -6.0 * ((double)(trial % 7) / 6.0));
        if (trial % 5 == 0 && trial > 0) {  // exact midpoints between neighbours
            const int i = (int)(u * (n - 1));
            x = 0.5 * (values[i] + values[i + 1]);
        }
        double best = values[0], best_distance = INFINITY;
        for (int i = 0; i < n; i++) {
            const double d = fabs(values[i] - x);
            if (d < best_distance || (d == best_distance && (e4m3_bits(values[i]) & 1) == 0))
                best = values[i], best_distance = d;
        }
        if (fabs(x) >= E4M3_MAX) best = copysign(E4M3_MAX, x);
        const double got = e4m3_round(x);
        EXPECT(got == best || (got == 0.0 && best == 0.0), "round(%.17g) = %.17g, nearest %.17g", x, got, best);
        if (test_failures > 10) return;
    }
    EXPECT(e4m3_round(1e6) == 448.0 && e4m3_round(-1e6) == -448.0, "saturation");
    EXPECT(e4m3_round(464.0) == 448.0, "464 (halfway to 480) saturates to 448");
}

static void test_hadamard(void) {
    for (int n = 1; n <= 256; n *= 2) {
        double x[256], y[256], q[256], k[256], signs[256];
        for (int i = 0; i < n; i++) {
            x[i] = y[i] = sin(1.0 + 3.0 * i) + (i == n / 3 ? 50.0 : 0.0);  // one outlier
            q[i] = cos(0.5 + 2.0 * i), k[i] = x[i];
            signs[i] = (i * 7 + 3) % 5 < 2 ? -1.0 : 1.0;
        }
        walsh_hadamard(y, n), walsh_hadamard(y, n);  // H H = n I
        for (int i = 0; i < n; i++) EXPECT(fabs(y[i] - n * x[i]) <= 1e-9 * n * (1 + fabs(x[i])), "n=%d H H x", n);
        double before = 0.0, after = 0.0, largest_before = 0.0, largest_after = 0.0;
        for (int i = 0; i < n; i++) before += q[i] * k[i], largest_before = fmax(largest_before, fabs(k[i]));
        incoherent_row(q, signs, n), incoherent_row(k, signs, n);
        for (int i = 0; i < n; i++) after += q[i] * k[i], largest_after = fmax(largest_after, fabs(k[i]));
        EXPECT(fabs(after - before) <= 1e-12 * (1 + fabs(before)) * n, "n=%d q.k %.17g -> %.17g", n, before, after);
        // The outlier's 50 spreads as 50 / sqrt(n) over every entry.
        if (n >= 64) EXPECT(largest_after < largest_before / 4, "n=%d largest %g -> %g", n, largest_before, largest_after);
    }
}

// x / scale rounded to e4m3, times scale: a value as an FP8 kernel holds it.
static double quantized(double x, double scale) { return e4m3_round(x / scale) * scale; }

// What stage 11 computes, rounding for rounding, in float64: Q and K rotated (the method's), every
// block of Q, K and V divided by its scale (ref_fp8_prepare's) and rounded to e4m3, P rounded to
// e4m3 before P V, O to fp16. With `skip_tile`, keys 128 to 255 are left out: a wrong kernel.
static void emulate(const attn_shape *s, const float *q, const float *k, const float *v, uint16_t *o, int skip_tile) {
    const int S = s->seq, D = s->dim, blocks = (S + 127) / 128;
    ref_fp8 *fp8 = ref_fp8_prepare(s, q, k, v);
    const float *qr = fp8->q_rot ? fp8->q_rot : q, *kr = fp8->k_rot ? fp8->k_rot : k;
    double p[512];
    for (int hh = 0; hh < s->batch * s->heads; hh++)
        for (int i = 0; i < S; i++) {
            const size_t head = (size_t)hh * S * D;
            const double sq = fp8->q_scale[hh * blocks + i / 128];
            const int keys = s->causal ? i + 1 : S;
            double row_max = -INFINITY, row_sum = 0.0;
            for (int j = 0; j < keys; j++) {
                double dot = 0.0;
                for (int d = 0; d < D; d++)
                    dot += quantized(qr[head + (size_t)i * D + d], sq) *
                           quantized(kr[head + (size_t)j * D + d], fp8->k_scale[hh * blocks + j / 128]);
                p[j] = dot / sqrt((double)D);
                row_max = fmax(row_max, p[j]);
            }
            for (int j = 0; j < keys; j++) p[j] = exp(p[j] - row_max), row_sum += p[j];
            for (int d = 0; d < D; d++) {
                double acc = 0.0;
                for (int j = 0; j < keys; j++)
                    if (!(skip_tile && j >= 128 && j < 256))
                        acc += e4m3_round(p[j]) * quantized(v[head + (size_t)j * D + d], fp8->v_scale[hh * blocks + j / 128]);
                o[head + (size_t)i * D + d] = float_to_half((float)(acc / row_sum));
            }
        }
    ref_fp8_free(fp8);
}

// The FP8 rule (check.h, reference.h) passes the emulated FP8 forward, per tensor and with block
// scales and the rotation, and fails it with a key tile left out.
static void test_rule(void) {
    for (int method = 0; method < 2; method++)
        for (int causal = 0; causal < 2; causal++) {
            attn_shape s = {.batch = 1, .heads = 2, .seq = 300, .dim = 64, .causal = causal};
            s.fp8 = method ? ATTN_FP8 | ATTN_FP8_BLOCK_SCALES | ATTN_FP8_HADAMARD : ATTN_FP8;
            const size_t n = attn_elems(&s);
            float *q = malloc(sizeof(float) * n), *k = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
            uint16_t *o = malloc(sizeof(uint16_t) * n);
            test_fill_normal(q, n, 1, 0.0, 1.0), test_fill_normal(k, n, 2, 0.0, 1.0), test_fill_normal(v, n, 3, 0.0, 1.0);
            emulate(&s, q, k, v, o, 0);
            check_result r = check_output(&s, q, k, v, o);
            EXPECT(check_passed(&r), "method %d causal %d: the emulated FP8 forward fails (largest error %.2f of its bound)",
                   method, causal, r.max_bound_ratio);
            emulate(&s, q, k, v, o, 1);
            r = check_output(&s, q, k, v, o);
            EXPECT(!check_passed(&r), "method %d causal %d: a key tile left out passes (rel L2 %.3g, largest error %.2f of its bound)", method, causal, r.rel_l2_err, r.max_bound_ratio);
            free(q), free(k), free(v), free(o);
        }
}

int main(void) {
    test_codes();
    test_rounding();
    test_hadamard();
    test_rule();
    if (test_failures) {
        printf("test_fp8: %d failures\n", test_failures);
        return 1;
    }
    printf("test_fp8: e4m3 codes, rounding (ties to even, saturation), the Walsh-Hadamard transform and the FP8 "
           "rule (an emulated FP8 forward passes, one with a key tile left out fails): ok\n");
    return 0;
}
