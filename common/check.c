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

// One compared row: its errors and whether it broke a bound.
typedef struct {
    double max_abs, max_ratio, err_sq, ref_sq;  // over the row's finite elements
    size_t over;                                // elements over the element bound
    int over_row_bound;                         // the row's L2 error is over the row bound
    double row_err, row_bound;                  // ||out_row - ref_row|| and its bound
    size_t first_bad;                           // flat index of the first failing element, or of the row
    double bad_out, bad_ref, bad_bound;
} row_errors;

// Records a failure if it comes before the one already recorded.
static void note_bad(check_result *r, size_t index, double out, double ref, double bound,
                     const row_errors *row) {
    if (index < r->first_bad) {
        r->first_bad = index;
        r->first_bad_out = out;
        r->first_bad_ref = ref;
        r->first_bad_bound = bound;
        r->first_bad_row = row != NULL;
        r->first_bad_row_err = row ? row->row_err : 0.0;
        r->first_bad_row_bound = row ? row->row_bound : 0.0;
    }
}

// Counts the elements of `out` still holding the poison, and the other NaN/Inf elements.
static void scan_output(const uint16_t *out, size_t n, int dtype, check_result *r) {
    for (size_t i = 0; i < n; i++) {
        if (out[i] == HALF_POISON) {
            r->unwritten++;
            note_bad(r, i, NAN, NAN, NAN, NULL);
        } else if (!isfinite(elem_to_float(out[i], dtype))) {
            r->nonfinite++;
            note_bad(r, i, elem_to_float(out[i], dtype), NAN, NAN, NULL);
        }
    }
}

int check_inputs_finite(const attn_shape *shape, const uint16_t *tensor, const char *name, char *msg,
                        size_t msg_size) {
    const size_t n = attn_elems(shape);
    // The exponent's and the mantissa's bits: fp16 has 5 and 10, bf16 8 and 7.
    const uint16_t exponent = shape->dtype == ATTN_BF16 ? 0x7f80 : 0x7c00, mantissa = 0x7fff & ~exponent;
    for (size_t i = 0; i < n; i++) {
        if ((tensor[i] & exponent) != exponent) continue;  // exponent all ones: Inf or NaN
        const char *what = (tensor[i] & mantissa) ? "nan" : (tensor[i] & 0x8000) ? "-inf" : "inf";
        const size_t D = (size_t)shape->dim, S = (size_t)shape->seq, H = (size_t)shape->heads;
        snprintf(msg, msg_size,
                 "%s holds a non-finite value (%s) at [b=%zu, h=%zu, s=%zu, d=%zu]; inputs must be "
                 "finite",
                 name, what, i / D / S / H, i / D / S % H, i / D % S, i % D);
        return -1;
    }
    return 0;
}

// Compares D outputs at out[base..] (fp16 or bf16, by the shape) with their float64 reference and
// its error terms (worst and rss, in units of u): per element |out - ref| <=
// check_element_bound(worst, u); per row
// ||out - ref|| <= row_rel_l2 ||ref|| + CHECK_ROW_RSS u ||rss||. Non-finite outputs are skipped:
// scan_output counts them.
static row_errors compare_row(const attn_shape *shape, const uint16_t *out, size_t base, const double *ref,
                              const double *worst, const double *rss, double row_rel_l2) {
    const int D = shape->dim;
    const double u = ref_check_unit(shape);
    row_errors e = {0};
    e.first_bad = (size_t)-1;
    double rss_sq = 0.0;
    for (int d = 0; d < D; d++) {
        const double o = elem_to_float(out[base + d], shape->dtype);
        if (!isfinite(o)) continue;
        const double err = fabs(o - ref[d]), bound = check_element_bound(worst[d], u);
        e.err_sq += err * err;
        e.ref_sq += ref[d] * ref[d];
        rss_sq += rss[d] * rss[d];
        if (err > e.max_abs) e.max_abs = err;
        if (err / bound > e.max_ratio) e.max_ratio = err / bound;
        if (err > bound && e.over++ == 0)
            e.first_bad = base + d, e.bad_out = o, e.bad_ref = ref[d], e.bad_bound = bound;
    }
    e.row_err = sqrt(e.err_sq);
    e.row_bound = row_rel_l2 * sqrt(e.ref_sq) + CHECK_ROW_RSS * u * sqrt(rss_sq);
    e.over_row_bound = e.row_err > e.row_bound;
    return e;
}

