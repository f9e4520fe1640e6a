// fuzz_npy.c - libFuzzer target for the .npy reader (common/npy.c), built with AddressSanitizer and
// UndefinedBehaviorSanitizer. Whatever the bytes, the parser must either refuse them with a
// message or accept a 4-D shape whose data are exactly the rest of the input; and the file reader
// must give the same verdict, shape and values.
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "npy.h"

static char temp_path[] = "/tmp/fuzz_npy_XXXXXX";

static void remove_temp(void) { unlink(temp_path); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const int fd = mkstemp(temp_path);
    if (fd < 0) {
        perror("fuzz_npy: mkstemp");
        abort();
    }
    close(fd);
    atexit(remove_temp);
    return 0;
}

static void fail(const char *why) {
    fprintf(stderr, "fuzz_npy: %s\n", why);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *bytes, size_t size) {
    int shape[4];
    size_t offset = 0;
    char error[512] = "";
    if (npy_parse_f16_4d(bytes, size, "input", shape, &offset, error, sizeof error) != 0) {
        if (strncmp(error, "input: ", 7) != 0 || error[7] == '\0') fail("a refusal without a message");
        return 0;
    }
    size_t elements = 1;
    for (int i = 0; i < 4; i++) {
        if (shape[i] < 1) fail("an accepted shape with a dimension < 1");
        elements *= (size_t)shape[i];  // cannot overflow: the data below are that many fp16 values
    }
    if (offset > size || size - offset != 2 * elements) fail("accepted data of the wrong length");

    // The file reader on the same bytes: same shape, and the values decoded little-endian.
    FILE *f = fopen(temp_path, "wb");
    if (!f || fwrite(bytes, 1, size, f) != size || fclose(f) != 0) fail("cannot write the temporary file");
    int file_shape[4];
    uint16_t *data = NULL;
    if (npy_read_f16_4d(temp_path, file_shape, &data, error, sizeof error) != 0) {
        fprintf(stderr, "%s\n", error);
        fail("the file reader refused what the parser accepted");
    }
    if (memcmp(shape, file_shape, sizeof shape) != 0) fail("the file reader read another shape");
    for (size_t i = 0; i < elements; i++)
        if (data[i] != (uint16_t)(bytes[offset + 2 * i] | bytes[offset + 2 * i + 1] << 8))
            fail("the file reader read other values");
    free(data);
    return 0;
}
