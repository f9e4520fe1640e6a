// half.h - IEEE fp16 <-> float on the host, in plain C (no compiler extension needed).
#ifndef FLASH_STAGES_HALF_H
#define FLASH_STAGES_HALF_H

#include <stdint.h>

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);  // round to nearest even; overflow gives +-inf

// The poison pattern written over outputs before a run: a NaN no arithmetic produces (CUDA's
// canonical fp16 NaN is 0x7fff; 0xffff has the sign bit set too), so an element still holding
// it was never written.
#define HALF_POISON ((uint16_t)0xffff)

#endif
