// test_backward.c - the float64 backward reference against finite differences of the forward
// reference, and the backward checker: it must pass exact gradients and catch wrong ones.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "half.h"
#include "reference.h"
#include "reference_bwd.h"
#include "test_util.h"

// L = sum over the head of dO * O, whose gradients are dQ, dK, dV. In float64 from reference_row.
static double loss(const attn_shape *s, const float *q, const float *k, const float *v, const float *d_o) {
    double *scores = malloc(sizeof(double) * s->seq), *row = malloc(sizeof(double) * s->dim), sum = 0.0;
    for (int i = 0; i < s->seq; i++) {
        reference_row(s, q, k, v, 0, 0, i, scores, row);
        for (int d = 0; d < s->dim; d++) sum += row[d] * d_o[(size_t)i * s->dim + d];
    }
    free(scores), free(row);
    return sum;
}

static const reference_error NO_ERROR_TERMS = {NULL, NULL};

static void exact_grads(const attn_shape *s, const float *q, const float *k, const float *v,
                        const float *d_o, uint16_t *grads[3]) {
    double *lse = malloc(sizeof(double) * s->seq), *delta = malloc(sizeof(double) * s->seq);
    double *a = malloc(sizeof(double) * s->dim), *b = malloc(sizeof(double) * s->dim);
    for (int bh = 0; bh < s->batch * s->heads; bh++) {
        reference_bwd_stats(s, q, k, v, d_o, bh / s->heads, bh % s->heads, lse, delta, NO_ERROR_TERMS);
        for (int i = 0; i < s->seq; i++) {
            const size_t base = ((size_t)bh * s->seq + i) * s->dim;
            reference_dq_row(s, q, k, v, d_o, bh / s->heads, bh % s->heads, lse, delta, NO_ERROR_TERMS, i,
                             a, NO_ERROR_TERMS);
            for (int d = 0; d < s->dim; d++) grads[0][base + d] = float_to_half((float)a[d]);
            reference_dkdv_row(s, q, k, v, d_o, bh / s->heads, bh % s->heads, lse, delta, NO_ERROR_TERMS,
                               i, a, b, NO_ERROR_TERMS, NO_ERROR_TERMS);
            for (int d = 0; d < s->dim; d++) {
                grads[1][base + d] = float_to_half((float)a[d]);
                grads[2][base + d] = float_to_half((float)b[d]);
            }
        }
    }
    free(lse), free(delta), free(a), free(b);
}

