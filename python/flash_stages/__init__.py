"""flash_stages: the course's attention kernels as a PyTorch operator, with autograd.

    import flash_stages
    o = flash_stages.attention(q, k, v, causal=True)   # as F.scaled_dot_product_attention(q, k, v, is_causal=True)

The kernels are the stages' own C launchers (``build/lib/libflash_stages_<stage>.so``, see
``_library.py``), registered from C++ (``csrc/op.cpp``) as the operators ``flash_stages::forward``
and ``flash_stages::backward``, with their autograd, and given fake implementations here, so that
autograd, ``torch.compile(fullgraph=True)`` and CUDA graphs work, and a call's host time is close
to that of PyTorch's own operators. Every buffer comes from PyTorch's allocator and every launch
goes to PyTorch's current stream.
"""

import collections
import functools
import math

import torch

from . import _library

__all__ = ["attention", "scaled_dot_product_attention", "stages", "default_stage", "StageInfo"]

StageInfo = collections.namedtuple("StageInfo",
                                   "name idea backward needs_sm90a bf16 grouped_heads strided kv_lengths fp8")
StageInfo.__doc__ = """A stage: its name, its idea in one line, whether it has a backward pass (can
train), whether it needs an H100/H200 (sm_90a instructions), whether it takes bf16 as well as fp16,
whether its kernels take K and V with fewer heads than Q (grouped-query attention), whether they
read tensors through their strides (a [batch, seq, heads, dim] tensor transposed, without a
copy), whether they take K and V of another length than Q (a KV cache, cross-attention), and
whether the forward multiplies in FP8 (e4m3, with fp16 in and out: its error is FP8's)."""

# The element types the kernels take, as attn.h's attn_dtype numbers them.
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}


def stages():
    """The stages found, in course order. Any of them is a valid ``stage=`` of :func:`attention`."""
    return [StageInfo(s.name, s.idea, s.has_backward, s.needs_sm90a, s.runs_bf16, s.runs_gqa, s.runs_strided,
                      s.runs_kv_seq, bool(s.fp8))
            for s in _library.load_stages().values()]


def _runs_on(stage, capability):
    """Whether a stage's kernels run on a GPU of this compute capability: sm_90a code needs 9.0."""
    return not stage.needs_sm90a or capability == (9, 0)


@functools.lru_cache(maxsize=None)
def _default_stage(device_index, kv_lengths=False):
    # The course's order is its order of speed: the last stage with a backward pass that runs here
    # (and, with `kv_lengths`, that takes K and V of another length than Q).
    if not _library.load_stages():
        _stage(None)  # raises: no stage libraries, and where they were looked for
    capability = torch.cuda.get_device_capability(device_index)
    trainable = [s.name for s in _library.load_stages().values()
                 if s.has_backward and _runs_on(s, capability) and (s.runs_kv_seq or not kv_lengths)]
    if not trainable:
        raise RuntimeError(f"flash_stages: no stage with a backward pass{' and K/V lengths' if kv_lengths else ''} "
                           f"runs on this GPU")
    return trainable[-1]


