// check.c - poison/NaN scan over the whole output, float64 comparison on all or sampled rows.
#include "check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "half.h"
#include "omp_compat.h"
#include "reference.h"
#include "reference_bwd.h"

// Rows of one head to compare when sampling: the first and last two (tails, causal edge), the
// two rows around the middle (a tile boundary for every power-of-two tile size when S is a
// power of two), then pseudo-random rows. Fixed for a given shape, so reruns check the same rows.
static int sample_row(int S, int i, uint64_t head_index) {
    switch (i) {
    case 0: return 0;
    case 1: return S - 1;
    case 2: return S > 1 ? 1 : 0;
    case 3: return S > 2 ? S - 2 : 0;
    case 4: return S / 2;
    case 5: return S / 2 > 0 ? S / 2 - 1 : 0;
    default: {
        uint64_t x = head_index * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull;
        x ^= x >> 31;
        x *= 0x94D049BB133111EBull;
        x ^= x >> 29;
        return (int)(x % (uint64_t)S);
    }
    }
}

static void note_bad(check_result *r, size_t index, double out, double ref) {
    if (index < r->first_bad) {
        r->first_bad = index;
        r->first_bad_out = out;
        r->first_bad_ref = ref;
    }
}

// Counts the elements of `out` still holding the poison, and the other NaN/Inf elements.
static void scan_output(const uint16_t *out, size_t n, check_result *r) {
    for (size_t i = 0; i < n; i++) {
        if (out[i] == HALF_POISON) {
            r->unwritten++;
            note_bad(r, i, NAN, NAN);
        } else if (!isfinite(half_to_float(out[i]))) {
            r->nonfinite++;
            note_bad(r, i, half_to_float(out[i]), NAN);
        }
    }
}

// One compared row: its errors and whether it broke a bound.
typedef struct {
    double max_abs, err_sq, ref_sq;  // over the row's finite elements
    size_t over;                     // elements over the element bound
    int over_rel_l2;                 // the row's relative L2 error is over its bound
    size_t first_bad;                // flat index of the first failing element, or of the row
    double bad_out, bad_ref;
} row_errors;

// Compares D fp16 outputs at out[base..] with their float64 reference: per element
// |out - ref| <= atol + rtol |ref|; per row relative L2 <= row_rel_l2, on rows whose squared norm
// is over min_ref_sq (a row of exact zeros has no relative error to speak of). Non-finite outputs
// are skipped: scan_output counts them.
static row_errors compare_row(const uint16_t *out, size_t base, const double *ref, int D, double atol,
                              double rtol, double row_rel_l2, double min_ref_sq) {
    row_errors e = {0};
    e.first_bad = (size_t)-1;
    for (int d = 0; d < D; d++) {
        const double o = half_to_float(out[base + d]);
        if (!isfinite(o)) continue;
        const double err = fabs(o - ref[d]);
        e.err_sq += err * err;
        e.ref_sq += ref[d] * ref[d];
        if (err > e.max_abs) e.max_abs = err;
        if (err > atol + rtol * fabs(ref[d]) && e.over++ == 0)
            e.first_bad = base + d, e.bad_out = o, e.bad_ref = ref[d];
    }
    e.over_rel_l2 = e.ref_sq > min_ref_sq && sqrt(e.err_sq / e.ref_sq) > row_rel_l2;
    if (e.over_rel_l2 && e.first_bad == (size_t)-1)  // report the row's first element
        e.first_bad = base, e.bad_out = half_to_float(out[base]), e.bad_ref = ref[0];
    return e;
}

// Adds one compared row to the result and to the running squared sums.
static void add_row(check_result *r, const row_errors *e, double *err_sq, double *ref_sq) {
    r->rows_over_rel_l2 += e->over_rel_l2;
    r->over_tolerance += e->over;
    *err_sq += e->err_sq;
    *ref_sq += e->ref_sq;
    if (e->max_abs > r->max_abs_err) r->max_abs_err = e->max_abs;
    if (e->over || e->over_rel_l2) note_bad(r, e->first_bad, e->bad_out, e->bad_ref);
}

