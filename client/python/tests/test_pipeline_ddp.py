# SPDX-License-Identifier: Apache-2.0
"""lossd.pipeline under real torch.distributed data parallelism: two processes (gloo, CPU),
DistributedDataParallel over the backbone, one hosted head per run that rank 0 creates, three
micro-batches a rank. The pipelined run (depth 2: no_sync on the first two, the all-reduce in
the last backward) must leave the backbone's gradients bit for bit those of the synchronous
DDP loop, and the head's Step must count every rank's every micro-batch. Skipped where torch
(with its distributed package) is not installed or the server has no hosted heads."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from head_harness import make_head, require_heads, unique  # noqa: E402
from lossd_servers import free_port  # noqa: E402

PY_ROOT = Path(__file__).resolve().parents[1]
H, V, BT, M = 16, 53, 11, 3

TRAINER = textwrap.dedent("""
    import os
    import numpy as np
    import torch
    import lossd
    from lossd.nn import RemoteLMHead
    from lossd.pipeline import Pipeline

    H, V, BT, M = %(h)d, %(v)d, %(bt)d, %(m)d
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh(),
                                   torch.nn.Linear(H, H))
    model = torch.nn.parallel.DistributedDataParallel(backbone)
    w = torch.from_numpy(np.load(os.environ["W"]))
    b = torch.from_numpy(np.load(os.environ["B"]))
    head = RemoteLMHead(os.environ["HEAD"], w, b, client=lossd.Client(os.environ["SERVER"]),
                        optimizer=lossd.OptimizerConfig.sgd(lr=0.1))

    def batch(k):
        g = torch.Generator().manual_seed(100 * rank + k)
        return torch.randn(BT, H, generator=g), torch.randint(0, V, (BT,), generator=g)

    mbs = [batch(k) for k in range(M)]
    if os.environ["MODE"] == "sync":
        for k, (x, t) in enumerate(mbs):
            ctx = model.no_sync() if k < M - 1 else torch.enable_grad()
            with ctx:
                loss = head(model(x), t, loss_scale=1.0 / M)
                (loss * (1.0 / M)).backward()
    else:
        Pipeline(head, depth=2, ddp=model).accumulate(mbs, lambda mb: (model(mb[0]), mb[1]))
    grads = {n: p.grad.clone() for n, p in backbone.named_parameters()}
    opt = head.optimizer()
    opt.step()
    torch.save({"grads": grads, "contributions": opt.last_result.contributions},
               os.environ["OUT"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
""") % dict(h=H, v=V, bt=BT, m=M)


def _run(tmp_path, server, head, mode):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    w, b = make_head(31, v=V, h=H)
    np.save(tmp_path / "w.npy", w.numpy())
    np.save(tmp_path / "b.npy", b.numpy())
    env = dict(os.environ, PYTHONPATH=str(PY_ROOT), SERVER=server, HEAD=head, MODE=mode,
               W=str(tmp_path / "w.npy"), B=str(tmp_path / "b.npy"), WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs, outs = [], []
    for r in range(2):
        out = tmp_path / ("out-%s-%d.pt" % (mode, r))
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=dict(
            env, RANK=str(r), OUT=str(out)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    for p in procs:
        log = p.communicate(timeout=300)[0]
        assert p.returncode == 0, "a trainer failed:\n%s" % log[-4000:]
    return [torch.load(o) for o in outs]


def test_ddp_pipeline_gives_the_synchronous_ddp_gradients(client, lossd_server, tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch without its distributed package")
    require_heads(client)
    names = [unique("pipe-ddp-sync"), unique("pipe-ddp-pipe")]
    try:
        sync = _run(tmp_path, lossd_server.address, names[0], "sync")
        pipe = _run(tmp_path, lossd_server.address, names[1], "pipe")
    finally:
        for n in names:
            try:
                client.drop_head(n)
            except Exception:  # noqa: BLE001 - a run that failed may not have made it
                pass
    for r in range(2):
        assert pipe[r]["contributions"] == sync[r]["contributions"] == 2 * M
        for n, g in sync[r]["grads"].items():
            assert torch.equal(pipe[r]["grads"][n], g), (r, n)
    # DDP averaged: both ranks hold the same backbone gradient.
    for n, g in pipe[0]["grads"].items():
        assert torch.equal(pipe[1]["grads"][n], g), n
