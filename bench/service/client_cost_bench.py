# SPDX-License-Identifier: Apache-2.0
"""Where one Python Compute's time goes (issue 36): the client's own steps timed apart, whole
calls against a lossd, the same bytes over a bare gRPC stream, and how much of the trainer's
Python thread the calls leave it (the GIL).

    python3 bench/service/client_cost_bench.py --lossd_bin PATH [--shape 2048x4096x8]
        [--dtype bf16] [--part_mib 1,2,4,8,16] [--runs 15] [--client DIR]
    python3 bench/service/client_cost_bench.py --server HOST:PORT ...

A call sends X (BT, H) with W by handle and takes dX back (want_dw off): the traffic of a
hosted head's Compute, with a V small enough that the compute is a small share. Rows:
- steps (no server): X to wire arrays (to_wire of a torch tensor); the request stream made
  into the bytes gRPC sends (messages and their serialization); the reply's bytes (as lossd
  sends them, in 4 MiB parts) parsed, put in place and made a torch tensor.
- calls: Client.compute, one at a time and two in flight (compute_async), overlap off and on;
  wall and the server's compute_seconds, medians.
- raw: the same request bytes, encoded once beforehand, over the Compute method with no
  (de)serializer, reply bytes dropped unparsed: what Python gRPC itself costs.
- trainer: a second Python thread counting loop turns while calls run, against its count
  alone; a counter in another process alike, which the GIL does not touch (on 2 cores the
  server takes CPU too).
--client DIR imports lossd from DIR (another checkout's client/python), for before/after runs.
"""

import argparse
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", help="host:port of a running lossd")
    p.add_argument("--lossd_bin", help="start this lossd (CPU backend) on a free port instead")
    p.add_argument("--shape", default="2048x4096x8", help="BTxHxV")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--part_mib", default="1,2,4,8,16", help="part sizes for the steps, MiB")
    p.add_argument("--call_part_mib", default="4", help="part sizes for the calls, MiB")
    p.add_argument("--reply_part_mib", type=float, default=0,
                   help="reply part size asked of the server, MiB (0: its default, 4 MiB)")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--client", help="import lossd from this folder")
    p.add_argument("--sections", default="steps,calls,raw,trainer")
    p.add_argument("--pin", action="store_true",
                   help="the lossd it starts on the last core, this process on the others: "
                        "the trainer row then sees less of the server's CPU")
    return p.parse_args(argv)


ARGS = parse_args()
sys.path.insert(0, ARGS.client or str(HERE.parents[1] / "client" / "python"))
sys.path.insert(0, str(HERE.parents[1] / "client" / "python" / "tests"))  # free_port

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import lossd  # noqa: E402
from lossd import _compute  # noqa: E402
from lossd._proto import pb  # noqa: E402
from lossd._runtime import _to_torch  # noqa: E402
from lossd._transfer import Assembler  # noqa: E402
from lossd.tensors import FLOAT_DTYPES, to_wire  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COMPUTE = "/lossd.v1.Loss/Compute"


def median_ms(fn, runs):
    """(median ms, median minor page faults) of fn() over `runs` calls."""
    ts, faults = [], []
    for _ in range(runs):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return 1e3 * statistics.median(ts), statistics.median(faults)


def request_bytes(header, inline, part_bytes, keep=False):
    """The request stream as the bytes gRPC sends: messages serialized, or (a client that
    encodes its parts itself) taken as they are. Each dropped once made, as gRPC drops it
    once sent, unless `keep`."""
    out, n = [], 0
    for m in _compute.compute_requests(header, inline, part_bytes):
        b = m if isinstance(m, bytes) else m.SerializeToString()
        n += len(b)
        if keep:
            out.append(b)
    return out if keep else n


def reply_bytes(dx, part_bytes=4 << 20):
    """dX's reply as lossd sends it without overlap: the summary, then 4 MiB parts."""
    flat = memoryview(np.ascontiguousarray(dx).reshape(-1).view(np.uint8))
    spec = pb.TensorSpec(dtype=pb.DTYPE_BF16 if dx.dtype == np.uint16 else pb.DTYPE_FP32,
                         shape=dx.shape)
    out = [pb.ComputeResponse(summary=pb.ComputeSummary(
        tensors=[pb.TENSOR_DX], specs=[spec])).SerializeToString()]
    for off in range(0, len(flat), part_bytes):
        out.append(pb.ComputeResponse(part=pb.TensorPart(
            tensor=pb.TENSOR_DX, offset=off,
            data=flat[off:off + part_bytes].tobytes())).SerializeToString())
    return out


