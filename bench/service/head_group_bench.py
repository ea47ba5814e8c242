# SPDX-License-Identifier: Apache-2.0
"""A hosted head served by a head group of S lossd processes against one plain head
(docs/hosted_head.md "Head groups", docs/scale_out.md "Replicated heads"): micro-batch
throughput, the Step's time on the server and its collective part, busy fraction and memory
per member, for each configuration:

  plain    one lossd, a one-server head (no --head_group_address)
  group1   one lossd with --head_group_address, the head created as a group of one member
           (the S = 1 overhead of the group path on the step)
  S >= 2   S lossd on one host (127.0.0.1, or --address), rank r on member r % S

    python3 bench/service/head_group_bench.py --lossd_bin PATH [--configs plain,group1,2,3]
        [--shape 256x256x8192] [--dtype fp32] [--trainers 6] [--micro_batches 2]
        [--steps 5] [--runs 3] [--backend cpu] [--threads_total N] [--out DIR]

Each run starts the processes afresh, creates one AdamW head (bias, random W), and times
--steps steps after one untimed warm-up step: every trainer thread (one lossd.Client each,
to its member) sends --micro_batches Computes into the head, then its Step; all trainers start
a step together. Per step: wall (first Compute sent to last Step returned), micro-batches per
second (trainers x micro-batches / wall), the members' StepResult.step_seconds (agreement,
reduce-scatter, norm, update of the member's slice, all-gather of the copy: the whole phase),
the tail (last Compute done to last Step returned), and each member's busy fraction (its
Computes' compute_seconds / wall). Runs go round robin over the configurations. A run reports
the median over its steps and each member's peak resident memory (VmHWM, read before it
stops: the head store, the step's buffers, the process); the table shows the median over runs
and their spread. The collective's time is estimated as a member's step_seconds minus the
plain head's step_seconds / S (the update and the norm scale with the slice), against a loopback bound: the bytes every member moves (reduce-scatter of the fp32
gradient and all-gather of the copy, (S - 1) / S of each) over one loopback TCP connection's
rate measured here (the members share one host's kernel copies: S x that, against the rate).

On the CPU backend every member's --threads is --threads_total / S (the host's cores shared),
so a host of few cores bounds the scaling: S members get no more compute than one. On a GPU
host (--backend cuda, one GPU per member through CUDA_VISIBLE_DEVICES=m) the same script
measures the scaling; head groups need the CUDA backend's NCCL communicator there.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "client" / "python"))  # run from a checkout

import lossd  # noqa: E402

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_rate(total=512 << 20, piece=4 << 20):
    """Bytes per second through one loopback TCP connection (sender and receiver threads)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    buf = memoryview(bytearray(os.urandom(1 << 16)) * (piece >> 16))

    def send():
        with socket.create_connection(("127.0.0.1", port)) as c:
            for _ in range(total // piece):
                c.sendall(buf)

    t = threading.Thread(target=send)
    sink = bytearray(piece)
    got = 0
    t0 = time.perf_counter()
    t.start()  # before accept: the sender's connect is what accept waits for
    conn, _ = srv.accept()
    while got < total:
        n = conn.recv_into(sink)
        if n == 0:
            break
        got += n
    dt = time.perf_counter() - t0
    t.join()
    conn.close()
    srv.close()
    return got / dt


class Members:
    """S lossd processes; group=False starts one without --head_group_address."""

    def __init__(self, args, size, group, logdir):
        self.addrs, self.procs, self.logs = [], [], []
        threads = max(1, args.threads_total // size)
        for m in range(size):
            port = free_port()
            self.addrs.append("%s:%d" % (args.address, port))
            cmd = [args.lossd_bin, "--address=%s" % args.address, "--port=%d" % port,
                   "--metrics_port=0", "--backend=%s" % args.backend, "--drain_seconds=1",
                   "--shutdown_grace=0", "--head_step_timeout=300s"]
            env = dict(os.environ)
            if args.backend == "cpu":
                cmd.append("--threads=%d" % threads)
            else:
                env["CUDA_VISIBLE_DEVICES"] = str(m)
            if group:
                cmd += ["--head_group_address=%s" % args.address, "--head_group_timeout=120s"]
            log = open(os.path.join(logdir, "member-%d-%d.log" % (size, m)), "ab")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               env=env))
        for p, a in zip(self.procs, self.addrs):
            self._wait(p, a)

    @staticmethod
    def _wait(proc, addr, timeout=120.0):
        deadline = time.monotonic() + timeout
        with lossd.Client(addr, timeout=2.0) as c:
            while True:
                if proc.poll() is not None:
                    sys.exit("lossd on %s exited with %s" % (addr, proc.returncode))
                try:
                    if c.health() == "SERVING":
                        return
                except lossd.LossdError:
                    pass
                if time.monotonic() > deadline:
                    sys.exit("lossd on %s not serving after %.0f s" % (addr, timeout))
                time.sleep(0.1)

    def peak_rss(self):
        """Each member's peak resident set (bytes) so far, from /proc (Linux)."""
        out = []
        for p in self.procs:
            try:
                with open("/proc/%d/status" % p.pid) as f:
                    kb = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
                out.append(kb * 1024)
            except (OSError, StopIteration):
                out.append(0)
        return out

    def close(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()


def all_at_once(fns):
    out, errs = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 (re-raised below)
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


def to_bf16(a):
    return lossd.bf16((a.view(np.uint32) >> 16).astype(np.uint16))


def make_data(args, bt, h, v):
    rng = np.random.default_rng(args.seed)
    w = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32)
    b = (rng.standard_normal(v) * 0.1).astype(np.float32)
    xs = [[(rng.standard_normal((bt, h))).astype(np.float32)
           for _ in range(args.micro_batches)] for _ in range(args.trainers)]
    ts = [[rng.integers(0, v, bt) for _ in range(args.micro_batches)]
          for _ in range(args.trainers)]
    if args.dtype == "bf16":  # truncated to bf16's bits: timing data, not accuracy
        w = to_bf16(w)
        xs = [[to_bf16(x) for x in row] for row in xs]
    return w, b, xs, ts