int main(void) {
    // 1. Finite differences on one small head, causal and not: central differences with a step
    //    of 1e-3 on float inputs agree with the analytic gradient to ~1e-5 (float rounding of the
    //    step and the h^2 term); a wrong formula is off by 1e-1 or more.
    for (int causal = 0; causal <= 1; causal++) {
        attn_shape s = {.batch = 1, .heads = 1, .seq = 6, .dim = 4, .causal = causal};
        const size_t n = attn_elems(&s);
        float *t[4];
        for (int i = 0; i < 4; i++) {
            t[i] = malloc(n * sizeof(float));
            for (size_t e = 0; e < n; e++) t[i][e] = (float)sin(0.7 * e + 1.3 * i + 0.2);
        }
        double lse[6], delta[6], dq[4], dk[4], dv[4];
        reference_bwd_stats(&s, t[0], t[1], t[2], t[3], 0, 0, lse, delta, NO_ERROR_TERMS);
        double worst = 0.0;
        for (int row = 0; row < s.seq; row++) {
            reference_dq_row(&s, t[0], t[1], t[2], t[3], 0, 0, lse, delta, NO_ERROR_TERMS, row, dq,
                             NO_ERROR_TERMS);
            reference_dkdv_row(&s, t[0], t[1], t[2], t[3], 0, 0, lse, delta, NO_ERROR_TERMS, row, dk, dv,
                               NO_ERROR_TERMS, NO_ERROR_TERMS);
            const double *analytic[3] = {dq, dk, dv};
            for (int which = 0; which < 3; which++)
                for (int d = 0; d < s.dim; d++) {
                    float *x = &t[which][(size_t)row * s.dim + d];
                    const float saved = *x, h = 1e-3f;
                    *x = saved + h;
                    const double up = loss(&s, t[0], t[1], t[2], t[3]);
                    *x = saved - h;
                    const double down = loss(&s, t[0], t[1], t[2], t[3]);
                    *x = saved;
                    const double numeric = (up - down) / (2.0 * h);
                    const double err = fabs(numeric - analytic[which][d]);
                    if (err > worst) worst = err;
                    EXPECT(err < 1e-4, "causal=%d tensor %d row %d d %d: analytic %.9f numeric %.9f",
                           causal, which, row, d, analytic[which][d], numeric);
                }
        }
        printf("finite differences, causal=%d: max |analytic - numeric| = %.2e\n", causal, worst);
        for (int i = 0; i < 4; i++) free(t[i]);
    }

    // 2. The checker on a shape with tails and several heads.
    attn_shape s = {.batch = 2, .heads = 3, .seq = 37, .dim = 64, .causal = 1};
    const size_t n = attn_elems(&s);
    float *q = malloc(n * sizeof(float)), *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    float *d_o = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        q[i] = half_to_float(float_to_half((float)sin(0.37 * i)));
        k[i] = half_to_float(float_to_half((float)cos(0.11 * i)));
        v[i] = half_to_float(float_to_half((float)sin(0.05 * i + 1.0)));
        d_o[i] = half_to_float(float_to_half((float)cos(0.23 * i + 0.5)));
    }
    uint16_t *g[3], *copy[3];
    for (int t = 0; t < 3; t++) g[t] = malloc(n * sizeof(uint16_t)), copy[t] = malloc(n * sizeof(uint16_t));
    exact_grads(&s, q, k, v, d_o, g);
    for (int t = 0; t < 3; t++) memcpy(copy[t], g[t], n * sizeof(uint16_t));
    const uint16_t *const *grads = (const uint16_t *const *)g;

    check_bwd_result r = check_backward(&s, q, k, v, d_o, grads);
    EXPECT(check_bwd_passed(&r), "exact gradients must pass");
    EXPECT(r.dq.full && r.dk.rows_checked == (size_t)6 * 37, "a small problem is checked in full");

    // Poison in dK, NaN in dQ, one wrong dV row (a 5% error on a whole row: a lost tile).
    g[1][n - 1] = HALF_POISON;
    r = check_backward(&s, q, k, v, d_o, grads);
    EXPECT(!check_bwd_passed(&r) && r.dk.unwritten == 1, "an unwritten dK element fails");
    memcpy(g[1], copy[1], n * sizeof(uint16_t));
    g[0][5] = 0x7e00;  // fp16 NaN
    r = check_backward(&s, q, k, v, d_o, grads);
    EXPECT(!check_bwd_passed(&r) && r.dq.nonfinite == 1, "a NaN in dQ fails");
    memcpy(g[0], copy[0], n * sizeof(uint16_t));
    const size_t row = ((size_t)(1 * 3 + 2) * 37 + 3) * 64;  // b=1 h=2 key 3
    for (int d = 0; d < 64; d++) g[2][row + d] = float_to_half(1.05f * half_to_float(g[2][row + d]));
    r = check_backward(&s, q, k, v, d_o, grads);
    EXPECT(!check_bwd_passed(&r) && r.dv.rows_over_rel_l2 >= 1, "a dV row 5%% off fails");
    memcpy(g[2], copy[2], n * sizeof(uint16_t));
    // A missing causal mask: dK computed as if non-causal.
    attn_shape full = s;
    full.causal = 0;
    exact_grads(&full, q, k, v, d_o, g);
    r = check_backward(&s, q, k, v, d_o, grads);
    EXPECT(!check_bwd_passed(&r), "non-causal gradients fail a causal check");

    for (int t = 0; t < 3; t++) free(g[t]), free(copy[t]);
    free(q), free(k), free(v), free(d_o);
    return test_summary("test_backward");
}
