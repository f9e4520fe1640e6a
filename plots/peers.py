#!/usr/bin/env python3
"""Measure the library kernels the stages are compared with, on the benchmark shapes: PyTorch's
scaled_dot_product_attention backends (flash, which is FlashAttention-2; cuDNN; efficient) and,
where it can be imported, FlashAttention-3 (`flash_attn_interface`, for instance from the PyPI
package tokenspeed-fa3, a prebuilt FlashAttention-3 for the H100 and H200) and, forward only,
cuDNN's FP8 attention (`cudnn`, from the PyPI package nvidia-cudnn-frontend: e4m3 Q, K and V with
one scale per tensor, quantized once per shape outside the timed region; rows of dtype e4m3,
checked against a looser sanity bound, FP8's). --only NAMES times only the peers named (comma-
separated), so that a merge (bench.sh --peers) leaves the other peers' rows as they were.

Same rules as the stages' harness (common/harness.c): random N(0,1) fp16 inputs, a check against
float64 before timing, CUDA events, warm-up, the median of many runs, L2 flushed before each run,
and one CSV row per measurement in the same columns. A peer that cannot run a shape, or cannot be
imported, is reported with a line and skipped. Where PyTorch or a GPU is missing, says so and
exits 0.

With --backward, times the backward pass instead (direction `bwd`, FLOPs 2.5x the forward's): the
forward runs once outside the timed region, then each timed run is one
torch.autograd.grad(O, (Q, K, V), dO), checked first against float64 autograd on head (0, 0).
"""
import argparse
import os
import sys

from cuda_timing import HARNESS, timed_ms, torch_on_gpu

COLUMNS = "gpu,stage,batch,heads,seq,dim,causal,direction,median_us,tflops,gbps,max_abs_err,runs,commit,min_us,max_us,dtype"
# A fixed sanity bound on head (0, 0), not the harness's rule: that rule (docs/measuring.md) needs
# the float64 reference's rounding analysis per element, which this check does not compute.
ATOL = RTOL = 4e-3
BWD_ATOL_RMS, BWD_RTOL = 2e-2, 1e-2  # backward: relative to each gradient's rms


def read_shapes(path):
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                yield tuple(int(x) for x in line.split())


def flush_and_spin(flush, i):
    """Before each timed run: overwrite a buffer twice the L2's size (evicting Q, K, V and O), then
    keep the GPU busy for ~1 ms. PyTorch's dispatch of one SDPA call takes tens of microseconds
    of host time, and one autograd backward (several kernels) can take more than 100; without
    the spin, a ~12 us kernel would be timed together with the GPU idling while the host catches
    up (the stages' C launches take a few microseconds, which the flush alone hides)."""
    import torch
    flush.fill_(i & 0xFF)
    torch.cuda._sleep(HARNESS["spin_cycles"])  # ~1 ms on the H100: longer than PyTorch's host dispatch


def check_error(q, k, v, out, causal, atol=ATOL, rtol=RTOL):
    """Max abs error of head (0, 0), every row, against float64 attention; ok where every element
    is within atol + rtol |ref|."""
    import torch
    qd, kd, vd = (t[0, 0].double() for t in (q, k, v))
    scores = (qd @ kd.T) / (q.shape[-1] ** 0.5)
    if causal:
        s = scores.shape[0]
        scores.masked_fill_(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ vd
    got = out[0, 0].double()
    if not torch.isfinite(out).all():
        return float("inf"), False
    err = (got - ref).abs()
    return err.max().item(), bool((err <= atol + rtol * ref.abs()).all())


def check_grads(q, k, v, d_o, grads, causal):
    """Max abs error of dQ, dK, dV on head (0, 0) against float64 autograd, and the verdict under
    the fixed backward sanity bound above (relative to each gradient's rms)."""
    import torch
    qd, kd, vd = (t[0, 0].double().detach().requires_grad_() for t in (q, k, v))
    scores = (qd @ kd.T) / (q.shape[-1] ** 0.5)
    if causal:
        s = scores.shape[0]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vd
    refs = torch.autograd.grad(out, (qd, kd, vd), d_o[0, 0].double())
    worst, ok = 0.0, True
    for got, ref in zip(grads, refs):
        got = got[0, 0].double()
        if not torch.isfinite(got).all():
            return float("inf"), False
        err = (got - ref).abs()
        rms = ref.pow(2).mean().sqrt()
        worst = max(worst, err.max().item())
        ok = ok and bool((err <= BWD_ATOL_RMS * rms + BWD_RTOL * ref.abs()).all())
    return worst, ok


class Peer:
    """One library kernel: its name (the CSV's stage column), the context it runs in (entered once
    per shape, outside the timed region), whether it takes [B, S, H, D] rather than [B, H, S, D]
    (the inputs are then transposed once, outside the timed region), and the timed call,
    `call(q, k, v, causal)`, in the peer's own layout; the element type it multiplies (the CSV's
    dtype column) and its sanity bound (absolute and relative, as ATOL and RTOL); and `to_half`,
    which turns the call's output into fp16 for the check, outside the timed region."""

    def __init__(self, name, context, bshd, call, dtype="fp16", tolerance=(ATOL, RTOL), to_half=None):
        self.name, self.context, self.bshd, self.call = name, context, bshd, call
        self.dtype, self.tolerance = dtype, tolerance
        self.to_half = to_half or (lambda out: out)

    def own_layout(self, t):
        """[B, H, S, D] to the peer's layout; a leaf that requires grad if t does."""
        return t.transpose(1, 2).contiguous().detach().requires_grad_(t.requires_grad) if self.bshd else t

    def bhsd(self, t):
        """The peer's layout back to [B, H, S, D] (a view)."""
        return t.transpose(1, 2) if self.bshd else t


def sdpa_peer(name, backend):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    return Peer(name, lambda: sdpa_kernel(backend), False,
                lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)))


