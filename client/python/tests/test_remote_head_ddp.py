# SPDX-License-Identifier: Apache-2.0
"""RemoteLMHead under real torch.distributed data parallelism: two processes (gloo, CPU),
DistributedDataParallel over the backbone only, one hosted head that rank 0 creates. Three
steps must equal one process that backpropagates both ranks' batches as two micro-batches
scaled by 1/2: DDP averages the backbone's gradients, the Step barrier sums the head's with
grad_scale 1/world_size. Skipped where torch (with its distributed package) is not installed
or the server has no hosted heads."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from head_harness import (  # noqa: E402
    ULPS_OF_MAX_PER_STEP, make_head, require_heads, ulps_of_max, unique)
from lossd_servers import free_port  # noqa: E402

PY_ROOT = Path(__file__).resolve().parents[1]
STEPS, H, V, BT = 3, 16, 53, 11

# One trainer: DDP's rank from the environment, or (WORLD_SIZE=0) one process doing both
# ranks' batches as micro-batches. Writes its backbone and losses to OUT.
TRAINER = textwrap.dedent("""
    import os, sys
    import numpy as np
    import torch
    import lossd
    from lossd.nn import RemoteLMHead

    STEPS, H, V, BT = %(steps)d, %(h)d, %(v)d, %(bt)d
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh())
    w = torch.from_numpy(np.load(os.environ["W"]))
    b = torch.from_numpy(np.load(os.environ["B"]))
    # SGD: its update is linear in the gradient, so the two runs' different summation orders
    # stay at rounding level (AdamW's normalised update can turn a last-bit difference of a
    # near-zero gradient into a whole step).
    opt_kw = dict(lr=0.1, momentum=0.9, foreach=False, fused=False)
    head_cfg = lossd.OptimizerConfig.sgd(lr=0.1, momentum=0.9, weight_decay=0.01)
    client = lossd.Client(os.environ["SERVER"])

    def batch(step, r):
        g = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(BT, H, generator=g), torch.randint(0, V, (BT,), generator=g)

    if world:
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
        model = torch.nn.parallel.DistributedDataParallel(backbone)
        head = RemoteLMHead(os.environ["HEAD"], w, b, client=client, optimizer=head_cfg)
        assert (head.rank, head.world_size, head.grad_scale) == (rank, 2, 0.5)
    else:
        rank, model = 0, backbone
        head = RemoteLMHead(os.environ["HEAD"], w, b, client=client, optimizer=head_cfg)
    opt, head_opt = torch.optim.SGD(model.parameters(), **opt_kw), head.optimizer()
    losses = []
    for step in range(STEPS):
        if world:
            x, t = batch(step, rank)
            loss = head(model(x), t)
            loss.backward()
            losses.append(float(loss.detach()))
        else:
            for r in range(2):
                x, t = batch(step, r)
                loss = head(model(x), t, loss_scale=0.5)
                (loss * 0.5).backward()
                losses.append(float(loss.detach()))
        opt.step(); head_opt.step(); opt.zero_grad()
        assert head_opt.last_result.contributions == 2, head_opt.last_result
    torch.save({"backbone": {k: v.clone() for k, v in backbone.state_dict().items()},
                "losses": losses, "version": head.version}, os.environ["OUT"])
    if world:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
""") % dict(steps=STEPS, h=H, v=V, bt=BT)


def _run(tmp_path, server, head, world):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    w, b = make_head(30, v=V, h=H)
    np.save(tmp_path / "w.npy", w.numpy())
    np.save(tmp_path / "b.npy", b.numpy())
    env = dict(os.environ, PYTHONPATH=str(PY_ROOT), SERVER=server, HEAD=head,
               W=str(tmp_path / "w.npy"), B=str(tmp_path / "b.npy"), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs, outs = [], []
    for r in range(max(world, 1)):
        out = tmp_path / ("out-%d-%d.pt" % (world, r))
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=dict(
            env, RANK=str(r), OUT=str(out)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    for p in procs:
        log = p.communicate(timeout=300)[0]
        assert p.returncode == 0, "a trainer failed:\n%s" % log[-4000:]
    return [torch.load(o) for o in outs]


def test_ddp_ranks_share_one_head(client, lossd_server, tmp_path):
    require_heads(client)
    if not torch.distributed.is_available():
        pytest.skip("torch without its distributed package")
    ddp_head, one_head = unique("ddp"), unique("one")
    try:
        ddp = _run(tmp_path, lossd_server.address, ddp_head, 2)
        one = _run(tmp_path, lossd_server.address, one_head, 0)[0]
        assert all(r["version"] == STEPS for r in ddp + [one])
        # Rank r's losses are the single process's micro-batch r of each step.
        for r in range(2):
            np.testing.assert_allclose(ddp[r]["losses"], one["losses"][r::2], rtol=1e-5)
        for k, v in one["backbone"].items():
            for r in range(2):
                torch.testing.assert_close(ddp[r]["backbone"][k], v, rtol=1e-4, atol=1e-6)
        a, b = client.export_head(ddp_head), client.export_head(one_head)
        # The head's sum of two halves is the same in either order (a + b = b + a), but the
        # backbone's last bits differ (DDP averages (g0 + g1) / 2, the single process adds
        # g0/2 + g1/2), and so do the hidden states after the first step: the masters agree
        # within the per-step bound of the optimizer tests (measured: 0).
        bound = ULPS_OF_MAX_PER_STEP * STEPS
        for n in ("master_w", "master_bias"):
            d = ulps_of_max(a.tensors[n], b.tensors[n]).max()
            print("DDP vs one process, %s: %.2f ulps of its largest value" % (n, d))
            assert d <= bound, "%s: %.1f ulps of its largest value apart > %d" % (n, d, bound)
    finally:
        for n in (ddp_head, one_head):
            try:
                client.drop_head(n)
            except Exception:  # noqa: BLE001 - cleaning up after a failure
                pass
