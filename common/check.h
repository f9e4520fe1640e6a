// check.h - compare a stage's fp16 output with the float64 reference.
#ifndef FLASH_STAGES_CHECK_H
#define FLASH_STAGES_CHECK_H

#include <stddef.h>
#include <stdint.h>
#include "attn.h"

// Element-wise bound |out - ref| <= CHECK_ATOL + CHECK_RTOL * |ref|. docs/measuring.md derives it:
// fp16 rounding of O (and, from stage 05 on, of P) costs at most ~1e-3 on these inputs, while an
// indexing or masking bug moves outputs by 1e-2 to 1.
#define CHECK_ATOL 4e-3
#define CHECK_RTOL 4e-3
// And per row: ||out_row - ref_row|| / ||ref_row|| <= CHECK_ROW_REL_L2. fp16 rounding gives at most
// ~5e-4 here; a dropped or doubled key tile in a long row gives 0.1 or more while moving each
// element by less than the element-wise bound.
#define CHECK_ROW_REL_L2 1e-2

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
    size_t rows_over_rel_l2;   // checked rows whose relative L2 error is over CHECK_ROW_REL_L2
    double max_abs_err;        // over checked finite elements
    double rel_l2_err;         // ||out - ref|| / ||ref|| over checked finite elements
    size_t first_bad;          // flat index of the first failing element; (size_t)-1 if none
    double first_bad_out, first_bad_ref;
} check_result;

// q, k, v: float copies of the fp16 inputs; out: the stage's fp16 output, all [B, H, S, D].
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

// Backward. The gradients differ in scale (dV ~ 1, dQ and dK ~ 1/sqrt(D)), so the element bound
// is relative to the rms of the checked reference values of that gradient:
//   |out - ref| <= CHECK_BWD_ATOL + CHECK_BWD_ATOL_RMS * rms + CHECK_BWD_RTOL * |ref|,
// and per row ||out_row - ref_row|| / ||ref_row|| <= CHECK_BWD_ROW_REL_L2 for rows whose norm is at
// least a tenth of the typical row's. fp16 P, dS and outputs give errors of ~1e-3 of the rms; a
// wrong tile, mask or missing accumulation gives 1e-1 or more. The absolute floor covers exact
// zeros (S = 1: dQ = dK = 0, computed as +-6e-8); the row rule skips rows that are nearly zero
// (dQ of row 1 when causal), where the rounding of D_i = dO.O from fp16 O is a few % of the row.
#define CHECK_BWD_ATOL 1e-4
#define CHECK_BWD_ATOL_RMS 2e-2
#define CHECK_BWD_RTOL 1e-2
#define CHECK_BWD_ROW_REL_L2 2e-2
// Full check up to this many float64 multiply-adds; otherwise sampled heads (each costing
// 2 S^2 D for its softmax statistics) within CHECK_BWD_MACS and CHECK_BWD_ROWS rows per head.
#define CHECK_BWD_FULL_MACS 1.5e9
#define CHECK_BWD_MACS 1.2e9
#define CHECK_BWD_ROWS 24

typedef struct {
    check_result dq, dk, dv;
} check_bwd_result;

// q, k, v, d_o: float copies of the fp16 tensors; grads: the stage's fp16 dQ, dK, dV.
check_bwd_result check_backward(const attn_shape *shape, const float *q, const float *k,
                                const float *v, const float *d_o, const uint16_t *const grads[3]);

static inline int check_bwd_passed(const check_bwd_result *r) {
    return check_passed(&r->dq) && check_passed(&r->dk) && check_passed(&r->dv);
}

void check_print_backward(const attn_shape *shape, const check_bwd_result *r);

#endif
