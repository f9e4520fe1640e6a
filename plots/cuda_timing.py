"""The timing loop plots/peers.py and plots/ceilings.py share: the harness's rules in Python;
and the harness's timing constants, read from common/harness.c so that peers.py times the
PyTorch backends by the same numbers as the stages.
Run directly, prints those constants (a CPU test: it fails if they can no longer be found)."""
import os
import re
import statistics

HARNESS_C = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common", "harness.c")


def harness_timing(path=HARNESS_C):
    """The harness's timing rules: warm-up runs, timed runs, the minimum of timed runs, the time
    budget in ms after which timing stops early, and the GPU spin before each timed run (cycles)."""
    with open(path) as f:
        text = f.read()

    def find(pattern):
        match = re.search(pattern, text, re.M)
        if not match:
            raise RuntimeError(f"{path}: no match for {pattern!r}; the harness's timing constants moved")
        return match.group(1)

    return {
        "warmup": int(find(r"\.warmup = (\d+)")),
        "iters": int(find(r"\.iters = (\d+)")),
        "min_runs": int(find(r"^#define MIN_TIMED_RUNS (\d+)")),
        "budget_ms": 1000.0 * float(find(r"^#define TIME_BUDGET_S ([0-9.eE+-]+)")),
        "spin_cycles": int(find(r"^#define SPIN_CYCLES (\d+)")),
    }


HARNESS = harness_timing()


def torch_on_gpu(tool, skipped):
    """PyTorch, where it is installed and sees a CUDA device; else None, after a line that says
    which is missing and `skipped` (what the tool does without it)."""
    try:
        import torch
    except ImportError as e:
        print(f"{tool}: PyTorch not available ({e}); {skipped}")
        return None
    if not torch.cuda.is_available():
        print(f"{tool}: no CUDA device visible to PyTorch; {skipped}")
        return None
    return torch


def median_ms(fn, **kwargs):
    """Median time of fn() in milliseconds (timed_ms's); returns (median, runs)."""
    median, _, _, runs = timed_ms(fn, **kwargs)
    return median, runs


def timed_ms(fn, warmup=HARNESS["warmup"], iters=HARNESS["iters"], min_runs=HARNESS["min_runs"],
             budget_ms=HARNESS["budget_ms"], before_each=None):
    """Times of fn() in milliseconds, by CUDA events, after `warmup` untimed calls; by default
    with the harness's numbers (HARNESS).

    Times up to `iters` calls, stopping early once `budget_ms` are timed and `min_runs` ran;
    `before_each` runs outside the timed region (the L2 flush). Returns (median, fastest,
    slowest, runs), as the harness reports them.
    """
    import torch
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    while len(samples) < iters and (len(samples) < min_runs or sum(samples) < budget_ms):
        if before_each:
            before_each(len(samples))
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return statistics.median(samples), min(samples), max(samples), len(samples)


if __name__ == "__main__":
    print(", ".join(f"{name} {value}" for name, value in HARNESS.items()))
