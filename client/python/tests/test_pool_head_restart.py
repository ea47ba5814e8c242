# SPDX-License-Identifier: Apache-2.0
"""A hosted head's replica is SIGKILLed and started again (empty, alive, a new instance) between
steps, with two trainers (one pool each). One rank's pool meets the loss in a compute; the
other's has not when it imports: it must not make a second head on the restarted replica but
import where the first rank's HeadLostError said, so that exactly one head exists, both pools
agree where, and the redone step completes. Both orders: rank 1 meets the loss and rank 0
imports unaware (the importer), or rank 0 meets it and imports and rank 1 imports unaware."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import lossd

BT, H, V = 10, 8, 20


def _pool(cluster, rank):
    return lossd.ReplicaPool(cluster.target(), resolver=cluster.resolver, probe_timeout=5,
                             rank=rank, timeout=60)


def _batch(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BT, H)).astype(np.float32), rng.integers(0, V, BT)


def _step(pools, name, version):
    """One micro-batch per rank, then every rank's Step (a barrier): the step's results."""
    for p in pools:
        x, t = _batch(100 * version + p.rank)
        p.compute(x, None, t, head=name, head_version=version, rank=p.rank, micro_batch=0,
                  grad_scale=1.0 / len(pools), want_dw=False)
    with ThreadPoolExecutor(len(pools)) as ex:
        futs = [ex.submit(p.step, name, version, rank=p.rank, world_size=len(pools),
                          timeout=60) for p in pools]
        return [f.result(timeout=90) for f in futs]


def _holders(cluster, name):
    """The replicas that hold head `name`, asked directly (not through a pool)."""
    out = []
    for addr in cluster.addresses:
        with lossd.Client(addr, timeout=10) as c:
            try:
                c.head_info(name)
            except lossd.NotFoundError:
                continue
            out.append(addr)
    return out


@pytest.mark.parametrize("rank0_first", [False, True], ids=["rank1_meets_first",
                                                           "rank0_meets_first"])
def test_one_head_whichever_rank_meets_the_loss_first(cluster, rank0_first):
    cluster.ensure_all()
    name = "restart-%d" % rank0_first
    key = "head:" + name
    w = (np.random.default_rng(3).standard_normal((V, H)) / 3).astype(np.float32)
    with _pool(cluster, 0) as r0, _pool(cluster, 1) as r1:
        r0.create_head(name, w, optimizer=lossd.OptimizerConfig.sgd(lr=0.05))
        _step([r0, r1], name, 0)
        export = r0.export_head(name)
        order = r0.order(key)
        assert r0.home(key) == r1.home(key) == order[0]
        host = cluster.host_of(order[0])
        cluster.kill(host)
        cluster.start(host)
        cluster.wait_serving(host)

        first = r0 if rank0_first else r1
        x, t = _batch(7)
        with pytest.raises(lossd.HeadLostError) as e:
            first.compute(x, None, t, head=name, head_version=1, rank=first.rank,
                          micro_batch=0, want_dw=False)
        assert e.value.replica == order[0] and e.value.moved_to == order[1]
        assert "import_head(export)" in e.value.message

        # Every rank may import; the one whose pool has not met the loss too.
        assert r0.import_head(export).created
        assert not r1.import_head(export).created  # the same head, imported once
        assert r0.home(key) == r1.home(key) == order[1]
        assert _holders(cluster, name) == [order[1]]

        results = _step([r0, r1], name, 1)  # the redone step completes, on one head
        assert [r.version for r in results] == [2, 2]
        assert [r.contributions for r in results] == [2, 2]
        r0.drop_head(name)
