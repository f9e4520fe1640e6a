// test_check.c - the checker must pass a right answer and catch each kind of wrong one.
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "half.h"
#include "reference.h"
#include "test_util.h"

// A correct fp16 output, from the reference itself.
static void exact_output(const attn_shape *s, const float *q, const float *k, const float *v,
                         uint16_t *out) {
    double *scores = malloc(sizeof(double) * s->seq), *row = malloc(sizeof(double) * s->dim);
    for (int bh = 0; bh < s->batch * s->heads; bh++)
        for (int i = 0; i < s->seq; i++) {
            reference_row(s, q, k, v, bh / s->heads, bh % s->heads, i, scores, row);
            for (int d = 0; d < s->dim; d++)
                out[((size_t)bh * s->seq + i) * s->dim + d] = float_to_half((float)row[d]);
        }
    free(scores), free(row);
}

static check_result run(const attn_shape *s, const float *q, const float *k, const float *v,
                        const uint16_t *out) {
    return check_output(s, q, k, v, out);
}

int main(void) {
    attn_shape s = {.batch = 2, .heads = 3, .seq = 37, .dim = 64, .causal = 1};
    const size_t n = attn_elems(&s);
    float *q = malloc(n * sizeof(float)), *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
    uint16_t *out = malloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) {  // fp16-exact inputs, like the harness's
        q[i] = half_to_float(float_to_half((float)sin(0.37 * i)));
        k[i] = half_to_float(float_to_half((float)cos(0.11 * i)));
        v[i] = half_to_float(float_to_half((float)sin(0.05 * i + 1.0)));
    }

    exact_output(&s, q, k, v, out);
    check_result r = run(&s, q, k, v, out);
    EXPECT(check_passed(&r) && r.full && r.rows_checked == 2 * 3 * 37, "exact output must pass");
    EXPECT(r.max_abs_err < 2e-3, "fp16 rounding only, got %.3g", r.max_abs_err);

    const size_t victim = n / 2 + 5;  // some element in the middle
    uint16_t saved = out[victim];

    out[victim] = HALF_POISON;  // never written
    r = run(&s, q, k, v, out);
    EXPECT(!check_passed(&r) && r.unwritten == 1 && r.first_bad == victim, "poison must fail");

    out[victim] = float_to_half(NAN);
    r = run(&s, q, k, v, out);
    EXPECT(!check_passed(&r) && r.nonfinite == 1 && r.unwritten == 0, "NaN must fail");

    out[victim] = float_to_half(INFINITY);
    r = run(&s, q, k, v, out);
    EXPECT(!check_passed(&r) && r.nonfinite == 1, "Inf must fail");

    out[victim] = float_to_half(half_to_float(saved) + 0.05f);  // a small but real error
    r = run(&s, q, k, v, out);
    EXPECT(!check_passed(&r) && r.over_tolerance == 1 && r.first_bad == victim, "error 0.05 must fail");
    out[victim] = saved;

    // A whole row off by 2%. Here |O| < 0.2 while its element bounds are about 1e-3: the
    // elements whose |O| is largest already break their bound, and the row its row bound.
    {
        size_t row = ((size_t)(0 * 3 + 2) * 37 + 20) * 64;
        uint16_t keep[64];
        for (int d = 0; d < 64; d++) {
            keep[d] = out[row + d];
            out[row + d] = float_to_half(half_to_float(out[row + d]) * 1.02f);
        }
        r = run(&s, q, k, v, out);
        EXPECT(!check_passed(&r) && r.over_tolerance > 0 && r.first_bad >= row && r.first_bad < row + 64,
               "a row 2%% off must fail (over %zu, rows %zu)", r.over_tolerance, r.rows_over_rel_l2);
        for (int d = 0; d < 64; d++) out[row + d] = keep[d];
    }

    // A causal kernel that forgot the mask on one row: row 3 of head (1, 1) averaged all keys.
    attn_shape open = s;
    open.causal = 0;
    double scores[37], row[64];
    reference_row(&open, q, k, v, 1, 1, 3, scores, row);
    size_t base = ((size_t)(1 * 3 + 1) * 37 + 3) * 64;
    for (int d = 0; d < 64; d++) out[base + d] = float_to_half((float)row[d]);
    r = run(&s, q, k, v, out);
    EXPECT(!check_passed(&r) && r.over_tolerance > 0, "missing causal mask must fail");

    // A long row whose every element is moved by 90% of its element bound, all the same way: no
    // element fails, but rounding errors do not line up like that over 64 elements, and the row
    // bound catches it (a systematic error such as a lost or doubled key tile looks like this).
    {
        attn_shape lng = {.batch = 1, .heads = 1, .seq = 2048, .dim = 64, .causal = 0};
        const size_t nl = attn_elems(&lng);
        float *lq = malloc(nl * sizeof(float)), *lk = malloc(nl * sizeof(float)), *lv = malloc(nl * sizeof(float));
        uint16_t *lo = malloc(nl * sizeof(uint16_t));
        test_fill_normal(lq, nl, 1, 0.0, 1.0);
        test_fill_normal(lk, nl, 2, 0.0, 1.0);
        test_fill_normal(lv, nl, 3, 0.0, 1.0);
        exact_output(&lng, lq, lk, lv, lo);
        const int victim_row = 1000;
        double *scratch = malloc(sizeof(double) * 2 * lng.seq), ref[64], worst[64], rss[64];
        reference_row_error(&lng, lq, lk, lv, 0, 0, victim_row, scratch, ref, (reference_error){worst, rss});
        const size_t base = (size_t)victim_row * 64;
        for (int d = 0; d < 64; d++) {  // the largest fp16 value at most ref + 0.9 bound
            const double target = ref[d] + 0.9 * check_element_bound(worst[d], ref_rounding_of(ATTN_FP16).u);
            uint16_t h = float_to_half((float)target);
            if (half_to_float(h) > target) h = (h & 0x8000) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
            lo[base + d] = h;
        }
        r = run(&lng, lq, lk, lv, lo);
        EXPECT(!check_passed(&r) && r.over_tolerance == 0 && r.rows_over_rel_l2 == 1 && r.first_bad_row &&
                   r.first_bad == base,
               "a row moved by 0.9 of its element bounds must fail the row bound only (over %zu, rows %zu)",
               r.over_tolerance, r.rows_over_rel_l2);
        free(lq), free(lk), free(lv), free(lo), free(scratch);
    }

    // Sampled mode (a large problem) must still see the last row, where tails go wrong.
    attn_shape big = {.batch = 1, .heads = 1, .seq = 3000, .dim = 128, .causal = 0};
    size_t nb = attn_elems(&big);
    float *bq = calloc(nb, sizeof(float)), *bk = calloc(nb, sizeof(float)), *bv = calloc(nb, sizeof(float));
    uint16_t *bo = malloc(nb * sizeof(uint16_t));
    for (size_t i = 0; i < nb; i++) bv[i] = 1.0f;  // all-equal scores: O is all ones
    for (size_t i = 0; i < nb; i++) bo[i] = float_to_half(1.0f);
    bo[nb - 1] = float_to_half(0.0f);  // last element of the last row wrong
    r = run(&big, bq, bk, bv, bo);
    EXPECT(!r.full && !check_passed(&r) && r.first_bad == nb - 1, "sampled check must include row S-1");
    free(bq), free(bk), free(bv), free(bo);

    free(q), free(k), free(v), free(out);
    return test_summary("test_check");
}
