#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One in-process anchor of the kernel benchmark, timed at bench_kernel's shapes on the inputs
of torch_baseline.py (bf16, forward + backward).

--op names the anchor:
- liger_cute: Liger-Kernel's CuTe-DSL SM90 op (liger_fused_linear_cross_entropy_sm90)
- liger_triton: Liger-Kernel's Triton op, through its LigerFusedLinearCrossEntropyLoss module
- quack: QuACK's chunked_linear_cross_entropy, base path (use_scaled_exp=False)
- quack_scaled: the same op on its scaled-exp path (use_scaled_exp=True)
- floor: PyTorch's 3-GEMM floor (x w^T, g w, g^T x, all bf16); it computes no loss
- naive: cross_entropy((x @ w.T).float(), y) and backward()

At each shape: the inputs (x ~ U(-1, 1), w ~ U(-a, a) with a = 6 / sqrt(H), random targets,
seed 0 on the device, as torch_baseline.py makes them); a reference loss, dX and dW from the
naive formula evaluated in float32 on the same bf16 inputs; one call of the op (where it
compiles and tunes); its loss, dX and dW checked against the reference (relative norm error
of dX and dW within --grad_tol, the loss within --loss_tol; the largest element error is
reported beside it). A result outside the tolerance is reported WRONG and is not timed. Then
the median of --runs CUDA-event timings after --warmup, and the peak device memory above the
inputs over the timed runs (torch.cuda.max_memory_allocated), in all and beyond the op's own
dX and dW. An op that fails (import, unsupported shape, out of memory) gets its error in its
row and the next shape still runs. Each row is printed as a markdown line and appended to
--csv as soon as its shape ends, so a run stopped by a time limit keeps what it finished.
--device cpu runs the same code on the CPU (times only): a check of the script at small shapes.
Exit status: 0; 2 for a bad flag; 3 when a row failed or was wrong.
"""
import argparse
import csv
import importlib.metadata
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from torch_timing import median_ms, peak_above, peak_start, sync

OPS = ("liger_cute", "liger_triton", "quack", "quack_scaled", "floor", "naive")
SHAPES = "8192x4096x128256,8192x2304x256000,16384x4096x128256"
# bf16 keeps 8 significant bits: 2^-6 is four of its steps, which dW accumulated in bf16
# across chunks (Liger's Triton op by default) stays inside, and a wrong scale, transpose or
# target does not. The loss is a mean over BT rows, far more accurate than one element.
GRAD_TOL = 2.0 ** -6
LOSS_TOL = 1e-3
CSV_FIELDS = ("call", "op", "bt", "h", "v", "ms", "tflops", "peak_gib", "beyond_grads_gib",
              "loss", "ref_loss", "loss_err", "dx_err", "dx_max_err", "dw_err", "dw_max_err",
              "status")
TABLE_HEAD = ("| op | BT, H, V | median | TFLOP/s | peak above inputs | beyond dX, dW | loss "
              "| loss rel. error | dX rel. error (max) | dW rel. error (max) | status |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")


def parse_shapes(text):
    shapes = []
    for s in text.split(","):
        if not s:
            continue
        parts = s.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"bad shape '{s}' in --shapes (want BTxHxV, each > 0)")
        shapes.append(tuple(int(p) for p in parts))
    if not shapes:
        raise SystemExit("--shapes is empty")
    return shapes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", required=True, help="one of: " + ", ".join(OPS))
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated BTxHxV")
    ap.add_argument("--runs", type=int, default=20, help="timed runs (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs after the checked one")
    ap.add_argument("--csv", default="", help="append the rows to this CSV file")
    ap.add_argument("--label", default="", help="the 'call' column of the CSV rows")
    ap.add_argument("--grad_tol", type=float, default=GRAD_TOL,
                    help="largest relative norm error of dX and dW")
    ap.add_argument("--loss_tol", type=float, default=LOSS_TOL, help="largest relative loss error")
    ap.add_argument("--quack_chunk", type=int, default=4096,
                    help="chunk_size for quack and quack_scaled (the library's default)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    ap.add_argument("--mark_missing", default="",
                    help="run nothing: append a row with this status for each shape that has "
                         "no row of this --op and --label in --csv yet (after a time limit)")
    args = ap.parse_args(argv)
    if args.op not in OPS:
        ap.error(f"bad --op '{args.op}' (one of: {', '.join(OPS)})")
    args.shapes = parse_shapes(args.shapes)
    if args.runs < 1 or args.warmup < 0:
        ap.error(f"bad --runs {args.runs} / --warmup {args.warmup} (want >= 1 / >= 0)")
    if not (0 < args.grad_tol < 1) or not (0 < args.loss_tol < 1):
        ap.error(f"bad --grad_tol {args.grad_tol} / --loss_tol {args.loss_tol} (want in (0, 1))")
    if args.quack_chunk <= 0 or args.quack_chunk % 8 != 0:
        ap.error(f"bad --quack_chunk {args.quack_chunk} (want a positive multiple of 8)")
    if args.device not in ("cuda", "cpu"):
        ap.error(f"bad --device '{args.device}' (cuda or cpu)")
    if args.mark_missing and not args.csv:
        ap.error("--mark_missing needs --csv")
    return args


def make_inputs(bt, h, v, dev):
    """torch_baseline.py's inputs: the same generator, order and scales."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.rand(bt, h, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)
    w = ((torch.rand(v, h, device=dev, generator=gen) * 2 - 1) * (6.0 / h ** 0.5)).to(
        torch.bfloat16)
    y = torch.randint(0, v, (bt,), device=dev, generator=gen)
    return x, w, y