// Adds one compared row to the result and to the running squared sums.
static void add_row(check_result *r, const row_errors *e, size_t base, double *err_sq, double *ref_sq) {
    r->rows_over_rel_l2 += e->over_row_bound;
    r->over_tolerance += e->over;
    *err_sq += e->err_sq;
    *ref_sq += e->ref_sq;
    if (e->max_abs > r->max_abs_err) r->max_abs_err = e->max_abs;
    if (e->max_ratio > r->max_bound_ratio) r->max_bound_ratio = e->max_ratio;
    if (e->over) note_bad(r, e->first_bad, e->bad_out, e->bad_ref, e->bad_bound, NULL);
    else if (e->over_row_bound) note_bad(r, base, NAN, NAN, NAN, e);  // the row, at its first element
}

check_result check_output(const attn_shape *shape, const float *q, const float *k, const float *v,
                          const uint16_t *out) {
    const int B = shape->batch, H = shape->heads, S = shape->seq, D = shape->dim, S_kv = attn_kv_seq(shape);
    const size_t n = attn_elems(shape);
    check_result r = {0};
    r.first_bad = (size_t)-1;

    // 1. Every element: unwritten (poison still there) or non-finite.
    scan_output(out, n, shape->dtype, &r);

    // 2. Which rows to compare.
    const double macs_per_row = (double)S_kv * D;
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

    // An FP8 forward's rule needs its blocks' scales (and Q and K rotated) first.
    ref_fp8 *fp8 = ref_fp8_prepare(shape, q, k, v);
    if (shape->fp8 && !fp8) {
        fprintf(stderr, "check: out of host memory\n");
        exit(1);
    }
    double err_sq = 0.0, ref_sq = 0.0;
    OMP_PARALLEL
    {
        // Scratch of 2 S_kv doubles, then the row, its worst and its rss terms and, FP8, the row of
        // attention of the unrounded inputs (D each).
        double *scratch = malloc(sizeof(double) * (2 * (size_t)S_kv + 4 * (size_t)D));
        if (!scratch) {
            fprintf(stderr, "check: out of host memory\n");
            exit(1);
        }
        double *ref_row = scratch + 2 * (size_t)S_kv, *worst = ref_row + D, *rss = worst + D, *true_row = rss + D;
        OMP_FOR_DYNAMIC
        for (long long t = 0; t < tasks; t++) {
            const int bh = (int)(t / rows_per_head), i = (int)(t % rows_per_head);
            const int b = bh / H, h = bh % H;
            const int row = r.full ? i : sample_row(S, i, (uint64_t)bh);
            if (fp8) {
                reference_row_error_fp8(shape, fp8, b, h, row, scratch, ref_row, (reference_error){worst, rss});
                reference_row(shape, q, k, v, b, h, row, scratch, true_row);
            } else {
                reference_row_error(shape, q, k, v, b, h, row, scratch, ref_row, (reference_error){worst, rss});
            }

            const size_t base = (((size_t)b * H + h) * S + row) * D;
            row_errors e = compare_row(shape, out, base, ref_row, worst, rss, CHECK_ROW_REL_L2);
            if (fp8) {  // the errors reported: FP8's own, against attention of the inputs themselves
                const row_errors truth = compare_row(shape, out, base, true_row, worst, rss, CHECK_ROW_REL_L2);
                e.err_sq = truth.err_sq, e.ref_sq = truth.ref_sq, e.max_abs = truth.max_abs;
            }
            OMP_CRITICAL
            add_row(&r, &e, base, &err_sq, &ref_sq);
        }
        free(scratch);
    }
    ref_fp8_free(fp8);
    r.rel_l2_err = ref_sq > 0.0 ? sqrt(err_sq / ref_sq) : sqrt(err_sq);
    r.rmse = sqrt(err_sq / ((double)r.rows_checked * D));
    return r;
}

