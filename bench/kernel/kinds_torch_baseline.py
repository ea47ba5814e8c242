#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Naive PyTorch baseline of the loss kinds, at the shapes and settings of kinds_bench.

Each kind as a trainer would write it without a fused kernel: the logits materialised in
fp32 from bf16 inputs, the loss built from them, autograd for dX and dW.
- cross_entropy: cross_entropy((x @ w.T).float(), y)
- logprob: log_softmax at temperature T, log p(target) and the entropy, backward of
  sum(dlogp * logp + dentropy * H) with random upstream gradients of a mean (U(-1, 1) / BT)
- policy: dapo (every row counts) with old and reference log-probs near the current ones,
  clip epsilon 0.2, beta 0.04 (Liger-Kernel's defaults)
- distill: the generalised JSD at jsd_beta 0.5 against a teacher head of the same H (its
  logits under no_grad), summed over rows and divided by BT

Times forward + backward with CUDA events (median of --runs after --warmup) and reports the
peak device memory above the inputs (torch.cuda.max_memory_allocated minus what was allocated
before the first call) and the part of it beyond the gradients (dX, dW), which the fused op's
"peak extra" compares with. An out-of-memory is caught and reported as such. Prints a
markdown table. --device cpu runs the same code on the CPU (times only, no memory figures):
a check of the code at small shapes on a machine without a GPU. --dry-run prints the plan.
"""
import argparse

import torch
import torch.nn.functional as F

from torch_timing import median_ms, peak_above, peak_start, sync

SHAPES = "8192x4096x128256,8192x2304x256000"
KINDS = ("cross_entropy", "logprob", "policy", "distill")
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.2, 0.04  # Liger-Kernel's LigerFusedLinearGRPOLoss defaults
JSD_BETA = 0.5


def parse_shapes(text):
    shapes = []
    for s in text.split(","):
        if not s:
            continue
        parts = s.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"bad shape '{s}' (want BTxHxV, each > 0)")
        shapes.append(tuple(int(p) for p in parts))
    if not shapes:
        raise SystemExit("--shapes is empty")
    return shapes


def parse_kinds(text):
    kinds = [k for k in text.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise SystemExit(f"bad --kinds entry '{k}' ({', '.join(KINDS)})")
    if not kinds:
        raise SystemExit("--kinds is empty")
    return kinds


def head(bt, h, v, dev, gen, dtype=torch.bfloat16):
    """X ~ U(-1, 1) and W ~ U(-a, a), a = 6 / sqrt(H) (logits of standard deviation 2)."""
    x = (torch.rand(bt, h, device=dev, generator=gen) * 2 - 1).to(dtype)
    w = ((torch.rand(v, h, device=dev, generator=gen) * 2 - 1) * (6.0 / h ** 0.5)).to(dtype)
    return x, w


def logits_of(x, w, temperature):
    return (x @ w.t()).float() / temperature


def make_loss(kind, bt, h, v, x, w, dev, gen, temperature):
    """(the kind's loss as a function of x and w, the other inputs it closes over by name)."""
    y = torch.randint(0, v, (bt,), device=dev, generator=gen)
    if kind == "cross_entropy":
        return (lambda: F.cross_entropy((x @ w.t()).float(), y)), dict(y=y)
    if kind == "logprob":
        dlogp = (torch.rand(bt, device=dev, generator=gen) * 2 - 1) / bt
        dent = (torch.rand(bt, device=dev, generator=gen) * 2 - 1) / bt

        def logprob():
            logsm = torch.log_softmax(logits_of(x, w, temperature), dim=-1)
            logp = logsm.gather(1, y[:, None]).squeeze(1)
            entropy = -(logsm.exp() * logsm).sum(-1)
            return (dlogp * logp + dent * entropy).sum()
        return logprob, dict(y=y, dlogp=dlogp, dentropy=dent)
    if kind == "policy":
        with torch.no_grad():
            cur = torch.log_softmax(logits_of(x, w, temperature), dim=-1).gather(
                1, y[:, None]).squeeze(1)
        old = cur + 0.15 * torch.randn(bt, device=dev, generator=gen)
        ref = cur + 0.15 * torch.randn(bt, device=dev, generator=gen)
        adv = torch.rand(bt, device=dev, generator=gen) * 2 - 1
        del cur

        def policy():
            logp = torch.log_softmax(logits_of(x, w, temperature), dim=-1).gather(
                1, y[:, None]).squeeze(1)
            ratio = torch.exp(logp - old)
            clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
            per_token = -torch.min(ratio * adv, clipped * adv)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            per_token = per_token + BETA * kl
            return per_token.sum() / bt  # dapo, every row counted
        return policy, dict(y=y, old=old, ref=ref, adv=adv)
    tx, tw = head(bt, h, v, dev, gen, x.dtype)  # the teacher, same H

    def distill():
        with torch.no_grad():
            log_p = torch.log_softmax(logits_of(tx, tw, temperature), dim=-1)
        log_q = torch.log_softmax(logits_of(x, w, temperature), dim=-1)
        # M = beta P + (1 - beta) Q; row = beta KL(P || M) + (1 - beta) KL(Q || M).
        log_m = torch.logsumexp(
            torch.stack([log_p + torch.log(torch.tensor(JSD_BETA, device=dev)),
                         log_q + torch.log(torch.tensor(1 - JSD_BETA, device=dev))]), dim=0)
        row = JSD_BETA * (log_p.exp() * (log_p - log_m)).sum(-1) + \
            (1 - JSD_BETA) * (log_q.exp() * (log_q - log_m)).sum(-1)
        return row.sum() / bt
    return distill, dict(tx=tx, tw=tw)


def run_kind(kind, bt, h, v, args, dev):
    """(median ms, peak above inputs GiB, peak beyond inputs and grads GiB, loss) or a note."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x, w = head(bt, h, v, dev, gen)
    x.requires_grad_(True)
    w.requires_grad_(True)
    loss_fn, _ = make_loss(kind, bt, h, v, x, w, dev, gen, args.temperature)

    def step():
        x.grad = None
        w.grad = None
        loss = loss_fn()
        loss.backward()
        return loss

    sync(dev)
    base = peak_start(dev)
    loss = step()
    peak, beyond = peak_above(dev, base, x, w)
    ms = median_ms(step, args.runs, dev, warmup=args.warmup)
    return ms, peak, beyond, float(loss.detach())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated BTxHxV")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated loss kinds")
    ap.add_argument("--runs", type=int, default=20, help="timed runs (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    ap.add_argument("--temperature", type=float, default=1.0, help="T (> 0)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the code")
    ap.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    kinds = parse_kinds(args.kinds)
    if args.runs < 1 or args.warmup < 0 or not args.temperature > 0:
        raise SystemExit("bad flags: --runs >= 1, --warmup >= 0, --temperature > 0")
    if args.dry_run:
        for bt, h, v in shapes:
            for kind in kinds:
                print(f"would run {kind} at {bt}x{h}x{v}: {args.runs} runs after "
                      f"{args.warmup} warm-up, T {args.temperature}, on {args.device}")
        return
    dev = torch.device(args.device)
    rows = []
    for bt, h, v in shapes:
        for kind in kinds:
            try:
                ms, peak, beyond, loss = run_kind(kind, bt, h, v, args, dev)
                rows.append((bt, h, v, kind, f"{ms:.2f} ms",
                             "n/a" if peak is None else f"{peak:.2f} GiB",
                             "n/a" if beyond is None else f"{beyond:.2f} GiB", f"{loss:.4f}"))
            except torch.cuda.OutOfMemoryError:
                rows.append((bt, h, v, kind, "out of memory", "-", "-", "-"))
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"  {bt}x{h}x{v} {kind}: {rows[-1][4]}", flush=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\nNaive PyTorch loss kinds on {name}, torch {torch.__version__}, bf16 inputs, fp32 "
          f"logits, median of {args.runs} runs after {args.warmup} warm-up, T "
          f"{args.temperature}\n")
    print("| BT, H, V | kind | naive PyTorch | peak above inputs | beyond inputs and grads | "
          "loss |")
    print("|---|---|---|---|---|---|")
    for bt, h, v, kind, ms, peak, beyond, loss in rows:
        print(f"| {bt}, {h}, {v} | {kind} | {ms} | {peak} | {beyond} | {loss} |")


if __name__ == "__main__":
    main()
