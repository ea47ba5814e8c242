# SPDX-License-Identifier: Apache-2.0
"""Named weights in a replica pool over three real replicas: W goes up again after a failover
only when the caller's tensors still hold the bytes first uploaded (or the pool kept a copy);
a handle the server answers NOT_FOUND for moves its key; a clean accumulator moves without an
error while one holding micro-batches raises StepLostError."""

import numpy as np
import pytest

import lossd
from lossd._pool_route import rendezvous_order
from pool_cluster import HOSTS

BT, H, V = 10, 8, 20


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) / 3).astype(np.float32)
    t = rng.integers(0, V, BT)
    return x, w, t


def _pool(cluster, **kw):
    return lossd.ReplicaPool(cluster.target(), resolver=cluster.resolver, probe_timeout=5,
                             timeout=60, **kw)


def _same(got, ref):
    for f in ("loss", "dx", "dw"):
        assert np.array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(ref, f))), f


def _as_torch(kind, w):
    if kind == "numpy":
        return w.copy()
    torch = pytest.importorskip("torch")
    return torch.nn.Parameter(torch.from_numpy(w.copy()))


# Not a constant: a constant added to every weight adds the same to every logit of a row.
DELTA = np.random.default_rng(9).standard_normal((V, H)).astype(np.float32) / 8


def _add_in_place(w):
    if isinstance(w, np.ndarray):
        w += DELTA
    else:
        import torch

        with torch.no_grad():
            w.add_(torch.from_numpy(DELTA))  # an optimizer step


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_changed_weights_are_not_uploaded_again(cluster, kind):
    cluster.ensure_all()
    x, w0, t = _inputs(1)
    w = _as_torch(kind, w0)
    with _pool(cluster) as pool:
        pw = pool.put_weights(w, name="changes-" + kind)
        first = pool.compute(x, pw, t)
        home = pool.home(pw.key)
        _add_in_place(w)
        cluster.kill(cluster.host_of(home))
        with pytest.raises(lossd.WeightsChangedError) as e:
            pool.compute(x, pw, t)
        assert e.value.name == "changes-" + kind
        assert "put_weights" in e.value.message and "checksum" in e.value.message
        st = pool.stats()
        assert (st.reuploads, st.moves, st.uploads) == (0, 1, 1)
        assert pool.home(pw.key) == rendezvous_order(pw.key, cluster.addresses)[1]
        # The trainer's recovery: give W again under the name.
        pw = pool.put_weights(w, name="changes-" + kind)
        again = pool.compute(x, pw, t)
        # By handle, as W by handle and W inline may differ in the last bit.
        ref = pool.compute(x, pool.put_weights(w0 + DELTA, name="ref-" + kind), t)
        _same(again, ref)
        assert not np.array_equal(again.dw, first.dw)
        st = pool.stats()
        assert (st.reuploads, st.uploads) == (0, 3)


def test_a_kept_copy_is_uploaded_again_whatever_the_caller_did(cluster):
    cluster.ensure_all()
    x, w, t = _inputs(2)
    w_orig = w.copy()
    with _pool(cluster) as pool:
        pw = pool.put_weights(w, name="kept", keep_copy=True)
        home = pool.home(pw.key)
        w += DELTA  # the caller's array changes; the pool's copy does not
        cluster.kill(cluster.host_of(home))
        got = pool.compute(x, pw, t)
        _same(got, pool.compute(x, pool.put_weights(w_orig, name="kept-ref"), t))
        st = pool.stats()
        assert (st.reuploads, st.uploads) == (1, 3)
        assert pw.replicas() == [pool.home(pw.key)] and pool.home(pw.key) != home


