// stage_library.c - what build/lib/libflash_stages_<stage>.so exports beside the STAGE table, for
// callers that bring their own CUDA runtime (python/flash_stages). The library links its own copy
// of the runtime, so the caller points it at the right device and reads its errors through it.
#include <cuda_runtime_api.h>

int flash_stages_set_device(int device) { return (int)cudaSetDevice(device); }

const char *flash_stages_error_string(int error) { return cudaGetErrorString((cudaError_t)error); }

// The per-block shared memory a kernel may opt in to on `device` (0 when it cannot be read).
size_t flash_stages_smem_optin(int device) {
    int bytes = 0;
    if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
    return (size_t)bytes;
}
