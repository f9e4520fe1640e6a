// reference_bwd.c - dQ, dK, dV of softmax(scale q k^T) v in float64 (see reference_bwd.h), and the
// error a correct fp16 or bf16 kernel can make on them.
//
// The rounding points of a FlashAttention-2 style backward (u and m the element type's unit
// roundoff and smallest normal, reference.h: 2^-11 and 2^-14 for fp16, written "fp16" below for
// either type; sigma_ij = D 2^-23 scale sum_d |q_id k_jd| bounds the fp32 score's error), each with
// the largest error it adds:
//   δ_i from the kernel's fp16 O:  O is off by its own rounding, u (|O_id| + m), and by the forward's
//                                  rounding of exp(s - max), which moves O_i by sum_j e_ij P_ij V_j
//                                  with one |e_ij| <= u (1 + m P_max / P_ij) shared by all d, so
//                                  δ_i by sum_j e_ij P_ij dP_ij; its fp32 scores move δ_i by
//                                  sum_j P_ij sigma_ij |dP_ij - δ_i|; its fp32 dot by D 2^-23
//                                  sum_d |dO_id O_id|. This error is the same for every key j of
//                                  row i: in dQ_i it moves dS_ij by P_ij err(δ_i), so dQ_i by
//                                  scale err(δ_i) (P K)_i, a sum with signs; in dK_j, whose terms
//                                  come from different rows, by scale sum_i P_ij err(δ_i) |q_id|.
//   P recomputed in fp32:          relative error sigma_ij, in dS and in P.
//   dP_ij in fp32:                 D 2^-23 sum_d |dO_id v_jd|, and both dP_ij and δ_i rounded to
//                                  fp32 before the subtraction: 2^-24 (|dP_ij| + |δ_i|).
//   P and dS to fp16:              u (P_ij + m) before dV's product; u (scale |dS_ij| + m) before
//                                  dQ's and dK's (whether or not the kernel scales dS first).
//   dQ, dK, dV to fp16:            u (|x| + m).
// fp32 sums over keys or queries, exp and lse are covered by the checker's factor CHECK_C1.
#include "reference_bwd.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "omp_compat.h"

// a.b, and in *magnitude sum |a_d b_d|, the scale of a kernel's fp32 rounding error of a.b.
static double dot(const float *a, const float *b, int D, double *magnitude) {
    double acc = 0.0, mag = 0.0;
    for (int d = 0; d < D; d++) {
        const double product = (double)a[d] * (double)b[d];
        acc += product;
        mag += fabs(product);
    }
    *magnitude = mag;
    return acc;
}

// Where Q[b, h, :, :] (and O, dO, dQ) starts; ref_kv_start (reference.h) gives its K/V head's start.
static size_t head_start(const attn_shape *s, int b, int h) {
    return ((size_t)b * s->heads + h) * (size_t)s->seq * s->dim;
}

static void *checked_malloc(size_t bytes) {
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "reference: out of host memory\n");
        exit(1);
    }
    return p;
}

