// test_gqa.c - K and V with fewer heads or another length than Q: the float64 reference against the
// same reference on K and V repeated to every query head, causal attention aligned bottom-right,
// the checker on exact and on wrong gradients, and the shapes the harness refuses.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "half.h"
#include "reference.h"
#include "reference_bwd.h"
#include "stage_check.h"
#include "test_util.h"

static const reference_error NONE = {NULL, NULL};

// k [B, H_kv, S_kv, D] repeated to [B, H, S_kv, D]: query head h gets K/V head h / group.
static float *repeat_heads(const attn_shape *s, const float *kv) {
    const int H = s->heads, group = attn_group(s);
    const size_t head = (size_t)attn_kv_seq(s) * s->dim;
    float *out = malloc(sizeof(float) * (size_t)s->batch * H * head);
    for (int b = 0; b < s->batch; b++)
        for (int h = 0; h < H; h++)
            memcpy(out + ((size_t)b * H + h) * head, kv + ((size_t)b * attn_kv_heads(s) + h / group) * head,
                   sizeof(float) * head);
    return out;
}

static double max_difference(const double *a, const double *b, int n) {
    double m = 0.0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs(a[i] - b[i]));
    return m;
}

// The forward and the backward of a grouped shape against the shape with K and V repeated.
static void compare_with_repeated(attn_shape s) {
    attn_shape rep = s;
    rep.kv_heads = 0;  // as many K/V heads as query heads
    const int S = s.seq, S_kv = attn_kv_seq(&s), D = s.dim, group = attn_group(&s);
    const size_t nq = attn_elems(&s), nkv = attn_kv_elems(&s);
    float *q = malloc(sizeof(float) * nq), *d_o = malloc(sizeof(float) * nq);
    float *k = malloc(sizeof(float) * nkv), *v = malloc(sizeof(float) * nkv);
    test_fill_normal(q, nq, 1, 0, 1), test_fill_normal(d_o, nq, 2, 0, 1);
    test_fill_normal(k, nkv, 3, 0, 1), test_fill_normal(v, nkv, 4, 0, 1);
    float *k_rep = repeat_heads(&s, k), *v_rep = repeat_heads(&s, v);
    double *scratch = malloc(sizeof(double) * 2 * S_kv), *a = malloc(sizeof(double) * D),
           *b = malloc(sizeof(double) * D);
    for (int h = 0; h < s.heads; h++)
        for (int i = 0; i < S; i++) {
            reference_row(&s, q, k, v, 1, h, i, scratch, a);
            reference_row(&rep, q, k_rep, v_rep, 1, h, i, scratch, b);
            EXPECT(max_difference(a, b, D) == 0.0, "O[1, %d, %d]: grouped and repeated differ", h, i);
        }

    // dK and dV of K/V head 1 of batch 1 are the sums over its query heads' shares.
    double *lse = malloc(sizeof(double) * group * S), *delta = malloc(sizeof(double) * group * S);
    double *dk = malloc(sizeof(double) * D), *dv = malloc(sizeof(double) * D), *sum_k = calloc(D, sizeof(double)),
           *sum_v = calloc(D, sizeof(double));
    const int kv_h = attn_kv_heads(&s) - 1;  // the last K/V head
    for (int g = 0; g < group; g++) {
        reference_bwd_stats(&s, q, k, v, d_o, 1, kv_h * group + g, lse + g * S, delta + g * S, NONE);
        reference_dq_row(&s, q, k, v, d_o, 1, kv_h * group + g, lse + g * S, delta + g * S, NONE, S - 1, a, NONE);
        double *lse_rep = malloc(sizeof(double) * S), *delta_rep = malloc(sizeof(double) * S);
        reference_bwd_stats(&rep, q, k_rep, v_rep, d_o, 1, kv_h * group + g, lse_rep, delta_rep, NONE);
        reference_dq_row(&rep, q, k_rep, v_rep, d_o, 1, kv_h * group + g, lse_rep, delta_rep, NONE, S - 1, b, NONE);
        EXPECT(max_difference(a, b, D) == 0.0, "dQ of query head %d: grouped and repeated differ", kv_h * group + g);
        // The repeated shape's K/V head kv_h * group + g is that query head's alone.
        reference_dkdv_row(&rep, q, k_rep, v_rep, d_o, 1, kv_h * group + g, lse_rep, delta_rep, NONE, 0, dk, dv, NONE,
                           NONE);
        for (int d = 0; d < D; d++) sum_k[d] += dk[d], sum_v[d] += dv[d];
        free(lse_rep), free(delta_rep);
    }
    reference_dkdv_row(&s, q, k, v, d_o, 1, kv_h, lse, delta, NONE, 0, dk, dv, NONE, NONE);
    EXPECT(max_difference(dk, sum_k, D) < 1e-12 && max_difference(dv, sum_v, D) < 1e-12,
           "dK, dV of K/V head %d: not the sum over its query heads (off by %g, %g)", kv_h,
           max_difference(dk, sum_k, D), max_difference(dv, sum_v, D));
    free(q), free(d_o), free(k), free(v), free(k_rep), free(v_rep), free(scratch), free(a), free(b);
    free(lse), free(delta), free(dk), free(dv), free(sum_k), free(sum_v);
}

