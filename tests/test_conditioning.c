// test_conditioning.c - the checker where fp16 error is large next to the result: V with a large
// mean, scores of large magnitude, dP_ij and δ_i that nearly cancel. A kernel simulated on the
// CPU with a FlashAttention-2 kernel's roundings must pass; its result moved a few fp16 ulps past
// one element's bound must fail; the same kernel with a bug (no causal mask, a key tile skipped)
// must fail too.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "half.h"
#include "reference.h"
#include "reference_bwd.h"
#include "test_util.h"

enum { KEY_TILE = 64 };

static float fp16(float x) { return half_to_float(float_to_half(x)); }

typedef enum { CORRECT, NO_CAUSAL_MASK, SKIP_KEY_TILE } kernel_bug;

static float dot32(const float *a, const float *b, int D) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

// One head's forward and backward with a FlashAttention-2 kernel's roundings: fp32 scores and
// sums; an online softmax over KEY_TILE-key tiles whose exp(s - running max) is rounded to fp16
// before P V while the row sum adds the unrounded values; O rounded to fp16. Backward from that
// O: δ_i = dO_i.O_i in fp32; P recomputed from the fp32 lse; P and dS rounded to fp16 before
// their products; dQ, dK, dV rounded to fp16. SKIP_KEY_TILE drops keys 64..127 of every row.
static void fp16_kernel(const attn_shape *s, const float *q, const float *k, const float *v,
                        const float *d_o, kernel_bug bug, uint16_t *out[4] /* o, dq, dk, dv */) {
    const int S = s->seq, D = s->dim;
    const float scale = 1.0f / sqrtf((float)D);
    float *lse = malloc(sizeof(float) * S), *delta = malloc(sizeof(float) * S);
    float *acc = malloc(sizeof(float) * D), *o = malloc(sizeof(float) * (size_t)S * D);
    for (int bh = 0; bh < s->batch * s->heads; bh++) {
        const size_t head = (size_t)bh * S * D;
        const float *qh = q + head, *kh = k + head, *vh = v + head, *doh = d_o + head;
        const int causal = s->causal && bug != NO_CAUSAL_MASK;
#define SEES(i, j) ((!causal || (j) <= (i)) && !(bug == SKIP_KEY_TILE && (j) >= 64 && (j) < 128))
        for (int i = 0; i < S; i++) {
            float m = -INFINITY, l = 0.0f;
            for (int d = 0; d < D; d++) acc[d] = 0.0f;
            for (int t0 = 0; t0 < S; t0 += KEY_TILE) {
                const int t1 = t0 + KEY_TILE < S ? t0 + KEY_TILE : S;
                float tile_max = -INFINITY, scores[KEY_TILE];
                for (int j = t0; j < t1; j++) {
                    scores[j - t0] = SEES(i, j) ? dot32(qh + (size_t)i * D, kh + (size_t)j * D, D) * scale : -INFINITY;
                    tile_max = fmaxf(tile_max, scores[j - t0]);
                }
                if (tile_max == -INFINITY) continue;
                const float m_new = fmaxf(m, tile_max), alpha = expf(m - m_new);
                l *= alpha;
                for (int d = 0; d < D; d++) acc[d] *= alpha;
                for (int j = t0; j < t1; j++) {
                    const float p = expf(scores[j - t0] - m_new), p16 = fp16(p);
                    l += p;
                    for (int d = 0; d < D; d++) acc[d] += p16 * vh[(size_t)j * D + d];
                }
                m = m_new;
            }
            for (int d = 0; d < D; d++) {
                o[(size_t)i * D + d] = fp16(acc[d] / l);
                out[0][head + (size_t)i * D + d] = float_to_half(o[(size_t)i * D + d]);
            }
            lse[i] = m + logf(l);
            delta[i] = dot32(doh + (size_t)i * D, o + (size_t)i * D, D);
        }
        // dQ row by row, then dK and dV key by key, as the two backward kernels do.
        for (int pass = 0; pass < 2; pass++)
            for (int r = 0; r < S; r++) {
                float *acc2 = o;  // O is no longer needed: dK's accumulator goes after acc
                for (int d = 0; d < D; d++) acc[d] = acc2[d] = 0.0f;
                for (int c = 0; c < S; c++) {
                    const int i = pass == 0 ? r : c, j = pass == 0 ? c : r;
                    if (!SEES(i, j)) continue;
                    const float p = expf(dot32(qh + (size_t)i * D, kh + (size_t)j * D, D) * scale - lse[i]);
                    const float dp = dot32(doh + (size_t)i * D, vh + (size_t)j * D, D);
                    const float ds16 = fp16(p * (dp - delta[i])), p16 = fp16(p);
                    for (int d = 0; d < D; d++) {
                        if (pass == 0) {
                            acc[d] += ds16 * kh[(size_t)j * D + d];
                        } else {
                            acc[d] += ds16 * qh[(size_t)i * D + d];
                            acc2[d] += p16 * doh[(size_t)i * D + d];
                        }
                    }
                }
                for (int d = 0; d < D; d++) {
                    const size_t e = head + (size_t)r * D + d;
                    if (pass == 0) {
                        out[1][e] = float_to_half(acc[d] * scale);
                    } else {
                        out[2][e] = float_to_half(acc[d] * scale);
                        out[3][e] = float_to_half(acc2[d]);
                    }
                }
            }
#undef SEES
    }
    free(lse), free(delta), free(acc), free(o);
}

