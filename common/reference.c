// reference.c - softmax(scale * q k^T) v for one query row, in float64, straight from the definition.
#include "reference.h"

#include <math.h>

void reference_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                   int b, int h, int row, double *scores, double *out_row) {
    const int S = shape->seq, D = shape->dim;
    const size_t head = ((size_t)b * shape->heads + h) * (size_t)S * D;  // start of [b, h, :, :]
    const float *q_row = q + head + (size_t)row * D;
    const double scale = 1.0 / sqrt((double)D);
    const int n_keys = shape->causal ? row + 1 : S;  // causal: keys 0..row

    // Subtracting the row max before exp() keeps exp() in (0, 1]: no overflow for any score.
    double row_max = -INFINITY;
    for (int j = 0; j < n_keys; j++) {
        const float *k_row = k + head + (size_t)j * D;
        double dot = 0.0;
        for (int d = 0; d < D; d++) dot += (double)q_row[d] * (double)k_row[d];
        scores[j] = scale * dot;
        if (scores[j] > row_max) row_max = scores[j];
    }
    double row_sum = 0.0;
    for (int j = 0; j < n_keys; j++) {
        scores[j] = exp(scores[j] - row_max);
        row_sum += scores[j];
    }
    for (int d = 0; d < D; d++) out_row[d] = 0.0;
    for (int j = 0; j < n_keys; j++) {
        const float *v_row = v + head + (size_t)j * D;
        const double p = scores[j] / row_sum;
        for (int d = 0; d < D; d++) out_row[d] += p * (double)v_row[d];
    }
}
