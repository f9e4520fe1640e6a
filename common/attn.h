// attn.h - the one interface between the shared harness (common/harness.c) and a stage.
//
// Every stage directory defines exactly one `attn_stage STAGE` in its .cu file; the harness owns
// everything else (command line, inputs, checking, timing, CSV), so a stage holds only its kernels.
#ifndef FLASH_STAGES_ATTN_H
#define FLASH_STAGES_ATTN_H

#include <stddef.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

// The element type of Q, K, V, O and the gradients. fp16 is 0, so a shape that names none is fp16.
typedef enum { ATTN_FP16 = 0, ATTN_BF16 = 1 } attn_dtype;

// One attention problem. Tensors are row-major [B, H, S, D] of `dtype`; softmax scale is 1/sqrt(D).
typedef struct {
    int batch;   // B >= 1
    int heads;   // H >= 1
    int seq;     // S >= 1, any value: kernels mask tails, never assume divisibility
    int dim;     // D, head dimension
    int causal;  // 1: query i sees keys 0..i only
    int dtype;   // attn_dtype: fp16 (every stage) or bf16 (the stages whose table says so)
    // K and V may have fewer heads and another length than Q (the stages whose table says so); 0
    // means as many as Q. K and V are then [B, kv_heads, kv_seq, D], and so are dK and dV.
    int kv_heads;  // a divisor of heads: query head h reads K/V head h / (heads / kv_heads)
    int kv_seq;    // keys per head, any value >= 1 (a KV cache, cross-attention). With `causal`,
                   // aligned bottom-right as FlashAttention does: query i sees keys 0..i + kv_seq -
                   // seq, so causal needs kv_seq >= seq (every query then sees at least one key)
    int fp8;       // the FP8 method of the stage that computes the forward (attn_stage.fp8), set
                   // by the harness from the stage's table: the checker's rule follows it. 0: none
} attn_shape;

// The FP8 methods (attn_stage.fp8, attn_shape.fp8): the forward takes fp16 Q, K and V, quantizes
// them to e4m3 with one scale per tensor (ATTN_FP8 alone) or per block of ATTN_FP8_BLOCK_ROWS rows
// of a head (| ATTN_FP8_BLOCK_SCALES), after rotating Q and K by a random-sign Hadamard transform
// (| ATTN_FP8_HADAMARD), and multiplies in e4m3 (P too); O is fp16.
enum { ATTN_FP8 = 1, ATTN_FP8_BLOCK_SCALES = 2, ATTN_FP8_HADAMARD = 4 };
#define ATTN_FP8_BLOCK_ROWS 128

static inline int attn_kv_heads(const attn_shape *s) { return s->kv_heads ? s->kv_heads : s->heads; }
static inline int attn_kv_seq(const attn_shape *s) { return s->kv_seq ? s->kv_seq : s->seq; }
// Query heads per K/V head, and how many keys past its own index a causal query sees.
static inline int attn_group(const attn_shape *s) { return s->heads / attn_kv_heads(s); }
static inline int attn_causal_offset(const attn_shape *s) { return attn_kv_seq(s) - s->seq; }
// Whether K and V differ from Q in heads or length (grouped-query attention, a KV cache).
static inline int attn_kv_differs(const attn_shape *s) {
    return attn_kv_heads(s) != s->heads || attn_kv_seq(s) != s->seq;
}

// Where a tensor's rows lie, in elements: row s of head h of batch b starts at
// b * batch + h * head + s * row, and its D elements follow it contiguously. All three 0 (a zeroed
// struct) means contiguous [B, H, S, D], the layout every stage takes; the stages whose table says
// runs_strided take any others whose strides are positive multiples of 8 elements (16 bytes, as
// the TMA engine needs; a dimension of one index included), for instance [B, S, H, D] memory read
// as [B, H, S, D] (batch = S H D, head = D, row = H D), as a model's projections leave Q, K and V.
typedef struct {
    long long batch, head, row;
} attn_strides;

// A tensor's strides, with all three 0 resolved to contiguous [B, `heads`, `seq`, D].
static inline attn_strides attn_strides_of(attn_strides given, int heads, int seq, int dim) {
    if (given.batch || given.head || given.row) return given;
    const attn_strides contiguous = {(long long)heads * seq * dim, (long long)seq * dim, dim};
    return contiguous;
}

typedef struct {
    // Tensors of shape->dtype, [B, H, S, D] (K, V, dK, dV: [B, H_kv, S_kv, D]), laid out as their
    // strides below say.
    const void *q, *k, *v;  // device, [B, H, S, D] of shape->dtype, as are all the tensors below
    void *o;                // device, [B, H, S, D]
    void *workspace;        // device, workspace_bytes(shape) bytes (NULL when 0). The forward
                            // writes it; the backward only reads it (the row log-sum-exp), so one
                            // forward serves any number of backward passes without a copy.
    // Backward only (NULL otherwise): the incoming gradient dO and the gradients to write.
    const void *d_o;        // device, [B, H, S, D]
    void *dq, *dk, *dv;     // device, [B, H, S, D]
    void *backward_scratch; // device, backward_scratch_bytes(shape) bytes (NULL when 0): the
                            // backward's own temporaries (delta, stage 08's float dQ), in any
                            // state on entry; nothing in it outlives the call.
    void *forward_scratch;  // device, forward_scratch_bytes(shape) bytes (NULL when 0): the
                            // forward's own temporaries (stage 10's tile counter), in any state
                            // on entry; nothing in it outlives the call.
    // The tensors' strides above, for the stages whose table says runs_strided; all zero (the
    // others) is contiguous [B, H, S, D].
    attn_strides q_strides, k_strides, v_strides, o_strides, d_o_strides, dq_strides, dk_strides, dv_strides;
} attn_tensors;

