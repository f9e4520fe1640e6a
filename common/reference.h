// reference.h - attention in float64 on the CPU: the answer every stage is checked against, and
// the error a correct fp16 or bf16 kernel can make on each element of it.
#ifndef FLASH_STAGES_REFERENCE_H
#define FLASH_STAGES_REFERENCE_H

#include "attn.h"

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

// One output row O[b, h, row, :] in float64. q is a [B, H, S, D] and k, v are [B, H_kv, S_kv, D]
// float copies of the fp16 or bf16 inputs (exact: every value of either is a float). `scores` is
// caller scratch of S_kv doubles.
void reference_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                   int b, int h, int row, double *scores, double *out_row);

// The same row and its error magnitudes. `scratch` holds 2 S_kv doubles.
void reference_row_error(const attn_shape *shape, const float *q, const float *k, const float *v,
                         int b, int h, int row, double *scratch, double *out_row,
                         reference_error err);

#endif
