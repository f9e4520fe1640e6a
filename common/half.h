// half.h - IEEE fp16 <-> float on the host, in plain C (no compiler extension needed).
#ifndef FLASH_STAGES_HALF_H
#define FLASH_STAGES_HALF_H

#include <stdint.h>

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);  // round to nearest even; overflow gives +-inf

// bfloat16: the top 16 bits of a float (8 exponent bits, 7 mantissa bits).
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);  // round to nearest even; NaN stays NaN

// Either of the two, by attn_dtype (attn.h): 0 fp16, 1 bf16.
float elem_to_float(uint16_t x, int dtype);
uint16_t float_to_elem(float f, int dtype);

// The poison pattern written over outputs before a run: a NaN no arithmetic produces (CUDA's
// canonical fp16 NaN is 0x7fff, its bf16 one 0x7fff too; 0xffff has the sign bit set, and is a NaN
// in both types), so an element still holding it was never written.
#define HALF_POISON ((uint16_t)0xffff)

#endif
