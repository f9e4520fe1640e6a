// stage_library.c - what build/lib/libflash_stages_<stage>.so exports beside the STAGE table, for
// callers that bring their own CUDA runtime (python/flash_stages). The library links its own copy
// of the runtime, so the caller points it at the right device and reads its errors through it.
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "stage_check.h"

extern const attn_stage STAGE;

// The sizes of the three structs python/flash_stages/_library.py mirrors with ctypes. The loader
// compares them with its mirror's, so that a field added to attn.h and not to the mirror, or a
// library built before the field, is an error instead of a misread table.
const size_t flash_stages_struct_sizes[3] = {sizeof(attn_stage), sizeof(attn_tensors), sizeof(attn_shape)};

int flash_stages_set_device(int device) { return (int)cudaSetDevice(device); }

const char *flash_stages_error_string(int error) { return cudaGetErrorString((cudaError_t)error); }

// Whether this stage runs `shape` on `device`: 0, or the harness's exit status with its sentence in
// `message` (stage_check.h), so that PyTorch users get the harness's refusals word for word.
int flash_stages_refusal(const attn_shape *shape, int device, char *message, size_t message_size) {
    int refused = shape_refusal(&STAGE, STAGE.name, shape, message, message_size);
    if (refused) return refused;
    struct cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess) {
        snprintf(message, message_size, "%s: cannot read CUDA device %d: %s", STAGE.name, device, cudaGetErrorString(err));
        return REFUSED_SHAPE;
    }
    const gpu_info gpu = {prop.name, prop.major, prop.minor, prop.sharedMemPerBlockOptin};
    return gpu_refusal(&STAGE, STAGE.name, shape, &gpu, message, message_size);
}