// Causal aligned bottom-right: with 3 queries and 7 keys, the last query sees every key and the
// first sees keys 0..4, as a non-causal row over the first 5 keys does.
static void bottom_right(void) {
    const attn_shape s = {.batch = 1, .heads = 1, .seq = 3, .dim = 64, .causal = 1, .kv_seq = 7};
    float q[3 * 64], k[7 * 64], v[7 * 64];
    test_fill_normal(q, 3 * 64, 5, 0, 1), test_fill_normal(k, 7 * 64, 6, 0, 1), test_fill_normal(v, 7 * 64, 7, 0, 1);
    double scratch[14], a[64], b[64];
    attn_shape open = s;
    open.causal = 0;
    reference_row(&s, q, k, v, 0, 0, 2, scratch, a);
    reference_row(&open, q, k, v, 0, 0, 2, scratch, b);
    EXPECT(max_difference(a, b, 64) == 0.0, "the last query must see every key");
    attn_shape first_five = open;
    first_five.kv_seq = 5;
    reference_row(&s, q, k, v, 0, 0, 0, scratch, a);
    reference_row(&first_five, q, k, v, 0, 0, 0, scratch, b);
    EXPECT(max_difference(a, b, 64) == 0.0, "the first query must see keys 0..4");
}

// The checker on a grouped shape: exact gradients pass, one wrong row of dK fails, and the report
// names it in dK's own [B, H_kv, S_kv, D] coordinates.
static void checker(void) {
    const attn_shape s = {.batch = 2, .heads = 4, .seq = 9, .dim = 64, .causal = 1, .kv_heads = 2, .kv_seq = 13};
    const int S = s.seq, D = s.dim, group = attn_group(&s);
    const size_t nq = attn_elems(&s), nkv = attn_kv_elems(&s);
    float *q = malloc(sizeof(float) * nq), *d_o = malloc(sizeof(float) * nq);
    float *k = malloc(sizeof(float) * nkv), *v = malloc(sizeof(float) * nkv);
    test_fill_normal(q, nq, 11, 0, 1), test_fill_normal(d_o, nq, 12, 0, 1);
    test_fill_normal(k, nkv, 13, 0, 1), test_fill_normal(v, nkv, 14, 0, 1);
    uint16_t *o = malloc(2 * nq), *grads[3] = {malloc(2 * nq), malloc(2 * nkv), malloc(2 * nkv)};
    double *scratch = malloc(sizeof(double) * 2 * 13), row[64], row2[64];
    double *lse = malloc(sizeof(double) * group * S), *delta = malloc(sizeof(double) * group * S);
    for (int bh = 0; bh < s.batch * s.heads; bh++)
        for (int i = 0; i < S; i++) {
            reference_row(&s, q, k, v, bh / s.heads, bh % s.heads, i, scratch, row);
            for (int d = 0; d < D; d++) o[((size_t)bh * S + i) * D + d] = float_to_half((float)row[d]);
        }
    for (int kv_bh = 0; kv_bh < s.batch * s.kv_heads; kv_bh++) {
        const int b = kv_bh / s.kv_heads, kv_h = kv_bh % s.kv_heads;
        for (int g = 0; g < group; g++) {
            const int h = kv_h * group + g;
            reference_bwd_stats(&s, q, k, v, d_o, b, h, lse + g * S, delta + g * S, NONE);
            for (int i = 0; i < S; i++) {
                reference_dq_row(&s, q, k, v, d_o, b, h, lse + g * S, delta + g * S, NONE, i, row, NONE);
                for (int d = 0; d < D; d++)
                    grads[0][(((size_t)b * s.heads + h) * S + i) * D + d] = float_to_half((float)row[d]);
            }
        }
        for (int j = 0; j < s.kv_seq; j++) {
            reference_dkdv_row(&s, q, k, v, d_o, b, kv_h, lse, delta, NONE, j, row, row2, NONE, NONE);
            for (int d = 0; d < D; d++) {
                grads[1][((size_t)kv_bh * s.kv_seq + j) * D + d] = float_to_half((float)row[d]);
                grads[2][((size_t)kv_bh * s.kv_seq + j) * D + d] = float_to_half((float)row2[d]);
            }
        }
    }
    const check_result forward = check_output(&s, q, k, v, o);
    EXPECT(check_passed(&forward), "the exact grouped O must pass");
    check_bwd_result backward = check_backward(&s, q, k, v, d_o, (const uint16_t *const *)grads);
    EXPECT(check_bwd_passed(&backward), "exact grouped gradients must pass");
    EXPECT(backward.dk.rows_checked == (size_t)s.batch * s.kv_heads * s.kv_seq, "every dK row is checked");
    // Row 12 of dK of K/V head 1 in batch 1, scaled by 1.1: caught.
    const size_t bad = ((size_t)(1 * s.kv_heads + 1) * s.kv_seq + 12) * D;
    for (int d = 0; d < D; d++) grads[1][bad + d] = float_to_half(half_to_float(grads[1][bad + d]) * 1.1f);
    backward = check_backward(&s, q, k, v, d_o, (const uint16_t *const *)grads);
    EXPECT(!check_passed(&backward.dk) && check_passed(&backward.dq) && check_passed(&backward.dv),
           "a wrong dK row must fail dK alone");
    EXPECT(backward.dk.first_bad / D / s.kv_seq == 3 && backward.dk.first_bad / D % s.kv_seq == 12,
           "the first bad dK element is at K/V head 3 (flat), row 12; got flat index %zu", backward.dk.first_bad);
    free(q), free(d_o), free(k), free(v), free(o), free(grads[0]), free(grads[1]), free(grads[2]);
    free(scratch), free(lse), free(delta);
}

