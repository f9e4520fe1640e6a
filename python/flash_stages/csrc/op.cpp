// op.cpp - the stages' C launchers as the PyTorch operators flash_stages::forward and
// flash_stages::backward, registered from C++ with their autograd.
//
// A call goes from PyTorch's dispatcher to the functions here and on to the stage's launcher
// (common/attn.h), with no Python in between. At small shapes a call's host time is most of its
// cost, and a Python autograd node, ctypes and Python-side allocations cost several times what
// this path does (plots/overhead.py measures it against SDPA). python/flash_stages builds this
// file with torch.utils.cpp_extension the first time it is imported (_library.load_operators),
// hands it each stage library it finds (flash_stages_op_add_stage), and registers the fake
// implementations that torch.compile traces with.
#include <dlfcn.h>

#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "attn.h"

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One stage library's entry points (common/stage_library.c).
struct StageLibrary {
    const attn_stage *table;
    int (*set_device)(int);  // the library links its own CUDA runtime, with its own current device
    const char *(*error_string)(int);
    int (*refusal)(const attn_shape *, int, char *, size_t);
};

// What one call needs from its stage, asked of the library once per stage, shape and device: why
// the stage cannot run the shape there ("" when it can), and its buffer sizes.
struct Plan {
    std::string refusal;
    size_t workspace_bytes, forward_scratch_bytes, backward_scratch_bytes;
};
using PlanKey = std::tuple<const attn_stage *, int, int, int, int, int, int, int, int, int>;

// Calls come from several threads (autograd runs the backward on its own). Stage libraries are
// only added, so references into their map stay valid after the lock is released; plans are
// copied out, since their map is emptied when it reaches kMaxPlans (a KV cache that grows by a
// key per step makes a new shape every call).
std::mutex registry_mutex;
std::map<std::string, StageLibrary> stage_libraries;  // by stage name
std::map<PlanKey, Plan> plans;
constexpr size_t kMaxPlans = 1024;

const StageLibrary &stage_library(c10::string_view name) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    const auto found = stage_libraries.find(std::string(name));
    TORCH_CHECK_VALUE(found != stage_libraries.end(), "flash_stages: no stage library named ", name, " is loaded");
    return found->second;
}

size_t optional_bytes(size_t (*bytes)(const attn_shape *), const attn_shape &shape) {
    return bytes ? bytes(&shape) : 0;  // a size the stage leaves NULL: it needs no such buffer
}

Plan plan_for(const StageLibrary &stage, const attn_shape &s, int device) {
    const PlanKey key{stage.table, s.batch, s.heads, s.seq, s.dim, s.causal, s.dtype, s.kv_heads, s.kv_seq, device};
    {
        std::lock_guard<std::mutex> lock(registry_mutex);
        const auto found = plans.find(key);
        if (found != plans.end()) return found->second;
    }
    // Asked outside the lock: the refusal reads the GPU's properties, which takes a while.
    Plan plan{"", 0, 0, 0};
    char message[512];
    if (stage.refusal(&s, device, message, sizeof message)) {
        plan.refusal = message;
    } else {
        plan.workspace_bytes = stage.table->workspace_bytes(&s);
        plan.forward_scratch_bytes = optional_bytes(stage.table->forward_scratch_bytes, s);
        plan.backward_scratch_bytes = optional_bytes(stage.table->backward_scratch_bytes, s);
    }
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (plans.size() >= kMaxPlans) plans.clear();
    plans.emplace(key, plan);
    return plan;
}

// Whether the stage's kernels read t where it lies: contiguous, or, for a stage that reads strides,
// a last dimension of stride 1 and batch, head and row strides that are positive multiples of 8
// elements (16 bytes, as the TMA engine needs) wherever that dimension has more than one index;
// and for every stage starting on a 16-byte boundary, since rows are loaded 16 bytes at a time.
bool readable(const attn_stage &table, const Tensor &t) {
    if (reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16) return false;
    if (t.is_contiguous()) return true;
    if (!table.runs_strided || (t.stride(3) != 1 && t.size(3) > 1)) return false;
    for (int d = 0; d < 3; d++)
        if (t.size(d) > 1 && (t.stride(d) <= 0 || t.stride(d) % 8)) return false;
    return true;
}

