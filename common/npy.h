// npy.h - read and write fp16 [B, H, S, D] tensors as NumPy .npy files (format version 1.0),
// so any stage's inputs and output can be loaded with numpy.load() or torch.from_numpy().
#ifndef FLASH_STAGES_NPY_H
#define FLASH_STAGES_NPY_H

#include <stddef.h>
#include <stdint.h>

// Returns 0 on success; otherwise -1 with a message in `error` (size `error_size`).
int npy_write_f16_4d(const char *path, const int shape[4], const uint16_t *data, char *error,
                     size_t error_size);

// Reads a little-endian fp16 ('<f2'), C-ordered, 4-D array. On success returns 0, fills
// `shape` and sets *data to a malloc'ed buffer the caller frees.
int npy_read_f16_4d(const char *path, int shape[4], uint16_t **data, char *error,
                    size_t error_size);

#endif
