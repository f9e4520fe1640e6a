#!/usr/bin/env python3
"""What one eager call of attention costs where the kernels take little time: the time per step of
a loop of forward, or forward plus backward, passes at a small shape, for PyTorch's SDPA and for
flash_stages (attention(), and the operator called directly, without attention()'s checks).

At B=1 H=8 S=512 D=64 the kernels take some tens of microseconds, so a loop of steps runs as fast
as the host enqueues them: the time per step is the host's time (Python, dispatch, autograd,
allocation, the launchers), which is what this measures. Each run is LOOP steps timed with CUDA
events around the loop, after the L2 is flushed; the runs of the implementations alternate
(interleaved_us), and the median of each one's runs is reported. Inputs are random N(0,1) fp16;
the gradient is torch.autograd.grad(O, (Q, K, V), dO), so no .grad accumulates.

    python3 plots/overhead.py --csv plots/data/<gpu>_overhead.csv

Writes one row per implementation and pass. Without PyTorch or a GPU, says so and exits 0.
"""
import argparse
import csv
import os
import pathlib
import statistics
import sys

from cuda_timing import torch_on_gpu

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))

COLUMNS = ["gpu", "impl", "stage", "batch", "heads", "seq", "dim", "causal", "pass", "us_per_step", "runs", "commit"]
SHAPES = [(1, 8, 512, 64, 1), (1, 8, 512, 64, 0)]
LOOP = 50  # steps per timed run
RUNS = 30  # timed runs of each step function, interleaved


def step_functions(torch, flash_stages, q, k, v, d_o, causal, stage):
    """{(impl, pass): one step}: SDPA (PyTorch's choice of backend), flash_stages.attention() and
    torch.ops.flash_stages.forward (the operator, with its autograd)."""
    import torch.nn.functional as F

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))

    def ours(q, k, v):
        return flash_stages.attention(q, k, v, causal=bool(causal), stage=stage)

    def op(q, k, v):
        return torch.ops.flash_stages.forward(q, k, v, bool(causal), stage)[0]

    steps = {}
    for impl, attend in (("sdpa", sdpa), ("flash_stages", ours), ("flash_stages_op", op)):
        def forward(attend=attend):
            with torch.no_grad():
                attend(q, k, v)

        def forward_backward(attend=attend):
            torch.autograd.grad(attend(q, k, v), (q, k, v), d_o)

        steps[impl, "forward"] = forward
        steps[impl, "forward_backward"] = forward_backward
    return steps


def interleaved_us(torch, steps, flush, runs=RUNS):
    """((impl, pass), median us per step, runs) for each step function: `runs` rounds, each timing
    every function once (LOOP steps, L2 flushed first), so that the host's slow and fast spells
    fall on all of them alike and their ratios come from the same moments."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {key: [] for key in steps}
    for key, step in steps.items():  # warm-up
        for _ in range(LOOP):
            step()
    for i in range(runs):
        for key, step in steps.items():
            flush.fill_(i & 0xFF)
            torch.cuda.synchronize()
            start.record()
            for _ in range(LOOP):
                step()
            stop.record()
            stop.synchronize()
            samples[key].append(1000.0 * start.elapsed_time(stop) / LOOP)
    return [(key, statistics.median(xs), len(xs)) for key, xs in samples.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", required=True, help="CSV to write")
    args = parser.parse_args()
    torch = torch_on_gpu("overhead", "nothing measured")
    if torch is None:
        return 0
    import flash_stages

    gpu = torch.cuda.get_device_name()
    stage = flash_stages.default_stage()
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    rows = []
    for batch, heads, seq, dim, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, d_o = (torch.randn(batch, heads, seq, dim, generator=gen, device="cuda", dtype=torch.float16)
                        for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        steps = step_functions(torch, flash_stages, q, k, v, d_o, causal, stage)
        for (impl, pass_), us, runs in interleaved_us(torch, steps, flush):
            print(f"overhead: {impl:16s} {pass_:16s} B={batch} H={heads} S={seq} D={dim} causal={causal}: "
                  f"{us:.1f} us per step")
            rows.append([gpu, impl, stage if impl != "sdpa" else "", batch, heads, seq, dim, causal, pass_,
                         f"{us:.2f}", runs, os.environ.get("FLASH_STAGES_COMMIT", "unknown")])
    with open(args.csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