// An output shaped as the input t: in t's layout where the stage reads strides and t's rows are
// contiguous (empty_like keeps a dense layout, and gives others a contiguous one), else
// contiguous. The rule reads t's strides alone, not where t lies, so that the fake
// implementations in python/flash_stages give the same layouts (_output_like).
Tensor output_like(const attn_stage &table, const Tensor &t) {
    return table.runs_strided && t.stride(3) == 1 ? at::empty_like(t) : at::empty_like(t, at::MemoryFormat::Contiguous);
}

// t, or a copy the stage reads, laid out as an output (output_like): a fresh allocation starts on
// a 16-byte boundary, and its layout is one the stage reads (a misaligned view of [B, S, H, D]
// stays [B, S, H, D] for a stage that reads strides).
Tensor readable_tensor(const attn_stage &table, const Tensor &t) {
    if (readable(table, t)) return t;
    Tensor copy = output_like(table, t);
    copy.copy_(t);
    return copy;
}

// t's attn_strides for a stage that reads strides (all zero, contiguous, for the others). A
// dimension of one index gets its contiguous stride, which no element is read through.
attn_strides strides_of(const attn_stage &table, const Tensor &t) {
    if (!table.runs_strided) return attn_strides{0, 0, 0};
    const int64_t contiguous[3] = {t.size(1) * t.size(2) * t.size(3), t.size(2) * t.size(3), t.size(3)};
    int64_t s[3];
    for (int d = 0; d < 3; d++) s[d] = t.size(d) == 1 ? contiguous[d] : t.stride(d);
    return attn_strides{s[0], s[1], s[2]};
}

void *pointer(const Tensor &t) { return t.numel() > 0 ? t.data_ptr() : nullptr; }

Tensor bytes(const Tensor &like, size_t count) {
    return at::empty({static_cast<int64_t>(count)}, like.options().dtype(at::kByte));
}

// A tensor's type, sizes and device for a message, as one string. Messages here are built from
// strings alone: a number streamed from this file into c10's message stream crashed where the
// process's libstdc++ was of another version than the compiler's headers.
std::string describe(const Tensor &t) {
    std::string text = std::string(c10::toString(t.scalar_type())) + " [";
    for (int64_t d = 0; d < t.dim(); d++) text += (d ? ", " : "") + std::to_string(t.size(d));
    return text + "] on " + t.device().str();
}

// What the kernels assume of the tensors they are handed, so that a direct call of
// torch.ops.flash_stages.* is as safe as attention(): fp16 or bf16 tensors of one type on one CUDA
// device (the ops have CUDA kernels only, so a CPU tensor never gets here), q, o and d_o
// [B, H, S, D], k and v [B, H_kv, S_kv, D] with H_kv dividing H. Whether the stage takes H_kv != H
// or S_kv != S, and the GPU, the stage's own check says (plan_for).
struct Named {
    const char *name;
    const Tensor &tensor;
};

void check_inputs(const char *op, const Tensor &q, const Tensor &k, std::initializer_list<Named> tensors) {
    for (const Named &n : tensors) {
        const bool kv = &n.tensor == &k || std::string(n.name) == "v";
        const Tensor &t = n.tensor, &like = kv ? k : q;
        const bool half = t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
        TORCH_CHECK_VALUE(half && t.scalar_type() == q.scalar_type() && t.dim() == 4 && t.sizes() == like.sizes() &&
                              t.device() == q.device(),
                          "flash_stages::", op, ": ", n.name, " must be a float16 or bfloat16 [batch, heads, seq, dim] ",
                          "tensor of ", kv ? "k" : "q", "'s type, shape and device, got ", describe(t));
    }
    TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) >= 1 && q.size(1) % k.size(1) == 0 &&
                          k.size(2) >= 1,
                      "flash_stages::", op, ": k must be [batch, heads_kv, seq_kv, dim] with q's batch and dim, heads_kv ",
                      "dividing q's heads and seq_kv >= 1, got q ", describe(q), " and k ", describe(k));
    for (int64_t size : q.sizes())
        TORCH_CHECK_VALUE(size <= std::numeric_limits<int>::max(), "flash_stages::", op, ": sizes must fit an int, got ",
                          describe(q));
}