def default_stage(device=None):
    """The fastest stage this GPU runs: the last one in course order with a backward pass whose
    kernels run here (10_fa3_schedule on an H100/H200, compute capability 9.0; 08_warp_specialized on
    every other GPU from sm_80)."""
    if device is None:
        return _default_stage(torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return _default_stage(torch.cuda.current_device() if device.index is None else device.index)


def _stage(name):
    found = _library.load_stages()
    if not found:
        raise RuntimeError("flash_stages: no stage libraries found in "
                           + ", ".join(str(d) for d in _library.library_dirs())
                           + "; build them (cmake --workflow --preset default) or pip install . from the repository root")
    if name not in found:
        raise ValueError(f"flash_stages: stage must be one of {', '.join(found)}; got {name!r}")
    return found[name]


def _lse_shape(q, stage):
    """The forward's second output: the row log-sum-exp in log2 units, [B, H, S] floats, which a
    stage with a backward pass writes for it (its whole workspace); empty for a forward-only stage.
    Computed from q's sizes alone, so that under torch.compile(dynamic=True) they stay symbolic."""
    return tuple(q.shape[:3]) if _stage(stage).has_backward else (0,)


# The operators flash_stages::forward and flash_stages::backward, with their CUDA kernels and
# autograd, come from C++ (csrc/op.cpp); torch.compile traces them with these fake
# implementations, which give the outputs' sizes and layouts without running anything.
_library.load_operators()


def _output_like(stage, t):
    """An output shaped as t, laid out as csrc/op.cpp's output_like lays it out: in t's layout where
    the stage reads strides and t's rows are contiguous, else contiguous."""
    if _stage(stage).runs_strided and t.stride(3) == 1:
        return torch.empty_like(t)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@torch.library.register_fake("flash_stages::forward")
def _(q, k, v, causal, stage):
    return _output_like(stage, q), q.new_empty(_lse_shape(q, stage), dtype=torch.float32)


@torch.library.register_fake("flash_stages::backward")
def _(d_o, q, k, v, o, lse, causal, stage):
    return _output_like(stage, q), _output_like(stage, k), _output_like(stage, v)


def _autocast_dtype():
    """The type torch.autocast("cuda") casts to, when it is on with fp16 or bf16, else None. Under
    it, attention() runs float32 q, k and v in that type and returns O in it, as
    F.scaled_dot_product_attention does. (torch.library.register_autocast would fix one type for
    the op, so attention() casts itself.)"""
    if not torch.is_autocast_enabled("cuda"):
        return None
    dtype = torch.get_autocast_dtype("cuda")
    return dtype if dtype in _DTYPES else None


def _check_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_stages.attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise ValueError(f"flash_stages.attention: {name} must be a CUDA tensor, got device {t.device}")
        if t.dtype not in _DTYPES and not (t.dtype == torch.float32 and _autocast_dtype()):
            raise TypeError(f"flash_stages.attention: {name} must be torch.float16 or torch.bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"flash_stages.attention: {name} must be 4-D [batch, heads, seq, dim], "
                             f"got shape {tuple(t.shape)}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"flash_stages.attention: q, k and v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    if v.shape != k.shape:
        raise ValueError(f"flash_stages.attention: k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"flash_stages.attention: q, k and v must have the same batch size and head dim, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_stages.attention: k's {k.shape[1]} heads must divide q's {q.shape[1]}")
    if k.shape[2] < 1:
        raise ValueError(f"flash_stages.attention: k and v must hold at least one key, got {tuple(k.shape)}")
    batch, heads, seq, dim = q.shape
    if dim not in (64, 128):
        raise ValueError(f"flash_stages.attention: the head dim (q.shape[-1]) must be 64 or 128, got {dim}")
    if batch < 1 or heads < 1 or seq < 1:
        raise ValueError(f"flash_stages.attention: batch, heads and seq must be at least 1, got {tuple(q.shape)}")


def attention(q, k, v, causal=False, scale=None, stage=None, return_lse=False):
    """softmax(scale · q kᵀ, causal mask) v, as ``F.scaled_dot_product_attention(q, k, v,
    is_causal=causal, scale=scale)``.

    q, k, v: CUDA fp16 or bf16 tensors of one type, on one device: q [batch, heads, seq, dim], k and v
    [batch, heads_kv, seq_kv, dim]; any seq >= 1, dim 64 or 128 (bf16 in the stages whose StageInfo
    says so: 08 and later). Under ``torch.autocast("cuda")`` float32 inputs run in autocast's type.
    heads_kv may divide heads (grouped-query attention, query head h reading K/V head
    h // (heads / heads_kv)) in the stages whose StageInfo says grouped_heads (08 and 10), and
    seq_kv differ from seq (a KV cache, cross-attention) in those whose StageInfo says kv_lengths
    (08 and 10); with ``causal`` the mask is aligned bottom-right, as FlashAttention's: query i sees keys
    0..i + seq_kv - seq, so causal needs seq_kv >= seq.
    A stage whose StageInfo says strided (stage 10) reads q, k, v and dO through their strides, so
    a [batch, seq, heads, dim] tensor transposed to [batch, heads, seq, dim] runs without a copy,
    and O and the gradients come out in the inputs' layout where those are dense (else contiguous);
    the other stages get non-contiguous inputs copied first. Views that do not start on a 16-byte
    boundary are copied for every stage.

    scale: None, or within a relative 1e-6 of 1/sqrt(dim) (as ``dim ** -0.5`` is), means 1/sqrt(dim),
    which the kernels apply themselves. Any other value is applied by multiplying q by
    scale·sqrt(dim) before the kernel: one extra pass over q and one more fp16 rounding of it
    (autograd carries the factor into dq).

    stage: a name from :func:`stages`, or None for :func:`default_stage` (or, where k and v have a
    length of their own and that stage does not take it, the fastest that does). Stages without a
    backward pass (01-07) raise an error when a gradient is required.

    return_lse: also return each row's log-sum-exp of the scaled scores, natural log, [batch, heads,
    seq] float32 (not differentiable), as FlashAttention's softmax_lse; stages with a backward pass only.
    """
    _check_inputs(q, k, v)
    autocast_dtype = _autocast_dtype()
    if autocast_dtype is not None:
        q, k, v = (t.to(autocast_dtype) if t.dtype == torch.float32 else t for t in (q, k, v))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"flash_stages.attention: q, k and v must have one type, got {q.dtype}, {k.dtype}, {v.dtype}")
    name = _stage_for(q, k, stage)
    st = _stage(name)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)) and not st.has_backward:
        trainable = ", ".join(s.name for s in _library.load_stages().values() if s.has_backward)
        raise RuntimeError(f"flash_stages.attention: stage {name} has a forward pass only, and a gradient is "
                           f"required; use one of {trainable}, or run under torch.no_grad()")
    if return_lse and not st.has_backward:
        raise ValueError(f"flash_stages.attention: return_lse needs a stage with a backward pass, which writes the "
                         f"log-sum-exp; {name} has a forward pass only")
    dim = q.shape[-1]
    if scale is not None and not math.isclose(scale, 1.0 / math.sqrt(dim), rel_tol=1e-6):
        q = q * (scale * math.sqrt(dim))
    o, lse_log2 = torch.ops.flash_stages.forward(q, k, v, bool(causal), name)
    if return_lse:
        return o, lse_log2 * math.log(2.0)
    return o


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, stage=None):
    """``F.scaled_dot_product_attention``'s arguments, for the calls the kernels can answer: no
    ``attn_mask`` and no dropout (each raises an error rather than being ignored), query, key and
    value of one sequence length where is_causal (SDPA aligns that mask top-left, the kernels
    bottom-right). With ``enable_gqa=True`` key and value may have fewer heads than query, a divisor
    of them, as SDPA's grouped-query attention: query head h reads K/V head h // (query heads / key
    heads). A stage whose StageInfo says grouped_heads reads them as they are; for the others key
    and value are repeated to query's heads first (a copy of each). ``stage`` as in
    :func:`attention`."""
    if attn_mask is not None:
        raise ValueError("flash_stages.scaled_dot_product_attention: attn_mask is not supported; the kernels apply "
                         "the causal mask themselves (is_causal=True) and no other")
    if dropout_p:
        raise ValueError(f"flash_stages.scaled_dot_product_attention: dropout_p must be 0, got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"flash_stages.scaled_dot_product_attention: {name} must be a 4-D tensor "
                             f"[batch, heads, seq, dim]")
    if is_causal and key.shape[2] != query.shape[2]:
        raise ValueError("flash_stages.scaled_dot_product_attention: with is_causal, SDPA aligns the mask top-left "
                         "where query and key lengths differ, and the kernels bottom-right (as FlashAttention); "
                         "call flash_stages.attention(q, k, v, causal=True) for the bottom-right mask")
    heads, kv_heads = query.shape[1], key.shape[1]
    if value.shape[1] != kv_heads:
        raise ValueError(f"flash_stages.scaled_dot_product_attention: key and value must have the same heads, got "
                         f"{kv_heads} and {value.shape[1]}")
    if kv_heads != heads:
        if not enable_gqa:
            raise ValueError(f"flash_stages.scaled_dot_product_attention: query has {heads} heads and key {kv_heads}; "
                             f"pass enable_gqa=True for grouped-query attention, as SDPA asks")
        if heads % kv_heads:
            raise ValueError(f"flash_stages.scaled_dot_product_attention: key's {kv_heads} heads must divide "
                             f"query's {heads}")
        key, value, stage = _grouped_or_repeated(query, key, value, stage)
    return attention(query, key, value, causal=is_causal, scale=scale, stage=stage)


def _stage_for(q, k, stage):
    """The stage to run: `stage`, else the default; where k has a length of its own (a KV cache,
    cross-attention) and the default does not take it, the fastest stage here that does."""
    if stage is not None:
        return stage
    name = default_stage(q.device)
    if k.shape[2] != q.shape[2] and not _stage(name).runs_kv_seq:
        name = _default_stage(q.device.index if q.device.index is not None else torch.cuda.current_device(),
                              kv_lengths=True)
    return name


def _grouped_or_repeated(query, key, value, stage):
    """(key, value, stage): the stage to run (_stage_for), with key and value as they are where it
    reads grouped K/V heads itself, else repeated to query's heads (a copy of each)."""
    name = _stage_for(query, key, stage)
    if _stage(name).runs_gqa or key.shape[1] == query.shape[1]:
        return key, value, name
    groups = query.shape[1] // key.shape[1]
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), name
