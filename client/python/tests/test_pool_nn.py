# SPDX-License-Identifier: Apache-2.0
"""The torch modules over a lossd.ReplicaPool (client=pool): LossdFusedLinearCrossEntropyLoss
with a server accumulator, and RemoteLMHead, each losing its replica mid-training and
recovering as the errors say (drop the accumulator and redo the step; import the head from
its last export), ending where a run on one server ends, bit for bit."""

import pytest

import lossd
from pool_cluster import HOSTS

torch = pytest.importorskip("torch")

from lossd.nn import LossdFusedLinearCrossEntropyLoss, RemoteLMHead  # noqa: E402
from lossd._pool_route import order_after_loss  # noqa: E402

BT, H, V, STEPS, MB = 8, 8, 16, 3, 2


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) / 3
    xs = [[torch.randn(BT, H, generator=g) for _ in range(MB)] for _ in range(STEPS)]
    ts = [[torch.randint(0, V, (BT,), generator=g) for _ in range(MB)] for _ in range(STEPS)]
    return w, xs, ts


def _pool(cluster):
    return lossd.ReplicaPool(cluster.target(), resolver=cluster.resolver, probe_timeout=5,
                             timeout=60)


def _train_loss_module(loss_fn, w0, xs, ts, before=None):
    """SGD over STEPS steps of MB micro-batches accumulated on the server; returns the
    per-micro-batch (loss, dX), the final W and how many steps were redone."""
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=0.5)
    out, redone = {}, 0
    for s in range(STEPS):
        while True:
            try:
                for m in range(MB):
                    if before is not None:
                        before(s, m)
                    x = xs[s][m].clone().requires_grad_()
                    loss = loss_fn(w, x, ts[s][m])
                    (loss / MB).backward()
                    out[(s, m)] = (loss.detach().clone(), x.grad.clone())
                loss_fn.apply_accumulated_gradients(w)
                break
            except lossd.StepLostError as e:
                assert "redo the step" in e.message
                redone += 1
                loss_fn.drop_accumulator()
        opt.step()
        opt.zero_grad()
    return out, w.detach().clone(), redone


def test_loss_module_with_an_accumulator_redoes_a_lost_step(cluster):
    cluster.ensure_all()
    w0, xs, ts = _data(21)
    with lossd.Client(cluster.address(HOSTS[0]), timeout=60) as c:
        ref, ref_w, _ = _train_loss_module(
            LossdFusedLinearCrossEntropyLoss(client=c, accumulator="nn-ref"), w0, xs, ts)
    with _pool(cluster) as pool:
        loss_fn = LossdFusedLinearCrossEntropyLoss(client=pool, accumulator="nn-acc")
        killed = []

        def before(s, m):
            if (s, m) == (1, 1) and not killed:
                home = pool.home("acc:nn-acc")
                killed.append(home)
                wkey.append(loss_fn.runtime._handle.key)
                assert pool.home(wkey[0]) == home  # W lives with the accumulator
                cluster.kill(cluster.host_of(home))

        wkey = []
        got, w, redone = _train_loss_module(loss_fn, w0, xs, ts, before)
        st = pool.stats()
        assert redone == 1 and st.steps_lost == 1 and st.down == killed
        assert pool.home("acc:nn-acc") != killed[0]
        # W went to the accumulator's replica: one upload a step, plus the step redone.
        # One upload a step; the step's W went up again once where its key moved, and once
        # more where the accumulator's next replica is not its W's.
        # W lost with its replica goes where every pool sends state lost there: the first
        # replica after the lost one in W's own order (order_after_loss).
        w_next = order_after_loss(wkey[0], pool.order(wkey[0]), killed[0])[0]
        apart = w_next != pool.home("acc:nn-acc")
        assert (st.moves, st.reuploads, st.uploads) == (2, 1, STEPS + 1 + apart), st
    for k in ref:
        assert torch.equal(got[k][0], ref[k][0]) and torch.equal(got[k][1], ref[k][1]), k
    assert torch.equal(w, ref_w)


def _train_head(client, name, w0, b0, xs, ts, before=None):
    head = RemoteLMHead(name, w0, b0, client=client, rank=0, world_size=1,
                        optimizer=lossd.OptimizerConfig.sgd(lr=0.5, momentum=0.9))
    opt = head.optimizer()
    last = head.export()
    out, imports = {}, 0
    for s in range(STEPS):
        while True:
            try:
                if before is not None:
                    before(s, head)
                x = xs[s][0].clone().requires_grad_()
                loss = head(x, ts[s][0])
                loss.backward()
                opt.step()
                break
            except lossd.HeadLostError as e:
                assert e.import_rank == 0 and e.head == name
                imports += 1
                head.load_export(last)
        out[s] = (loss.detach().clone(), x.grad.clone())
        last = head.export()
    return out, head.weight(), imports


def test_remote_head_is_imported_after_its_replica_dies(cluster):
    cluster.ensure_all()
    w0, xs, ts = _data(22)
    b0 = torch.randn(V, generator=torch.Generator().manual_seed(3)) / 10
    with lossd.Client(cluster.address(HOSTS[0]), timeout=60) as c:
        ref, ref_w, _ = _train_head(c, "nn-head-ref", w0, b0, xs, ts)
    with _pool(cluster) as pool:
        killed = []

        def before(s, head):
            if s == 1 and not killed:
                home = pool.home("head:nn-head")
                killed.append(home)
                cluster.kill(cluster.host_of(home))

        got, w, imports = _train_head(pool, "nn-head", w0, b0, xs, ts, before)
        st = pool.stats()
        assert imports == 1 and st.heads_lost == 1 and st.down == killed
        assert pool.home("head:nn-head") != killed[0]
    for s in ref:
        assert torch.equal(got[s][0], ref[s][0]) and torch.equal(got[s][1], ref[s][1]), s
    assert torch.equal(w, ref_w)
