# SPDX-License-Identifier: Apache-2.0
"""Timing and peak memory of one PyTorch step, for the benchmark scripts beside this file
(anchors_bench.py, kinds_torch_baseline.py). They import it by its bare name: Python puts a
script's own folder first on its path, so it is found wherever the scripts run from (the
repository root, a bundle's folder), ahead of any PYTHONPATH.

On a CUDA device the times are CUDA events and the memory the allocator's peak; elsewhere
(--device cpu, a check of a script) the times are wall time and there are no memory figures.
"""
import statistics
import time

import torch


def sync(dev):
    """Waits for the work queued on the device (none to wait for off CUDA)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, runs, dev, warmup=0):
    """The median of `runs` timings of fn() in milliseconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(runs):
        if dev.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_start(dev):
    """Resets the device's peak memory statistic and returns the bytes allocated now, the base
    peak_above counts from; None off CUDA. Call it with the device idle (after sync)."""
    if dev.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_above(dev, base, x, w):
    """(the peak device memory since peak_start above `base`, the part of it beyond dX and dW),
    both in GiB; (None, None) off CUDA. dX and dW are x's and w's sizes in their gradients'
    dtype, bf16 where a step left no gradient (PyTorch's 3-GEMM floor)."""
    if dev.type != "cuda":
        return None, None
    sync(dev)
    peak = torch.cuda.max_memory_allocated() - base
    grads = sum(t.numel() * (t.grad.element_size() if t.grad is not None else 2) for t in (x, w))
    return peak / 2**30, (peak - grads) / 2**30