// The fields a stage leaves out of its table (C++ designated initializers, in this order) are
// NULL or 0: every stage states the first six, and a forward-only stage, which needs nothing
// else, stops there.
#ifdef __cplusplus
#define ATTN_OPTIONAL = 0
#else
#define ATTN_OPTIONAL
#endif
typedef struct attn_stage {
    const char *name;  // directory name, e.g. "03_online_softmax"
    const char *idea;  // one line, printed by --help
    // NULL when the stage can run `shape`, otherwise a sentence that says why not.
    const char *(*unsupported)(const attn_shape *shape);
    // Device memory the forward pass writes (0 for none): its own temporaries (stage 01's S x S
    // scores), or what it leaves for the backward to read (stages 08 and 10: the row log-sum-exp).
    size_t (*workspace_bytes)(const attn_shape *shape);
    // The most dynamic shared memory one block of any of the stage's kernels asks for at this
    // shape (0 for none). The harness compares it with the GPU's per-block limit before launching.
    size_t (*shared_bytes)(const attn_shape *shape);
    // Enqueue the forward pass on `stream`; returns the launch error, if any.
    cudaError_t (*forward)(const attn_shape *shape, const attn_tensors *t, cudaStream_t stream);

    // Optional from here on.
    // Enqueue the backward pass (dQ, dK, dV from Q, K, V, O, dO and whatever the forward left in
    // the workspace, with backward_scratch for its temporaries); NULL for the forward-only stages.
    cudaError_t (*backward)(const attn_shape *shape, const attn_tensors *t, cudaStream_t stream) ATTN_OPTIONAL;
    // Device memory the backward pass needs for itself, apart from the workspace (NULL or 0 for
    // none). Kept apart so that the workspace, which lives from the forward to the backward (in
    // PyTorch, saved with the graph), holds only what the backward reads, and the backward never
    // writes it.
    size_t (*backward_scratch_bytes)(const attn_shape *shape) ATTN_OPTIONAL;
    // Device memory the forward pass needs for itself during the call (NULL or 0 for none): apart
    // from the workspace for the same reason, and per call, so that forwards on two streams at
    // once never share it.
    size_t (*forward_scratch_bytes)(const attn_shape *shape) ATTN_OPTIONAL;
    // 1 when the kernels use sm_90a instructions (wgmma, setmaxnreg): they run on compute
    // capability 9.0 (H100, H200) only, and the harness skips other GPUs with a message.
    int needs_sm90a ATTN_OPTIONAL;
    // 1 when the kernels take bf16 tensors as well as fp16 (shape->dtype); the harness refuses
    // bf16 for the other stages.
    int runs_bf16 ATTN_OPTIONAL;
    // 1 when the kernels take K and V with fewer heads than Q (kv_heads: grouped-query attention);
    // the harness refuses such shapes for the other stages.
    int runs_gqa ATTN_OPTIONAL;
    // 1 when the kernels read and write every tensor through its strides (attn_tensors); the
    // others are handed contiguous [B, H, S, D] tensors only.
    int runs_strided ATTN_OPTIONAL;
    // 1 when the kernels take K and V of another length than Q (kv_seq: a KV cache,
    // cross-attention); the harness refuses such shapes for the other stages.
    int runs_kv_seq ATTN_OPTIONAL;
    // The FP8 method of the forward (ATTN_FP8 | ...: its inputs and output stay fp16, its products
    // are e4m3), 0 for the stages that compute in the tensors' own type.
    int fp8 ATTN_OPTIONAL;
} attn_stage;

// Defined by the stage being built into this executable.
extern const attn_stage STAGE;

// Elements in one of Q, O (and dQ).
static inline size_t attn_elems(const attn_shape *s) {
    return (size_t)s->batch * s->heads * s->seq * s->dim;
}
// Elements in one of K, V (and dK, dV).
static inline size_t attn_kv_elems(const attn_shape *s) {
    return (size_t)s->batch * attn_kv_heads(s) * attn_kv_seq(s) * s->dim;
}

// FLOPs of the forward pass by the usual convention: two S x S_kv x D matrix products (QK^T, PV)
// at 2 FLOPs per multiply-add, for causal times the share of the query-key pairs the mask keeps,
// 1 - S / (2 S_kv) (one half where S_kv = S). Softmax and masked-out work are not counted.
static inline double attn_forward_flops(const attn_shape *s) {
    const double kv_seq = attn_kv_seq(s);
    double f = 4.0 * s->batch * s->heads * (double)s->seq * kv_seq * s->dim;
    return s->causal ? (1.0 - s->seq / (2.0 * kv_seq)) * f : f;
}

// The backward pass does five S x S x D products (S and dP recomputed, dV, dK, dQ) against the
// forward's two: by convention 2.5x the forward FLOPs, whatever a stage actually recomputes.
static inline double attn_backward_flops(const attn_shape *s) { return 2.5 * attn_forward_flops(s); }

#ifdef __cplusplus
}
#endif
#endif