def receive(msgs):
    """What Client.compute does with the reply's bytes: parse, put in place, torch tensor."""
    parse = getattr(_compute, "parse_response", pb.ComputeResponse.FromString)
    asm = Assembler("Compute")
    reader = _compute.ReplyReader(asm, False)
    for m in msgs:
        reader.add(parse(m))
    summary = reader.summary or reader.announced
    return _to_torch(asm.finish()[pb.TENSOR_DX], None), summary


def steps(x, header_inline, part_mibs, runs):
    rows = []
    rows.append(("X to wire arrays (to_wire)", median_ms(
        lambda: to_wire(x, "x", FLOAT_DTYPES), runs)))
    header, inline = header_inline
    for mib in part_mibs:
        rows.append(("request bytes, %g MiB parts" % mib, median_ms(
            lambda: request_bytes(header, inline, int(mib * (1 << 20))), runs)))
    dx = inline[-1][1]
    msgs = reply_bytes(dx)
    rows.append(("reply bytes parsed + placed + torch", median_ms(lambda: receive(msgs), runs)))
    return rows


def setup(client, shape, dtype):
    bt, h, v = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(bt, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 0.02).to(dtype)
    t = torch.randint(0, v, (bt,), generator=g)
    return x, client.put_weights(w), t


def timed_calls(client, x, hw, t, overlap, in_flight, n):
    """(wall, client CPU) seconds per call over n calls with `in_flight` at once: CPU is the
    whole process's (every gRPC thread), so it holds only while nothing else runs here."""
    c0, t0 = time.process_time(), time.perf_counter()
    comps = []
    if in_flight == 1:
        for _ in range(n):
            comps.append(client.compute(x, hw, t, want_dw=False,
                                        overlap=overlap).compute_seconds)
    else:
        futs = [client.compute_async(x, hw, t, want_dw=False, overlap=overlap)
                for _ in range(n)]
        comps = [f.result().compute_seconds for f in futs]
    return ((time.perf_counter() - t0) / n, (time.process_time() - c0) / n,
            statistics.median(comps))


def calls(addr, x, hw, t, runs, part_mibs, reply_mib):
    """Rows (name, wall ms, client CPU ms, server compute ms), medians over `runs` groups of
    4 calls, per request part size, overlap off and on, 1 and 2 in flight."""
    rows = []
    for mib in part_mibs:
        client = lossd.Client(addr, timeout=120, part_bytes=int(mib * (1 << 20)),
                              response_part_bytes=int(reply_mib * (1 << 20)))
        for overlap in (False, True):
            for in_flight in (1, 2):
                timed_calls(client, x, hw, t, overlap, in_flight, 2)  # warm-up
                got = [timed_calls(client, x, hw, t, overlap, in_flight, 4)
                       for _ in range(runs)]
                rows.append(("%g MiB parts, %d in flight, overlap %s" % (
                    mib, in_flight, "on" if overlap else "off"),
                    *(1e3 * statistics.median(g[k] for g in got) for k in range(3))))
        client.close()
    return rows


def raw(client, x, hw, t, runs):
    """Compute over a bare stream: requests encoded once beforehand, replies left as bytes."""
    captured = {}
    inputs = _compute.Inputs(x, hw, t, None, None, None, "mean")
    _compute.set_options(inputs.header, inputs.xdt, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, lse_square_scale=0.0, softcap=None,
                         grad_dtype=None, grad_scale=None, chunk_rows=0, token_scaling=False)
    _compute.set_outputs(inputs.header, inputs.has_bias, None, want_dx=True, want_dw=False,
                         want_db=False, want_lse=False, want_z_loss=False,
                         want_accuracy=False, want_predictions=False)
    inputs.header.overlap = False
    captured["req"] = request_bytes(inputs.header, inputs.inline, lossd.DEFAULT_PART_BYTES,
                                    keep=True)
    call = client.channel.stream_stream(COMPUTE)  # no serializers: bytes in, bytes out
    walls, cpus = [], []
    for i in range(runs + 2):
        c0, t0 = time.process_time(), time.perf_counter()
        got = sum(len(m) for m in call(iter(captured["req"]), timeout=60))
        if i >= 2:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    assert got >= x.numel() * x.element_size()
    return 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)


