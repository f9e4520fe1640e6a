// check.h - compare a stage's fp16 or bf16 output with the float64 reference.
#ifndef FLASH_STAGES_CHECK_H
#define FLASH_STAGES_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "attn.h"
#include "reference.h"

// The rule, for the forward and the backward alike (docs/measuring.md derives it). An FP8 forward
// (attn_shape.fp8) is held to the same rule, in units of e4m3's u, 2^-4, against attention of the
// e4m3-rounded inputs it multiplies (reference.h); its errors are reported against attention of
// the inputs themselves (max abs err, rel L2 err, RMSE: FP8's own error). The reference
// gives, with every element, the first-order bound `worst` on the error a correct kernel can
// make on it and the root-sum-square `rss` of the same terms, both in units of the element type's
// unit roundoff u: 2^-11 for fp16, 2^-8 for bf16 (reference.h). An element passes if
//   |out - ref| <= CHECK_C1 * u * worst + CHECK_ATOL_FLOOR,
// where CHECK_C1 = 2 doubles the first-order bound to cover what the analysis leaves out (fp32
// sums over keys, exp, lse, second-order terms); the floor, fp16's smallest subnormal, is for exact
// zeros. A row passes if
//   ||out_row - ref_row|| <= CHECK_ROW_REL_L2 * ||ref_row|| + CHECK_ROW_RSS * u * ||rss_row||:
// independent roundings add up like a random walk, so a row's L2 error stays within a few rss (4
// is 7 standard deviations of uniform rounding errors); a dropped or doubled key tile or a
// missing mask in a long row moves every element by less than its element bound, but the row by
// 10% or more.
#define CHECK_C1 2.0
#define CHECK_ATOL_FLOOR 0x1p-24
#define CHECK_ROW_RSS 4.0
#define CHECK_ROW_REL_L2 1e-2

static inline double check_element_bound(double worst, double u) {
    return CHECK_C1 * u * worst + CHECK_ATOL_FLOOR;
}

// Problems up to this many float64 multiply-adds (B*H*S*S*D) are checked in full; larger ones on
// a fixed sample of rows per (batch, head), each row still computed over all of its keys.
#define CHECK_FULL_MACS 6.0e8
#define CHECK_SAMPLE_MACS 4.0e8  // total budget for sampled checks
#define CHECK_MIN_ROWS_PER_HEAD 8

typedef struct {
    int full;                  // 1: every row compared, 0: sampled rows
    size_t rows_checked;
    size_t unwritten;          // elements still holding HALF_POISON (anywhere in O)
    size_t nonfinite;          // other NaN/Inf elements (anywhere in O)
    size_t over_tolerance;     // finite elements of checked rows outside the element bound
    size_t rows_over_rel_l2;   // checked rows whose L2 error is over the row bound
    double max_abs_err;        // over checked finite elements
    double rel_l2_err;         // ||out - ref|| / ||ref|| over checked finite elements
    double rmse;               // sqrt(mean (out - ref)^2) over the checked rows' elements
    double max_bound_ratio;    // max |out - ref| / element bound over checked finite elements
    size_t first_bad;          // flat index of the first failing element; (size_t)-1 if none
    double first_bad_out, first_bad_ref, first_bad_bound;
    int first_bad_row;         // 1: the first failure is its row's L2 error, not the element
    double first_bad_row_err, first_bad_row_bound;
} check_result;

// Inputs must be finite: with a NaN or Inf in Q, K, V or dO the reference is NaN too, and a failed
// check would blame the kernel. Returns 0 if every value of `tensor` ([B, H, S, D], of the shape's dtype) is
// finite; otherwise -1 and, in `msg`, "<name> holds a non-finite value (nan) at [b=0, h=1, s=5,
// d=3]; inputs must be finite" for the first one.
int check_inputs_finite(const attn_shape *shape, const uint16_t *tensor, const char *name, char *msg,
                        size_t msg_size);

// q, k, v: float copies of the inputs; out: the stage's output, of the shape's dtype, all [B, H, S, D].
check_result check_output(const attn_shape *shape, const float *q, const float *k, const float *v,
                          const uint16_t *out);

static inline int check_passed(const check_result *r) {
    return r->unwritten == 0 && r->nonfinite == 0 && r->over_tolerance == 0 &&
           r->rows_over_rel_l2 == 0;
}

// Prints the verdict, the errors and, on failure, the first bad element as [b, h, s, d].
void check_print(const attn_shape *shape, const check_result *r);
// The verdict lines alone, prefixed by `label`.
void check_print_verdict(const char *label, const attn_shape *shape, const check_result *r);

// Backward: the same rule on dQ, dK and dV, each element with its own error terms.
// Full check up to this many float64 multiply-adds; otherwise sampled heads (each costing
// 3 S^2 D for its softmax statistics) within CHECK_BWD_MACS and CHECK_BWD_ROWS rows per head.
#define CHECK_BWD_FULL_MACS 1.5e9
#define CHECK_BWD_MACS 1.2e9
#define CHECK_BWD_ROWS 24

typedef struct {
    check_result dq, dk, dv;
} check_bwd_result;

// q, k, v, d_o: float copies of the inputs; grads: the stage's dQ, dK, dV, of the shape's dtype.
check_bwd_result check_backward(const attn_shape *shape, const float *q, const float *k,
                                const float *v, const float *d_o, const uint16_t *const grads[3]);

static inline int check_bwd_passed(const check_bwd_result *r) {
    return check_passed(&r->dq) && check_passed(&r->dk) && check_passed(&r->dv);
}

void check_print_backward(const attn_shape *shape, const check_bwd_result *r);

#endif
