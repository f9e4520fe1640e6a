// test_e4m3_gpu.cu - the GPU's rounding to e4m3 (cvt.rn.satfinite.e4m3x2.f32, pack4_e4m3 in
// common/wgmma_ptx.cuh) against common/fp8.h's e4m3_round, for every finite float of both signs:
// the FP8 checker rounds Q, K and V on the CPU and needs the very bytes stage 11's kernel writes.
// Needs a GPU of compute capability 8.9 or newer; prints SKIPPED and exits 77 otherwise.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"
#include "wgmma_ptx.cuh"

// out[i] = the e4m3 byte of the float with bits first + i (the sign bit from `sign`).
__global__ void round_on_gpu(uint32_t first, uint32_t count, uint32_t sign, uint8_t *out) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
        out[i] = (uint8_t)pack4_e4m3(__uint_as_float((first + i) | sign), 0.0f, 0.0f, 0.0f);
}

int main(void) {
    int devices = 0;
    cudaDeviceProp prop;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess ||
        prop.major * 10 + prop.minor < 89) {
        printf("SKIPPED: no CUDA GPU of compute capability 8.9 or newer\n");
        return 77;
    }
    const uint32_t chunk = 1u << 27, finite_end = 0x7f800000u;  // the bits of +inf: every finite float below
    uint8_t *device_bytes, *host_bytes = (uint8_t *)malloc(chunk);
    if (!host_bytes || cudaMalloc(&device_bytes, chunk) != cudaSuccess) {
        printf("test_e4m3_gpu: out of memory\n");
        return 1;
    }
    long long mismatches = 0, tested = 0;
    for (uint32_t sign = 0; sign <= 0x80000000u; sign += 0x80000000u) {
        for (uint32_t first = 0; first < finite_end; first += chunk) {
            const uint32_t count = finite_end - first < chunk ? finite_end - first : chunk;
            round_on_gpu<<<1024, 256>>>(first, count, sign, device_bytes);
            if (cudaMemcpy(host_bytes, device_bytes, count, cudaMemcpyDeviceToHost) != cudaSuccess) {
                printf("test_e4m3_gpu: CUDA error %s\n", cudaGetErrorString(cudaGetLastError()));
                return 1;
            }
            long long bad = 0;
#pragma omp parallel for reduction(+ : bad)
            for (long long i = 0; i < (long long)count; i++) {
                const uint32_t bits = (first + (uint32_t)i) | sign;
                float x;
                memcpy(&x, &bits, sizeof x);
                const uint8_t want = e4m3_bits(e4m3_round((double)x));
                if (host_bytes[i] != want && !(x == 0.0f && (host_bytes[i] & 0x7f) == 0)) bad++;
            }
            if (bad && mismatches == 0) printf("test_e4m3_gpu: mismatches among floats from bits 0x%08x\n", first | sign);
            mismatches += bad, tested += count;
        }
        if (sign) break;
    }
    cudaFree(device_bytes), free(host_bytes);
    printf("test_e4m3_gpu: %lld floats rounded on the GPU and by fp8.h, %lld mismatches\n", tested, mismatches);
    return mismatches ? 1 : 0;
}