void reference_bwd_stats(const attn_shape *shape, const float *q, const float *k, const float *v,
                         const float *d_o, int b, int h, double *lse, double *delta,
                         reference_error delta_err) {
    const ref_rounding r = ref_rounding_of(shape->dtype);
    const int S = shape->seq, D = shape->dim, S_kv = attn_kv_seq(shape);
    const size_t head = head_start(shape, b, h), kv = ref_kv_start(shape, b, h);
    const double scale = 1.0 / sqrt((double)D);
    OMP_PARALLEL
    {
    // Per row: the exp of each score, its fp32 error bound, dP, and O.
    double *e = checked_malloc(sizeof(double) * ((size_t)3 * S_kv + D));
    double *sigma = e + S_kv, *dp = e + 2 * (size_t)S_kv, *o = e + 3 * (size_t)S_kv;
    OMP_FOR_DYNAMIC  // causal rows differ in length
    for (int i = 0; i < S; i++) {
        const float *q_row = q + head + (size_t)i * D, *do_row = d_o + head + (size_t)i * D;
        const int n_keys = ref_keys_seen(shape, i);
        double row_max = -INFINITY, magnitude;
        for (int j = 0; j < n_keys; j++) {
            e[j] = scale * dot(q_row, k + kv + (size_t)j * D, D, &magnitude);
            sigma[j] = D * REF_F32_STEP * scale * magnitude;
            if (e[j] > row_max) row_max = e[j];
        }
        // The sum of exp and sum_j exp(s_ij - max) dP_ij, normalized at the end; O alongside.
        double row_sum = 0.0, weighted = 0.0;
        for (int d = 0; d < D; d++) o[d] = 0.0;
        for (int j = 0; j < n_keys; j++) {
            const float *v_row = v + kv + (size_t)j * D;
            e[j] = exp(e[j] - row_max);
            dp[j] = dot(do_row, v_row, D, &magnitude);
            row_sum += e[j];
            weighted += e[j] * dp[j];
            if (delta_err.worst)
                for (int d = 0; d < D; d++) o[d] += e[j] * (double)v_row[d];
        }
        lse[i] = row_max + log(row_sum);
        delta[i] = weighted / row_sum;
        if (!delta_err.worst) continue;

        const double p_max = 1.0 / row_sum;
        double worst = 0.0, squares = 0.0, o_magnitude = 0.0;
        for (int j = 0; j < n_keys; j++) {  // the forward's P rounding and fp32 scores
            const double p = e[j] / row_sum;
            const double term = r.u * (p + r.min_normal * p_max) * fabs(dp[j]) +
                                p * sigma[j] * fabs(dp[j] - delta[i]);
            worst += term;
            squares += term * term;
        }
        for (int d = 0; d < D; d++) {  // O rounded to fp16
            const double o_d = o[d] / row_sum;
            const double term = r.u * (fabs(o_d) + r.min_normal) * fabs((double)do_row[d]);
            worst += term;
            squares += term * term;
            o_magnitude += fabs(o_d * do_row[d]);
        }
        const double fp32 = D * REF_F32_STEP * o_magnitude + 0.5 * REF_F32_STEP * fabs(delta[i]);
        worst += fp32;
        squares += fp32 * fp32;
        delta_err.worst[i] = worst / r.u;
        delta_err.rss[i] = sqrt(squares) / r.u;
    }
    free(e);
    }
}

// The error of one dS_ij that reaches dQ or dK through its product: fp32 scores in P, fp32 dP
// and the subtraction, dS rounded to fp16. Absolute; δ_i's own error is added by the callers.
static double ds_error(ref_rounding r, double p, double dp, double ds, double delta_i, double sigma,
                       double dp_magnitude, double scale, int D) {
    return r.u * (scale * fabs(ds) + r.min_normal) + sigma * scale * fabs(ds) +
           scale * p * (D * REF_F32_STEP * dp_magnitude + 0.5 * REF_F32_STEP * (fabs(dp) + fabs(delta_i)));
}

// Adds the output's own rounding to accumulated error terms and turns both into units of u.
static void finish_error(ref_rounding r, const double *value, reference_error err, int D) {
    for (int d = 0; d < D; d++) {
        const double rounding = r.u * (fabs(value[d]) + r.min_normal);
        err.worst[d] = (err.worst[d] + rounding) / r.u;
        err.rss[d] = sqrt(err.rss[d] + rounding * rounding) / r.u;
    }
}