def test_not_found_for_a_handle_moves_its_key(cluster, caplog):
    cluster.ensure_all()
    x, w, t = _inputs(3)
    with _pool(cluster) as pool:
        pw = pool.put_weights(w, name="evicted")
        home = pool.home(pw.key)
        ref = pool.compute(x, pw, t)
        # Another client (an eviction would do the same) drops the handle on its replica.
        with lossd.Client(home) as c:
            c.drop_weights(pw._held[home].handle)
        with caplog.at_level("WARNING", logger="lossd.pool"):
            got = pool.compute(x, pw, t)
        _same(got, ref)
        order = rendezvous_order(pw.key, cluster.addresses)
        assert home == order[0] and pool.home(pw.key) == order[1]
        st = pool.stats()
        assert (st.moves, st.reuploads, st.uploads) == (1, 1, 2)
        msgs = [r.getMessage() for r in caplog.records]
        assert sum("moved from %s" % home in m for m in msgs) == 1
        assert sum("re-uploaded to %s" % order[1] in m for m in msgs) == 1


def test_accumulator_moves_quietly_when_empty_and_loudly_when_not(cluster):
    cluster.ensure_all()
    x, w, t = _inputs(4)
    with _pool(cluster) as pool:
        key = "acc:quiet"
        pool.compute(x, w, t, accumulator="quiet")
        g = pool.fetch_gradients("quiet", reset=True)
        assert g.micro_batches == 1
        home = pool.home(key)
        cluster.restart(cluster.host_of(home))
        # Nothing was in it: the next step simply begins on the next replica.
        r = pool.compute(x, w, t, accumulator="quiet")
        assert r.accumulated_micro_batches == 1
        assert pool.home(key) == [a for a in pool.order(key) if a != home][0]
        assert pool.stats().steps_lost == 0
        # One micro-batch in it, then its replica restarts: the step must be redone.
        home = pool.home(key)
        cluster.restart(cluster.host_of(home))
        with pytest.raises(lossd.StepLostError) as e:
            pool.compute(x, w, t, accumulator="quiet")
        assert e.value.replica == home and e.value.moved_to == pool.home(key) != home
        assert "drop_accumulator('quiet')" in e.value.message
        assert pool.stats().steps_lost == 1
        pool.drop_accumulator("quiet")
        for _ in range(2):
            pool.compute(x, w, t, accumulator="quiet")
        assert pool.fetch_gradients("quiet", reset=True).micro_batches == 2


def test_a_pool_meeting_a_head_late_finds_it_where_it_moved(cluster):
    """After a restart moved a head to its next replica, a trainer starting then (a fresh
    pool) finds it there, not on the restarted replica its hash names first."""
    cluster.ensure_all()
    x, w, t = _inputs(5)
    with _pool(cluster) as first:
        first.create_head("late", w, optimizer="sgd")
        export = first.export_head("late")
        home = first.home("head:late")
        assert home == first.order("head:late")[0]
        cluster.restart(cluster.host_of(home))
        with pytest.raises(lossd.HeadLostError) as e:
            first.compute(x, None, t, head="late", head_version=0, micro_batch=0)
        moved = e.value.moved_to
        assert e.value.replica == home and moved == first.order("head:late")[1]
        assert first.import_head(export).created
        with _pool(cluster, rank=1) as late:
            r = late.compute(x, None, t, head="late", head_version=0, rank=1, micro_batch=0)
            assert late.home("head:late") == moved and r.head_added
            assert late.stats().moves == 0
        assert first.step("late", 0).contributions == 1


class _Flaky(lossd.Client):
    """A client whose next compute fails with UNAVAILABLE (the server itself stays up), after
    sending it or not: a cut connection, as the pool sees one."""

    fail = {}  # address -> "before" (nothing sent) or "after" (sent, then the reply lost)

    def compute(self, *a, **kw):
        when = self.fail.pop(self.target, None)
        if when == "before":
            raise lossd.UnavailableError("injected: connection reset", method="Compute")
        r = super().compute(*a, **kw)
        if when == "after":
            raise lossd.UnavailableError("injected: reply lost", method="Compute")
        return r


