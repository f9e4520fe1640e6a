#ifndef FLASH_STAGES_GPU_SPIN_H
#define FLASH_STAGES_GPU_SPIN_H
#include <cuda_runtime.h>
#ifdef __cplusplus
extern "C" {
#endif
// Keeps the GPU busy on `stream` for about `cycles` SM clock cycles (one thread); returns the
// launch's error, if any.
cudaError_t gpu_spin(cudaStream_t stream, long long cycles);
#ifdef __cplusplus
}
#endif
#endif
