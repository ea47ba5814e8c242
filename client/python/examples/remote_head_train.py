# SPDX-License-Identifier: Apache-2.0
"""Trains a small language model twice, once with its LM head hosted on lossd
(lossd.nn.RemoteLMHead: the head's weights and AdamW state live on the server, a step moves
only the hidden states up and dX down) and once with the same head as a local torch layer,
from the same initial weights on the same batches, and compares the two loss curves.

    python3 remote_head_train.py --server localhost:50051 [--steps 300]

Model: token embedding (V=1000, H=64), two residual MLP blocks, a layer norm, and the head
(V, H) with a bias; AdamW (foreach=False, fused=False) for the backbone and for the head
(lossd's follows torch's), a cosine learning-rate schedule, and clip_grad_norm_ over
backbone plus head. Data: token sequences where the next token is (7 * t + 3) mod V nine
times in ten, so the loss falls from ln(1000) = 6.9 towards the noise's floor.

The curves agree to the rounding of the loss computation (the server computes the loss and
its gradients in fp32 in another order than torch): the check is every step's two losses
within CURVE_RTOL (1e-4) of each other, relative.
"""

import argparse
import copy
import math
import sys
import time
import uuid

import torch

import lossd
from lossd.nn import RemoteLMHead, clip_grad_norm_

V, H, BATCH, SEQ = 1000, 64, 8, 32
LR, WEIGHT_DECAY, MAX_NORM = 3e-3, 0.01, 1.0
# How far the two runs' losses may be apart at any step, relative. Measured on the CPU
# backend (2026-12-02): at most 2.1e-7 over 300 steps, about one fp32 rounding of the loss
# (lossd sums the cross-entropy in another order than torch, and AdamW carries last-bit
# differences forward without amplifying them here). 1e-4 leaves room for another backend's
# GEMM summation order and the chaos a longer run may add, and still fails on any real
# mistake in the head's path (a dropped or doubled micro-batch, a missed or repeated step, a
# wrong weight decay or bias correction), which moves the curve by far more. (A gradient off
# by a constant factor it cannot see: AdamW's update is invariant to it; the per-step tests
# in tests/test_remote_head.py check the scale.)
CURVE_RTOL = 1e-4


class Backbone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(),
                                torch.nn.Linear(2 * H, H)) for _ in range(2))
        self.norm = torch.nn.LayerNorm(H)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.norm(h)


def batches(steps, seed):
    """[(ids (BATCH, SEQ), labels (BATCH, SEQ))]: each next token (7 t + 3) mod V, or with
    probability 0.1 a random one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.empty(BATCH, SEQ + 1, dtype=torch.int64)
        seq[:, 0] = torch.randint(0, V, (BATCH,), generator=g)
        for i in range(SEQ):
            nxt = (7 * seq[:, i] + 3) % V
            noise = torch.rand(BATCH, generator=g) < 0.1
            seq[:, i + 1] = torch.where(noise, torch.randint(0, V, (BATCH,), generator=g), nxt)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False,
                             fused=False)


def cosine(opt, steps):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps)))


def train_local(backbone, head, data):
    opt_b, opt_h = adamw(backbone.parameters()), adamw(head.parameters())
    sched = [cosine(o, len(data)) for o in (opt_b, opt_h)]
    losses = []
    for ids, labels in data:
        h = backbone(ids)
        loss = torch.nn.functional.cross_entropy(head(h).reshape(-1, V), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(backbone.parameters()) + list(head.parameters()),
                                       MAX_NORM)
        for o in (opt_b, opt_h):
            o.step()
            o.zero_grad()
        for s in sched:
            s.step()
        losses.append(float(loss.detach()))
    return losses


def train_remote(backbone, head, data):
    """The same loop with the head on lossd: RemoteLMHead in place of the local head and its
    loss, RemoteHeadOptimizer in place of the head's AdamW, lossd.nn.clip_grad_norm_ over
    backbone plus head."""
    opt_b, opt_h = adamw(backbone.parameters()), head.optimizer()
    sched = [cosine(o, len(data)) for o in (opt_b, opt_h)]
    losses = []
    for ids, labels in data:
        loss = head(backbone(ids), labels)
        loss.backward()
        clip_grad_norm_(backbone.parameters(), head, MAX_NORM)
        for o in (opt_b, opt_h):
            o.step()
            o.zero_grad()
        for s in sched:
            s.step()
        losses.append(float(loss.detach()))
    return losses


def run(client, steps, seed=0):
    """Both runs from the same initial weights on the same batches: (local, remote) losses."""
    torch.manual_seed(seed)
    backbone = Backbone()
    head = torch.nn.Linear(H, V)
    data = batches(steps, seed + 1)
    name = "example-head-%s" % uuid.uuid4().hex[:8]
    remote = RemoteLMHead(name, head.weight, head.bias, client=client,
                          optimizer=lossd.OptimizerConfig.adamw(
                              lr=LR, weight_decay=WEIGHT_DECAY,
                              bias_weight_decay=WEIGHT_DECAY))
    try:
        backbone_remote = copy.deepcopy(backbone)
        local = train_local(backbone, head, data)
        hosted = train_remote(backbone_remote, remote, data)
    finally:
        remote.drop()
    return local, hosted


def compare(local, hosted):
    """The largest relative gap between the curves; raises AssertionError past CURVE_RTOL."""
    gaps = [abs(a - b) / abs(a) for a, b in zip(local, hosted)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= CURVE_RTOL, (
        "the curves part at step %d: local %.6f, hosted %.6f (%.2e relative > %.0e)" % (
            worst, local[worst], hosted[worst], gaps[worst], CURVE_RTOL))
    assert hosted[-1] < hosted[0] - 1.0, "the hosted run did not learn: %.3f -> %.3f" % (
        hosted[0], hosted[-1])
    return gaps[worst]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="localhost:50051")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    with lossd.Client(args.server) as client:
        local, hosted = run(client, args.steps, args.seed)
    print("step   local loss   hosted loss")
    for k in list(range(0, args.steps, max(1, args.steps // 15))) + [args.steps - 1]:
        print("%4d   %10.6f   %11.6f" % (k, local[k], hosted[k]))
    worst = compare(local, hosted)
    print("largest gap %.2e relative (bound %.0e); %d steps in %.1f s" % (
        worst, CURVE_RTOL, args.steps, time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