def _count_in_process(stop, out):
    n = 0
    while not stop.is_set():
        n += 1
        if n % 4096 == 0:
            out.value = n
    out.value = n


def trainer(client, x, hw, t, seconds=3.0):
    """Loop turns per second of a Python thread and of another process, alone and while
    calls run (two in flight, overlap on): the share of its speed the trainer keeps."""
    def thread_rate(busy):
        stop, box = threading.Event(), [0]

        def count():
            n = 0
            while not stop.is_set():
                n += 1
            box[0] = n
        th = threading.Thread(target=count)
        t0 = time.perf_counter()
        th.start()
        busy()
        stop.set()
        th.join()
        return box[0] / (time.perf_counter() - t0)

    def proc_rate(busy):
        stop, val = multiprocessing.Event(), multiprocessing.Value("q", 0)
        p = multiprocessing.Process(target=_count_in_process, args=(stop, val))
        p.start()
        time.sleep(0.5)  # started and counting
        v0, t0 = val.value, time.perf_counter()
        busy()
        v1, t1 = val.value, time.perf_counter()
        stop.set()
        p.join()
        return (v1 - v0) / (t1 - t0)

    def idle():
        time.sleep(seconds)

    def busy():
        end = time.perf_counter() + seconds
        pending = []
        while time.perf_counter() < end:
            pending.append(client.compute_async(x, hw, t, want_dw=False))
            if len(pending) >= 2:
                pending.pop(0).result()
        for f in pending:
            f.result()

    return (thread_rate(busy) / thread_rate(idle), proc_rate(busy) / proc_rate(idle))


def start_lossd(binary):
    from lossd_servers import free_port

    port = free_port()
    # glibc's MALLOC_* settings are the client's to try (see RESULTS.md), not the server's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    cmd = [binary, "--port=%d" % port, "--backend=cpu", "--metrics_port=0", "--drain_seconds=1"]
    if ARGS.pin:
        last = max(os.sched_getaffinity(0))
        cmd = ["taskset", "-c", str(last)] + cmd + ["--threads=1"]
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {last})
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return proc, "127.0.0.1:%d" % port


def main():
    shape = tuple(int(s) for s in ARGS.shape.split("x"))
    sections = set(ARGS.sections.split(","))
    proc = None
    addr = ARGS.server
    if addr is None:
        if not ARGS.lossd_bin:
            raise SystemExit("--server or --lossd_bin")
        proc, addr = start_lossd(ARGS.lossd_bin)
    try:
        client = lossd.Client(addr, wait_for_ready=True, timeout=120)
        x, hw, t = setup(client, shape, DTYPES[ARGS.dtype])
        mb = x.numel() * x.element_size() / (1 << 20)
        print("# client %s; shape %s %s: X %.0f MiB up, dX %.0f MiB down; grpcio %s" % (
            Path(lossd.__file__).parent, ARGS.shape, ARGS.dtype, mb, mb, grpc.__version__))
        if "steps" in sections:
            inputs = _compute.Inputs(x, hw, t, None, None, None, "mean")
            for name, (ms, faults) in steps(x, (inputs.header, inputs.inline),
                                            [float(s) for s in ARGS.part_mib.split(",")],
                                            ARGS.runs):
                print("step  | %-42s | %7.2f ms | %6d page faults" % (name, ms, faults))
        if "calls" in sections:
            for name, wall, cpu, comp in calls(
                    addr, x, hw, t, ARGS.runs, [float(s) for s in ARGS.call_part_mib.split(",")],
                    ARGS.reply_part_mib):
                print("call  | %-42s | %7.2f ms wall | %6.2f ms client CPU | %6.2f ms compute"
                      " | %.2f GB/s" % (name, wall, cpu, comp,
                                        2 * mb * (1 << 20) / 1e9 / (wall / 1e3)))
        if "raw" in sections:
            wall, cpu = raw(client, x, hw, t, ARGS.runs)
            print("raw   | %-42s | %7.2f ms wall | %6.2f ms client CPU" % (
                "bare stream, same bytes, overlap off", wall, cpu))
        if "trainer" in sections:
            th, pr = trainer(client, x, hw, t)
            print("train | Python thread keeps %.0f%% of its speed (another process: %.0f%%)"
                  % (100 * th, 100 * pr))
        client.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
