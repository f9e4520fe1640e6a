// test_util.h - a minimal assertion macro for the CPU tests: print the failing condition, count it.
#ifndef FLASH_STAGES_TEST_UTIL_H
#define FLASH_STAGES_TEST_UTIL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "half.h"

static int test_failures = 0;

#define EXPECT(cond, ...)                                                  \
    do {                                                                   \
        if (!(cond)) {                                                     \
            test_failures++;                                               \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
            printf(__VA_ARGS__);                                           \
            printf("\n");                                                  \
        }                                                                  \
    } while (0)

// x[i] ~ N(mean, std^2), rounded to fp16 (so the float holds the exact input a kernel sees), from
// a counter-based hash: the same values for a given seed on every machine.
static inline void test_fill_normal(float *x, size_t n, uint64_t seed, double mean, double std) {
    for (size_t i = 0; i < n; i++) {
        uint64_t z = seed * 0x100000001B3ull + i + 0x9E3779B97F4A7C15ull;  // splitmix64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const double u1 = ((double)(z >> 40) + 1.0) / 16777217.0;  // (0, 1]
        const double u2 = (double)(z & 0xffffff) / 16777216.0;     // [0, 1)
        const double normal = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        x[i] = half_to_float(float_to_half((float)(mean + std * normal)));
    }
}

static inline int test_summary(const char *name) {
    printf("%s: %s (%d failure%s)\n", name, test_failures ? "FAILED" : "passed", test_failures,
           test_failures == 1 ? "" : "s");
    return test_failures ? 1 : 0;
}

#endif