// The problem the stage's table describes (attn_shape): kv_heads and kv_seq are 0 where they equal
// Q's, meaning as many as Q, which every stage takes.
attn_shape shape_of(const Tensor &q, const Tensor &k, bool causal) {
    attn_shape s{};
    s.batch = static_cast<int>(q.size(0));
    s.heads = static_cast<int>(q.size(1));
    s.seq = static_cast<int>(q.size(2));
    s.dim = static_cast<int>(q.size(3));
    s.causal = causal;
    s.dtype = q.scalar_type() == at::kBFloat16 ? ATTN_BF16 : ATTN_FP16;
    s.kv_heads = k.size(1) == q.size(1) ? 0 : static_cast<int>(k.size(1));
    s.kv_seq = k.size(2) == q.size(2) ? 0 : static_cast<int>(k.size(2));
    return s;
}

using Launcher = cudaError_t (*)(const attn_shape *, const attn_tensors *, cudaStream_t);

// Enqueues the launcher on PyTorch's current stream of the device.
void launch(const StageLibrary &stage, const char *direction, Launcher launcher, const attn_shape &shape,
            const attn_tensors &tensors, int device) {
    int error = stage.set_device(device);
    if (!error) error = launcher(&shape, &tensors, c10::cuda::getCurrentCUDAStream(device).stream());
    TORCH_CHECK(!error, stage.table->name, ": ", direction, " launch failed: ", stage.error_string(error));
}

// O and, for a stage with a backward pass, the row log-sum-exp (log2 units, [B, H, S] float32)
// that the backward recomputes P from: the stage's whole workspace, which autograd keeps until the
// backward. A forward-only stage's workspace (stage 01's scores) is a temporary of the call.
std::tuple<Tensor, Tensor> forward_cuda(const Tensor &q_in, const Tensor &k_in, const Tensor &v_in, bool causal,
                                        c10::string_view stage_name) {
    const StageLibrary &stage = stage_library(stage_name);
    check_inputs("forward", q_in, k_in, {{"q", q_in}, {"k", k_in}, {"v", v_in}});
    const Tensor q = readable_tensor(*stage.table, q_in), k = readable_tensor(*stage.table, k_in),
                 v = readable_tensor(*stage.table, v_in);
    const attn_shape shape = shape_of(q, k, causal);
    const int device = q.get_device();
    const Plan plan = plan_for(stage, shape, device);
    TORCH_CHECK_VALUE(plan.refusal.empty(), plan.refusal);
    const bool keeps_lse = stage.table->backward != nullptr;
    const Tensor o = output_like(*stage.table, q_in);
    const Tensor lse = keeps_lse ? at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat))
                                 : at::empty({0}, q.options().dtype(at::kFloat));
    TORCH_CHECK(!keeps_lse || plan.workspace_bytes == lse.nbytes(), "flash_stages: stage ", stage.table->name,
                "'s workspace is not the row log-sum-exp the op expects");
    const Tensor workspace = keeps_lse ? lse : bytes(q, plan.workspace_bytes);
    // The forward's own temporaries (stage 10's tile counter), per call, so that forwards on two
    // streams never share them. Once freed, the caching allocator hands this memory only to work
    // queued after this call on the same stream.
    const Tensor scratch = bytes(q, plan.forward_scratch_bytes);
    attn_tensors t{};
    t.q = pointer(q), t.k = pointer(k), t.v = pointer(v), t.o = pointer(o);
    t.workspace = pointer(workspace), t.forward_scratch = pointer(scratch);
    t.q_strides = strides_of(*stage.table, q), t.k_strides = strides_of(*stage.table, k);
    t.v_strides = strides_of(*stage.table, v), t.o_strides = strides_of(*stage.table, o);
    launch(stage, "forward", stage.table->forward, shape, t, device);
    return {o, lse};
}

