# SPDX-License-Identifier: Apache-2.0
"""Trainer simulator for pipelined head calls (lossd.pipeline): per micro-batch a trunk of
configurable time T (forward T/3, backward 2T/3), then the hosted head's call; step time of M
micro-batches against T, for pipeline depths 1 (today's synchronous loop), 2 and 3.

    python3 bench/service/pipeline_bench.py --server HOST:PORT [--shape 8192x4096x128256]
        [--dtype bf16] [--micro_batches 8] [--depths 1,2,3] [--ratios 0.25,0.5,1,2,4]
        [--trunk auto|cuda|busy|sleep] [--steps 3] [--out DIR]
    python3 bench/service/pipeline_bench.py --lossd_bin PATH ...   # starts a CPU lossd

The trunk: `cuda` a loop of bf16 matmuls on the trainer's GPU, calibrated to T (the trainer's
CPU stays free, as in training); `busy` torch matmuls on the trainer's CPU until T has passed
(they release the GIL, as a GPU trunk's launches do not need it); `sleep` the thread sleeps T
(a GPU trunk on a host whose CPU does nothing else); auto = cuda where torch sees a GPU, else
busy. T is given as ratios of the head's time h (one synchronous call, measured first).

Per point: the median over --steps steps of the wall time of Pipeline.accumulate over M
micro-batches (the head's Step, timed apart, is not in it), against the serial sum M (T + h)
and the bound max(M T, M a), a = the head's amortised time with no trunk (the faster of one
call at a time and two in flight). Writes pipeline_bench.md, pipeline_bench.csv and (with matplotlib) pipeline_bench.png
into --out. Targets (issue 36): depth 2 <= 1.05 x the bound at every ratio.
"""

import argparse
import csv
import importlib.util
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("lossd") is None:  # run from a checkout, not an installed client
    sys.path.insert(0, str(HERE.parents[1] / "client" / "python"))

import lossd  # noqa: E402
from lossd.nn import RemoteLMHead  # noqa: E402
from lossd.pipeline import Pipeline  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Trunk:
    """A stand-in backbone: forward(x) spends T/3, its backward 2T/3, and passes x (and dX)
    through unchanged, so the head sees the hidden states it was given."""

    def __init__(self, kind, device):
        self.kind, self.device = kind, device
        self.seconds = 0.0
        self.per_matmul = None
        if kind in ("cuda", "busy"):
            n = 1024 if kind == "cuda" else 128
            dt = torch.bfloat16 if kind == "cuda" else torch.float32
            self.a = torch.randn(n, n, device=device, dtype=dt)
            self.per_matmul = self._calibrate()

    def _calibrate(self):
        reps = 200 if self.kind == "cuda" else 50
        for _ in range(2):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(self.a, self.a)
            self._sync()
            per = (time.perf_counter() - t0) / reps
        return per

    def _sync(self):
        if self.kind == "cuda":
            torch.cuda.synchronize()

    def spend(self, seconds):
        if seconds <= 0:
            return
        if self.kind == "sleep":
            time.sleep(seconds)
        elif self.kind == "cuda":  # enqueued: the trainer's thread goes on, as in training
            for _ in range(max(1, round(seconds / self.per_matmul))):
                torch.mm(self.a, self.a)
        else:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                torch.mm(self.a, self.a)

    def layer(self):
        trunk = self

        class _Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                trunk.spend(trunk.seconds / 3)
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                trunk.spend(2 * trunk.seconds / 3)
                return g

        return _Fn.apply


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", help="host:port of a running lossd")
    p.add_argument("--lossd_bin", help="start this lossd (CPU backend) on a free port instead")
    p.add_argument("--shape", default="512x256x4096", help="BTxHxV of one micro-batch")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--micro_batches", type=int, default=8)
    p.add_argument("--depths", default="1,2,3")
    p.add_argument("--ratios", default="0.25,0.5,1,2,4", help="T as multiples of the head's h")
    p.add_argument("--trunk", default="auto", choices=["auto", "cuda", "busy", "sleep"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max_in_flight", type=int, default=2)
    p.add_argument("--out", default="/tmp/pipeline_bench")
    return p.parse_args(argv)


def start_lossd(binary, out):
    from lossd_servers import free_port  # tests/ helper: a free loopback port

    port = free_port()
    log = open(out / "lossd.log", "wb")
    proc = subprocess.Popen([binary, "--port=%d" % port, "--backend=cpu", "--metrics_port=0",
                             "--drain_seconds=1"], stdout=log, stderr=subprocess.STDOUT)
    addr = "127.0.0.1:%d" % port
    with lossd.Client(addr, timeout=2.0) as c:
        for _ in range(300):
            try:
                if c.health() == "SERVING":
                    return proc, addr
            except lossd.LossdError:
                time.sleep(0.1)
    proc.terminate()
    raise SystemExit("lossd did not start; see %s" % (out / "lossd.log"))


def micro_batches(m, bt, h, v, dtype, device):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(bt, h, generator=g).to(device=device, dtype=dtype),
             torch.randint(0, v, (bt,), generator=g).to(device)) for _ in range(m)]


def timed_step(pipe, head, mbs, layer, sync):
    """(accumulate's wall seconds, the head's Step seconds, head-wait seconds)."""
    t0 = time.perf_counter()
    pipe.accumulate(mbs, lambda mb: (layer(mb[0].requires_grad_()), mb[1]))
    sync()
    t1 = time.perf_counter()
    head.optimizer().step()
    return t1 - t0, time.perf_counter() - t1, pipe.wait_seconds


