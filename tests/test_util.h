// test_util.h - a minimal assertion macro for the CPU tests: print the failing condition, count it.
#ifndef FLASH_STAGES_TEST_UTIL_H
#define FLASH_STAGES_TEST_UTIL_H

#include <stdio.h>

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

static inline int test_summary(const char *name) {
    printf("%s: %s (%d failure%s)\n", name, test_failures ? "FAILED" : "passed", test_failures,
           test_failures == 1 ? "" : "s");
    return test_failures ? 1 : 0;
}

#endif
