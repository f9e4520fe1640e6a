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
#include <stdlib.h>

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

// An FP8 forward multiplies e4m3 values, and the tensor cores sum their products with fewer bits
// than fp32 (DeepSeek-V3's report, section 3.3.2, measures about 14): taken here as exact to
// REF_FP8_SUM_STEP of the magnitudes per instruction, which sums 32 products.
#define REF_FP8_SUM_STEP 0x1p-13

// reference_row_error and its FP8 form (fp8 not NULL: q, k and v are then the rounded inputs,
// fp8->q_hat ...) in one: the row, and its error terms.
static void row_error(const attn_shape *shape, const float *q, const float *k, const float *v, const ref_fp8 *fp8,
                      int b, int h, int row, double *scratch, double *out_row, reference_error err) {
    const int S = shape->seq, D = shape->dim, S_kv = attn_kv_seq(shape);
    const size_t q_head = ((size_t)b * shape->heads + h) * (size_t)S * D;  // start of Q[b, h, :, :]
    const size_t kv_head = ref_kv_start(shape, b, h);
    const int n_keys = ref_keys_seen(shape, row);  // causal: bottom-right, the last query sees every key
    const int want_error = err.worst != NULL;
    const ref_rounding r = ref_rounding_of(shape->dtype);
    double *p = scratch, *sigma = want_error ? scratch + S_kv : NULL;

    // Subtracting the row max before exp() keeps exp() in (0, 1]: no overflow for any score.
    const float *q_row = q + q_head + (size_t)row * D;
    const double row_max = row_scores(shape, q_row, k + kv_head, n_keys, p, sigma);
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

    // FP8: the scores' sums in the tensor cores (D / 32 instructions of 32 products each).
    if (fp8)
        for (int j = 0; j < n_keys; j++) {
            const float *k_row = k + kv_head + (size_t)j * D;
            double magnitude = 0.0;
            for (int d = 0; d < D; d++) magnitude += fabs((double)q_row[d] * k_row[d]);
            sigma[j] += (D / 32) * REF_FP8_SUM_STEP * magnitude / sqrt((double)D);
        }

    // Error terms, absolute, one per key and one for the output's rounding: summed into `worst`,
    // summed in squares into `rss`, then both turned into units of the check's u. P is rounded to
    // the element type, or, FP8, to e4m3 (unscaled: P <= 1), and P V is summed 32 keys an
    // instruction with REF_FP8_SUM_STEP.
    const double u_p = fp8 ? E4M3_U : r.u, min_p = fp8 ? E4M3_MIN_NORMAL : r.min_normal;
    const double sums = fp8 ? (double)((n_keys + 31) / 32) * REF_FP8_SUM_STEP : 0.0;
    const double p_max = 1.0 / row_sum;
    for (int d = 0; d < D; d++) err.worst[d] = err.rss[d] = 0.0;
    for (int j = 0; j < n_keys; j++) {
        const float *v_row = v + kv_head + (size_t)j * D;
        const double rounding = u_p * (p[j] + min_p * p_max) + sums * p[j], moved = p[j] * sigma[j];
        for (int d = 0; d < D; d++) {
            const double term = rounding * fabs((double)v_row[d]) + moved * fabs(v_row[d] - out_row[d]);
            err.worst[d] += term;
            err.rss[d] += term * term;
        }
    }
    const double unit = ref_check_unit(shape);
    for (int d = 0; d < D; d++) {
        const double rounding = r.u * (fabs(out_row[d]) + r.min_normal);  // O in the element type
        err.worst[d] = (err.worst[d] + rounding) / unit;
        err.rss[d] = sqrt(err.rss[d] + rounding * rounding) / unit;
    }
}

void reference_row_error(const attn_shape *shape, const float *q, const float *k, const float *v,
                         int b, int h, int row, double *scratch, double *out_row,
                         reference_error err) {
    row_error(shape, q, k, v, NULL, b, h, row, scratch, out_row, err);
}

void reference_row_error_fp8(const attn_shape *shape, const ref_fp8 *fp8, int b, int h, int row, double *scratch,
                             double *out_row, reference_error err) {
    row_error(shape, fp8->q_hat, fp8->k_hat, fp8->v_hat, fp8, b, h, row, scratch, out_row, err);
}

// amax / 448 over rows [r0, r1) of a [rows, D] head (1 where all are zero, as the kernel's).
// amax / 448 in float, as the kernel divides (the scale it multiplies back is this float); 1 for
// an all-zero block or tensor.
static double scale_of(float amax) { return amax > 0.0f ? (float)(amax / (float)E4M3_MAX) : 1.0f; }