// dQ, dK, dV. The kernels only read the forward's O and log-sum-exp and write their temporaries
// (delta, stage 08's float dQ) into a scratch buffer of this call, so the op is pure without a
// copy, and a graph can be run backward twice (retain_graph).
std::tuple<Tensor, Tensor, Tensor> backward_cuda(const Tensor &d_o_in, const Tensor &q_in, const Tensor &k_in,
                                                 const Tensor &v_in, const Tensor &o_in, const Tensor &lse,
                                                 bool causal, c10::string_view stage_name) {
    const StageLibrary &stage = stage_library(stage_name);
    TORCH_CHECK_VALUE(stage.table->backward, "flash_stages::backward: stage ", stage_name, " has a forward pass only");
    check_inputs("backward", q_in, k_in, {{"d_o", d_o_in}, {"q", q_in}, {"k", k_in}, {"v", v_in}, {"o", o_in}});
    TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.sizes() == q_in.sizes().slice(0, 3) &&
                          lse.is_contiguous() && lse.device() == q_in.device(),
                      "flash_stages::backward: lse must be the forward's contiguous float32 [batch, heads, seq] on q's ",
                      "device, got ", describe(lse));
    const attn_stage &table = *stage.table;
    const Tensor d_o = readable_tensor(table, d_o_in), q = readable_tensor(table, q_in),
                 k = readable_tensor(table, k_in), v = readable_tensor(table, v_in), o = readable_tensor(table, o_in);
    const attn_shape shape = shape_of(q, k, causal);
    const int device = q.get_device();
    const Plan plan = plan_for(stage, shape, device);
    TORCH_CHECK_VALUE(plan.refusal.empty(), plan.refusal);
    const Tensor scratch = bytes(q, plan.backward_scratch_bytes);
    const Tensor dq = output_like(table, q_in), dk = output_like(table, k_in), dv = output_like(table, v_in);
    attn_tensors t{};
    t.q = pointer(q), t.k = pointer(k), t.v = pointer(v), t.o = pointer(o), t.workspace = pointer(lse);
    t.d_o = pointer(d_o), t.dq = pointer(dq), t.dk = pointer(dk), t.dv = pointer(dv);
    t.backward_scratch = pointer(scratch);
    t.q_strides = strides_of(table, q), t.k_strides = strides_of(table, k), t.v_strides = strides_of(table, v);
    t.o_strides = strides_of(table, o), t.d_o_strides = strides_of(table, d_o);
    t.dq_strides = strides_of(table, dq), t.dk_strides = strides_of(table, dk), t.dv_strides = strides_of(table, dv);
    launch(stage, "backward", table.backward, shape, t, device);
    return {dq, dk, dv};
}