check_result check_output(const attn_shape *shape, const float *q, const float *k, const float *v,
                          const uint16_t *out) {
    const int B = shape->batch, H = shape->heads, S = shape->seq, D = shape->dim;
    const size_t n = attn_elems(shape);
    check_result r = {0};
    r.first_bad = (size_t)-1;

    // 1. Every element: unwritten (poison still there) or non-finite.
    scan_output(out, n, &r);

    // 2. Which rows to compare.
    const double macs_per_row = (double)S * D;
    const double total_macs = (double)B * H * S * macs_per_row;
    int rows_per_head = S;
    r.full = total_macs <= CHECK_FULL_MACS;
    if (!r.full) {
        double affordable = CHECK_SAMPLE_MACS / ((double)B * H * macs_per_row);
        rows_per_head = affordable < CHECK_MIN_ROWS_PER_HEAD ? CHECK_MIN_ROWS_PER_HEAD
                        : affordable > S                     ? S
                                                             : (int)affordable;
    }
    const long long tasks = (long long)B * H * rows_per_head;
    r.rows_checked = (size_t)tasks;

    double err_sq = 0.0, ref_sq = 0.0;
    OMP_PARALLEL
    {
        double *scores = malloc(sizeof(double) * (size_t)S);
        double *ref_row = malloc(sizeof(double) * (size_t)D);
        if (!scores || !ref_row) {
            fprintf(stderr, "check: out of host memory\n");
            exit(1);
        }
        OMP_FOR_DYNAMIC
        for (long long t = 0; t < tasks; t++) {
            const int bh = (int)(t / rows_per_head), i = (int)(t % rows_per_head);
            const int b = bh / H, h = bh % H;
            const int row = r.full ? i : sample_row(S, i, (uint64_t)bh);
            reference_row(shape, q, k, v, b, h, row, scores, ref_row);

            const size_t base = (((size_t)b * H + h) * S + row) * D;
            const row_errors e =
                compare_row(out, base, ref_row, D, CHECK_ATOL, CHECK_RTOL, CHECK_ROW_REL_L2, 0.0);
            OMP_CRITICAL
            add_row(&r, &e, &err_sq, &ref_sq);
        }
        free(scores);
        free(ref_row);
    }
    r.rel_l2_err = ref_sq > 0.0 ? sqrt(err_sq / ref_sq) : sqrt(err_sq);
    return r;
}

void check_print(const attn_shape *shape, const check_result *r) {
    printf("check: %s, %zu rows vs float64 reference: max abs err %.3e, rel L2 err %.3e "
           "(bounds: %.0e + %.0e*|ref| per element, %.0e rel L2 per row)\n",
           r->full ? "full output" : "sampled rows", r->rows_checked, r->max_abs_err,
           r->rel_l2_err, CHECK_ATOL, CHECK_RTOL, CHECK_ROW_REL_L2);
    check_print_verdict("check", shape, r);
}

void check_print_verdict(const char *label, const attn_shape *shape, const check_result *r) {
    if (check_passed(r)) {
        printf("%s: PASS\n", label);
        return;
    }
    printf("%s: FAIL: %zu unwritten, %zu NaN/Inf, %zu over the element bound, %zu rows over "
           "the row bound\n",
           label, r->unwritten, r->nonfinite, r->over_tolerance, r->rows_over_rel_l2);
    const size_t D = (size_t)shape->dim, S = (size_t)shape->seq, H = (size_t)shape->heads;
    const size_t i = r->first_bad;
    printf("%s: first bad element [b=%zu, h=%zu, s=%zu, d=%zu]: out %.6g, ref %.6g\n",
           label, i / D / S / H, i / D / S % H, i / D % S, i % D, r->first_bad_out, r->first_bad_ref);
}

// ---------------------------------------------------------------------------------------------
// Backward: dQ, dK, dV.

// Which heads the backward check visits: all of them when their statistics fit the budget,
// otherwise an evenly spaced subset that always includes the first and the last head (so a wrong
// batch or head offset still shows).
static int pick_head(int heads_total, int heads_checked, int i) {
    if (heads_checked >= heads_total) return i;
    if (heads_checked == 1) return heads_total - 1;
    return (int)((long long)i * (heads_total - 1) / (heads_checked - 1));
}

typedef struct {
    int tensor;  // 0 dQ, 1 dK, 2 dV
    int bh, row;
} grad_row;

