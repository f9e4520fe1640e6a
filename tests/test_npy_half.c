// test_npy_half.c - fp16 and bf16 conversions against known bit patterns, and a .npy round trip.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "npy.h"
#include "test_util.h"

int main(int argc, char **argv) {
    // exact: the float is a half value, so half_to_float must give it back too.
    struct { float f; uint16_t h; int exact; } known[] = {
        {0.0f, 0x0000, 1}, {-0.0f, 0x8000, 1}, {1.0f, 0x3c00, 1}, {-2.0f, 0xc000, 1},
        {65504.0f, 0x7bff, 1}, {5.9604645e-8f, 0x0001, 1} /* smallest subnormal */,
        {6.1035156e-5f, 0x0400, 1} /* smallest normal */, {INFINITY, 0x7c00, 1},
        {-INFINITY, 0xfc00, 1}, {0.1f, 0x2e66, 0}, {1.0f + 1.0f / 2048, 0x3c00, 0} /* tie: even */,
        {1.0f + 3.0f / 2048, 0x3c02, 0} /* tie: even */, {70000.0f, 0x7c00, 0} /* overflow */,
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        EXPECT(float_to_half(known[i].f) == known[i].h, "float_to_half(%g) = 0x%04x, want 0x%04x",
               known[i].f, float_to_half(known[i].f), known[i].h);
        if (known[i].exact)
            EXPECT(half_to_float(known[i].h) == known[i].f, "half_to_float(0x%04x) = %g", known[i].h,
                   half_to_float(known[i].h));
    }
    EXPECT(isnan(half_to_float(HALF_POISON)), "the poison must read as NaN");
    // Every finite half survives half -> float -> half.
    for (uint32_t h = 0; h < 0x10000; h++)
        if ((h & 0x7c00) != 0x7c00)
            EXPECT(float_to_half(half_to_float((uint16_t)h)) == h, "round trip of 0x%04x", h);

    // bf16: float's top 16 bits, rounded to nearest even.
    struct { float f; uint16_t b; int exact; } known_bf16[] = {
        {0.0f, 0x0000, 1}, {-0.0f, 0x8000, 1}, {1.0f, 0x3f80, 1}, {-2.0f, 0xc000, 1},
        {3.3895314e38f, 0x7f7f, 1} /* largest */, {1.1754944e-38f, 0x0080, 1} /* smallest normal */,
        {INFINITY, 0x7f80, 1}, {0.1f, 0x3dcd, 0}, {1.0f + 1.0f / 256, 0x3f80, 0} /* tie: even */,
        {1.0f + 3.0f / 256, 0x3f82, 0} /* tie: even */, {3.4e38f, 0x7f80, 0} /* rounds past the largest */,
        {65504.0f, 0x4780, 0} /* fp16's largest is not a bf16 */,
    };
    for (size_t i = 0; i < sizeof known_bf16 / sizeof known_bf16[0]; i++) {
        EXPECT(float_to_bf16(known_bf16[i].f) == known_bf16[i].b, "float_to_bf16(%g) = 0x%04x, want 0x%04x",
               known_bf16[i].f, float_to_bf16(known_bf16[i].f), known_bf16[i].b);
        if (known_bf16[i].exact)
            EXPECT(bf16_to_float(known_bf16[i].b) == known_bf16[i].f, "bf16_to_float(0x%04x) = %g",
                   known_bf16[i].b, bf16_to_float(known_bf16[i].b));
    }
    EXPECT(isnan(bf16_to_float(HALF_POISON)), "the poison must read as NaN in bf16 too");
    EXPECT(isnan(bf16_to_float(float_to_bf16(NAN))), "NaN stays NaN");
    for (uint32_t b = 0; b < 0x10000; b++)
        if ((b & 0x7f80) != 0x7f80)
            EXPECT(float_to_bf16(bf16_to_float((uint16_t)b)) == b, "bf16 round trip of 0x%04x", b);
    EXPECT(float_to_elem(0.1f, 1) == float_to_bf16(0.1f) && float_to_elem(0.1f, 0) == float_to_half(0.1f),
           "float_to_elem picks the type");

    const char *dir = argc > 1 ? argv[1] : ".";
    char path[4096], error[4352];
    snprintf(path, sizeof path, "%s/test_npy_half.npy", dir);
    int shape[4] = {2, 3, 5, 7}, back[4];
    uint16_t data[2 * 3 * 5 * 7], *loaded;
    for (int i = 0; i < 210; i++) data[i] = float_to_half((float)i - 100.5f);
    EXPECT(npy_write_f16_4d(path, shape, data, error, sizeof error) == 0, "write: %s", error);
    EXPECT(npy_read_f16_4d(path, back, &loaded, error, sizeof error) == 0, "read: %s", error);
    if (loaded) {
        EXPECT(memcmp(shape, back, sizeof shape) == 0, "shape round trip");
        EXPECT(memcmp(data, loaded, sizeof data) == 0, "data round trip");
        free(loaded);
    }
    // The header ends on a 64-byte boundary, as numpy writes it.
    FILE *f = fopen(path, "rb");
    unsigned char pre[10];
    EXPECT(f && fread(pre, 1, 10, f) == 10, "reopen");
    if (f) fclose(f);
    EXPECT((10 + (pre[8] | pre[9] << 8)) % 64 == 0, "header alignment");

    // The parser on files held in memory: what numpy would read as this 4-D float16 array, and
    // nothing else. Each case: header text (version 1.0), data bytes, expected message or NULL.
    struct { const char *header; size_t data; const char *refusal; } cases[] = {
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 2, 3), }", 12, NULL},
        {"{\"shape\": (1,1,2,3,), \"descr\": \"<f2\", \"fortran_order\": False}", 12, NULL},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 1, 2, 3), }", 12, "has rank 5"},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (2, 3), }", 12, "has rank 2"},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 2, 3), }", 14, "2 bytes after the data"},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 2, 3), }", 10, "truncated"},
        {"{'descr': '>f2', 'fortran_order': False, 'shape': (1, 1, 2, 3), }", 12, "big-endian"},
        {"{'descr': '<f2', 'fortran_order': True, 'shape': (1, 1, 2, 3), }", 12, "Fortran-ordered"},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 0, 3), }", 0, "empty dimension"},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 2147483648, 3), }", 12, "over 2147483647"},
        {"{'descr': '<f2', 'fortran_order': False, 'shape': (2147483647, 2147483647, 2147483647, "
         "2147483647), }", 12, "more bytes than"},
        {"{'descr': '<f2', 'shape': (1, 1, 2, 3), }", 12, "no 'fortran_order'"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        unsigned char file[512] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
        const size_t header_len = strlen(cases[c].header);
        file[8] = (unsigned char)header_len;
        memcpy(file + 10, cases[c].header, header_len);
        int dims[4];
        size_t offset = 0;
        const int status = npy_parse_f16_4d(file, 10 + header_len + cases[c].data, "x.npy", dims, &offset,
                                            error, sizeof error);
        if (!cases[c].refusal)
            EXPECT(status == 0 && dims[2] == 2 && dims[3] == 3 && offset == 10 + header_len,
                   "case %zu must be accepted: %s", c, status ? error : "");
        else
            EXPECT(status != 0 && strstr(error, cases[c].refusal) && !strncmp(error, "x.npy: ", 7),
                   "case %zu must be refused with '%s', got '%s'", c, cases[c].refusal, status ? error : "");
    }

    snprintf(path, sizeof path, "%s/does_not_exist.npy", dir);
    EXPECT(npy_read_f16_4d(path, back, &loaded, error, sizeof error) != 0, "a missing file must fail");
    return test_summary("test_npy_half");
}
