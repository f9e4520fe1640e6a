#!/usr/bin/env python3
"""sdpa_once.py BACKEND --batch B --heads H --seq S --dim D [--backward]

One forward pass (and with --backward one backward pass) of PyTorch's scaled_dot_product_attention
with one backend (flash, cudnn or efficient), random N(0,1) fp16 inputs, inside the NVTX range
"sdpa": the run plots/profiles.sh hands to Nsight Compute (ncu --nvtx --nvtx-include "sdpa/"), so
a peer's kernels are profiled at the stages' shapes and nothing of PyTorch's set-up is.
"""
import argparse
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=["flash", "cudnn", "efficient"])
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.backend]
    shape = (args.batch, args.heads, args.seq, args.dim)
    q, k, v, d_o = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(args.backward)
    # The backward on this thread (autograd otherwise runs it on a worker thread of its own), so
    # that its kernels fall inside the NVTX range, which belongs to the thread that opened it.
    with sdpa_kernel(backend), torch.autograd.set_multithreading_enabled(False):
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("sdpa")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        if args.backward:
            torch.autograd.grad(out, (q, k, v), d_o)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