void reference_dq_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                      const float *d_o, int b, int h, const double *lse, const double *delta,
                      reference_error delta_err, int i, double *dq_row, reference_error dq_err) {
    const ref_rounding r = ref_rounding_of(shape->dtype);
    const int D = shape->dim;
    const size_t head = head_start(shape, b, h), kv = ref_kv_start(shape, b, h);
    const double scale = 1.0 / sqrt((double)D);
    const float *q_row = q + head + (size_t)i * D, *do_row = d_o + head + (size_t)i * D;
    const int n_keys = ref_keys_seen(shape, i);
    double *pk = dq_err.worst ? checked_malloc(sizeof(double) * (size_t)D) : NULL;  // (P K)_i
    for (int d = 0; d < D; d++) {
        dq_row[d] = 0.0;
        if (pk) pk[d] = dq_err.worst[d] = dq_err.rss[d] = 0.0;
    }
    for (int j = 0; j < n_keys; j++) {
        const float *k_row = k + kv + (size_t)j * D;
        double qk_magnitude, dp_magnitude;
        const double p = exp(scale * dot(q_row, k_row, D, &qk_magnitude) - lse[i]);
        const double dp = dot(do_row, v + kv + (size_t)j * D, D, &dp_magnitude);
        const double ds = p * (dp - delta[i]);
        for (int d = 0; d < D; d++) dq_row[d] += scale * ds * (double)k_row[d];
        if (!pk) continue;
        const double sigma = D * REF_F32_STEP * scale * qk_magnitude;
        const double c = ds_error(r, p, dp, ds, delta[i], sigma, dp_magnitude, scale, D);
        for (int d = 0; d < D; d++) {
            const double term = c * fabs((double)k_row[d]);
            dq_err.worst[d] += term;
            dq_err.rss[d] += term * term;
            pk[d] += p * (double)k_row[d];
        }
    }
    if (!pk) return;
    for (int d = 0; d < D; d++) {  // δ_i's error, the same in every dS_ij of the row
        const double reach = r.u * scale * fabs(pk[d]);
        dq_err.worst[d] += reach * delta_err.worst[i];
        dq_err.rss[d] += (reach * delta_err.rss[i]) * (reach * delta_err.rss[i]);
    }
    finish_error(r, dq_row, dq_err, D);
    free(pk);
}

void reference_dkdv_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                        const float *d_o, int b, int kv_h, const double *lse, const double *delta,
                        reference_error delta_err, int j, double *dk_row, double *dv_row,
                        reference_error dk_err, reference_error dv_err) {
    const ref_rounding r = ref_rounding_of(shape->dtype);
    const int S = shape->seq, D = shape->dim, group = attn_group(shape);
    const size_t kv = ref_kv_start(shape, b, kv_h * group);
    const double scale = 1.0 / sqrt((double)D);
    const float *k_row = k + kv + (size_t)j * D, *v_row = v + kv + (size_t)j * D;
    const int want_error = dk_err.worst != NULL;
    for (int d = 0; d < D; d++) {
        dk_row[d] = dv_row[d] = 0.0;
        if (want_error) dk_err.worst[d] = dk_err.rss[d] = dv_err.worst[d] = dv_err.rss[d] = 0.0;
    }
    // Every query of every query head that reads this K/V head and sees key j (causal: the queries
    // i with j <= i + S_kv - S).
    const int first_query = shape->causal && j > attn_causal_offset(shape) ? j - attn_causal_offset(shape) : 0;
    for (int task = 0; task < group * (S - first_query); task++) {
        const int g = task / (S - first_query), i = first_query + task % (S - first_query);
        const size_t head = head_start(shape, b, kv_h * group + g), stat = (size_t)g * S + i;
        const float *q_row = q + head + (size_t)i * D, *do_row = d_o + head + (size_t)i * D;
        double qk_magnitude, dp_magnitude;
        const double p = exp(scale * dot(q_row, k_row, D, &qk_magnitude) - lse[stat]);
        const double dp = dot(do_row, v_row, D, &dp_magnitude);
        const double ds = p * (dp - delta[stat]);
        for (int d = 0; d < D; d++) {
            dv_row[d] += p * (double)do_row[d];
            dk_row[d] += scale * ds * (double)q_row[d];
        }
        if (!want_error) continue;
        const double sigma = D * REF_F32_STEP * scale * qk_magnitude;
        const double cv = r.u * (p + r.min_normal) + sigma * p;
        const double ck = ds_error(r, p, dp, ds, delta[stat], sigma, dp_magnitude, scale, D);
        // δ_i's error enters dS_ij once per query; queries' errors are independent of each other.
        const double ck_worst = ck + r.u * scale * p * delta_err.worst[stat];
        const double ck_rss = ck + r.u * scale * p * delta_err.rss[stat];
        for (int d = 0; d < D; d++) {
            const double tv = cv * fabs((double)do_row[d]), q_d = fabs((double)q_row[d]);
            dv_err.worst[d] += tv;
            dv_err.rss[d] += tv * tv;
            dk_err.worst[d] += ck_worst * q_d;
            dk_err.rss[d] += (ck_rss * q_d) * (ck_rss * q_d);
        }
    }
    if (!want_error) return;
    finish_error(r, dk_row, dk_err, D);
    finish_error(r, dv_row, dv_err, D);
}
