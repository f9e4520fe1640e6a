"""flash_stages against float64 SDPA, under torch.compile, in CUDA graphs, on a side stream, and
on bad input. Run by CTest (python/tests/run.py) with the build tree's libraries."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_stages

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Odd shapes: tails in every tile, S = 1, one head, several of each.
SHAPES = [(1, 1, 1, 64), (2, 3, 77, 64), (1, 2, 333, 128), (2, 1, 1000, 64), (1, 3, 257, 128)]


def runs_here(name):
    info = {s.name: s for s in flash_stages.stages()}[name]
    return not info.needs_sm90a or torch.cuda.get_device_capability() == (9, 0)


TRAINING_STAGES = [s.name for s in flash_stages.stages() if s.backward] if torch.cuda.is_available() else []
BF16_STAGES = [s.name for s in flash_stages.stages() if s.bf16] if torch.cuda.is_available() else []
# The FP8 stage's error is e4m3's, not fp16's: its harness checks it by its own rule (common/check.h).
FORWARD_STAGES = ([s.name for s in flash_stages.stages() if not s.backward and not s.fp8]
                  if torch.cuda.is_available() else [])


def inputs(shape, seed=0, requires_grad=False, dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=gen, device="cuda", dtype=dtype).requires_grad_(requires_grad)
            for _ in range(4)]


def sdpa_with_grads(q, k, v, d_o, causal, dtype, scale=None, backend=None):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    if backend is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    else:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    o.backward(d_o.to(dtype))
    return [o.detach(), q.grad, k.grad, v.grad]


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("stage", TRAINING_STAGES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_float64(stage, causal, shape):
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    q, k, v, d_o = inputs(shape, requires_grad=True)
    o = flash_stages.attention(q, k, v, causal=causal, stage=stage)
    o.backward(d_o)
    ours = [o.detach(), q.grad, k.grad, v.grad]
    exact = sdpa_with_grads(q, k, v, d_o, causal, torch.float64)
    pytorch_fp16 = sdpa_with_grads(q, k, v, d_o, causal, torch.float16)
    for name, mine, ref, theirs in zip(("o", "dq", "dk", "dv"), ours, exact, pytorch_fp16):
        assert torch.isfinite(mine).all(), f"{name} has NaN or Inf"
        bound = 2 * max_error(theirs, ref) + 1e-3
        assert max_error(mine, ref) <= bound, f"{name}: error {max_error(mine, ref):.3g} > {bound:.3g}"


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_backward_only_reads_the_saved_lse(stage):
    # The forward's second output is what autograd saves for the backward: the log-sum-exp alone,
    # one float per row (the stage's whole workspace). The backward writes its temporaries to a
    # scratch of its own, so the log-sum-exp comes out as the forward wrote it, and a second
    # backward of the same forward (retain_graph) gives the same gradients.
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    batch, heads, seq, _ = shape = (2, 3, 333, 64)
    q, k, v, d_o = inputs(shape, seed=6)
    o, lse = torch.ops.flash_stages.forward(q, k, v, True, stage)
    assert lse.shape == (batch, heads, seq) and lse.dtype == torch.float32
    as_written = lse.clone()
    first = torch.ops.flash_stages.backward(d_o, q, k, v, o, lse, True, stage)
    torch.cuda.synchronize()
    assert torch.equal(lse, as_written), "the backward wrote into the saved log-sum-exp"
    second = torch.ops.flash_stages.backward(d_o, q, k, v, o, lse, True, stage)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)  # stage 08 may sum dq in another order


@pytest.mark.parametrize("stage", TRAINING_STAGES)
@pytest.mark.parametrize("causal", [False, True])
def test_return_lse_matches_float64(stage, causal):
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    q, k, v, _ = inputs((2, 3, 333, 128), seed=7)
    with torch.no_grad():
        o, lse = flash_stages.attention(q, k, v, causal=causal, stage=stage, return_lse=True)
    scores = q.double() @ k.double().transpose(-1, -2) / 128 ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(333, 333, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, dim=-1), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_opcheck(stage):
    # PyTorch's own checks of a custom op: schema, fake implementation against the real one,
    # autograd registration, and AOT dispatch with static and dynamic shapes.
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    q, k, v, d_o = inputs((1, 2, 130, 64), seed=8, requires_grad=True)
    torch.library.opcheck(torch.ops.flash_stages.forward.default, (q, k, v, True, stage))
    o, lse = torch.ops.flash_stages.forward(q.detach(), k.detach(), v.detach(), True, stage)
    torch.library.opcheck(torch.ops.flash_stages.backward.default,
                          (d_o.detach(), q.detach(), k.detach(), v.detach(), o, lse, True, stage))


def test_one_graph_for_many_lengths():
    # torch.compile(dynamic=True): the fake implementations keep the sizes symbolic, so new
    # sequence lengths and batch sizes reuse the one compiled graph. Every size of the first call
    # differs from the others and from 1: dynamo gives equal sizes one symbol and specializes
    # sizes of 1, and a later call that breaks either would compile again.
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(lambda q, k, v: flash_stages.attention(q, k, v, causal=True), backend=counter,
                         dynamic=True, fullgraph=True)
    for shape in [(2, 3, 300, 64), (4, 3, 517, 64), (5, 3, 1000, 64)]:
        q, k, v, _ = inputs(shape, seed=9)
        with torch.no_grad():
            torch.testing.assert_close(step(q, k, v), flash_stages.attention(q, k, v, causal=True), atol=0, rtol=0)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for three shapes"


@pytest.mark.parametrize("stage", BF16_STAGES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_bf16_matches_float64_as_closely_as_sdpa_bf16(stage, causal, shape):
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    info = {s.name: s for s in flash_stages.stages()}[stage]
    q, k, v, d_o = inputs(shape, seed=5, requires_grad=info.backward, dtype=torch.bfloat16)
    o = flash_stages.attention(q, k, v, causal=causal, stage=stage)
    assert o.dtype == torch.bfloat16
    ours = [o.detach()]
    if info.backward:
        o.backward(d_o)
        ours += [q.grad, k.grad, v.grad]
    exact = sdpa_with_grads(q, k, v, d_o, causal, torch.float64)
    pytorch_bf16 = sdpa_with_grads(q, k, v, d_o, causal, torch.bfloat16)
    for name, mine, ref, theirs in zip(("o", "dq", "dk", "dv"), ours, exact, pytorch_bf16):
        assert mine.dtype == torch.bfloat16 and torch.isfinite(mine).all(), f"{name}: {mine.dtype}, or NaN/Inf"
        bound = 2 * max_error(theirs, ref) + 1e-2
        assert max_error(mine, ref) <= bound, f"{name}: error {max_error(mine, ref):.3g} > {bound:.3g}"


def test_autocast_runs_float32_inputs_in_bf16():
    q, k, v, _ = inputs((1, 2, 200, 64), seed=13)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        o = flash_stages.attention(q.float(), k.float(), v.float(), causal=True)
    assert o.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(o, flash_stages.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True))


def test_scale_of_one_over_sqrt_dim_takes_no_extra_pass():
    q, k, v, _ = inputs((1, 2, 200, 128), seed=11)
    with torch.no_grad():
        default = flash_stages.attention(q, k, v)
        # 128 ** -0.5 differs from 1 / math.sqrt(128) in its last bit: within the tolerance.
        assert torch.equal(flash_stages.attention(q, k, v, scale=128 ** -0.5), default)


def test_autocast_runs_float32_inputs_in_fp16():
    q, k, v, _ = inputs((1, 2, 200, 64), seed=12)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        o = flash_stages.attention(q.float(), k.float(), v.float(), causal=True)
    assert o.dtype == torch.float16
    with torch.no_grad():
        assert torch.equal(o, flash_stages.attention(q, k, v, causal=True))


@pytest.mark.parametrize("case, words", [
    ("fp32", "must be a float16"),
    ("shapes", "of k's type, shape and device"),
])
def test_the_op_itself_checks_its_inputs(case, words):
    q, k, v = good()
    if case == "fp32":
        v = v.float()
    elif case == "shapes":
        v = v[:, :, :32].contiguous()
    if "08_warp_specialized" not in {s.name for s in flash_stages.stages()}:
        pytest.skip("needs stage 08's library")
    with pytest.raises(ValueError, match=words):
        torch.ops.flash_stages.forward(q, k, v, False, "08_warp_specialized")


def test_the_op_copies_what_the_stage_cannot_read():
    # Stage 08 reads contiguous tensors only: called directly with a [B, S, H, D] tensor seen as
    # [B, H, S, D], or one 2 bytes past a 16-byte boundary, the op copies it and gives what the
    # contiguous tensor gives.
    if "08_warp_specialized" not in {s.name for s in flash_stages.stages()}:
        pytest.skip("needs stage 08's library")
    q, k, v = good()
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    assert not transposed.is_contiguous() and misaligned.data_ptr() % 16
    expected = torch.ops.flash_stages.forward(q, k, v, False, "08_warp_specialized")[0]
    for q_as in (transposed, misaligned):
        assert torch.equal(torch.ops.flash_stages.forward(q_as, k, v, False, "08_warp_specialized")[0], expected)


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_fake_outputs_are_laid_out_as_the_real_ones(stage):
    # torch.compile plans with the fake implementations: their outputs' strides must be the real
    # ones, for [B, S, H, D] tensors seen as [B, H, S, D] too (stage 10 keeps that layout, the
    # others give contiguous outputs). Under inference_mode the op runs without its autograd
    # kernel, which would copy for the stages that read contiguous tensors only.
    from torch._subclasses.fake_tensor import FakeTensorMode
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    q, k, v, d_o = (t.transpose(1, 2) for t in inputs((1, 130, 2, 64), seed=14))
    with torch.inference_mode():
        o, lse = torch.ops.flash_stages.forward(q, k, v, True, stage)
        grads = torch.ops.flash_stages.backward(d_o, q, k, v, o, lse, True, stage)
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(t) for t in (d_o, q, k, v, o, lse)]
            fake_o, fake_lse = torch.ops.flash_stages.forward(*fake[1:4], True, stage)
            fake_grads = torch.ops.flash_stages.backward(*fake, True, stage)
    assert [t.stride() for t in (o, lse, *grads)] == [t.stride() for t in (fake_o, fake_lse, *fake_grads)]


def test_a_second_derivative_raises():
    # The kernels' gradients have no gradient of their own: create_graph=True gives a graph whose
    # backward raises, rather than zeros.
    q, k, v, d_o = inputs((1, 2, 64, 64), seed=13, requires_grad=True)
    o = flash_stages.attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(o, (q,), d_o, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()


def test_the_op_is_for_cuda_tensors_only():
    q, k, v = (t.cpu() for t in good())
    with pytest.raises(NotImplementedError):
        torch.ops.flash_stages.forward(q, k, v, False, "08_warp_specialized")


@pytest.mark.parametrize("stage", FORWARD_STAGES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_only_stages_match_float64(stage, causal):
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    q, k, v, _ = inputs((1, 2, 333, 64))
    with torch.no_grad():
        o = flash_stages.attention(q, k, v, causal=causal, stage=stage)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert max_error(o, exact) <= 2 * max_error(theirs, exact) + 1e-3


# Every stage held to fp16's bound: all but the FP8 one, whose many-heads cases are CTest's
# (tests/CMakeLists.txt: add_many_heads_tests), checked by its own rule.
FP16_STAGES = [s.name for s in flash_stages.stages() if not s.fp8] if torch.cuda.is_available() else []


@pytest.mark.parametrize("stage", FP16_STAGES)
@pytest.mark.parametrize("shape, causal", [((1, 65537, 5, 64), False), ((65536, 2, 3, 128), True),
                                           ((2, 33000, 4, 64), False)])
def test_more_heads_than_a_grid_dimension_holds(stage, shape, causal):
    # B * H past 65,535, the limit of a grid's y and z dimensions: H alone past it, B alone past
    # it, and neither.
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    trains = stage in TRAINING_STAGES
    q, k, v, d_o = inputs(shape, seed=7, requires_grad=trains)
    with torch.set_grad_enabled(trains):
        o = flash_stages.attention(q, k, v, causal=causal, stage=stage)
    ours = [o.detach()]
    if trains:
        o.backward(d_o)
        ours += [q.grad, k.grad, v.grad]
    exact = sdpa_with_grads(q, k, v, d_o, causal, torch.float64)
    # SDPA's fused fp16 kernels need not take this many heads; its fp16 math backend does.
    pytorch_fp16 = sdpa_with_grads(q, k, v, d_o, causal, torch.float16, backend=SDPBackend.MATH)
    for name, mine, ref, theirs in zip(("o", "dq", "dk", "dv"), ours, exact, pytorch_fp16):
        assert torch.isfinite(mine).all(), f"{name} has NaN or Inf"
        bound = 2 * max_error(theirs, ref) + 1e-3
        assert max_error(mine, ref) <= bound, f"{name}: error {max_error(mine, ref):.3g} > {bound:.3g}"


@pytest.mark.parametrize("stage", TRAINING_STAGES)
@pytest.mark.parametrize("offset_of", ["k", "q"])
def test_scores_with_large_offsets(stage, offset_of):
    # K ~ N(30, 1) shifts each query row's scores by its own constant (about +-10 to +-100), which
    # softmax cancels; Q ~ N(30, 1) shifts each key's. The odd length leaves a partial key tile.
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    q, k, v, d_o = inputs((2, 3, 129, 128), seed=8)
    with torch.no_grad():
        (k if offset_of == "k" else q).add_(30.0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_stages.attention(q, k, v, stage=stage)
    o.backward(d_o)
    exact = sdpa_with_grads(q, k, v, d_o, False, torch.float64)
    pytorch_fp16 = sdpa_with_grads(q, k, v, d_o, False, torch.float16)
    for name, mine, ref, theirs in zip(("o", "dq", "dk", "dv"), [o.detach(), q.grad, k.grad, v.grad], exact,
                                       pytorch_fp16):
        assert torch.isfinite(mine).all(), f"{name} has NaN or Inf"
        bound = 2 * max_error(theirs, ref) + 1e-3
        assert max_error(mine, ref) <= bound, f"{name}: error {max_error(mine, ref):.3g} > {bound:.3g}"


def test_default_stage_and_stage_list():
    names = [s.name for s in flash_stages.stages()]
    assert names == sorted(names) and "08_warp_specialized" in names
    expected = "10_fa3_schedule" if torch.cuda.get_device_capability() == (9, 0) else "08_warp_specialized"
    assert flash_stages.default_stage() == expected


def test_scale_and_non_contiguous_inputs():
    # [B, S, H, D] tensors seen as [B, H, S, D]: strided, not contiguous.
    q, k, v, d_o = (t.transpose(1, 2).detach().requires_grad_() for t in inputs((2, 200, 3, 64), seed=1))
    assert not q.is_contiguous()
    o = flash_stages.attention(q, k, v, causal=True, scale=0.3)
    o.backward(d_o)
    exact = sdpa_with_grads(q, k, v, d_o, True, torch.float64, scale=0.3)
    theirs = sdpa_with_grads(q, k, v, d_o, True, torch.float16, scale=0.3)
    for mine, ref, fp16 in zip([o, q.grad, k.grad, v.grad], exact, theirs):
        assert max_error(mine, ref) <= 2 * max_error(fp16, ref) + 1e-3


@pytest.mark.parametrize("stage", TRAINING_STAGES)
@pytest.mark.parametrize("layout", ["bshd", "fused_qkv"])
def test_strided_layouts(stage, layout):
    # [B, S, H, D] tensors seen as [B, H, S, D], and q, k, v as slices of one fused projection
    # [B, S, 3, H, D] (strided, not dense). A stage that reads strides takes them as they are and
    # gives O and the gradients in q's layout where q is dense; the others get copies.
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    batch, seq, heads, dim = 2, 333, 3, 64
    if layout == "bshd":
        q, k, v, d_o = (t.transpose(1, 2) for t in inputs((batch, seq, heads, dim), seed=21))
    else:
        fused, d_o = inputs((batch, seq, 3, heads, dim), seed=22)[:2]
        q, k, v = (t.transpose(1, 2) for t in fused.unbind(2))
        d_o = d_o[:, :, 0].transpose(1, 2)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    assert not q.is_contiguous()
    o = flash_stages.attention(q, k, v, causal=True, stage=stage)
    o.backward(d_o)
    strided = {s.name: s for s in flash_stages.stages()}[stage].strided
    if strided and layout == "bshd":
        assert o.stride() == q.stride() and q.grad.stride() == q.stride()
    exact = sdpa_with_grads(q, k, v, d_o, True, torch.float64)
    theirs = sdpa_with_grads(q, k, v, d_o, True, torch.float16)
    for name, mine, ref, fp16 in zip(("o", "dq", "dk", "dv"), [o, q.grad, k.grad, v.grad], exact, theirs):
        assert torch.isfinite(mine).all(), f"{name} has NaN or Inf"
        assert max_error(mine, ref) <= 2 * max_error(fp16, ref) + 1e-3, name


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_views_that_start_mid_allocation(stage):
    # x[1:] of a flat tensor, seen as [B, H, S, D]: contiguous, but 2 bytes past a 16-byte boundary.
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    shape = (1, 2, 130, 64)
    flat = inputs((4, 1 + 2 * 130 * 64), seed=3)[0]
    q, k, v, d_o = (row[1:].view(shape) for row in flat)
    assert q.is_contiguous() and q.data_ptr() % 16 != 0
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    q_view, k_view, v_view = (t.view(shape) for t in (q, k, v))  # non-leaf views of the leaves
    o = flash_stages.attention(q_view, k_view, v_view, causal=True, stage=stage)
    o.backward(d_o)
    aligned = [t.detach().clone() for t in (q, k, v, d_o)]  # PyTorch's cuDNN backend needs them so
    exact = sdpa_with_grads(*aligned, True, torch.float64)
    theirs = sdpa_with_grads(*aligned, True, torch.float16)
    for mine, ref, fp16 in zip([o, q.grad, k.grad, v.grad], exact, theirs):
        assert torch.isfinite(mine).all()
        assert max_error(mine, ref) <= 2 * max_error(fp16, ref) + 1e-3


def test_torch_compile_fullgraph():
    q, k, v, d_o = inputs((2, 2, 300, 64), seed=2, requires_grad=True)

    def step(q, k, v):
        return flash_stages.attention(q, k, v, causal=True)

    compiled = torch.compile(step, fullgraph=True)
    o = compiled(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    o_eager = step(q, k, v)
    grads_eager = torch.autograd.grad(o_eager, (q, k, v), d_o)
    assert torch.equal(o, o_eager)
    for a, b in zip(grads, grads_eager):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)  # dq may be summed in another order


def test_cuda_graph_capture_and_replay():
    q, k, v, d_o = inputs((1, 2, 256, 128), seed=3, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as PyTorch's docs ask
        for _ in range(2):
            torch.autograd.grad(flash_stages.attention(q, k, v), (q, k, v), d_o)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = flash_stages.attention(q, k, v)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_o)
    new = inputs((1, 2, 256, 128), seed=4)
    with torch.no_grad():
        for static, fresh in zip((q, k, v, d_o), new):
            static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    o_eager = flash_stages.attention(q, k, v)
    grads_eager = torch.autograd.grad(o_eager, (q, k, v), d_o)
    torch.testing.assert_close(o, o_eager, atol=0, rtol=0)
    for a, b in zip((dq, dk, dv), grads_eager):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


def test_runs_on_the_current_stream():
    q, k, v, _ = inputs((2, 4, 512, 64), seed=5)
    side = torch.cuda.Stream()
    late_q = torch.zeros_like(q)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the copy below lands late on this stream
        late_q.copy_(q)
        o = flash_stages.attention(late_q, k, v)  # wrong stream: it would read zeros
    side.synchronize()
    with torch.no_grad():
        expected = flash_stages.attention(q, k, v)
    assert torch.equal(o, expected)


def test_forwards_on_two_streams_at_once():
    # Stage 10's causal D = 64 forward takes its query tiles from a counter that each call owns
    # (its forward scratch): forwards queued on two streams at once must not share one, or the
    # second would find the counter used up and leave tiles unwritten.
    if not runs_here("10_fa3_schedule"):
        pytest.skip("10_fa3_schedule needs an H100/H200")
    problems = [inputs((4, 16, 1024, 64), seed=10 + i)[:3] for i in range(16)]
    with torch.no_grad():
        expected = [flash_stages.attention(*p, causal=True, stage="10_fa3_schedule") for p in problems]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # every forward is queued before the first one runs
    outputs = [None] * len(problems)
    with torch.no_grad():
        for i, problem in enumerate(problems):
            with torch.cuda.stream(streams[i % 2]):
                outputs[i] = flash_stages.attention(*problem, causal=True, stage="10_fa3_schedule")
    torch.cuda.synchronize()
    for got, want in zip(outputs, expected):
        assert torch.equal(got, want)


def good():
    return inputs((1, 2, 64, 64))[:3]


@pytest.mark.parametrize("case, error, words", [
    ("cpu", ValueError, "q must be a CUDA tensor"),
    ("bf16", TypeError, "q, k and v must have one type"),
    ("fp32", TypeError, "v must be torch.float16 or torch.bfloat16"),
    ("bf16_stage", ValueError, "bf16 tensors are not supported"),
    ("dim96", ValueError, "head dim (q.shape[-1]) must be 64 or 128, got 96"),
    ("3d", ValueError, "q must be 4-D"),
    ("shapes", ValueError, "k and v must have the same shape"),
    ("not_tensor", TypeError, "v must be a torch.Tensor"),
    ("stage", ValueError, "stage must be one of"),
    ("forward_only_grad", RuntimeError, "has a forward pass only"),
    ("forward_only_lse", ValueError, "return_lse needs a stage with a backward pass"),
])
def test_bad_input_names_the_argument(case, error, words):
    q, k, v = good()
    kwargs = {}
    if case == "cpu":
        q = q.cpu()
    elif case == "bf16":
        k = k.bfloat16()
    elif case == "fp32":
        v = v.float()
    elif case == "bf16_stage":
        q, k, v = (t.bfloat16() for t in (q, k, v))
        kwargs["stage"] = "07_swizzle_cp_async"
    elif case == "dim96":
        q, k, v = (torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.float16) for _ in range(3))
    elif case == "3d":
        q = q[0]
    elif case == "shapes":
        k = k[:, :, :32]
    elif case == "not_tensor":
        v = v.tolist()
    elif case == "stage":
        kwargs["stage"] = "10_nonexistent"
    elif case == "forward_only_grad":
        q.requires_grad_()
        kwargs["stage"] = "07_swizzle_cp_async"
    elif case == "forward_only_lse":
        kwargs.update(stage="07_swizzle_cp_async", return_lse=True)
    with pytest.raises(error) as raised:
        flash_stages.attention(q, k, v, **kwargs)
    assert words in str(raised.value)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_mismatched_devices():
    q, k, v = good()
    with pytest.raises(ValueError, match="must be on one device"):
        flash_stages.attention(q, k.to("cuda:1"), v)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0),
                    reason="this GPU runs stage 09")
def test_hopper_stage_elsewhere_says_why():
    q, k, v = good()
    with pytest.raises(ValueError, match="needs an H100 or H200"):
        flash_stages.attention(q, k, v, stage="09_tma_wgmma")


def test_sdpa_arguments_and_grouped_heads():
    q, _, _, _ = inputs((2, 8, 200, 64), seed=21)
    k, v = inputs((2, 2, 200, 64), seed=22)[:2]
    with torch.no_grad():
        ours = flash_stages.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        repeated = flash_stages.attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), causal=True)
        assert torch.equal(ours, repeated)
        exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, dim=1),
                                               v.double().repeat_interleave(4, dim=1), is_causal=True)
        assert max_error(ours, exact) < 5e-3
    for kwargs, words in (({}, "pass enable_gqa=True"), ({"enable_gqa": True, "attn_mask": q}, "attn_mask"),
                          ({"enable_gqa": True, "dropout_p": 0.1}, "dropout_p must be 0")):
        with pytest.raises(ValueError, match=words):
            flash_stages.scaled_dot_product_attention(q, k, v, **kwargs)


def test_transformers_llama_trains_as_with_sdpa():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import flash_stages.transformers as fst
    fst.register()
    # Four heads of D = 64 sharing two K/V heads, an odd length: random weights, random tokens.
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda()
    ids = torch.randint(0, 128, (2, 301), device="cuda")

    def loss_and_gradient(implementation, dtype):
        m = copy.deepcopy(model).to(dtype)
        m.config._attn_implementation = implementation
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), m.model.layers[0].self_attn.q_proj.weight.grad.double().flatten()

    exact_loss, exact_grad = loss_and_gradient("sdpa", torch.float32)
    sdpa_loss, sdpa_grad = loss_and_gradient("sdpa", torch.bfloat16)
    ours_loss, ours_grad = loss_and_gradient(fst.NAME, torch.bfloat16)
    assert abs(ours_loss - exact_loss) <= 2 * abs(sdpa_loss - exact_loss) + 1e-2
    cosine = F.cosine_similarity(ours_grad, exact_grad, dim=0).item()
    sdpa_cosine = F.cosine_similarity(sdpa_grad, exact_grad, dim=0).item()
    assert cosine >= sdpa_cosine - 0.01, f"gradient cosine {cosine:.4f} against SDPA's {sdpa_cosine:.4f}"


GROUPED_STAGES = [s.name for s in flash_stages.stages() if s.grouped_heads] if torch.cuda.is_available() else []


@pytest.mark.parametrize("stage", GROUPED_STAGES)
@pytest.mark.parametrize("kv_heads, kv_seq, causal", [(2, 77, False), (2, 77, True), (1, 77, True), (1, 300, True),
                                                      (3, 40, False)])
def test_grouped_heads_and_kv_lengths(stage, kv_heads, kv_seq, causal):
    # Stages 08 and 10 read K and V with fewer heads as they are, stage 08 of another length too;
    # the truth repeats them to every query head and applies the mask aligned bottom-right
    # explicitly.
    if not runs_here(stage):
        pytest.skip(f"{stage} needs an H100/H200")
    if kv_seq != 77 and not {s.name: s for s in flash_stages.stages()}[stage].kv_lengths:
        pytest.skip(f"{stage} takes K and V of Q's length only")
    q, _, _, d_o = inputs((2, 6, 77, 64), seed=31, requires_grad=True)
    k, v = inputs((2, kv_heads, kv_seq, 64), seed=32, requires_grad=True)[:2]
    o = flash_stages.attention(q, k, v, causal=causal, stage=stage)
    o.backward(d_o)
    mask = torch.ones(77, kv_seq, dtype=torch.bool, device="cuda").tril(kv_seq - 77) if causal else None

    def sdpa(dtype):
        qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks.repeat_interleave(6 // kv_heads, 1),
                                             vs.repeat_interleave(6 // kv_heads, 1), attn_mask=mask)
        out.backward(d_o.to(dtype))
        return [out.detach(), qs.grad, ks.grad, vs.grad]

    exact, theirs = sdpa(torch.float64), sdpa(torch.float16)
    for name, mine, ref, other in zip(("o", "dq", "dk", "dv"), [o.detach(), q.grad, k.grad, v.grad], exact, theirs):
        assert mine.shape == ref.shape and torch.isfinite(mine).all(), f"{name}: shape or NaN/Inf"
        bound = 2 * max_error(other, ref) + 1e-3
        assert max_error(mine, ref) <= bound, f"{name}: error {max_error(mine, ref):.3g} > {bound:.3g}"