def measure(head, mbs, trunk, depth, seconds, steps):
    trunk.seconds = seconds
    pipe = Pipeline(head, depth=depth)
    layer = trunk.layer()
    timed_step(pipe, head, mbs, layer, trunk._sync)  # warm-up (first calls, caches)
    runs = [timed_step(pipe, head, mbs, layer, trunk._sync) for _ in range(steps)]
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
            statistics.median(r[2] for r in runs))


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE.parents[1] / "client" / "python" / "tests"))
    proc = None
    if args.lossd_bin:
        proc, server = start_lossd(args.lossd_bin, out)
    elif args.server:
        server = args.server
    else:
        raise SystemExit("--server or --lossd_bin")
    kind = args.trunk
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "busy"
    device = "cuda" if kind == "cuda" else "cpu"
    if kind == "busy":
        torch.set_num_threads(1)  # one core for the trunk, the others for the client (and
        # a lossd on the same host)
    bt, h, v = (int(s) for s in args.shape.lower().split("x"))
    dtype = DTYPES[args.dtype]
    m = args.micro_batches
    try:
        client = lossd.Client(server, max_in_flight=args.max_in_flight, timeout=600.0)
        g = torch.Generator().manual_seed(1)
        w = torch.randn(v, h, generator=g) * h ** -0.5
        head = RemoteLMHead("pipeline-bench-%s" % uuid.uuid4().hex[:8], w, None,
                            client=client, optimizer=lossd.OptimizerConfig.sgd(lr=1e-6),
                            compute_dtype=args.dtype)
        trunk = Trunk(kind, device)
        mbs = micro_batches(m, bt, h, v, dtype, device)
        serial, _, _ = measure(head, mbs, trunk, 1, 0.0, args.steps)
        hcall = serial / m  # one synchronous call (the trunk's time 0)
        piped, _, _ = measure(head, mbs, trunk, 2, 0.0, args.steps)
        # The head's amortised time: the faster of one call at a time and two in flight.
        amort = min(piped / m, hcall)
        rows = []
        for ratio in [float(r) for r in args.ratios.split(",")]:
            t = ratio * hcall
            for depth in [int(d) for d in args.depths.split(",")]:
                wall, step_s, wait = measure(head, mbs, trunk, depth, t, args.steps)
                serial_sum = m * (t + hcall)
                bound = max(m * t, m * amort)
                rows.append(dict(ratio=ratio, trunk_ms=1e3 * t, depth=depth,
                                 step_ms=1e3 * wall, serial_sum_ms=1e3 * serial_sum,
                                 of_serial=wall / serial_sum, bound_ms=1e3 * bound,
                                 of_bound=wall / bound, wait_ms=1e3 * wait,
                                 head_step_ms=1e3 * step_s))
                print("T %.2fx h: depth %d: %.1f ms (%.2fx the serial sum, %.2fx the bound)" % (
                    ratio, depth, 1e3 * wall, wall / serial_sum, wall / bound), flush=True)
        head.drop()
        report(out, args, kind, hcall, amort, rows)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def report(out, args, kind, hcall, amort, rows):
    with open(out / "pipeline_bench.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    lines = ["# Pipelined head calls: step time against the trunk's time", "",
             "shape %s %s, M = %d micro-batches, trunk `%s`, max_in_flight %d, median of %d "
             "steps. h (one synchronous call) = %.1f ms; a (amortised, the faster of "
             "one and two in flight, no trunk) = %.1f ms." % (args.shape, args.dtype, args.micro_batches, kind,
                                    args.max_in_flight, args.steps, 1e3 * hcall, 1e3 * amort),
             "", "| T / h | T ms | depth | step ms | x serial sum M(T+h) | x bound max(MT, Ma) "
             "| waiting for the head ms | head Step ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %.2f | %.1f | %d | %.1f | %.2f | %.2f | %.1f | %.1f |" % (
            r["ratio"], r["trunk_ms"], r["depth"], r["step_ms"], r["of_serial"],
            r["of_bound"], r["wait_ms"], r["head_step_ms"]))
    two = [r for r in rows if r["depth"] == 2]
    if two:
        worst = max(r["of_bound"] for r in two)
        lines += ["", "Target: depth 2 <= 1.05x the bound at every T: worst %.2fx, %s." % (
            worst, "PASS" if worst <= 1.05 else "not met")]
    text = "\n".join(lines) + "\n"
    (out / "pipeline_bench.md").write_text(text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in sorted({r["depth"] for r in rows}):
        pts = [r for r in rows if r["depth"] == d]
        ax.plot([r["trunk_ms"] for r in pts], [r["step_ms"] for r in pts], "o-",
                label="depth %d" % d)
    pts = [r for r in rows if r["depth"] == rows[0]["depth"]]
    ax.plot([r["trunk_ms"] for r in pts], [r["bound_ms"] for r in pts], "k--",
            label="bound max(MT, Ma)")
    ax.set_xlabel("trunk time T per micro-batch (ms)")
    ax.set_ylabel("step time, %d micro-batches (ms)" % args.micro_batches)
    ax.set_title("lossd.pipeline, %s %s, trunk %s" % (args.shape, args.dtype, kind))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pipeline_bench.png", dpi=120)


if __name__ == "__main__":
    main()
