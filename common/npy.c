// npy.c - the .npy format: magic, version, header length, a Python-dict header, raw data.
//
// The reader is strict. It accepts a file only when numpy.load() would return a 4-D float16,
// C-ordered array made of exactly the bytes that follow the header. Any other rank, dtype, byte
// order or data length is refused with the reason; nothing is ever read in part.
#include "npy.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char NPY_MAGIC[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};
enum { NPY_RANK = 4, NPY_SHOWN_DIMS = 8 };  // dimensions kept for messages

#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static int npy_fail(char *error, size_t error_size, const char *name, const char *fmt, ...) {
    int used = snprintf(error, error_size, "%s: ", name);
    if (used >= 0 && (size_t)used < error_size) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(error + used, error_size - (size_t)used, fmt, args);
        va_end(args);
    }
    return -1;
}

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

// ---------------------------------------------------------------------------------------------
// The header: a Python dict literal, as numpy writes it and as ast.literal_eval would read it,
// restricted to what a float16 array's header can hold: the keys 'descr', 'fortran_order' and
// 'shape', each once, a string, a bool and a tuple of non-negative integers.

typedef struct {
    const unsigned char *text;
    size_t len, pos;
    const char *name;
    char *error;
    size_t error_size;
} header_cursor;

static int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f';
}

static void skip_space(header_cursor *h) {
    while (h->pos < h->len && is_space(h->text[h->pos])) h->pos++;
}

static int peek(const header_cursor *h) { return h->pos < h->len ? h->text[h->pos] : -1; }

// "expected X at byte N of the header, found 'c'" (or the end of the header).
static int unexpected(header_cursor *h, const char *expected) {
    const int c = peek(h);
    if (c < 0)
        return npy_fail(h->error, h->error_size, h->name,
                        "header ends where %s was expected; not a valid .npy header", expected);
    if (c >= 0x20 && c < 0x7f)
        return npy_fail(h->error, h->error_size, h->name,
                        "header has '%c' at byte %zu where %s was expected", c, h->pos, expected);
    return npy_fail(h->error, h->error_size, h->name,
                    "header has byte 0x%02x at byte %zu where %s was expected", (unsigned)c, h->pos,
                    expected);
}

static int expect_char(header_cursor *h, char c, const char *what) {
    skip_space(h);
    if (peek(h) != (unsigned char)c) return unexpected(h, what);
    h->pos++;
    return 0;
}

// A quoted string without escapes (numpy's keys and type strings never need them). Sets
// *start and *length to its contents.
static int read_string(header_cursor *h, const unsigned char **start, size_t *length,
                       const char *what) {
    skip_space(h);
    const int quote = peek(h);
    if (quote != '\'' && quote != '"') return unexpected(h, what);
    const size_t open = ++h->pos;
    while (h->pos < h->len && h->text[h->pos] != quote) {
        const unsigned char c = h->text[h->pos];
        if (c < 0x20 || c >= 0x7f || c == '\\') return unexpected(h, "a plain ASCII string");
        h->pos++;
    }
    if (h->pos >= h->len) return unexpected(h, "the end of a string");
    *start = h->text + open;
    *length = h->pos - open;
    h->pos++;  // the closing quote
    return 0;
}

static int string_is(const unsigned char *s, size_t length, const char *word) {
    return length == strlen(word) && memcmp(s, word, length) == 0;
}

// Python's True or False, as a whole word.
static int read_bool(header_cursor *h, int *value) {
    skip_space(h);
    const char *words[2] = {"False", "True"};
    for (int v = 0; v < 2; v++) {
        const size_t n = strlen(words[v]);
        if (h->len - h->pos >= n && memcmp(h->text + h->pos, words[v], n) == 0) {
            const size_t after = h->pos + n;
            const int next = after < h->len ? h->text[after] : -1;
            if (!(next == '_' || (next >= '0' && next <= '9') || (next >= 'a' && next <= 'z') ||
                  (next >= 'A' && next <= 'Z'))) {
                h->pos = after;
                *value = v;
                return 0;
            }
        }
    }
    return unexpected(h, "True or False for 'fortran_order'");
}

// The shape tuple: "()", "(5,)", "(1, 2, 3, 4)", with an optional trailing comma. Every
// dimension is counted into *rank; the first NPY_SHOWN_DIMS are stored.
static int read_shape(header_cursor *h, int dims[NPY_SHOWN_DIMS], int *rank) {
    *rank = 0;
    if (expect_char(h, '(', "'(' opening the shape tuple") != 0) return -1;
    skip_space(h);
    if (peek(h) == ')') {
        h->pos++;
        return 0;
    }
    for (;;) {
        skip_space(h);
        int c = peek(h);
        if (c < '0' || c > '9') return unexpected(h, "a dimension (a non-negative integer)");
        if (c == '0' && h->pos + 1 < h->len && h->text[h->pos + 1] >= '0' && h->text[h->pos + 1] <= '9')
            return unexpected(h, "a dimension without leading zeros");
        long long value = 0;
        while ((c = peek(h)) >= '0' && c <= '9') {
            value = value * 10 + (c - '0');
            if (value > INT_MAX)
                return npy_fail(h->error, h->error_size, h->name,
                                "dimension %d of the shape is over %d", *rank, INT_MAX);
            h->pos++;
        }
        if (*rank < NPY_SHOWN_DIMS) dims[*rank] = (int)value;
        if (*rank == INT_MAX) return unexpected(h, "fewer dimensions");
        ++*rank;
        skip_space(h);
        if (peek(h) == ')') break;
        if (expect_char(h, ',', "',' or ')' in the shape tuple") != 0) return -1;
        skip_space(h);
        if (peek(h) == ')') break;  // trailing comma
    }
    h->pos++;  // ')'
    return 0;
}