// One tensor's scales: per block of a head's rows, or, from the largest amax of all its blocks,
// the tensor's one in every slot.
static void tensor_scales(const float *x, int heads_total, int rows, int D, int per_block, double *scale) {
    const int blocks = (rows + ATTN_FP8_BLOCK_ROWS - 1) / ATTN_FP8_BLOCK_ROWS;
    float tensor_amax = 0.0f;
    for (int hh = 0; hh < heads_total; hh++)
        for (int blk = 0; blk < blocks; blk++) {
            const int r0 = blk * ATTN_FP8_BLOCK_ROWS;
            const int r1 = r0 + ATTN_FP8_BLOCK_ROWS < rows ? r0 + ATTN_FP8_BLOCK_ROWS : rows;
            const float *head = x + (size_t)hh * rows * D;
            float amax = 0.0f;
            for (size_t i = (size_t)r0 * D; i < (size_t)r1 * D; i++) amax = fmaxf(amax, fabsf(head[i]));
            scale[(size_t)hh * blocks + blk] = scale_of(amax);
            tensor_amax = fmaxf(tensor_amax, amax);
        }
    if (!per_block)
        for (size_t i = 0; i < (size_t)heads_total * blocks; i++) scale[i] = scale_of(tensor_amax);
}

// x's rows rotated as the kernel rotates them (fp8_rotate_row_f32).
static float *rotated(const float *x, size_t rows, int D) {
    float *out = malloc(sizeof(float) * rows * D);
    if (!out) return NULL;
    for (size_t i = 0; i < rows * D; i++) out[i] = x[i];
    for (size_t r = 0; r < rows; r++) fp8_rotate_row_f32(out + r * D, D);
    return out;
}

// x's rows times the float inverse of their block's scale (in float, as the kernel multiplies),
// rounded to e4m3 and multiplied back: the values the kernel multiplies, bit for bit before the
// scale, as floats (e4m3's 4 significant bits times the scale, rounded once more).
static float *rounded(const float *x, int heads_total, int rows, int D, const double *scale) {
    const int blocks = (rows + ATTN_FP8_BLOCK_ROWS - 1) / ATTN_FP8_BLOCK_ROWS;
    float *out = malloc(sizeof(float) * heads_total * rows * D);
    if (!out) return NULL;
    for (size_t i = 0; i < (size_t)heads_total * rows * D; i++) {
        const size_t row = i / D;
        const float s = (float)scale[(row / rows) * blocks + (row % rows) / ATTN_FP8_BLOCK_ROWS], inverse = 1.0f / s;
        const float scaled = x[i] * inverse;  // in float, as the kernel multiplies
        out[i] = (float)(e4m3_round(scaled) * s);
    }
    return out;
}

ref_fp8 *ref_fp8_prepare(const attn_shape *shape, const float *q, const float *k, const float *v) {
    if (!shape->fp8) return NULL;
    const int D = shape->dim, S = shape->seq, S_kv = attn_kv_seq(shape);
    const int heads = shape->batch * shape->heads, kv_heads = shape->batch * attn_kv_heads(shape);
    const int per_block = (shape->fp8 & ATTN_FP8_BLOCK_SCALES) != 0;
    ref_fp8 *fp8 = calloc(1, sizeof(ref_fp8));
    if (!fp8) return NULL;
    if (shape->fp8 & ATTN_FP8_HADAMARD) {
        fp8->q_rot = rotated(q, (size_t)heads * S, D);
        fp8->k_rot = rotated(k, (size_t)kv_heads * S_kv, D);
    }
    const size_t q_blocks = (size_t)heads * ((S + ATTN_FP8_BLOCK_ROWS - 1) / ATTN_FP8_BLOCK_ROWS);
    const size_t kv_blocks = (size_t)kv_heads * ((S_kv + ATTN_FP8_BLOCK_ROWS - 1) / ATTN_FP8_BLOCK_ROWS);
    fp8->q_scale = malloc(sizeof(double) * q_blocks);
    fp8->k_scale = malloc(sizeof(double) * kv_blocks), fp8->v_scale = malloc(sizeof(double) * kv_blocks);
    if (!fp8->q_scale || !fp8->k_scale || !fp8->v_scale ||
        ((shape->fp8 & ATTN_FP8_HADAMARD) && (!fp8->q_rot || !fp8->k_rot))) {
        ref_fp8_free(fp8);
        return NULL;
    }
    tensor_scales(fp8->q_rot ? fp8->q_rot : q, heads, S, D, per_block, fp8->q_scale);
    tensor_scales(fp8->k_rot ? fp8->k_rot : k, kv_heads, S_kv, D, per_block, fp8->k_scale);
    tensor_scales(v, kv_heads, S_kv, D, per_block, fp8->v_scale);
    fp8->q_hat = rounded(fp8->q_rot ? fp8->q_rot : q, heads, S, D, fp8->q_scale);
    fp8->k_hat = rounded(fp8->k_rot ? fp8->k_rot : k, kv_heads, S_kv, D, fp8->k_scale);
    fp8->v_hat = rounded(v, kv_heads, S_kv, D, fp8->v_scale);
    if (!fp8->q_hat || !fp8->k_hat || !fp8->v_hat) {
        ref_fp8_free(fp8);
        return NULL;
    }
    return fp8;
}

void ref_fp8_free(ref_fp8 *fp8) {
    if (!fp8) return;
    free(fp8->q_rot), free(fp8->k_rot), free(fp8->q_scale), free(fp8->k_scale), free(fp8->v_scale);
    free(fp8->q_hat), free(fp8->k_hat), free(fp8->v_hat);
    free(fp8);
}

void reference_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                   int b, int h, int row, double *scores, double *out_row) {
    reference_row_error(shape, q, k, v, b, h, row, scores, out_row, (reference_error){NULL, NULL});
}