def test_a_passing_unavailable_moves_nothing(cluster):
    """UNAVAILABLE while the replica still answers: a stateless compute is sent again to the
    same replica; a compute into an accumulator is not (it may have been added): the step is
    redone; a head's is raised as is (its (rank, micro-batch) key makes a retry safe)."""
    cluster.ensure_all()
    x, w, t = _inputs(6)
    with _pool(cluster, client_factory=_Flaky) as pool:
        ref = pool.compute(x, w, t)
        home = pool.owner("rank:0")
        _Flaky.fail[home] = "before"
        _same(pool.compute(x, w, t), ref)
        assert (pool.stats().moves, pool.stats().down) == (0, [])

        pool.compute(x, w, t, accumulator="flaky")
        acc_home = pool.home("acc:flaky")
        _Flaky.fail[acc_home] = "after"  # added on the server, the reply lost
        with pytest.raises(lossd.StepLostError) as e:
            pool.compute(x, w, t, accumulator="flaky")
        assert "unknown" in e.value.message and e.value.moved_to == acc_home
        assert pool.home("acc:flaky") == acc_home and pool.stats().moves == 0
        pool.drop_accumulator("flaky")  # the recovery: the sum goes, the step is redone
        for _ in range(2):
            pool.compute(x, w, t, accumulator="flaky")
        assert pool.fetch_gradients("flaky", reset=True).micro_batches == 2

        pool.create_head("flaky-head", w, optimizer="sgd")
        _Flaky.fail[pool.home("head:flaky-head")] = "after"
        with pytest.raises(lossd.UnavailableError):
            pool.compute(x, None, t, head="flaky-head", head_version=0, micro_batch=0)
        again = pool.compute(x, None, t, head="flaky-head", head_version=0, micro_batch=0)
        assert not again.head_added  # the first arrived: the same key adds nothing
        assert pool.step("flaky-head", 0).contributions == 1
        st = pool.stats()
        assert (st.moves, st.steps_lost, st.heads_lost, st.down) == (0, 1, 0, [])


def test_resolution_drops_and_readmits_replicas(cluster, caplog):
    """A replica the name stops listing loses its keys (weights go up again on the next); one
    killed is down until a later resolution finds it answering again (restarted); keys with
    state stay where they moved, stateless ones follow their hash back."""
    cluster.ensure_all()
    x, w, t = _inputs(7)
    now = [0.0]
    listed = [list(HOSTS)]
    with lossd.ReplicaPool(cluster.target(), resolver=lambda host, port: listed[0],
                           resolve_interval=30,
                           clock=lambda: now[0], probe_timeout=5, timeout=60) as pool:
        pw = pool.put_weights(w, name="dropped")
        ref = pool.compute(x, pw, t)
        home = pool.home(pw.key)
        listed[0] = [h for h in listed[0] if h != cluster.host_of(home)]
        now[0] += 31
        with caplog.at_level("INFO", logger="lossd.pool"):
            _same(pool.compute(x, pw, t), ref)
        assert home not in pool.replicas() and pool.home(pw.key) != home
        st = pool.stats()
        assert (st.resolutions, st.moves, st.reuploads) == (1, 1, 1)
        assert any("removed ['%s']" % home in r.getMessage() for r in caplog.records)

        # Listed again; then the rank's replica dies: down, and back once it answers.
        listed[0] = list(HOSTS)
        now[0] += 31
        pool.compute(x, w, t)
        first = pool.owner("rank:0")
        assert first == pool.order("rank:0")[0]
        cluster.kill(cluster.host_of(first))
        _same(pool.compute(x, pw, t), ref)  # W's replica is another one, or moves
        pool.compute(x, w, t)  # stateless: moves off the dead replica
        assert pool.stats().down == [first] and pool.owner("rank:0") != first
        cluster.ensure_all()  # started again: a new instance
        pool.resolve()  # what the periodic one does, waiting for its probes
        assert pool.stats().down == [] and pool.owner("rank:0") == first
        pool.compute(x, w, t)
        st = pool.stats()
        assert st.calls[first] > 0 and st.resolutions >= 3