def fa3_peer():
    import contextlib
    from flash_attn_interface import flash_attn_func
    return Peer("fa3", contextlib.nullcontext, True,
                lambda q, k, v, causal: flash_attn_func(q, k, v, causal=bool(causal)))


# FP8's sanity bound: e4m3 keeps 3 mantissa bits, so one scale per tensor moves O by a few percent
# of its size (stage 11's lesson measures it); a wrong kernel moves it by far more.
FP8_ATOL = FP8_RTOL = 0.15


def cudnn_fp8_peer():
    """cuDNN's FP8 attention forward through nvidia-cudnn-frontend's graph API. Each shape's Q, K
    and V are quantized once (x / scale in e4m3, scale = amax / 448 per tensor) and its graph built
    once, outside the timed region, so the time is cuDNN's kernel alone; P is scaled by 448 into
    e4m3 (P <= 1). On Hopper cuDNN writes O in e4m3 only (fp16 output needs Blackwell): O is scaled
    by 448 / amax(V), since |O| <= amax(V), and turned back into fp16 for the check, untimed."""
    import contextlib

    import cudnn
    import torch

    prepared = {}

    def quantize(x):
        scale = (x.abs().amax().float() / 448.0).clamp_min(1e-12).reshape(1, 1, 1, 1)
        return (x.float() / scale).to(torch.float8_e4m3fn), scale

    def prepare(q, k, v, causal):
        (q8, dq), (k8, dk), (v8, dv) = quantize(q), quantize(k), quantize(v)
        one = torch.ones(1, 1, 1, 1, device="cuda")
        scale_s, descale_s, scale_o = one * 448.0, one / 448.0, 1.0 / dv
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)
        q_t, k_t, v_t = (graph.tensor_like(t).set_data_type(cudnn.data_type.FP8_E4M3) for t in (q8, k8, v8))
        scalars = [graph.tensor_like(t) for t in (dq, dk, dv, descale_s, scale_s, scale_o)]
        o_t, _, amax_s_t, amax_o_t = graph.sdpa_fp8(
            q=q_t, k=k_t, v=v_t, descale_q=scalars[0], descale_k=scalars[1], descale_v=scalars[2],
            descale_s=scalars[3], scale_s=scalars[4], scale_o=scalars[5], generate_stats=False,
            attn_scale=1.0 / q.shape[-1] ** 0.5, use_causal_mask=bool(causal))
        o = torch.empty_like(q, dtype=torch.float8_e4m3fn)
        o_t.set_output(True).set_dim(o.size()).set_stride(o.stride()).set_data_type(cudnn.data_type.FP8_E4M3)
        amax_s, amax_o = torch.zeros_like(one), torch.zeros_like(one)
        for t in (amax_s_t, amax_o_t):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        pack = {q_t: q8, k_t: k8, v_t: v8, o_t: o, amax_s_t: amax_s, amax_o_t: amax_o}
        pack.update(zip(scalars, (dq, dk, dv, descale_s, scale_s, scale_o)))
        workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
        return graph, pack, workspace, o, dv

    def call(q, k, v, causal):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape), bool(causal))
        if key not in prepared:
            prepared.clear()  # one shape's buffers at a time
            prepared[key] = prepare(q, k, v, causal)
        graph, pack, workspace, o, _ = prepared[key]
        graph.execute(pack, workspace)
        return o

    def to_half(o):
        o_scale = next(iter(prepared.values()))[4]  # O's scale: amax(V) / 448
        return (o.float() * o_scale).half()

    return Peer("cudnn_fp8", contextlib.nullcontext, False, call, dtype="e4m3", tolerance=(FP8_ATOL, FP8_RTOL),
                to_half=to_half)


