// test_reference.c - the float64 reference on cases whose answer is known in closed form.
#include <math.h>
#include <stdlib.h>

#include "reference.h"
#include "test_util.h"

enum { S = 9, D = 64 };
static float q[S * D], k[S * D], v[S * D];
static double scores[S], out[D];

static void fill(float *x, float value) {
    for (int i = 0; i < S * D; i++) x[i] = value;
}

static void fill_v_distinct(void) {
    for (int j = 0; j < S; j++)
        for (int d = 0; d < D; d++) v[j * D + d] = (float)(j * 0.5 - d * 0.25 + 1.0);
}

static double max_diff_to_v_row(int j) {
    double worst = 0.0;
    for (int d = 0; d < D; d++) worst = fmax(worst, fabs(out[d] - v[j * D + d]));
    return worst;
}

int main(void) {
    attn_shape shape = {.batch = 1, .heads = 1, .seq = S, .dim = D, .causal = 0};
    fill_v_distinct();

    // 1. Identical keys: every score equal, so softmax is uniform and O is the mean of V's rows.
    fill(q, 0.7f);
    fill(k, -0.3f);
    for (int row = 0; row < S; row++) {
        reference_row(&shape, q, k, v, 0, 0, row, scores, out);
        for (int d = 0; d < D; d++) {
            double mean = 0.0;
            for (int j = 0; j < S; j++) mean += (double)v[j * D + d] / S;
            EXPECT(fabs(out[d] - mean) < 1e-12, "row %d d %d: %.17g vs mean %.17g", row, d, out[d], mean);
        }
    }

    // 2. One dominant key: key 4 aligned with q, the others orthogonal to it. Score gap
    //    8 * 1 * 64 / sqrt(64) = 64, so every other weight is below e^-64: O = V[4].
    fill(q, 1.0f);
    fill(k, 0.0f);
    for (int d = 0; d < D; d++) k[4 * D + d] = 8.0f;
    reference_row(&shape, q, k, v, 0, 0, 2, scores, out);
    EXPECT(max_diff_to_v_row(4) < 1e-12, "dominant key: max diff %.3g", max_diff_to_v_row(4));

    // 3. Causal row 0 sees only key 0, whatever the scores: O = V[0].
    shape.causal = 1;
    for (int i = 0; i < S * D; i++) q[i] = (float)sin(i), k[i] = (float)cos(3.0 * i);
    reference_row(&shape, q, k, v, 0, 0, 0, scores, out);
    EXPECT(max_diff_to_v_row(0) == 0.0, "causal row 0: max diff %.3g", max_diff_to_v_row(0));
    //    ... and causal row 1 is a convex mix of V[0] and V[1] only.
    reference_row(&shape, q, k, v, 0, 0, 1, scores, out);
    for (int d = 0; d < D; d++) {
        double lo = fmin(v[d], v[D + d]), hi = fmax(v[d], v[D + d]);
        EXPECT(out[d] >= lo - 1e-12 && out[d] <= hi + 1e-12, "causal row 1 d %d: %.17g", d, out[d]);
    }
    shape.causal = 0;

    // 4. Scores of magnitude 1e4: q = 100, k = +-12.5 gives scores of +-1e4. exp() of the raw
    //    scores would overflow; the max-subtracted softmax must stay finite and pick key 7.
    fill(q, 100.0f);
    fill(k, -12.5f);
    for (int d = 0; d < D; d++) k[7 * D + d] = 12.5f;
    reference_row(&shape, q, k, v, 0, 0, 5, scores, out);
    int finite = 1;
    for (int d = 0; d < D; d++) finite &= isfinite(out[d]);
    EXPECT(finite, "large scores gave a non-finite output");
    EXPECT(max_diff_to_v_row(7) < 1e-12, "large scores: max diff to V[7] %.3g", max_diff_to_v_row(7));

    // 5. Batch and head offsets: head (1, 2) of a [2, 3, S, D] tensor is read, not head (0, 0).
    attn_shape big = {.batch = 2, .heads = 3, .seq = S, .dim = D, .causal = 1};
    size_t n = (size_t)2 * 3 * S * D, head = (size_t)(1 * 3 + 2) * S * D;
    float *bq = calloc(n, sizeof(float)), *bk = calloc(n, sizeof(float)), *bv = calloc(n, sizeof(float));
    for (int d = 0; d < D; d++) bv[head + d] = 42.0f;  // V[1, 2, 0, :]
    reference_row(&big, bq, bk, bv, 1, 2, 0, scores, out);
    EXPECT(out[0] == 42.0 && out[D - 1] == 42.0, "head offset: got %g", out[0]);
    free(bq), free(bk), free(bv);

    return test_summary("test_reference");
}
