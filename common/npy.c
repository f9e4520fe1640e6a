// npy.c - the .npy format: magic, version, header length, a Python-dict header, raw data.
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char NPY_MAGIC[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

int npy_write_f16_4d(const char *path, const int shape[4], const uint16_t *data, char *error,
                     size_t error_size) {
    char header[256];
    int len = snprintf(header, sizeof header,
                       "{'descr': '<f2', 'fortran_order': False, 'shape': (%d, %d, %d, %d), }",
                       shape[0], shape[1], shape[2], shape[3]);
    // Pad with spaces and end with '\n' so magic + version + length + header is a multiple of 64.
    int total = 10 + len + 1;
    int padded = (total + 63) / 64 * 64;
    memset(header + len, ' ', (size_t)(padded - total));
    header[padded - 10 - 1] = '\n';
    uint16_t header_len = (uint16_t)(padded - 10);

    FILE *f = fopen(path, "wb");
    if (!f) {
        snprintf(error, error_size, "cannot create %s", path);
        return -1;
    }
    const size_t n = (size_t)shape[0] * shape[1] * shape[2] * shape[3];
    const unsigned char version[2] = {1, 0};
    const unsigned char len_le[2] = {(unsigned char)(header_len & 0xff),
                                     (unsigned char)(header_len >> 8)};
    int ok = fwrite(NPY_MAGIC, 1, 6, f) == 6 && fwrite(version, 1, 2, f) == 2 &&
             fwrite(len_le, 1, 2, f) == 2 && fwrite(header, 1, header_len, f) == header_len &&
             fwrite(data, sizeof(uint16_t), n, f) == n;  // fp16 is little-endian on every CUDA host
    if (fclose(f) != 0 || !ok) {
        snprintf(error, error_size, "error writing %s", path);
        return -1;
    }
    return 0;
}

int npy_read_f16_4d(const char *path, int shape[4], uint16_t **data, char *error,
                    size_t error_size) {
    *data = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(error, error_size, "cannot open %s", path);
        return -1;
    }
    unsigned char preamble[10];
    char header[4096];
    int status = -1;
    if (fread(preamble, 1, 10, f) != 10 || memcmp(preamble, NPY_MAGIC, 6) != 0 || preamble[6] != 1) {
        snprintf(error, error_size, "%s: not a version-1 .npy file", path);
        goto done;
    }
    size_t header_len = (size_t)preamble[8] | (size_t)preamble[9] << 8;
    if (header_len >= sizeof header || fread(header, 1, header_len, f) != header_len) {
        snprintf(error, error_size, "%s: truncated or oversized header", path);
        goto done;
    }
    header[header_len] = '\0';
    if (!strstr(header, "'descr': '<f2'")) {
        snprintf(error, error_size, "%s: dtype must be float16 ('<f2'), header is %s", path, header);
        goto done;
    }
    if (!strstr(header, "'fortran_order': False")) {
        snprintf(error, error_size, "%s: must be C-ordered (fortran_order False)", path);
        goto done;
    }
    const char *shape_text = strstr(header, "'shape': (");
    if (!shape_text || sscanf(shape_text, "'shape': (%d, %d, %d, %d)", &shape[0], &shape[1],
                              &shape[2], &shape[3]) != 4) {
        snprintf(error, error_size, "%s: shape must have 4 dimensions [B, H, S, D], header is %s",
                 path, header);
        goto done;
    }
    for (int i = 0; i < 4; i++) {
        if (shape[i] < 1) {
            snprintf(error, error_size, "%s: every dimension must be >= 1", path);
            goto done;
        }
    }
    const size_t n = (size_t)shape[0] * shape[1] * shape[2] * shape[3];
    *data = malloc(n * sizeof(uint16_t));
    if (!*data || fread(*data, sizeof(uint16_t), n, f) != n) {
        snprintf(error, error_size, "%s: data shorter than its shape says", path);
        free(*data);
        *data = NULL;
        goto done;
    }
    status = 0;
done:
    fclose(f);
    return status;
}
