// check.c - poison/NaN scan over the whole output, float64 comparison on all or sampled rows.
#include "check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "half.h"
#include "omp_compat.h"
#include "reference.h"

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

check_result check_output(const attn_shape *shape, const float *q, const float *k, const float *v,
                          const uint16_t *out) {
    const int B = shape->batch, H = shape->heads, S = shape->seq, D = shape->dim;
    const size_t n = attn_elems(shape);
    check_result r = {0};
    r.first_bad = (size_t)-1;

    // 1. Every element: unwritten (poison still there) or non-finite.
    for (size_t i = 0; i < n; i++) {
        if (out[i] == HALF_POISON) {
            r.unwritten++;
            note_bad(&r, i, NAN, NAN);
        } else if (!isfinite(half_to_float(out[i]))) {
            r.nonfinite++;
            note_bad(&r, i, half_to_float(out[i]), NAN);
        }
    }

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
            double row_max_abs = 0.0, row_err_sq = 0.0, row_ref_sq = 0.0;
            size_t row_over = 0, row_first_bad = (size_t)-1;
            double bad_out = 0.0, bad_ref = 0.0;
            for (int d = 0; d < D; d++) {
                const double o = half_to_float(out[base + d]);
                if (!isfinite(o)) continue;  // already counted in step 1
                const double err = fabs(o - ref_row[d]);
                row_err_sq += err * err;
                row_ref_sq += ref_row[d] * ref_row[d];
                if (err > row_max_abs) row_max_abs = err;
                if (err > CHECK_ATOL + CHECK_RTOL * fabs(ref_row[d])) {
                    if (row_over++ == 0) {
                        row_first_bad = base + d;
                        bad_out = o;
                        bad_ref = ref_row[d];
                    }
                }
            }
            // Rows of exact zeros (possible only with --load) have no relative error to speak of.
            const int row_over_l2 =
                row_ref_sq > 0.0 && sqrt(row_err_sq / row_ref_sq) > CHECK_ROW_REL_L2;
            if (row_over_l2 && row_first_bad == (size_t)-1) {
                row_first_bad = base;  // report the row's first element
                bad_out = half_to_float(out[base]);
                bad_ref = ref_row[0];
            }
            OMP_CRITICAL
            {
                r.rows_over_rel_l2 += row_over_l2;
                err_sq += row_err_sq;
                ref_sq += row_ref_sq;
                if (row_max_abs > r.max_abs_err) r.max_abs_err = row_max_abs;
                r.over_tolerance += row_over;
                if (row_over || row_over_l2) note_bad(&r, row_first_bad, bad_out, bad_ref);
            }
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
    if (check_passed(r)) {
        printf("check: PASS\n");
        return;
    }
    printf("check: FAIL: %zu unwritten, %zu NaN/Inf, %zu over the element bound, %zu rows over "
           "the row bound\n",
           r->unwritten, r->nonfinite, r->over_tolerance, r->rows_over_rel_l2);
    const size_t D = (size_t)shape->dim, S = (size_t)shape->seq, H = (size_t)shape->heads;
    const size_t i = r->first_bad;
    printf("check: first bad element [b=%zu, h=%zu, s=%zu, d=%zu]: out %.6g, ref %.6g\n",
           i / D / S / H, i / D / S % H, i / D % S, i % D, r->first_bad_out, r->first_bad_ref);
}