check_bwd_result check_backward(const attn_shape *shape, const float *q, const float *k,
                                const float *v, const float *d_o, const uint16_t *const grads[3]) {
    const int B = shape->batch, H = shape->heads, S = shape->seq, D = shape->dim;
    const size_t n = attn_elems(shape);
    check_bwd_result res;
    check_result *r[3] = {&res.dq, &res.dk, &res.dv};
    for (int t = 0; t < 3; t++) {
        *r[t] = (check_result){0};
        r[t]->first_bad = (size_t)-1;
        scan_output(grads[t], n, r[t]);
    }

    // Heads, and rows within a head: everything when a full check fits CHECK_BWD_FULL_MACS; else
    // as many heads as the per-head statistics allow and CHECK_BWD_ROWS sampled rows of each of
    // dQ, dK, dV per head (each row still summed over all of its queries or keys).
    const double stats_macs = 2.0 * S * (double)S * D;
    const int full = (double)B * H * 4.5 * stats_macs <= CHECK_BWD_FULL_MACS;
    int heads = B * H;
    if (!full) {
        const double affordable = CHECK_BWD_MACS / stats_macs;
        heads = affordable < 1 ? 1 : affordable > B * H ? B * H : (int)affordable;
    }
    const int rows_per_head = full || S < CHECK_BWD_ROWS ? S : CHECK_BWD_ROWS;
    for (int t = 0; t < 3; t++) {
        r[t]->full = full;
        r[t]->rows_checked = (size_t)heads * rows_per_head;
    }

    double *lse = malloc(sizeof(double) * (size_t)S), *delta = malloc(sizeof(double) * (size_t)S);
    const size_t n_rows = 3 * (size_t)rows_per_head;
    double *ref = malloc(sizeof(double) * n_rows * D);
    grad_row *rows = malloc(sizeof(grad_row) * n_rows);
    if (!lse || !delta || !ref || !rows) {
        fprintf(stderr, "check: out of host memory\n");
        exit(1);
    }
    double err_sq[3] = {0, 0, 0}, ref_sq[3] = {0, 0, 0};
    for (int hc = 0; hc < heads; hc++) {
        const int bh = pick_head(B * H, heads, hc), b = bh / H, h = bh % H;
        reference_bwd_stats(shape, q, k, v, d_o, b, h, lse, delta);
        for (int i = 0; i < rows_per_head; i++) {
            const int row = full ? i : sample_row(S, i, (uint64_t)bh);
            for (int t = 0; t < 3; t++) rows[3 * i + t] = (grad_row){t, bh, row};
        }
        // dK and dV rows come out of one reference call; the dV task copies what the dK task wrote.
        OMP_PARALLEL
        {
        OMP_FOR_DYNAMIC
        for (long long task = 0; task < (long long)rows_per_head; task++) {
            const grad_row *g = &rows[3 * task];
            reference_dq_row(shape, q, k, v, d_o, b, h, lse, delta, g->row, ref + (3 * task) * D);
            reference_dkdv_row(shape, q, k, v, d_o, b, h, lse, delta, g->row,
                               ref + (3 * task + 1) * D, ref + (3 * task + 2) * D);
        }
        }
        // Compare: element bound relative to the rms of the checked reference rows, because the
        // three gradients have different scales (dV ~ 1, dQ and dK ~ scale).
        double head_ref_sq[3] = {0, 0, 0};
        for (size_t i = 0; i < n_rows; i++)
            for (int d = 0; d < D; d++) head_ref_sq[rows[i].tensor] += ref[i * D + d] * ref[i * D + d];
        for (size_t i = 0; i < n_rows; i++) {
            const grad_row *g = &rows[i];
            check_result *c = r[g->tensor];
            const double rms = sqrt(head_ref_sq[g->tensor] / ((double)rows_per_head * D));
            const size_t base = ((size_t)g->bh * S + g->row) * D;
            // A row's relative error only means something when the row is not ~0 (dQ of the first
            // causal rows, dK and dV of keys few queries attend to); those fall under the element
            // bound alone.
            const row_errors e = compare_row(grads[g->tensor], base, ref + i * D, D,
                                             CHECK_BWD_ATOL + CHECK_BWD_ATOL_RMS * rms, CHECK_BWD_RTOL,
                                             CHECK_BWD_ROW_REL_L2, 1e-2 * head_ref_sq[g->tensor] / rows_per_head);
            add_row(c, &e, &err_sq[g->tensor], &ref_sq[g->tensor]);
        }
    }
    for (int t = 0; t < 3; t++)
        r[t]->rel_l2_err = ref_sq[t] > 0.0 ? sqrt(err_sq[t] / ref_sq[t]) : sqrt(err_sq[t]);
    free(lse);
    free(delta);
    free(ref);
    free(rows);
    return res;
}

void check_print_backward(const attn_shape *shape, const check_bwd_result *r) {
    const char *names[3] = {"dQ", "dK", "dV"};
    const check_result *c[3] = {&r->dq, &r->dk, &r->dv};
    for (int t = 0; t < 3; t++) {
        char label[32];
        snprintf(label, sizeof label, "check %s", names[t]);
        printf("%s: %s, %zu rows vs float64 reference: max abs err %.3e, rel L2 err %.3e (bounds: "
               "%.0e + %.0e*rms + %.0e*|ref| per element, %.0e rel L2 per row)\n",
               label, c[t]->full ? "full output" : "sampled heads and rows", c[t]->rows_checked,
               c[t]->max_abs_err, c[t]->rel_l2_err, CHECK_BWD_ATOL, CHECK_BWD_ATOL_RMS, CHECK_BWD_RTOL,
               CHECK_BWD_ROW_REL_L2);
        check_print_verdict(label, shape, c[t]);
    }
}
