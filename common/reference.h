// reference.h - attention in float64 on the CPU: the answer every stage is checked against, and
// the error a correct fp16 or bf16 kernel can make on each element of it.
#ifndef FLASH_STAGES_REFERENCE_H
#define FLASH_STAGES_REFERENCE_H

#include "attn.h"
#include "fp8.h"

// The element type's rounding. Rounding to nearest moves a normal value by at most u times its
// size; below the smallest normal m the spacing is fixed, so it moves any value x by at most
// u (|x| + m). fp16: u = 2^-11, m = 2^-14. bf16 keeps float's 8 exponent bits and 7 of its
// mantissa bits: u = 2^-8, m = 2^-126.
typedef struct {
    double u, min_normal;
} ref_rounding;

static inline ref_rounding ref_rounding_of(int dtype) {
    const ref_rounding fp16 = {0x1p-11, 0x1p-14}, bf16 = {0x1p-8, 0x1p-126};
    return dtype == ATTN_BF16 ? bf16 : fp16;
}
// An fp32 sum of n terms is off by at most n * REF_F32_STEP times the sum of their magnitudes:
// 2^-23, not 2^-24, so that tensor cores' truncating accumulation is covered too.
#define REF_F32_STEP 0x1p-23

// Where K/V head h / (H / H_kv), the one query head h reads, starts in a [B, H_kv, S_kv, D] tensor;
// and how many keys query i sees: all S_kv, or with the mask 0..i + S_kv - S (bottom-right).
static inline size_t ref_kv_start(const attn_shape *s, int b, int h) {
    return ((size_t)b * attn_kv_heads(s) + h / attn_group(s)) * (size_t)attn_kv_seq(s) * s->dim;
}
static inline int ref_keys_seen(const attn_shape *s, int i) {
    return s->causal ? i + 1 + attn_causal_offset(s) : attn_kv_seq(s);
}

// Error magnitudes of a row's elements, in units of the shape's u (D doubles each; both or neither
// NULL):
//   worst: the first-order bound on a correct kernel's error, each rounding at its largest
//          and all of one sign;
//   rss:   the root-sum-square of the same terms, the size that independent roundings reach.
// docs/measuring.md lists the rounding points and derives the terms.
typedef struct {
    double *worst, *rss;
} reference_error;

// The FP8 forward's quantization (attn_shape.fp8), as its error terms need it: the scale of each
// block of rows, amax / 448 over ATTN_FP8_BLOCK_ROWS rows of a head (or one for the whole tensor),
// and, with the Hadamard transform, Q and K rotated (the kernel rounds the rotated values; the
// scores themselves do not change).
typedef struct {
    float *q_rot, *k_rot;                 // [B, H, S, D] and [B, H_kv, S_kv, D]; NULL: not rotated
    double *q_scale, *k_scale, *v_scale;  // [B * H][blocks of S] and [B * H_kv][blocks of S_kv]
    float *q_hat, *k_hat, *v_hat;         // Q, K (rotated) and V as the kernel multiplies them
} ref_fp8;

// The scales (and rotated copies) for `shape`'s FP8 method from the float copies of the inputs;
// NULL when shape->fp8 is 0. Free with ref_fp8_free.
ref_fp8 *ref_fp8_prepare(const attn_shape *shape, const float *q, const float *k, const float *v);
void ref_fp8_free(ref_fp8 *fp8);

// The unit the checker's bounds count in: the element type's u, or e4m3's for an FP8 forward.
static inline double ref_check_unit(const attn_shape *s) { return s->fp8 ? E4M3_U : ref_rounding_of(s->dtype).u; }

// One output row O[b, h, row, :] in float64. q is a [B, H, S, D] and k, v are [B, H_kv, S_kv, D]
// float copies of the fp16 or bf16 inputs (exact: every value of either is a float). `scores` is
// caller scratch of S_kv doubles.
void reference_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                   int b, int h, int row, double *scores, double *out_row);

// The same row and its error magnitudes. `scratch` holds 2 S_kv doubles.
void reference_row_error(const attn_shape *shape, const float *q, const float *k, const float *v,
                         int b, int h, int row, double *scratch, double *out_row,
                         reference_error err);

// The row an FP8 forward must give (fp8 from ref_fp8_prepare): attention in float64 of the inputs
// it multiplies, Q, K and V rounded to e4m3 by their blocks' scales (q_hat, k_hat, v_hat; the
// rotation leaves the scores as they were), and the error terms, in units of e4m3's u, of what it
// rounds after that: P to e4m3, the tensor cores' sums, O to fp16. How far that row lies from
// attention of the inputs themselves is FP8's error, which the checker reports (RMSE) and does not
// bound. `scratch` holds 2 S_kv doubles.
void reference_row_error_fp8(const attn_shape *shape, const ref_fp8 *fp8, int b, int h, int row, double *scratch,
                             double *out_row, reference_error err);

#endif