def make_peers(backward=False):
    from torch.nn.attention import SDPBackend
    peers = [sdpa_peer("sdpa_flash", SDPBackend.FLASH_ATTENTION), sdpa_peer("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
             sdpa_peer("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)]
    try:
        peers.append(fa3_peer())
    except (ImportError, OSError) as e:  # not installed, or built for another PyTorch
        print(f"peers: fa3 skipped: FlashAttention-3 cannot be imported ({e}); "
              "pip install tokenspeed-fa3 on an H100 or H200 adds it")
    if not backward:  # cuDNN's FP8 peer is timed forward only
        try:
            peers.append(cudnn_fp8_peer())
        except (ImportError, OSError, AttributeError) as e:
            print(f"peers: cudnn_fp8 skipped: nvidia-cudnn-frontend cannot be imported ({e}); "
                  "pip install nvidia-cudnn-frontend adds it")
    return peers


def measure(peer, q, k, v, d_o, causal, backward, flush):
    """Check, then time, one peer at one shape: (median_us, min_us, max_us, runs, max_err), or a
    string saying why it was skipped or failed (starting "FAILED" for a failed check)."""
    import torch
    with peer.context():
        try:
            qkv = tuple(peer.own_layout(t) for t in (q, k, v))
            out = peer.call(*qkv, causal)
            if backward:
                d_out = peer.own_layout(d_o)

                def run():
                    return torch.autograd.grad(out, qkv, d_out, retain_graph=True)
                grads = tuple(peer.bhsd(g) for g in run())
            else:
                def run():
                    return peer.call(*qkv, causal)
            torch.cuda.synchronize()
        except Exception as e:  # the peer cannot run this shape (PyTorch's and cuDNN's errors alike)
            return (str(e).splitlines() or [type(e).__name__])[0][:100]
        if backward:
            max_err, ok = check_grads(q, k, v, d_o, grads, causal)
        else:
            max_err, ok = check_error(q, k, v, peer.bhsd(peer.to_half(out)), causal, *peer.tolerance)
        if not ok:
            return f"FAILED check: max abs err {max_err:.3e}"
        ms, fastest_ms, slowest_ms, runs = timed_ms(run, before_each=lambda i: flush_and_spin(flush, i))
    return ms * 1e3, fastest_ms * 1e3, slowest_ms * 1e3, runs, max_err


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--csv", required=True, help="CSV file to append rows to")
    parser.add_argument("--shapes", default=os.path.join(os.path.dirname(__file__), "shapes.txt"))
    parser.add_argument("--backward", action="store_true", help="time the backward pass")
    parser.add_argument("--only", help="comma-separated peer names: time only these")
    args = parser.parse_args()
    torch = torch_on_gpu("peers", "no peer rows written")
    if torch is None:
        return 0

    props = torch.cuda.get_device_properties(0)
    gpu = props.name.replace(",", " ")
    commit = os.environ.get("FLASH_STAGES_COMMIT", "unknown")
    flush = torch.empty(2 * props.L2_cache_size, dtype=torch.uint8, device="cuda")
    peers = make_peers(args.backward)
    if args.only:
        peers = [p for p in peers if p.name in args.only.split(",")]
        if not peers:
            print(f"peers: none of {args.only} times the {'backward' if args.backward else 'forward'} here")
            return 0
    print(f"peers: PyTorch {torch.__version__}, {gpu}: {', '.join(p.name for p in peers)}")

    new_file = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
    failures = 0
    direction = "bwd" if args.backward else "fwd"
    with open(args.csv, "a") as csv:
        if new_file:
            csv.write(COLUMNS + "\n")
        for B, H, S, D, causal in read_shapes(args.shapes):
            gen = torch.Generator(device="cuda").manual_seed(S * 1000 + D * 10 + causal)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=gen)
                       .requires_grad_(args.backward) for _ in range(3))
            d_o = torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=gen) if args.backward else None
            for peer in list(peers):
                label = f"{peer.name:<15} B={B:<2} H={H:<2} S={S:<5} D={D:<3} {'causal' if causal else 'non-causal':<10}"
                result = measure(peer, q, k, v, d_o, causal, args.backward, flush)
                if isinstance(result, str):
                    print(f"{label} {'' if result.startswith('FAILED') else 'skipped: '}{result}")
                    failures += result.startswith("FAILED")
                    if "does not support backward" in result:  # a forward-only build: said once
                        peers.remove(peer)
                    continue
                median_us, min_us, max_us, runs, max_err = result
                flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0) * (2.5 if args.backward else 1.0)
                tflops = flops / (median_us * 1e-6) * 1e-12
                # Compulsory traffic: Q, K, V (and O, dO) read, O (or dQ, dK, dV) written.
                gbps = (8 if args.backward else 4) * B * H * S * D * 2 / (median_us * 1e-6) * 1e-9
                print(f"{label} {direction} median {median_us:.1f} us over {runs} runs "
                      f"(min {min_us:.1f}, max {max_us:.1f}): {tflops:.2f} TFLOP/s")
                csv.write(f"{gpu},{peer.name},{B},{H},{S},{D},{causal},{direction},{median_us:.3f},{tflops:.3f},"
                          f"{gbps:.1f},{max_err:.3e},{runs},{commit},{min_us:.3f},{max_us:.3f},{peer.dtype}\n")
                csv.flush()
            del q, k, v, d_o
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
