// kernel_common.cuh - device helpers shared by the stages' kernels (included by .cu files only).
#ifndef FLASH_STAGES_KERNEL_COMMON_CUH
#define FLASH_STAGES_KERNEL_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attn.h"

// Offset of head (b, h) in a [B, H, S, D] tensor.
__host__ __device__ inline size_t head_offset(int b, int h, int H, int S, int D) {
    return ((size_t)b * H + h) * (size_t)S * D;
}

__host__ __device__ inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Where a tensor's rows lie on the device (attn_strides, resolved), and how many heads it has, so
// that a kernel's flat head index (b * heads + h) finds its batch and head.
struct RowLayout {
    long long batch, head, row;  // element strides
    int heads;
    // The first element of row `r` of flat head `head_index`.
    __host__ __device__ size_t offset(int head_index, int r) const {
        return (size_t)(head_index / heads) * batch + (size_t)(head_index % heads) * head + (size_t)r * row;
    }
};
// A tensor of `heads` heads of `seq` rows, as attn_tensors describes it (strides all zero: contiguous).
inline RowLayout row_layout(attn_strides given, int heads, int seq, int dim) {
    const attn_strides st = attn_strides_of(given, heads, seq, dim);
    return {st.batch, st.head, st.row, heads};
}

// A grid of one block per (tile, head) puts the tiles of one head's rows along x and the B * H
// heads along y and z; its kernels number a block's head blockIdx.z * gridDim.y + blockIdx.y. CUDA
// allows at most 65,535 blocks along y and along z, so a launcher covers the heads in chunks of
// y * z heads, each launch given its tensors from the chunk's first head on (or, in stages 08 and 10, the
// whole tensors and the chunk's first head, from which its kernels number heads): one chunk up to
// 65,535 heads, two up to 65,535^2 (more than the INT_MAX elements that stage_check.c allows).
typedef struct {
    int first, count;  // heads [first, first + count)
    dim3 grid;         // (tiles, y, z) with y * z = count
} head_chunk;

// The chunk of heads from `first` (< heads_total) on, in a grid of `tiles` blocks per head.
inline head_chunk head_chunk_from(int first, int heads_total, int tiles) {
    const int left = heads_total - first, most = 65535;
    const int y = left < most ? left : most, z = left / y < most ? left / y : most;
    return {first, y * z, dim3(tiles, y, z)};
}

// Copy rows [row0, row0 + ROWS) of one head's [S, D] fp16 matrix into a float tile in shared
// memory with row stride `stride` (>= D; a stride of D + 1 staggers rows across banks). Rows past
// S are filled with zeros: the tail tile is always full, and masking decides what counts.
template <int ROWS, int D>
__device__ inline void load_tile_f32(float *tile, int stride, const __half *head, int row0, int S) {
    for (int i = threadIdx.x; i < ROWS * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        tile[r * stride + d] = row0 + r < S ? __half2float(head[(size_t)(row0 + r) * D + d]) : 0.0f;
    }
}

// Copy rows [row0, row0 + ROWS) of one head's [S, D] fp16 matrix into an fp16 tile in shared
// memory (row stride `stride` halves, a multiple of 8), 16 bytes per thread per step; rows past S
// are zero-filled. The tensor-core stages keep their tiles in fp16, the format WMMA reads.
template <int ROWS, int D>
__device__ inline void load_tile_f16(__half *tile, int stride, const __half *head, int row0, int S) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += blockDim.x) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        uint4 chunk = make_uint4(0, 0, 0, 0);
        if (row0 + r < S) chunk = *reinterpret_cast<const uint4 *>(head + (size_t)(row0 + r) * D + c * 8);
        *reinterpret_cast<uint4 *>(tile + r * stride + c * 8) = chunk;
    }
}

// q_row . k_row over D floats, both in shared memory.
template <int D>
__device__ inline float dot_row(const float *q_row, const float *k_row) {
    float acc = 0.0f;
#pragma unroll 16
    for (int d = 0; d < D; d++) acc += q_row[d] * k_row[d];
    return acc;
}

// A block gets 48 KB of dynamic shared memory unless the kernel's limit is raised first.
template <typename Kernel>
inline cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