// "(1, 1, 2, 64, 64)" for messages; the first NPY_SHOWN_DIMS dimensions and "..." beyond.
static void shape_text(const int *dims, int rank, char *out, size_t size) {
    size_t used = (size_t)snprintf(out, size, "(");
    for (int i = 0; i < rank && i < NPY_SHOWN_DIMS && used < size; i++)
        used += (size_t)snprintf(out + used, size - used, "%s%d", i ? ", " : "", dims[i]);
    if (rank > NPY_SHOWN_DIMS && used < size) snprintf(out + used, size - used, ", ...)");
    else if (used < size) snprintf(out + used, size - used, "%s", rank == 1 ? ",)" : ")");
}

enum { KEY_DESCR = 1, KEY_FORTRAN = 2, KEY_SHAPE = 4 };

static int parse_header(header_cursor *h, int shape[NPY_RANK]) {
    int seen = 0, rank = 0, fortran = 0, dims[NPY_SHOWN_DIMS] = {0};
    if (expect_char(h, '{', "'{' opening the header's dictionary") != 0) return -1;
    for (;;) {
        skip_space(h);
        if (peek(h) == '}') break;
        const unsigned char *key, *value;
        size_t key_len, value_len;
        if (read_string(h, &key, &key_len, "a quoted key or '}'") != 0) return -1;
        if (expect_char(h, ':', "':' after a key") != 0) return -1;
        int which = string_is(key, key_len, "descr")           ? KEY_DESCR
                    : string_is(key, key_len, "fortran_order") ? KEY_FORTRAN
                    : string_is(key, key_len, "shape")         ? KEY_SHAPE
                                                               : 0;
        if (which == 0)
            return npy_fail(h->error, h->error_size, h->name,
                            "header has the key '%.*s'; a .npy header holds only 'descr', "
                            "'fortran_order' and 'shape'",
                            (int)(key_len > 40 ? 40 : key_len), (const char *)key);
        if (seen & which)
            return npy_fail(h->error, h->error_size, h->name, "header has the key '%.*s' twice",
                            (int)key_len, (const char *)key);
        seen |= which;
        if (which == KEY_DESCR) {
            if (read_string(h, &value, &value_len, "a quoted type string for 'descr'") != 0) return -1;
            if (!string_is(value, value_len, "<f2")) {
                const char *why = string_is(value, value_len, ">f2")
                                      ? "big-endian float16; store it little-endian, "
                                        "a.astype('<f2')"
                                      : "need little-endian float16, '<f2'; convert with "
                                        "a.astype(numpy.float16)";
                return npy_fail(h->error, h->error_size, h->name, "dtype is '%.*s': %s",
                                (int)(value_len > 40 ? 40 : value_len), (const char *)value, why);
            }
        } else if (which == KEY_FORTRAN) {
            if (read_bool(h, &fortran) != 0) return -1;
        } else if (read_shape(h, dims, &rank) != 0) {
            return -1;
        }
        skip_space(h);
        if (peek(h) == '}') break;
        if (expect_char(h, ',', "',' or '}' after a value") != 0) return -1;
    }
    h->pos++;  // '}'
    skip_space(h);  // numpy pads with spaces and ends with '\n'
    if (h->pos != h->len) return unexpected(h, "only spaces after the header's dictionary");

    const char *missing = !(seen & KEY_DESCR)     ? "descr"
                          : !(seen & KEY_FORTRAN) ? "fortran_order"
                          : !(seen & KEY_SHAPE)   ? "shape"
                                                  : NULL;
    if (missing)
        return npy_fail(h->error, h->error_size, h->name, "header has no '%s'", missing);
    if (fortran)
        return npy_fail(h->error, h->error_size, h->name,
                        "array is Fortran-ordered; need C order, numpy.ascontiguousarray(a)");
    char text[128];
    shape_text(dims, rank, text, sizeof text);
    if (rank != NPY_RANK)
        return npy_fail(h->error, h->error_size, h->name,
                        "shape %s has rank %d; need rank 4, [B, H, S, D]", text, rank);
    for (int i = 0; i < NPY_RANK; i++) {
        shape[i] = dims[i];
        if (shape[i] < 1)
            return npy_fail(h->error, h->error_size, h->name,
                            "shape %s has an empty dimension; every one must be >= 1", text);
    }
    return 0;
}

