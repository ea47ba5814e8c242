# SPDX-License-Identifier: Apache-2.0
"""Trains remote_head_train.py's small language model with its head hosted on lossd twice, from
the same weights on the same batches: once with the synchronous gradient-accumulation loop
(each micro-batch's forward, head call, backward, one after another), once with
lossd.pipeline.Pipeline (depth 2: the backbone's forward of micro-batch k+1 runs while k's
head call is in flight), and compares the two loss curves.

    python3 pipeline_train.py --server localhost:50051 [--steps 100] [--micro_batches 4]

Both runs: AdamW for the backbone and the head (the head's on the server), a cosine schedule,
lossd.nn.clip_grad_norm_ over backbone plus head, the hosted head's Step. The pipeline leaves
the backbone's gradients bit for bit the synchronous loop's; the head's step sum may be added
in another order where two calls are in flight (the server sums in arrival order), so the
curves agree to rounding (CURVE_RTOL); with --max_in_flight 1 they are identical.
"""

import argparse
import copy
import os
import sys
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lossd  # noqa: E402
from lossd.nn import RemoteLMHead, clip_grad_norm_  # noqa: E402
from lossd.pipeline import Pipeline  # noqa: E402
from remote_head_train import (CURVE_RTOL, H, LR, MAX_NORM, V, WEIGHT_DECAY,  # noqa: E402
                               Backbone, adamw, batches, cosine)


def train(backbone, head, data, micro, pipeline_depth):
    """Steps over `data`, each batch cut into `micro` micro-batches; pipeline_depth None is
    the synchronous loop. Returns (losses, seconds spent in the accumulation loops)."""
    opt_b, opt_h = adamw(backbone.parameters()), head.optimizer()
    sched = [cosine(o, len(data)) for o in (opt_b, opt_h)]
    pipe = Pipeline(head, depth=pipeline_depth) if pipeline_depth else None
    losses, spent = [], 0.0
    for ids, labels in data:
        mbs = list(zip(ids.chunk(micro), labels.chunk(micro)))
        t0 = time.perf_counter()
        if pipe is None:
            step_losses = []
            for x, y in mbs:
                loss = head(backbone(x), y, loss_scale=1.0 / micro)
                (loss * (1.0 / micro)).backward()
                step_losses.append(loss.detach())
        else:
            step_losses = pipe.accumulate(mbs, lambda mb: (backbone(mb[0]), mb[1]))
        spent += time.perf_counter() - t0
        clip_grad_norm_(backbone.parameters(), head, MAX_NORM)
        for o in (opt_b, opt_h):
            o.step()
            o.zero_grad()
        for s in sched:
            s.step()
        losses.append(float(sum(step_losses)) / micro)
    return losses, spent


def run(server, steps, micro, depth, max_in_flight, seed=0):
    torch.manual_seed(seed)
    backbone = Backbone()
    w = torch.nn.Linear(H, V)
    data = batches(steps, seed + 1)
    cfg = lossd.OptimizerConfig.adamw(lr=LR, weight_decay=WEIGHT_DECAY,
                                      bias_weight_decay=WEIGHT_DECAY)
    out = []
    for tag, d in (("sync", None), ("pipe", depth)):
        with lossd.Client(server, max_in_flight=max_in_flight) as client:
            head = RemoteLMHead("example-%s-%s" % (tag, uuid.uuid4().hex[:8]), w.weight,
                                w.bias, client=client, optimizer=cfg)
            try:
                out.append(train(copy.deepcopy(backbone), head, data, micro, d))
            finally:
                head.drop()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="localhost:50051")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--micro_batches", type=int, default=4)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--max_in_flight", type=int, default=2)
    ap.add_argument("--min_drop", type=float, default=1.0,
                    help="how far the pipelined loss must fall from the first step to the last")
    args = ap.parse_args(argv)
    (sync, t_sync), (piped, t_pipe) = run(args.server, args.steps, args.micro_batches,
                                          args.depth, args.max_in_flight)
    print("step   synchronous   pipelined")
    for k in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
        print("%4d   %11.6f   %9.6f" % (k, sync[k], piped[k]))
    gaps = [abs(a - b) / abs(a) for a, b in zip(sync, piped)]
    worst = max(gaps)
    assert worst <= CURVE_RTOL, "the curves part: %.2e relative > %.0e" % (worst, CURVE_RTOL)
    assert piped[-1] < piped[0] - args.min_drop, "the pipelined run did not learn: %.3f -> %.3f" % (
        piped[0], piped[-1])
    print("largest gap %.2e relative (bound %.0e; identical: %s); accumulation loops %.2f s "
          "synchronous, %.2f s pipelined" % (worst, CURVE_RTOL, sync == piped, t_sync, t_pipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
