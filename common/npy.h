// npy.h - read and write fp16 [B, H, S, D] tensors as NumPy .npy files, so any stage's inputs and
// output can be loaded with numpy.load() or torch.from_numpy().
#ifndef FLASH_STAGES_NPY_H
#define FLASH_STAGES_NPY_H

#include <stddef.h>
#include <stdint.h>

// Writes format version 1.0. Returns 0 on success; otherwise -1 with a message in `error` (size
// `error_size`).
int npy_write_f16_4d(const char *path, const int shape[4], const uint16_t *data, char *error,
                     size_t error_size);

// Reads a little-endian fp16 ('<f2'), C-ordered array of exactly 4 dimensions, each >= 1, whose
// data fill the rest of the file exactly (format versions 1.0, 2.0 and 3.0). On success returns 0,
// fills `shape` and sets *data to a malloc'ed buffer the caller frees. Otherwise returns -1 with
// the reason, naming `path`, in `error`.
int npy_read_f16_4d(const char *path, int shape[4], uint16_t **data, char *error,
                    size_t error_size);

// The same rules on a whole file held in memory (`len` bytes at `buf`); `name` only labels the
// messages. On success returns 0, fills `shape` and sets *data_offset to where the fp16 data start:
// they are exactly the last B*H*S*D*2 bytes of the buffer. Nothing is allocated.
int npy_parse_f16_4d(const unsigned char *buf, size_t len, const char *name, int shape[4],
                     size_t *data_offset, char *error, size_t error_size);

#endif
