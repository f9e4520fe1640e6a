// half.c - fp16 and bf16 conversions by bit manipulation, so the harness stays C11 with no extensions.
#include "half.h"

#include <math.h>
#include <string.h>

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ff;
    if (exponent == 0x1f)  // inf or NaN: keep the payload
        return bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {   // zero or subnormal: value = mantissa * 2^-24
        float magnitude = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float f) {
    uint32_t u = float_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t abs_bits = u & 0x7fffffffu;
    if (abs_bits >= 0x7f800000u)  // inf or NaN
        return (uint16_t)(sign | 0x7c00 | (abs_bits > 0x7f800000u ? 0x200 : 0));
    if (abs_bits >= 0x477ff000u)  // rounds to >= 65520: overflow
        return (uint16_t)(sign | 0x7c00);
    if (abs_bits < 0x38800000u) {  // below 2^-14: subnormal half (or zero)
        // Scaling by 2^24 makes the subnormal's integer mantissa; rintf rounds to nearest even.
        float magnitude = bits_float(abs_bits) * 16777216.0f;
        uint32_t mantissa = (uint32_t)rintf(magnitude);
        return (uint16_t)(sign | mantissa);  // mantissa 1024 carries into the exponent correctly
    }
    // Normal: rebias the exponent, then round the 13 dropped bits to nearest even.
    uint32_t half_bits = (abs_bits - 0x38000000u) >> 13;
    uint32_t dropped = abs_bits & 0x1fffu;
    if (dropped > 0x1000u || (dropped == 0x1000u && (half_bits & 1u)))
        half_bits++;
    return (uint16_t)(sign | half_bits);
}

float bf16_to_float(uint16_t b) { return bits_float((uint32_t)b << 16); }

uint16_t float_to_bf16(float f) {
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN: keep it quiet
    // Round the 16 dropped bits to nearest even; a carry into the exponent is the right result,
    // up to infinity for the largest values.
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float elem_to_float(uint16_t x, int dtype) { return dtype ? bf16_to_float(x) : half_to_float(x); }

uint16_t float_to_elem(float f, int dtype) { return dtype ? float_to_bf16(f) : float_to_half(f); }
