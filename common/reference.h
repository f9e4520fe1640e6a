// reference.h - attention in float64 on the CPU: the answer every stage is checked against.
#ifndef FLASH_STAGES_REFERENCE_H
#define FLASH_STAGES_REFERENCE_H

#include "attn.h"

// One output row O[b, h, row, :] in float64. q, k, v are [B, H, S, D] float copies of the fp16
// inputs (exact: every fp16 value is a float). `scores` is caller scratch of S doubles.
void reference_row(const attn_shape *shape, const float *q, const float *k, const float *v,
                   int b, int h, int row, double *scores, double *out_row);

#endif