// The rule's constants, for the lines that report a check.
static void print_bounds(const attn_shape *shape) {
    printf("bounds: |err| <= %g u worst + 2^-24 per element, ||err|| <= %g ||ref|| + %g u ||rss|| per "
           "row, u = %s",
           CHECK_C1, CHECK_ROW_REL_L2, CHECK_ROW_RSS,
           shape->fp8 ? "2^-4 (e4m3)" : shape->dtype == ATTN_BF16 ? "2^-8 (bf16)" : "2^-11 (fp16)");
}

void check_print(const attn_shape *shape, const check_result *r) {
    printf("check: %s, %zu rows vs float64 reference: max abs err %.3e, rel L2 err %.3e, RMSE %.3e, "
           "largest error %.2f of its bound (",
           r->full ? "full output" : "sampled rows", r->rows_checked, r->max_abs_err,
           r->rel_l2_err, r->rmse, r->max_bound_ratio);
    print_bounds(shape);
    printf(")\n");
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
    if (r->first_bad_row)
        printf("%s: first bad row [b=%zu, h=%zu, s=%zu]: L2 error %.6g, row bound %.6g\n", label,
               i / D / S / H, i / D / S % H, i / D % S, r->first_bad_row_err, r->first_bad_row_bound);
    else if (isnan(r->first_bad_bound))  // unwritten or NaN/Inf
        printf("%s: first bad element [b=%zu, h=%zu, s=%zu, d=%zu]: out %.6g\n", label,
               i / D / S / H, i / D / S % H, i / D % S, i % D, r->first_bad_out);
    else
        printf("%s: first bad element [b=%zu, h=%zu, s=%zu, d=%zu]: out %.6g, ref %.6g, error %.3g "
               "over its bound %.3g\n",
               label, i / D / S / H, i / D / S % H, i / D % S, i % D, r->first_bad_out,
               r->first_bad_ref, fabs(r->first_bad_out - r->first_bad_ref), r->first_bad_bound);
}

// ---------------------------------------------------------------------------------------------
// Backward: dQ, dK, dV.

// Which K/V heads the backward check visits: all of them when their statistics fit the budget,
// otherwise an evenly spaced subset that always includes the first and the last (so a wrong batch
// or head offset still shows).
static int pick_head(int heads_total, int heads_checked, int i) {
    if (heads_checked >= heads_total) return i;
    if (heads_checked == 1) return heads_total - 1;
    return (int)((long long)i * (heads_total - 1) / (heads_checked - 1));
}

typedef struct {
    int tensor;  // 0 dQ, 1 dK, 2 dV
    int bh, row; // the head (a query head for dQ, a K/V head for dK and dV) and the row in it
} grad_row;

// What one K/V head's check works in: for each of its G = H / H_kv query heads that head's lse,
// δ_i and δ_i's error terms (4 S each), and for each checked row of dQ (G rows_q of them), dK and
// dV (rows_kv each) its grad_row, reference, worst and rss terms (D each).
typedef struct {
    double *stats, *ref;
    grad_row *rows;
} head_scratch;

static head_scratch head_scratch_alloc(int S, int D, int group, size_t n_rows) {
    head_scratch h = {malloc(sizeof(double) * 4 * (size_t)group * S), malloc(sizeof(double) * 3 * n_rows * D),
                      malloc(sizeof(grad_row) * n_rows)};
    if (!h.stats || !h.ref || !h.rows) {
        fprintf(stderr, "check: out of host memory\n");
        exit(1);
    }
    return h;
}

static void head_scratch_free(head_scratch *h) {
    free(h->stats);
    free(h->ref);
    free(h->rows);
}

