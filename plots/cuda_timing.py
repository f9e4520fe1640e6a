"""The timing loop plots/sdpa_peers.py and plots/ceilings.py share: the harness's rules in Python."""
import statistics


def median_ms(fn, warmup=3, iters=30, min_runs=5, budget_ms=float("inf"), before_each=None):
    """Median time of fn() in milliseconds, by CUDA events, after `warmup` untimed calls.

    Times up to `iters` calls, stopping early once `budget_ms` are timed and `min_runs` ran;
    `before_each` runs outside the timed region (the L2 flush). Returns (median, runs).
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
    return statistics.median(samples), len(samples)