// The fp16 value `ulps` steps past ref + bound (ulps >= 1).
static uint16_t half_past(double ref, double bound, int ulps) {
    const double limit = ref + bound;
    uint16_t h = float_to_half((float)limit);
    int steps = 0;
    while (steps < ulps) {
        h = (h & 0x8000) ? (h == 0x8000 ? 0x0001 : (uint16_t)(h - 1)) : (uint16_t)(h + 1);
        if (half_to_float(h) > limit) steps++;
    }
    return h;
}

typedef struct {
    const char *name;
    double qk_std, v_mean, v_std, do_mean;
} regime;

static void run_regime(const regime *g, attn_shape s, uint64_t seed) {
    const size_t n = attn_elems(&s);
    float *t[4];
    uint16_t *out[4], *bad[4];
    for (int i = 0; i < 4; i++) {
        t[i] = malloc(n * sizeof(float));
        out[i] = malloc(n * sizeof(uint16_t));
        bad[i] = malloc(n * sizeof(uint16_t));
    }
    test_fill_normal(t[0], n, seed, 0.0, g->qk_std);
    test_fill_normal(t[1], n, seed + 1, 0.0, g->qk_std);
    test_fill_normal(t[2], n, seed + 2, g->v_mean, g->v_std);
    test_fill_normal(t[3], n, seed + 3, g->do_mean, 1.0);
    const float *q = t[0], *k = t[1], *v = t[2], *d_o = t[3];
    char label[160];
    snprintf(label, sizeof label, "%s, S=%d D=%d %s", g->name, s.seq, s.dim, s.causal ? "causal" : "non-causal");

    // 1. The simulated correct kernel passes, forward and backward.
    fp16_kernel(&s, q, k, v, d_o, CORRECT, out);
    const check_result fwd = check_output(&s, q, k, v, out[0]);
    const uint16_t *const grads[3] = {out[1], out[2], out[3]};
    const check_bwd_result bwd = check_backward(&s, q, k, v, d_o, grads);
    printf("%-58s error/bound: O %.3f, dQ %.3f, dK %.3f, dV %.3f\n", label, fwd.max_bound_ratio,
           bwd.dq.max_bound_ratio, bwd.dk.max_bound_ratio, bwd.dv.max_bound_ratio);
    EXPECT(check_passed(&fwd), "%s: a correct fp16 forward must pass", label);
    EXPECT(check_bwd_passed(&bwd), "%s: a correct fp16 backward must pass (dQ %zu+%zu, dK %zu+%zu, dV %zu+%zu)",
           label, bwd.dq.over_tolerance, bwd.dq.rows_over_rel_l2, bwd.dk.over_tolerance,
           bwd.dk.rows_over_rel_l2, bwd.dv.over_tolerance, bwd.dv.rows_over_rel_l2);

    // 2. One element of O and one of dQ moved 3 fp16 ulps past the bound the reference gives it.
    const int b = 0, h = s.heads - 1, row = s.seq - 1;
    const size_t base = (((size_t)b * s.heads + h) * s.seq + row) * s.dim;
    double *scratch = malloc(sizeof(double) * (6 * (size_t)s.seq + 3 * (size_t)s.dim));
    double *ref = scratch + 2 * (size_t)s.seq, *worst = ref + s.dim, *rss = worst + s.dim;
    double *stats = rss + s.dim;
    const int d = s.dim / 3;
    reference_row_error(&s, q, k, v, b, h, row, scratch, ref, (reference_error){worst, rss});
    memcpy(bad[0], out[0], n * sizeof(uint16_t));
    bad[0][base + d] = half_past(ref[d], check_element_bound(worst[d], ref_rounding_of(ATTN_FP16).u), 3);
    check_result r = check_output(&s, q, k, v, bad[0]);
    EXPECT(!check_passed(&r) && r.over_tolerance == 1 && r.first_bad == base + d,
           "%s: O 3 ulps past its bound must fail (over %zu)", label, r.over_tolerance);

    const reference_error delta_err = {stats + 2 * (size_t)s.seq, stats + 3 * (size_t)s.seq};
    reference_bwd_stats(&s, q, k, v, d_o, b, h, stats, stats + s.seq, delta_err);
    reference_dq_row(&s, q, k, v, d_o, b, h, stats, stats + s.seq, delta_err, row, ref,
                     (reference_error){worst, rss});
    memcpy(bad[1], out[1], n * sizeof(uint16_t));
    bad[1][base + d] = half_past(ref[d], check_element_bound(worst[d], ref_rounding_of(ATTN_FP16).u), 3);
    const uint16_t *const bad_grads[3] = {bad[1], out[2], out[3]};
    check_bwd_result rb = check_backward(&s, q, k, v, d_o, bad_grads);
    EXPECT(!check_bwd_passed(&rb) && rb.dq.over_tolerance == 1 && rb.dq.first_bad == base + d,
           "%s: dQ 3 ulps past its bound must fail (over %zu)", label, rb.dq.over_tolerance);

    // 3. Kernels with a bug fail: no causal mask (causal shapes), a skipped key tile (S > 128).
    for (kernel_bug bug = NO_CAUSAL_MASK; bug <= SKIP_KEY_TILE; bug++) {
        if ((bug == NO_CAUSAL_MASK && !s.causal) || (bug == SKIP_KEY_TILE && s.seq <= 128)) continue;
        fp16_kernel(&s, q, k, v, d_o, bug, bad);
        r = check_output(&s, q, k, v, bad[0]);
        const uint16_t *const buggy[3] = {bad[1], bad[2], bad[3]};
        rb = check_backward(&s, q, k, v, d_o, buggy);
        const char *what = bug == NO_CAUSAL_MASK ? "no causal mask" : "a skipped key tile";
        // With V within +-0.1 of 40, a skipped tile moves O by less than O's fp16 spacing there
        // (2^-5): no check of O can see it. The backward still does.
        if (g->v_std >= 1.0 || bug == NO_CAUSAL_MASK)
            EXPECT(!check_passed(&r), "%s: %s must fail the forward", label, what);
        EXPECT(!check_bwd_passed(&rb), "%s: %s must fail the backward", label, what);
    }
    free(scratch);
    for (int i = 0; i < 4; i++) free(t[i]), free(out[i]), free(bad[i]);
}