int npy_parse_f16_4d(const unsigned char *buf, size_t len, const char *name, int shape[4],
                     size_t *data_offset, char *error, size_t error_size) {
    if (len < sizeof NPY_MAGIC || memcmp(buf, NPY_MAGIC, sizeof NPY_MAGIC) != 0)
        return npy_fail(error, error_size, name, "not a .npy file (no \\x93NUMPY magic)");
    if (len < 10) return npy_fail(error, error_size, name, "file ends inside the preamble");
    const unsigned major = buf[6], minor = buf[7];
    if (!(major >= 1 && major <= 3) || minor != 0)
        return npy_fail(error, error_size, name,
                        ".npy format version %u.%u; versions 1.0, 2.0 and 3.0 are read", major, minor);
    // Version 1.0 stores the header length in 2 bytes, 2.0 and 3.0 in 4 (little-endian).
    const size_t preamble = major == 1 ? 10 : 12;
    if (len < preamble) return npy_fail(error, error_size, name, "file ends inside the preamble");
    size_t header_len = (size_t)buf[8] | (size_t)buf[9] << 8;
    if (major > 1) header_len |= (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
    if (header_len > len - preamble)
        return npy_fail(error, error_size, name,
                        "header says it is %zu bytes, but only %zu follow: the file is truncated",
                        header_len, len - preamble);

    header_cursor h = {buf + preamble, header_len, 0, name, error, error_size};
    if (parse_header(&h, shape) != 0) return -1;

    // B*H*S*D*2 bytes, each product checked: four dimensions up to INT_MAX overflow a size_t.
    size_t bytes = sizeof(uint16_t);
    for (int i = 0; i < NPY_RANK; i++) {
        if (bytes > SIZE_MAX / (size_t)shape[i])
            return npy_fail(error, error_size, name,
                            "shape [%d, %d, %d, %d] holds more bytes than this machine can address",
                            shape[0], shape[1], shape[2], shape[3]);
        bytes *= (size_t)shape[i];
    }
    const size_t offset = preamble + header_len, data_len = len - offset;
    if (data_len < bytes)
        return npy_fail(error, error_size, name,
                        "data are %zu bytes, shape [%d, %d, %d, %d] needs %zu: the file is truncated",
                        data_len, shape[0], shape[1], shape[2], shape[3], bytes);
    if (data_len > bytes)
        return npy_fail(error, error_size, name,
                        "%zu byte%s after the data that shape [%d, %d, %d, %d] describes (%zu bytes): "
                        "the file holds more than its shape says",
                        data_len - bytes, data_len - bytes == 1 ? "" : "s", shape[0], shape[1], shape[2], shape[3], bytes);
    *data_offset = offset;
    return 0;
}

// The whole file in one malloc'ed buffer; *len its size. 0 on success.
static int read_file(FILE *f, unsigned char **buf, size_t *len) {
    size_t cap = 1 << 16;
    if (fseek(f, 0, SEEK_END) == 0) {  // a size hint; the loop below still reads to the end
        const long size = ftell(f);
        if (size >= 0 && (unsigned long)size < SIZE_MAX) cap = (size_t)size + 1;
        if (fseek(f, 0, SEEK_SET) != 0) return -1;
    }
    *len = 0;
    *buf = malloc(cap);
    if (!*buf) return -1;
    for (;;) {
        if (*len == cap) {
            if (cap > SIZE_MAX / 2) return -1;
            unsigned char *bigger = realloc(*buf, cap * 2);
            if (!bigger) return -1;
            *buf = bigger;
            cap *= 2;
        }
        const size_t got = fread(*buf + *len, 1, cap - *len, f);
        *len += got;
        if (got == 0) return ferror(f) ? -1 : 0;
    }
}

int npy_read_f16_4d(const char *path, int shape[4], uint16_t **data, char *error,
                    size_t error_size) {
    *data = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(error, error_size, "cannot open %s", path);
        return -1;
    }
    unsigned char *buf = NULL;
    size_t len = 0, offset = 0;
    const int read_status = read_file(f, &buf, &len);
    fclose(f);
    if (read_status != 0) {
        free(buf);
        return npy_fail(error, error_size, path, "cannot read the file (error or out of memory)");
    }
    if (npy_parse_f16_4d(buf, len, path, shape, &offset, error, error_size) != 0) {
        free(buf);
        return -1;
    }
    // Move the data to the front and decode them in place: each fp16 is its own two bytes,
    // little-endian, whatever the host's byte order.
    const size_t n = (len - offset) / 2;
    memmove(buf, buf + offset, len - offset);
    uint16_t *values = (uint16_t *)(void *)buf;
    for (size_t i = 0; i < n; i++) {
        const uint16_t value = (uint16_t)(buf[2 * i] | buf[2 * i + 1] << 8);
        memcpy(&values[i], &value, sizeof value);
    }
    uint16_t *fitted = realloc(buf, n * sizeof(uint16_t));
    *data = fitted ? fitted : values;
    return 0;
}