// Checks K/V head kv_bh: rows of dQ of each query head that reads it, and rows of its dK and dV
// (all of them with `full`, else rows_q and rows_kv sampled ones), adding them to r[] and the
// squared sums one thread at a time. Its row loop runs on every thread when called from one
// thread, on the calling thread alone inside a parallel region.
static void check_backward_head(const attn_shape *shape, const float *q, const float *k, const float *v,
                                const float *d_o, const uint16_t *const grads[3], int kv_bh, int full, int rows_q,
                                int rows_kv, head_scratch *h, check_result *r[3], double err_sq[3],
                                double ref_sq[3]) {
    const int H_kv = attn_kv_heads(shape), S = shape->seq, S_kv = attn_kv_seq(shape), D = shape->dim;
    const int group = attn_group(shape), b = kv_bh / H_kv, kv_h = kv_bh % H_kv;
    const size_t stat = (size_t)group * S, n_dq = (size_t)group * rows_q, n_rows = n_dq + 2 * (size_t)rows_kv;
    double *lse = h->stats, *delta = lse + stat;
    const reference_error delta_err = {delta + stat, delta + 2 * stat};
    double *ref = h->ref, *worst = ref + n_rows * D, *rss = worst + n_rows * D;
    for (int g = 0; g < group; g++) {
        const int hd = kv_h * group + g;
        reference_bwd_stats(shape, q, k, v, d_o, b, hd, lse + g * S, delta + g * S,
                            (reference_error){delta_err.worst + g * S, delta_err.rss + g * S});
        for (int i = 0; i < rows_q; i++) {
            const int bh = b * shape->heads + hd;
            h->rows[(size_t)g * rows_q + i] = (grad_row){0, bh, full ? i : sample_row(S, i, (uint64_t)bh)};
        }
    }
    for (int i = 0; i < rows_kv; i++) {
        const int row = full ? i : sample_row(S_kv, i, (uint64_t)kv_bh);
        h->rows[n_dq + 2 * i] = (grad_row){1, kv_bh, row};
        h->rows[n_dq + 2 * i + 1] = (grad_row){2, kv_bh, row};
    }
    // dQ rows at slots 0 .. n_dq - 1, then each dK row and its dV row (one reference call).
    const long long tasks = (long long)(n_dq + rows_kv);
    OMP_PARALLEL
    {
    OMP_FOR_DYNAMIC
    for (long long task = 0; task < tasks; task++) {
        if (task < (long long)n_dq) {
            const grad_row *gr = &h->rows[task];
            const int g = (int)(task / rows_q);
            const size_t at = (size_t)task * D;
            reference_dq_row(shape, q, k, v, d_o, b, kv_h * group + g, lse + g * S, delta + g * S,
                             (reference_error){delta_err.worst + g * S, delta_err.rss + g * S}, gr->row, ref + at,
                             (reference_error){worst + at, rss + at});
        } else {
            const size_t slot = n_dq + 2 * (size_t)(task - (long long)n_dq), dk = slot * D, dv = dk + D;
            reference_dkdv_row(shape, q, k, v, d_o, b, kv_h, lse, delta, delta_err, h->rows[slot].row, ref + dk,
                               ref + dv, (reference_error){worst + dk, rss + dk},
                               (reference_error){worst + dv, rss + dv});
        }
    }
    }
    for (size_t i = 0; i < n_rows; i++) {
        const grad_row *g = &h->rows[i];
        const size_t base = ((size_t)g->bh * (g->tensor == 0 ? S : S_kv) + g->row) * D;
        const row_errors e = compare_row(shape, grads[g->tensor], base, ref + i * D, worst + i * D, rss + i * D,
                                         CHECK_ROW_REL_L2);
        OMP_CRITICAL
        add_row(r[g->tensor], &e, base, &err_sq[g->tensor], &ref_sq[g->tensor]);
    }
}

