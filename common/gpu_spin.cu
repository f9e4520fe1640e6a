// The pause before every timed run: one thread keeps the GPU busy for about `cycles` SM clock
// cycles, as torch.cuda._sleep does before each timed run of PyTorch's backends
// (plots/peers.py), so that the stages and their peers are timed under the same conditions.
#include "gpu_spin.h"

__global__ void spin_kernel(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

extern "C" cudaError_t gpu_spin(cudaStream_t stream, long long cycles) {
    spin_kernel<<<1, 1, 0, stream>>>(cycles);
    return cudaGetLastError();
}
