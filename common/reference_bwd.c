// reference_bwd.c - dQ, dK, dV of softmax(scale q k^T) v in float64 (see reference_bwd.h).
#include "reference_bwd.h"

#include <math.h>

#include "omp_compat.h"

static double dot(const float *a, const float *b, int D) {
    double acc = 0.0;
    for (int d = 0; d < D; d++) acc += (double)a[d] * (double)b[d];
    return acc;
}

static size_t head_start(const attn_shape *s, int b, int h) {
    return ((size_t)b * s->heads + h) * (size_t)s->seq * s->dim;
}

void reference_bwd_stats(const attn_shape *shape, const float *q, const float *k, const float *v,
                         const float *d_o, int b, int h, double *lse, double *delta) {
    const int S = shape->seq, D = shape->dim;
    const size_t head = head_start(shape, b, h);
    const double scale = 1.0 / sqrt((double)D);
    OMP_PARALLEL
    {
    OMP_FOR_DYNAMIC  // causal rows differ in length
    for (int i = 0; i < S; i++) {
        const float *q_row = q + head + (size_t)i * D, *do_row = d_o + head + (size_t)i * D;
        const int n_keys = shape->causal ? i + 1 : S;
        double row_max = -INFINITY;
        for (int j = 0; j < n_keys; j++) {
            const double s_ij = scale * dot(q_row, k + head + (size_t)j * D, D);
            if (s_ij > row_max) row_max = s_ij;
        }
        // Second sweep: the sum of exp and sum_j exp(s_ij - max) dP_ij, normalized at the end.
        double row_sum = 0.0, weighted = 0.0;
        for (int j = 0; j < n_keys; j++) {
            const double e = exp(scale * dot(q_row, k + head + (size_t)j * D, D) - row_max);
            row_sum += e;
            weighted += e * dot(do_row, v + head + (size_t)j * D, D);
        }
        lse[i] = row_max + log(row_sum);
        delta[i] = weighted / row_sum;
    }
    }
}

void reference_dq_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                      const float *d_o, int b, int h, const double *lse, const double *delta,
                      int i, double *dq_row) {
    const int S = shape->seq, D = shape->dim;
    const size_t head = head_start(shape, b, h);
    const double scale = 1.0 / sqrt((double)D);
    const float *q_row = q + head + (size_t)i * D, *do_row = d_o + head + (size_t)i * D;
    const int n_keys = shape->causal ? i + 1 : S;
    for (int d = 0; d < D; d++) dq_row[d] = 0.0;
    for (int j = 0; j < n_keys; j++) {
        const float *k_row = k + head + (size_t)j * D;
        const double p = exp(scale * dot(q_row, k_row, D) - lse[i]);
        const double ds = p * (dot(do_row, v + head + (size_t)j * D, D) - delta[i]);
        for (int d = 0; d < D; d++) dq_row[d] += scale * ds * (double)k_row[d];
    }
}

void reference_dkdv_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                        const float *d_o, int b, int h, const double *lse, const double *delta,
                        int j, double *dk_row, double *dv_row) {
    const int S = shape->seq, D = shape->dim;
    const size_t head = head_start(shape, b, h);
    const double scale = 1.0 / sqrt((double)D);
    const float *k_row = k + head + (size_t)j * D, *v_row = v + head + (size_t)j * D;
    for (int d = 0; d < D; d++) dk_row[d] = dv_row[d] = 0.0;
    for (int i = shape->causal ? j : 0; i < S; i++) {  // causal: only queries i >= j see key j
        const float *q_row = q + head + (size_t)i * D, *do_row = d_o + head + (size_t)i * D;
        const double p = exp(scale * dot(q_row, k_row, D) - lse[i]);
        const double ds = p * (dot(do_row, v_row, D) - delta[i]);
        for (int d = 0; d < D; d++) {
            dv_row[d] += p * (double)do_row[d];
            dk_row[d] += scale * ds * (double)q_row[d];
        }
    }
}