check_bwd_result check_backward(const attn_shape *shape, const float *q, const float *k,
                                const float *v, const float *d_o, const uint16_t *const grads[3]) {
    const int B = shape->batch, H_kv = attn_kv_heads(shape), S = shape->seq, S_kv = attn_kv_seq(shape);
    const int D = shape->dim, group = attn_group(shape);
    check_bwd_result res;
    check_result *r[3] = {&res.dq, &res.dk, &res.dv};
    for (int t = 0; t < 3; t++) {
        *r[t] = (check_result){0};
        r[t]->first_bad = (size_t)-1;
        scan_output(grads[t], t == 0 ? attn_elems(shape) : attn_kv_elems(shape), shape->dtype, r[t]);
    }

    // K/V heads, and rows within them: everything when a full check fits CHECK_BWD_FULL_MACS; else
    // as many K/V heads as the statistics of their query heads allow, and CHECK_BWD_ROWS sampled
    // rows of dQ per query head and of dK and dV per K/V head (each row still summed over all of
    // its queries or keys).
    const double stats_macs = 3.0 * group * S * (double)S_kv * D;  // a K/V head's query heads
    const int full = (double)B * H_kv * 4.5 * stats_macs <= CHECK_BWD_FULL_MACS;
    int heads = B * H_kv;
    if (!full) {
        const double affordable = CHECK_BWD_MACS / stats_macs;
        heads = affordable < 1 ? 1 : affordable > B * H_kv ? B * H_kv : (int)affordable;
    }
    const int rows_q = full || S < CHECK_BWD_ROWS ? S : CHECK_BWD_ROWS;
    const int rows_kv = full || S_kv < CHECK_BWD_ROWS ? S_kv : CHECK_BWD_ROWS;
    r[0]->full = r[1]->full = r[2]->full = full;
    r[0]->rows_checked = (size_t)heads * group * rows_q;
    r[1]->rows_checked = r[2]->rows_checked = (size_t)heads * rows_kv;

    // Many heads (short rows, or many heads sampled): one head per thread at a time. Few: one head
    // after another on this thread, each with its rows spread over the threads. Either way each
    // thread's work is large next to starting a parallel region, which is slow where the cores
    // are shared.
    double err_sq[3] = {0, 0, 0}, ref_sq[3] = {0, 0, 0};
    OMP_PARALLEL_IF(heads >= 4 * omp_threads())
    {
        head_scratch h = head_scratch_alloc(S, D, group, (size_t)group * rows_q + 2 * (size_t)rows_kv);
        OMP_FOR_DYNAMIC
        for (int hc = 0; hc < heads; hc++)
            check_backward_head(shape, q, k, v, d_o, grads, pick_head(B * H_kv, heads, hc), full, rows_q, rows_kv,
                                &h, r, err_sq, ref_sq);
        head_scratch_free(&h);
    }
    for (int t = 0; t < 3; t++)
        r[t]->rel_l2_err = ref_sq[t] > 0.0 ? sqrt(err_sq[t] / ref_sq[t]) : sqrt(err_sq[t]);
    return res;
}

void check_print_backward(const attn_shape *shape, const check_bwd_result *r) {
    const char *names[3] = {"dQ", "dK", "dV"};
    const check_result *c[3] = {&r->dq, &r->dk, &r->dv};
    for (int t = 0; t < 3; t++) {
        char label[32];
        snprintf(label, sizeof label, "check %s", names[t]);
        printf("%s: %s, %zu rows vs float64 reference: max abs err %.3e, rel L2 err %.3e, largest "
               "error %.2f of its bound\n",
               label, c[t]->full ? "full output" : "sampled heads and rows", c[t]->rows_checked,
               c[t]->max_abs_err, c[t]->rel_l2_err, c[t]->max_bound_ratio);
        // dK and dV are [B, H_kv, S_kv, D]: their first bad element is named in those.
        attn_shape as_stored = *shape;
        if (t > 0) as_stored.heads = attn_kv_heads(shape), as_stored.seq = attn_kv_seq(shape);
        check_print_verdict(label, &as_stored, c[t]);
    }
    printf("check (backward) ");
    print_bounds(shape);
    printf("\n");
}