// Launches kernel<<<grid, threads, smem, stream>>>(args...) as a dependent launch (programmatic
// dependent launch, Hopper): its blocks may start once the stream's previous kernel's blocks have
// exited (or have all signalled earlier with grid_launch_dependents, wgmma_ptx.cuh), before that
// kernel has completed and flushed its writes, so its set-up overlaps that
// completion and the launch gap; the kernel calls grid_dependency_wait (wgmma_ptx.cuh) before it
// reads what the previous kernel wrote.
template <typename... Params, typename... Args>
inline cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, int threads, size_t smem,
                                    cudaStream_t stream, Args... args) {
    cudaLaunchAttribute dependent;
    dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    dependent.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid, config.blockDim = dim3(threads), config.dynamicSmemBytes = smem, config.stream = stream;
    config.attrs = &dependent, config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, args...);
}

// The signature of the fused kernels of stages 02 to 07, which launch_attention launches (stages
// 08 on launch kernels of their own, with their own parameters).
typedef void (*attention_kernel)(const __half *q, const __half *k, const __half *v, __half *o, int S,
                                 float scale, int causal);

// Launch a fused attention kernel the way stages 02 to 07 do: one block per
// (query tile of `block_rows` rows, head), in chunks of heads (head_chunk), `threads` threads,
// `smem` bytes of dynamic shared memory (the limit raised where needed), softmax scale 1/sqrt(D).
inline cudaError_t launch_attention(attention_kernel kernel, int block_rows, int threads, size_t smem,
                                    const attn_shape *s, const attn_tensors *t, cudaStream_t stream) {
    cudaError_t err = allow_dynamic_smem(kernel, smem);
    if (err != cudaSuccess) return err;
    const int heads_total = s->batch * s->heads, tiles = ceil_div(s->seq, block_rows);
    for (int first = 0; first < heads_total;) {
        const head_chunk c = head_chunk_from(first, heads_total, tiles);
        const size_t offset = (size_t)first * s->seq * s->dim;
        kernel<<<c.grid, threads, smem, stream>>>((const __half *)t->q + offset, (const __half *)t->k + offset,
                                                  (const __half *)t->v + offset, (__half *)t->o + offset, s->seq,
                                                  1.0f / sqrtf((float)s->dim), s->causal);
        first += c.count;
    }
    return cudaGetLastError();
}

// The head dims every stage supports; a stage's unsupported() returns this sentence otherwise.
#define HEAD_DIM_SENTENCE "this stage is compiled for head dims D = 64 and 128 only"
inline const char *unsupported_head_dim(const attn_shape *shape) {
    return shape->dim == 64 || shape->dim == 128 ? NULL : HEAD_DIM_SENTENCE;
}

inline size_t no_workspace(const attn_shape *) { return 0; }
inline size_t no_shared_memory(const attn_shape *) { return 0; }

// A stage's shared_bytes() when its kernel's dynamic shared memory is Layout<D>::bytes.
template <template <int> class Layout>
size_t layout_shared_bytes(const attn_shape *s) {
    return s->dim == 64 ? Layout<64>::bytes : Layout<128>::bytes;
}

// The workspace of the stages with a backward pass: the forward's row log-sum-exp in log2 units,
// lse_log2[B*H*S] (float), from which the backward recomputes P = 2^(s scale log2 e - lse_log2)
// without a softmax. Nothing else: the workspace lives from the forward to the backward.
inline size_t attention_rows(const attn_shape *s) { return (size_t)s->batch * s->heads * s->seq; }
inline size_t lse_workspace_bytes(const attn_shape *s) { return sizeof(float) * attention_rows(s); }
inline float *workspace_lse(const attn_shape *, const attn_tensors *t) { return (float *)t->workspace; }

// The backward's scratch starts with delta_i = rowsum(dO * O), delta[B*H*S] (float), which the
// backward computes first (backward_common.cuh) and which dies with it. A backward that sums dQ
// across blocks with atomics puts a float dQ accumulator after it, 256-byte aligned for the vector
// atomics: stage 08's [B, H, S, D] (backward_common.cuh turns it into fp16 or bf16); stage 10's has
// its own size and order (backward.cu: dq_stage_index).
inline size_t delta_scratch_bytes(const attn_shape *s) { return sizeof(float) * attention_rows(s); }
inline float *scratch_delta(const attn_shape *, const attn_tensors *t) { return (float *)t->backward_scratch; }
inline size_t dq_accum_offset(const attn_shape *s) { return (delta_scratch_bytes(s) + 255) / 256 * 256; }
inline size_t delta_and_dq_accum_scratch_bytes(const attn_shape *s) {
    return dq_accum_offset(s) + sizeof(float) * attn_elems(s);
}
inline float *scratch_dq_accum(const attn_shape *s, const attn_tensors *t) {
    return (float *)((char *)t->backward_scratch + dq_accum_offset(s));
}

#endif