static const char *any_shape(const attn_shape *s) { return (void)s, NULL; }

// What the harness refuses, before any GPU work.
static void refusals(void) {
    attn_stage plain = {.name = "plain", .unsupported = any_shape}, grouped = plain;
    grouped.runs_gqa = 1, grouped.runs_kv_seq = 1;
    attn_stage heads_only = plain;
    heads_only.runs_gqa = 1;
    char message[512];
    const attn_shape ok = {.batch = 1, .heads = 8, .seq = 64, .dim = 64, .causal = 1, .kv_heads = 2, .kv_seq = 100};
    EXPECT(shape_refusal(&grouped, "x", &ok, message, sizeof message) == 0, "refused: %s", message);
    EXPECT(shape_refusal(&plain, "x", &ok, message, sizeof message) && strstr(message, "not supported"),
           "a stage without runs_gqa must refuse: %s", message);
    EXPECT(shape_refusal(&heads_only, "x", &ok, message, sizeof message) && strstr(message, "another length"),
           "a stage without runs_kv_seq must refuse another K/V length: %s", message);
    attn_shape same_length = ok;
    same_length.kv_seq = 0;
    EXPECT(shape_refusal(&heads_only, "x", &same_length, message, sizeof message) == 0,
           "a stage with runs_gqa takes fewer K/V heads: %s", message);
    attn_shape bad = ok;
    bad.kv_heads = 3;
    EXPECT(shape_refusal(&grouped, "x", &bad, message, sizeof message) && strstr(message, "must divide"),
           "3 K/V heads for 8 query heads: %s", message);
    bad = ok;
    bad.kv_seq = 63;
    EXPECT(shape_refusal(&grouped, "x", &bad, message, sizeof message) && strstr(message, "at least as many keys"),
           "causal with fewer keys than queries: %s", message);
    bad.causal = 0;
    EXPECT(shape_refusal(&grouped, "x", &bad, message, sizeof message) == 0, "non-causal, fewer keys: %s", message);
}

int main(void) {
    compare_with_repeated((attn_shape){.batch = 2, .heads = 6, .seq = 37, .dim = 64, .causal = 0, .kv_heads = 2,
                                       .kv_seq = 53});
    compare_with_repeated((attn_shape){.batch = 2, .heads = 6, .seq = 37, .dim = 64, .causal = 1, .kv_heads = 2,
                                       .kv_seq = 53});
    compare_with_repeated((attn_shape){.batch = 2, .heads = 4, .seq = 20, .dim = 64, .causal = 1, .kv_heads = 1});
    bottom_right();
    checker();
    refusals();
    return test_summary("test_gqa");
}