def one_run(args, config, data, logdir):
    """One run of one configuration: per-step measurements after a warm-up step."""
    size = 1 if config in ("plain", "group1") else int(config)
    members = Members(args, size, config != "plain", logdir)
    w, b, xs, ts = data
    T, M = args.trainers, args.micro_batches
    try:
        setup = [lossd.Client(a, timeout=600.0) for a in members.addrs]
        name, gid = "bench-%s" % uuid.uuid4().hex[:8], "g-%s" % uuid.uuid4().hex
        opt = lossd.OptimizerConfig.adamw(lr=1e-3, weight_decay=0.01)
        if config == "plain":
            infos = [setup[0].create_head(name, w, b, optimizer=opt)]
        else:
            infos = all_at_once([lambda m=m: setup[m].create_head(
                name, w, b, optimizer=opt,
                group={"members": members.addrs, "member": m, "id": gid})
                for m in range(size)])
        head_bytes = [setup[m].head_info(name).bytes for m in range(size)]
        clients = [lossd.Client(members.addrs[r % size], timeout=600.0) for r in range(T)]
        steps = args.steps + 1
        start_b, end_b = threading.Barrier(T + 1), threading.Barrier(T + 1)
        rec = [[None] * T for _ in range(steps)]
        errs = []

        def trainer(r):
            c = clients[r]
            for k in range(steps):
                start_b.wait()
                try:
                    comp = 0.0
                    for mb in range(M):
                        res = c.compute(xs[r][mb], None, ts[r][mb], head=name, head_version=k,
                                        rank=r, micro_batch=mb, want_dx=True)
                        comp += res.compute_seconds
                    computed = time.perf_counter()
                    s = c.step(name, k, rank=r, world_size=T)
                    rec[k][r] = (comp, computed, time.perf_counter(), s.step_seconds)
                except Exception as e:  # noqa: BLE001 (reported by the main thread)
                    errs.append(e)
                end_b.wait()

        threads = [threading.Thread(target=trainer, args=(r,), daemon=True) for r in range(T)]
        for t in threads:
            t.start()
        out = []
        for k in range(steps):
            start_b.wait()
            t0 = time.perf_counter()
            end_b.wait()
            if errs:
                raise errs[0]
            if k == 0:
                continue  # warm-up: first touches, the copy's first use
            wall = max(x[2] for x in rec[k]) - t0
            busy = [sum(rec[k][r][0] for r in range(T) if r % size == m) / wall
                    for m in range(size)]
            out.append({
                "wall": wall,
                "mbps": T * M / wall,
                "step_seconds": statistics.median(
                    rec[k][m][3] for m in range(min(size, T))),
                "tail": max(x[2] for x in rec[k]) - max(x[1] for x in rec[k]),
                "busy_min": min(busy),
            })
        for t in threads:
            t.join()
        for c in clients + setup:
            c.close()
        run = {key: statistics.median(s[key] for s in out) for key in out[0]}
        run["head_bytes"] = head_bytes
        run["peak_rss"] = members.peak_rss()
        run["n"] = int(infos[0].v) * int(infos[0].h) + int(infos[0].v)
        return run
    finally:
        members.close()


