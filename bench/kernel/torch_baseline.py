#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Naive PyTorch baseline for the kernel benchmark, at the same shapes as bench_kernel.

Forward + backward of `cross_entropy((x @ w.T).float(), y)` in bf16 inputs, timed with CUDA
events (median of --runs after --warmup), plus the peak device memory above the inputs and
the PyTorch 3-GEMM floor (x w^T, g w, g^T x in bf16) as a cross-check of the C++ floor.
Prints a markdown table; --csv also writes CSV.
"""
import argparse

import torch
import torch.nn.functional as F
from torch_timing import median_ms

SHAPES = "1024x1024x32000,8192x4096x128256,8192x2304x256000,16384x4096x128256,32768x4096x128256"


def time_ms(fn, warmup, runs):
    """The median of `runs` CUDA-event timings of fn() in milliseconds, after `warmup` calls."""
    return median_ms(fn, runs, torch.device("cuda"), warmup=warmup)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for s in args.shapes.split(","):
        bt, h, v = (int(t) for t in s.split("x"))
        gen = torch.Generator(device=dev).manual_seed(0)
        x = (torch.rand(bt, h, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)
        w = ((torch.rand(v, h, device=dev, generator=gen) * 2 - 1) * (6.0 / h ** 0.5)).to(
            torch.bfloat16)
        y = torch.randint(0, v, (bt,), device=dev, generator=gen)
        x.requires_grad_(True)
        w.requires_grad_(True)

        def naive():
            x.grad = None
            w.grad = None
            loss = F.cross_entropy((x @ w.t()).float(), y)
            loss.backward()
            return loss

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = naive()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        naive_ms = time_ms(naive, args.warmup, args.runs)

        xd = x.detach()
        wd = w.detach()

        def floor():
            z = xd @ wd.t()
            _ = z @ wd
            _ = z.t() @ xd

        floor_ms = time_ms(floor, args.warmup, args.runs)
        flop = 6.0 * bt * h * v
        rows.append((bt, h, v, naive_ms, peak / 2**30, floor_ms, flop / naive_ms / 1e9,
                     float(loss)))
        del x, w, y, xd, wd
        torch.cuda.empty_cache()

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"median of {args.runs} runs after {args.warmup} warm-up\n")
    print("| BT, H, V | naive PyTorch | naive TFLOP/s | naive peak extra | torch 3-GEMM floor "
          "| loss |")
    print("|---|---|---|---|---|---|")
    for bt, h, v, ms, peak_gib, fl, tf, loss in rows:
        print(f"| {bt}, {h}, {v} | {ms:.2f} ms | {tf:.0f} | {peak_gib:.2f} GiB | {fl:.2f} ms "
              f"| {loss:.4f} |")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("bt,h,v,naive_ms,naive_peak_gib,torch_floor_ms,naive_tflops,loss\n")
            for r in rows:
                f.write(",".join(str(t) for t in r) + "\n")


if __name__ == "__main__":
    main()