int main(void) {
    // Scores: q.k scale with q, k ~ N(0, qk_std^2) has a standard deviation of qk_std^2, so 3.2
    // gives scores of +-30 at three standard deviations.
    const regime regimes[] = {
        {"V ~ N(40, 1)", 1.0, 40.0, 1.0, 0.0},
        {"scores to +-30", 3.2, 0.0, 1.0, 0.0},
        {"dP ~ δ_i: V ~ N(40, 0.1), dO ~ N(1, 1)", 1.0, 40.0, 0.1, 1.0},
        {"all three", 3.2, 40.0, 0.1, 1.0},
    };
    const int seqs[] = {2, 3, 17, 100, 300};
    uint64_t seed = 1;
    for (size_t g = 0; g < sizeof regimes / sizeof regimes[0]; g++)
        for (size_t i = 0; i < sizeof seqs / sizeof seqs[0]; i++)
            for (int causal = 0; causal <= 1; causal++) {
                attn_shape s = {.batch = 1, .heads = 2, .seq = seqs[i], .dim = 64, .causal = causal};
                run_regime(&regimes[g], s, seed += 4);
            }
    // A long row at D = 128.
    attn_shape long_row = {.batch = 1, .heads = 1, .seq = 1023, .dim = 128, .causal = 1};
    run_regime(&regimes[0], long_row, seed += 4);
    return test_summary("test_conditioning");
}