def summarize(config, runs):
    keys = ("wall", "mbps", "step_seconds", "tail", "busy_min")
    s = {k: statistics.median(r[k] for r in runs) for k in keys}
    s["spread"] = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in keys}
    s["head_bytes"] = runs[0]["head_bytes"]
    s["peak_rss"] = [statistics.median(r["peak_rss"][m] for r in runs)
                     for m in range(len(runs[0]["peak_rss"]))]
    s["n"] = runs[0]["n"]
    s["size"] = 1 if config in ("plain", "group1") else int(config)
    return s


def device():
    """The host's CPU model and core count (the CPU backend's device)."""
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return "CPU (%s, %d cores)" % (model, os.cpu_count() or 0)


def report(args, results, rate):
    plain = results.get("plain")
    lines = [
        "Device: %s. %s" % (device(), time.strftime("%Y-%m-%d", time.gmtime())),
        "",
        "Shape (BT, H, V) = %s %s, AdamW with a bias; %d trainers x %d micro-batches a step; "
        "median of %d runs (each the median of %d steps after a warm-up); backend %s, "
        "%d threads in all; loopback TCP %.2f GB/s (one connection)." % (
            args.shape, args.dtype, args.trainers, args.micro_batches, args.runs, args.steps,
            args.backend, args.threads_total, rate / 1e9),
        "",
        "| config | S | micro-batches/s | vs plain | step wall ms | Step on server ms | "
        "collective ms (est.) | loopback bound ms | tail ms | busy (min member) | "
        "head bytes per member | peak RSS per member MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    c_bytes = DTYPE_BYTES[args.dtype]
    for config, s in results.items():
        S = s["size"]
        vs = s["mbps"] / plain["mbps"] if plain else float("nan")
        coll, bound = "-", "-"
        if plain and config not in ("plain",):
            est = s["step_seconds"] - plain["step_seconds"] / S
            moved = S * (S - 1) / S * (4 + c_bytes) * s["n"]
            coll = "%.1f" % (est * 1e3)
            bound = "%.1f" % (moved / rate * 1e3) if S > 1 else "0"
        lo, hi = s["spread"]["mbps"]
        lines.append("| %s | %d | %.2f (%.2f-%.2f) | %.2fx | %.0f | %.1f | %s | %s | %.1f | %.0f%% "
                     "| %s | %s |" % (config, S, s["mbps"], lo, hi, vs, s["wall"] * 1e3,
                                      s["step_seconds"] * 1e3, coll, bound, s["tail"] * 1e3,
                                      100 * s["busy_min"],
                                      ", ".join(str(b) for b in s["head_bytes"]),
                                      ", ".join("%.0f" % (b / 2**20) for b in s["peak_rss"])))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lossd_bin", required=True)
    p.add_argument("--configs", default="plain,group1,2,3")
    p.add_argument("--shape", default="256x256x8192", help="BTxHxV")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--trainers", type=int, default=6)
    p.add_argument("--micro_batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads_total", type=int, default=os.cpu_count() or 1)
    p.add_argument("--address", default="127.0.0.1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="/tmp/head_group_bench")
    args = p.parse_args()
    bt, h, v = (int(x) for x in args.shape.lower().split("x"))
    os.makedirs(args.out, exist_ok=True)
    data = make_data(args, bt, h, v)
    rate = statistics.median(loopback_rate() for _ in range(3))
    # Round robin over the configurations, run by run: a host whose load drifts (a shared
    # machine) shifts every configuration alike instead of the ones measured last.
    configs = args.configs.split(",")
    runs = {config: [] for config in configs}
    for i in range(args.runs):
        for config in configs:
            runs[config].append(one_run(args, config, data, args.out))
            print("%s run %d: %.2f micro-batches/s, Step %.1f ms" % (
                config, i, runs[config][-1]["mbps"], runs[config][-1]["step_seconds"] * 1e3),
                file=sys.stderr)
    results = {config: summarize(config, runs[config]) for config in configs}
    text = report(args, results, rate)
    print(text)
    Path(args.out, "head_group_bench.md").write_text(text)
    Path(args.out, "head_group_bench.json").write_text(json.dumps(
        {"args": vars(args), "device": device(), "loopback_bytes_per_s": rate,
         "results": results}, indent=1))


if __name__ == "__main__":
    main()