// The autograd of flash_stages::forward: the forward saves Q, K, V, O and the log-sum-exp, and the
// backward hands them to flash_stages::backward. Both call the operators through the dispatcher,
// so that torch.compile traces them (with the fake implementations) as it traces any operator:
// the forward below autograd; the backward as it is, so that a second derivative through it
// (create_graph=True) reaches its autograd kernel, which raises an error (it has none).
class Attention : public torch::autograd::Function<Attention> {
  public:
    static variable_list forward(AutogradContext *ctx, const Tensor &q, const Tensor &k, const Tensor &v, bool causal,
                                 const std::string &stage) {
        static const auto forward_op =
            c10::Dispatcher::singleton()
                .findSchemaOrThrow("flash_stages::forward", "")
                .typed<std::tuple<Tensor, Tensor>(const Tensor &, const Tensor &, const Tensor &, bool, c10::string_view)>();
        // A stage that reads only contiguous tensors gets them so here, once, and the copies are
        // what the backward reads too (contiguous() returns a contiguous tensor itself; a
        // misaligned one the op copies in each pass).
        const bool strided = stage_library(stage).table->runs_strided;
        const Tensor qs = strided ? q : q.contiguous(), ks = strided ? k : k.contiguous(), vs = strided ? v : v.contiguous();
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        auto [o, lse] = forward_op.call(qs, ks, vs, causal, stage);
        ctx->mark_non_differentiable({lse});
        // lse gets no gradient: without this, autograd would allocate and zero one for backward().
        ctx->set_materialize_grads(false);
        ctx->save_for_backward({qs, ks, vs, o, lse});
        ctx->saved_data["causal"] = causal;
        ctx->saved_data["stage"] = stage;
        return {o, lse};
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        static const auto backward_op =
            c10::Dispatcher::singleton()
                .findSchemaOrThrow("flash_stages::backward", "")
                .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                                          const Tensor &, const Tensor &, bool, c10::string_view)>();
        const Tensor &grad_o = grads[0];
        if (!grad_o.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};  // nothing flowed into O
        const variable_list saved = ctx->get_saved_variables();
        const bool causal = ctx->saved_data["causal"].toBool();
        const std::string stage = ctx->saved_data["stage"].toStringRef();
        auto [dq, dk, dv] = backward_op.call(grad_o, saved[0], saved[1], saved[2], saved[3], saved[4], causal, stage);
        return {dq, dk, dv, Tensor(), Tensor()};
    }
};

std::tuple<Tensor, Tensor> forward_autograd(const Tensor &q, const Tensor &k, const Tensor &v, bool causal,
                                            c10::string_view stage) {
    const variable_list outputs = Attention::apply(q, k, v, causal, std::string(stage));
    return {outputs[0], outputs[1]};
}

}  // namespace

// Registers the stage library at `path` (loaded already, by python/flash_stages/_library.py) under
// its table's name. Returns NULL, or why the library cannot be used.
extern "C" const char *flash_stages_op_add_stage(const char *path) {
    static thread_local std::string error;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) return (error = dlerror()).c_str();
    StageLibrary stage{static_cast<const attn_stage *>(dlsym(handle, "STAGE")),
                       reinterpret_cast<int (*)(int)>(dlsym(handle, "flash_stages_set_device")),
                       reinterpret_cast<const char *(*)(int)>(dlsym(handle, "flash_stages_error_string")),
                       reinterpret_cast<int (*)(const attn_shape *, int, char *, size_t)>(
                           dlsym(handle, "flash_stages_refusal"))};
    const auto *sizes = static_cast<const size_t *>(dlsym(handle, "flash_stages_struct_sizes"));
    if (!stage.table || !stage.set_device || !stage.error_string || !stage.refusal || !sizes)
        return (error = std::string(path) + " lacks the symbols of common/stage_library.c").c_str();
    // A library built from another common/attn.h would have its structs misread.
    if (sizes[0] != sizeof(attn_stage) || sizes[1] != sizeof(attn_tensors) || sizes[2] != sizeof(attn_shape))
        return (error = std::string(path) + " was built from another common/attn.h; rebuild the libraries").c_str();
    std::lock_guard<std::mutex> lock(registry_mutex);
    stage_libraries[stage.table->name] = stage;
    return nullptr;
}

TORCH_LIBRARY(flash_stages, m) {
    m.set_python_module("flash_stages");  // where the fake implementations are registered
    m.def("forward(Tensor q, Tensor k, Tensor v, bool causal, str stage) -> (Tensor, Tensor)");
    m.def("backward(Tensor d_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, str stage) -> "
          "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flash_stages, CUDA, m) {
    m.impl("forward", &forward_cuda);
    m.impl("backward", &backward_cuda);
}

TORCH_LIBRARY_IMPL(flash_stages, Autograd, m) {
    m.impl("forward", &forward_autograd);
    // The kernels' gradients have no gradient of their own: differentiating through them raises
    // an error instead of giving zeros.
    m.impl("backward", torch::autograd::autogradNotImplementedFallback());
}
