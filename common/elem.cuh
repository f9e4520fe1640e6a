// elem.cuh - the element types of the tensor-core stages, fp16 (__half) and bf16 (__nv_bfloat16),
// and the conversions that differ between them. Both are 2 bytes, and everything that only moves
// them (ldmatrix, cp.async, TMA, the swizzle) treats them alike; they differ in the products' type
// (f16 or bf16 in the mma and wgmma instructions) and in how a float rounds to them.
#ifndef FLASH_STAGES_ELEM_CUH
#define FLASH_STAGES_ELEM_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

// Bytes per element, fp16 and bf16 alike: what shared-memory layouts are sized with.
constexpr int ELEM_BYTES = 2;
static_assert(sizeof(__half) == ELEM_BYTES && sizeof(__nv_bfloat16) == ELEM_BYTES, "2-byte elements");

template <typename Elem>
inline constexpr bool is_bf16 = std::is_same_v<Elem, __nv_bfloat16>;

// Two floats to one .b32 of two elements (lo in the low half), rounded to nearest: the A-operand
// packing of P and dS, and how the kernels write their outputs two at a time.
template <typename Elem>
__device__ inline uint32_t pack2(float lo, float hi) {
    if constexpr (is_bf16<Elem>) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    } else {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
}

// The two elements of a .b32 as floats (lo in .x).
template <typename Elem>
__device__ inline float2 unpack2(uint32_t bits) {
    if constexpr (is_bf16<Elem>)
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&bits));
    else
        return __half22float2(*reinterpret_cast<const __half2 *>(&bits));
}

#endif
