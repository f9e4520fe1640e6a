// reference.c - softmax(scale * q k^T) v for one query row, in float64, straight from the
// definition; and, on request, the error a correct fp16 or bf16 kernel can make on each element.
//
// The rounding points of a kernel that computes O_d = sum_j P_j V_jd from fp16 (or bf16) inputs,
// each with the largest error it can add to O_d (u and m the element type's unit roundoff and
// smallest normal, reference.h):
//   scores in fp32:        s_j is off by sigma_j = D 2^-23 scale sum_d |q_d k_jd|; P_j moves by a
//                          factor (1 +- sigma_j), and with the normalization O_d by
//                          sum_j P_j sigma_j |V_jd - O_d|
//   exp(s - max) to the type:  a value in (0, 1], before the division by the row sum: P_j moves by
//                          u (P_j + m P_max), so O_d by sum_j u (P_j + m P_max) |V_jd|
//   O to the type:         u (|O_d| + m)
// fp32 sums (the row sum, P V), exp and the division are covered by the checker's factor
// CHECK_C1 (check.h); docs/measuring.md says why they can be.
#include "reference.h"

#include <math.h>

// Fills scores[j] = scale q.k_j and, when sigma is not NULL, sigma[j], the bound on a kernel's
// fp32 error of that score, for the row's keys; returns the row max.
static double row_scores(const attn_shape *shape, const float *q_row, const float *k_head,
                         int n_keys, double *scores, double *sigma) {
    const int D = shape->dim;
    const double scale = 1.0 / sqrt((double)D);
    double row_max = -INFINITY;
    for (int j = 0; j < n_keys; j++) {
        const float *k_row = k_head + (size_t)j * D;
        double dot = 0.0, magnitude = 0.0;
        for (int d = 0; d < D; d++) {
            const double product = (double)q_row[d] * (double)k_row[d];
            dot += product;
            magnitude += fabs(product);
        }
        scores[j] = scale * dot;
        if (sigma) sigma[j] = D * REF_F32_STEP * scale * magnitude;
        if (scores[j] > row_max) row_max = scores[j];
    }
    return row_max;
}

void reference_row_error(const attn_shape *shape, const float *q, const float *k, const float *v,
                         int b, int h, int row, double *scratch, double *out_row,
                         reference_error err) {
    const int S = shape->seq, D = shape->dim, S_kv = attn_kv_seq(shape);
    const size_t q_head = ((size_t)b * shape->heads + h) * (size_t)S * D;  // start of Q[b, h, :, :]
    const size_t kv_head = ref_kv_start(shape, b, h);
    const int n_keys = ref_keys_seen(shape, row);  // causal: bottom-right, the last query sees every key
    const int want_error = err.worst != NULL;
    const ref_rounding r = ref_rounding_of(shape->dtype);
    double *p = scratch, *sigma = want_error ? scratch + S_kv : NULL;

    // Subtracting the row max before exp() keeps exp() in (0, 1]: no overflow for any score.
    const double row_max = row_scores(shape, q + q_head + (size_t)row * D, k + kv_head, n_keys, p, sigma);
    double row_sum = 0.0;
    for (int j = 0; j < n_keys; j++) {
        p[j] = exp(p[j] - row_max);
        row_sum += p[j];
    }
    for (int j = 0; j < n_keys; j++) p[j] /= row_sum;
    for (int d = 0; d < D; d++) out_row[d] = 0.0;
    for (int j = 0; j < n_keys; j++) {
        const float *v_row = v + kv_head + (size_t)j * D;
        for (int d = 0; d < D; d++) out_row[d] += p[j] * (double)v_row[d];
    }
    if (!want_error) return;

    // Error terms, absolute, one per key and one for the output's rounding: summed into `worst`,
    // summed in squares into `rss`, then both turned into units of u.
    const double p_max = 1.0 / row_sum;
    for (int d = 0; d < D; d++) err.worst[d] = err.rss[d] = 0.0;
    for (int j = 0; j < n_keys; j++) {
        const float *v_row = v + kv_head + (size_t)j * D;
        const double rounding = r.u * (p[j] + r.min_normal * p_max), moved = p[j] * sigma[j];
        for (int d = 0; d < D; d++) {
            const double term = rounding * fabs((double)v_row[d]) + moved * fabs(v_row[d] - out_row[d]);
            err.worst[d] += term;
            err.rss[d] += term * term;
        }
    }
    for (int d = 0; d < D; d++) {
        const double rounding = r.u * (fabs(out_row[d]) + r.min_normal);
        err.worst[d] = (err.worst[d] + rounding) / r.u;
        err.rss[d] = sqrt(err.rss[d] + rounding * rounding) / r.u;
    }
}

void reference_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                   int b, int h, int row, double *scores, double *out_row) {
    reference_row_error(shape, q, k, v, b, h, row, scores, out_row, (reference_error){NULL, NULL});
}