@dataclass
class Reference:
    loss: float
    dx: torch.Tensor  # float32
    dw: torch.Tensor  # float32


def reference(x, w, y):
    """The naive loss and its gradients in float32 (no TF32) from the bf16 inputs."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        xf = x.detach().float().requires_grad_(True)
        wf = w.detach().float().requires_grad_(True)
        loss = F.cross_entropy(xf @ wf.t(), y)
        loss.backward()
        return Reference(float(loss.detach()), xf.grad, wf.grad)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def rel_errors(got, want):
    """(relative norm error, largest element error over the largest reference element)."""
    diff = got.detach().float() - want
    norm = float(torch.linalg.vector_norm(want))
    peak = float(want.abs().max())
    rel = float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else float("inf")
    biggest = float(diff.abs().max()) / peak if peak > 0 else float("inf")
    return rel, biggest


def check_outputs(loss, dx, dw, ref, grad_tol, loss_tol):
    """The op's errors against `ref` and what is wrong with them ('' when within tolerance).
    A NaN error fails every comparison, so it is reported as wrong too."""
    errs = {"loss": float("nan"), "ref_loss": ref.loss, "loss_err": float("nan"),
            "dx_err": float("nan"), "dx_max_err": float("nan"), "dw_err": float("nan"),
            "dw_max_err": float("nan")}
    problems = []
    if loss is None or loss.numel() != 1:
        problems.append("no scalar loss")
    else:
        errs["loss"] = float(loss.detach().float())
        errs["loss_err"] = abs(errs["loss"] - ref.loss) / max(abs(ref.loss), 1e-30)
        if not errs["loss_err"] <= loss_tol:
            problems.append(f"loss {errs['loss']:.6g} vs {ref.loss:.6g} "
                            f"(rel. error {errs['loss_err']:.3g} > {loss_tol:.3g})")
    for name, got, want in (("dX", dx, ref.dx), ("dW", dw, ref.dw)):
        key = name.lower()
        if got is None:
            problems.append(f"no {name}")
            continue
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name} shape {tuple(got.shape)}, want {tuple(want.shape)}")
            continue
        errs[f"{key}_err"], errs[f"{key}_max_err"] = rel_errors(got, want)
        if not errs[f"{key}_err"] <= grad_tol:
            problems.append(f"{name} rel. error {errs[f'{key}_err']:.3g} > {grad_tol:.3g}")
    return errs, "; ".join(problems)


def load_op(name, quack_chunk):
    """The op as f(x, w, y) -> scalar loss (importing its package); None for the floor."""
    if name == "naive":
        return lambda x, w, y: F.cross_entropy((x @ w.t()).float(), y)
    if name == "liger_cute":
        from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import (
            liger_fused_linear_cross_entropy_sm90)
        return lambda x, w, y: liger_fused_linear_cross_entropy_sm90(x, w, y)
    if name == "liger_triton":
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss)
        module = LigerFusedLinearCrossEntropyLoss()  # mean, no softcap or z-loss
        return lambda x, w, y: module(w, x, y)  # its order: weight, input, target
    if name in ("quack", "quack_scaled"):
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
        scaled = name == "quack_scaled"
        return lambda x, w, y: chunked_linear_cross_entropy(
            x, w, y, chunk_size=quack_chunk, use_scaled_exp=scaled)
    if name == "floor":
        return None
    raise ValueError(f"unknown op '{name}'")


def package_versions():
    found = []
    for pkg in ("torch", "triton", "liger_kernel", "quack-kernels", "nvidia-cutlass-dsl",
                "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi"):
        try:
            found.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def make_step(f, x, w, y):
    """One forward + backward (or the floor's three GEMMs when f is None)."""
    if f is None:
        xd, wd = x.detach(), w.detach()

        def floor():
            z = xd @ wd.t()
            _ = z @ wd
            _ = z.t() @ xd
        return floor

    def step():
        x.grad = None
        w.grad = None
        loss = f(x, w, y)
        loss.backward()
        return loss
    return step


def first_call_checked(f, x, w, y, args, dev, row):
    """Runs the op once (compiling it) and fills the row's errors. True when it may be timed."""
    ref = reference(x, w, y) if f is not None else None
    x.requires_grad_(True)
    w.requires_grad_(True)
    step = make_step(f, x, w, y)
    loss = step()
    sync(dev)
    if ref is None:
        row["status"] = "ok (no loss to check)"
        return True
    errs, problem = check_outputs(loss, x.grad, w.grad, ref, args.grad_tol, args.loss_tol)
    row.update(errs)
    del ref
    x.grad = None
    w.grad = None
    if problem:
        row["status"] = f"WRONG, not timed: {problem}"
        return False
    row["status"] = "ok"
    return True


def timed(f, x, w, y, args, dev, row):
    """Warm-up, the timed runs and the peak memory over them, into the row."""
    step = make_step(f, x, w, y)
    for _ in range(args.warmup):
        step()
    x.grad = None
    w.grad = None
    sync(dev)
    # The allocator keeps its cache (the timed runs reuse the warm-up's blocks); the peak
    # counts tensors alive, which the cache does not change.
    base = peak_start(dev)
    ms = median_ms(step, args.runs, dev)
    row["ms"] = ms
    row["tflops"] = 6.0 * row["bt"] * row["h"] * row["v"] / ms / 1e9
    if base is not None:
        # Beyond the op's own outputs: dX and dW as it returns them (the floor's are bf16).
        row["peak_gib"], row["beyond_grads_gib"] = peak_above(dev, base, x, w)


def run_shape(op, f_or_error, shape, args, dev):
    """One row: the check, then the timing; any failure goes into the row's status."""
    bt, h, v = shape
    row = {"call": args.label, "op": op, "bt": bt, "h": h, "v": v, "status": ""}
    if isinstance(f_or_error, BaseException):
        row["status"] = f"error: {error_text(f_or_error)}"
        return row
    x = w = y = None
    try:
        x, w, y = make_inputs(bt, h, v, dev)
        if first_call_checked(f_or_error, x, w, y, args, dev, row):
            timed(f_or_error, x, w, y, args, dev, row)
    except Exception as e:  # noqa: BLE001 - every failure is reported in the row
        traceback.print_exc(file=sys.stderr)
        row["status"] = f"error: {error_text(e)}" + (
            f" (after: {row['status']})" if row["status"] and row["status"] != "ok" else "")
        row.pop("ms", None)
    finally:
        del x, w, y
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return row


def error_text(e):
    """The exception's type and first line, short enough for a table cell."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.replace("|", "/")
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def fmt(value, spec, unit=""):
    if value is None or value == "" or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:{spec}}{unit}"


def markdown_row(r):
    dx = f"{fmt(r.get('dx_err'), '.2e')} ({fmt(r.get('dx_max_err'), '.2e')})"
    dw = f"{fmt(r.get('dw_err'), '.2e')} ({fmt(r.get('dw_max_err'), '.2e')})"
    return (f"| {r['op']} | {r['bt']}, {r['h']}, {r['v']} | {fmt(r.get('ms'), '.2f', ' ms')} "
            f"| {fmt(r.get('tflops'), '.0f')} | {fmt(r.get('peak_gib'), '.2f', ' GiB')} "
            f"| {fmt(r.get('beyond_grads_gib'), '.2f', ' GiB')} | {fmt(r.get('loss'), '.4f')} "
            f"| {fmt(r.get('loss_err'), '.1e')} | {dx} | {dw} | {r['status']} |")


def csv_value(value):
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def append_csv(path, row):
    """Appends one row, writing the header first when the file is new or empty."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as fh:
        out = csv.writer(fh)
        if new:
            out.writerow(CSV_FIELDS)
        out.writerow([csv_value(row.get(k)) for k in CSV_FIELDS])


def mark_missing(args):
    """Rows with status --mark_missing for the shapes that have none of this op and label."""
    done = set()
    if os.path.exists(args.csv):
        with open(args.csv, newline="") as fh:
            for r in csv.DictReader(fh):
                if r["op"] == args.op and r["call"] == args.label:
                    done.add((int(r["bt"]), int(r["h"]), int(r["v"])))
    for bt, h, v in args.shapes:
        if (bt, h, v) not in done:
            append_csv(args.csv, {"call": args.label, "op": args.op, "bt": bt, "h": h, "v": v,
                                  "status": args.mark_missing})


def main(argv=None):
    args = parse_args(argv)
    if args.mark_missing:
        mark_missing(args)
        return 0
    if args.dry_run:
        for bt, h, v in args.shapes:
            print(f"would run {args.op} at {bt}x{h}x{v}: checked once, then {args.runs} runs "
                  f"after {args.warmup} warm-up, on {args.device}")
        return 0
    dev = torch.device(args.device)
    try:
        f = load_op(args.op, args.quack_chunk)
    except Exception as e:  # noqa: BLE001 - an import failure becomes every row's error
        traceback.print_exc(file=sys.stderr)
        f = e
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{args.op} on {name}: {package_versions()}; median of {args.runs} runs after "
          f"{args.warmup} warm-up; tolerance dX/dW {args.grad_tol:.3g}, loss "
          f"{args.loss_tol:.3g}\n", flush=True)
    rows = []
    for shape in args.shapes:
        t0 = time.time()
        row = run_shape(args.op, f, shape, args, dev)
        rows.append(row)
        print(f"  {args.op} {shape[0]}x{shape[1]}x{shape[2]} ({time.time() - t0:.0f} s): "
              f"{markdown_row(row)}", flush=True)
        if args.csv:
            append_csv(args.csv, row)
    print("\n" + TABLE_HEAD)
    for row in rows:
        print(markdown_row(row))
    return 0 if all(r["status"].startswith("ok") for r in rows) else 3


if __name__ == "__main__":
    sys.exit(main())
