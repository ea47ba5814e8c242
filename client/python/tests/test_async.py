# SPDX-License-Identifier: Apache-2.0
"""Client.compute_async and ReplicaPool.compute_async (lossd._async): a concurrent.futures.Future
of the same result the synchronous call returns, several calls of one client in flight at
once, at most max_in_flight of them, cancel before a call starts, done-callbacks, and every
error the same LossdError subclass (with its request id) the synchronous call raises. Needs no
torch."""

import concurrent.futures
import threading

import numpy as np
import pytest

import lossd

V, H, BT = 37, 12, 9


def _data(seed, bt=BT):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((V, H)) * 0.4).astype(np.float32)
    x = rng.standard_normal((bt, H)).astype(np.float32)
    t = rng.integers(0, V, bt)
    return w, x, t


@pytest.fixture
def aclient(lossd_server):
    with lossd.Client(lossd_server.address, timeout=120.0, max_in_flight=2) as c:
        yield c


def _same(a, b):
    assert a.loss == b.loss
    for name in ("dx", "dw"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


def test_a_future_of_the_synchronous_result(aclient):
    w, x, t = _data(1)
    fut = aclient.compute_async(x, w, t, label_smoothing=0.1)
    assert isinstance(fut, concurrent.futures.Future)
    _same(fut.result(timeout=60), aclient.compute(x, w, t, label_smoothing=0.1))
    assert fut.exception() is None and fut.done()


def test_several_calls_in_flight_give_each_its_own_result(aclient):
    data = [_data(10 + i, bt=BT + i) for i in range(6)]
    futs = [aclient.compute_async(x, w, t) for w, x, t in data]
    for fut, (w, x, t) in zip(futs, data):
        _same(fut.result(timeout=60), aclient.compute(x, w, t))


def test_max_in_flight_calls_run_at_once_and_no_more(aclient):
    # Two calls that each wait for the other: both finish only if they run together.
    barrier = threading.Barrier(2, timeout=30)
    running = []
    release = threading.Event()

    def call(i):
        running.append(i)
        barrier.wait()
        release.wait(30)
        return i

    futs = [aclient.call_async(call, i) for i in range(3)]
    # The third waits behind the two running ones (max_in_flight 2): not started, so it can
    # be cancelled; the caller's thread was never blocked (all three returned at once).
    assert not futs[2].running() and not futs[2].done()
    assert futs[2].cancel() and futs[2].cancelled()
    release.set()
    assert sorted(f.result(timeout=30) for f in futs[:2]) == [0, 1]
    assert sorted(running) == [0, 1]


def test_a_waiting_compute_can_be_cancelled_and_sends_nothing(aclient, lossd_server):
    w, x, t = _data(2)
    release = threading.Event()
    blockers = [aclient.call_async(release.wait, 30) for _ in range(2)]
    acc = "async-cancelled-acc"
    fut = aclient.compute_async(x, w, t, accumulator=acc)
    assert fut.cancel()
    release.set()
    for b in blockers:
        b.result(timeout=30)
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(timeout=1)
    with pytest.raises(lossd.NotFoundError):  # the cancelled compute never created it
        aclient.fetch_gradients(acc)


def test_done_callbacks_get_the_future(aclient):
    w, x, t = _data(3)
    seen = []
    done = threading.Event()

    def cb(f):
        seen.append(f)
        done.set()

    fut = aclient.compute_async(x, w, t)
    fut.add_done_callback(cb)
    assert done.wait(60)
    assert seen == [fut] and seen[0].result().loss == aclient.compute(x, w, t).loss


def test_errors_are_the_synchronous_calls(aclient):
    w, x, t = _data(4)
    bad = np.full_like(t, V + 5)  # a target past V: the server refuses it
    with pytest.raises(lossd.InvalidArgumentError) as sync:
        aclient.compute(x, w, bad)
    err = aclient.compute_async(x, w, bad).exception(timeout=60)
    assert type(err) is type(sync.value) and err.code == sync.value.code
    assert err.message == sync.value.message and err.request_id
    assert err.request_id != sync.value.request_id  # each call its own id
    # Refused before sending (a client-side check) is the same error too.
    with pytest.raises(lossd.InvalidArgumentError) as sync:
        aclient.compute(x, w, t, out={"dx": np.zeros((1, 1), np.float32)})
    err = aclient.compute_async(x, w, t, out={"dx": np.zeros((1, 1), np.float32)}).exception(
        timeout=60)
    assert sync.value.request_id is None
    assert type(err) is type(sync.value) and str(err) == str(sync.value)
    with pytest.raises(lossd.InvalidArgumentError):
        aclient.compute_async(x, w, bad).result(timeout=60)


def test_a_hosted_heads_key_is_added_once_with_calls_in_flight(aclient):
    if "hosted_head" not in aclient.server_info().features:
        pytest.skip("this lossd does not list the hosted_head feature")
    name = "async-head-key"
    w, x, t = _data(5)
    aclient.create_head(name, w, None, optimizer=lossd.OptimizerConfig.sgd(lr=0.1))
    try:
        futs = [aclient.compute_async(x, None, t, head=name, head_version=0, rank=0,
                                      micro_batch=k) for k in (0, 1, 0, 1)]
        added = [f.result(timeout=60).head_added for f in futs]
        assert sorted(added) == [False, False, True, True]
        assert aclient.head_info(name).contributions == 2
        err = aclient.compute_async(x, None, t, head=name, head_version=3, rank=0,
                                    micro_batch=2).exception(timeout=60)
        assert isinstance(err, lossd.FailedPreconditionError) and "version" in err.message
    finally:
        aclient.drop_head(name)


def test_a_closed_client_answers_with_client_closed(lossd_server):
    c = lossd.Client(lossd_server.address)
    c.close()
    w, x, t = _data(6)
    err = c.compute_async(x, w, t).exception(timeout=5)
    assert isinstance(err, lossd.ClientClosedError) and "closed" in str(err)


def test_max_in_flight_is_checked(lossd_server):
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(lossd.InvalidArgumentError, match="max_in_flight must be an "
                                                              "integer >= 1"):
            lossd.Client(lossd_server.address, max_in_flight=bad)


def test_a_pool_routes_compute_async_as_compute(lossd_server):
    with lossd.connect_pool(lossd_server.address, max_in_flight=3) as pool:
        assert pool.max_in_flight == 3
        data = [_data(20 + i) for i in range(4)]
        futs = [pool.compute_async(x, w, t) for w, x, t in data]
        for fut, (w, x, t) in zip(futs, data):
            _same(fut.result(timeout=60), pool.compute(x, w, t))
        err = pool.compute_async(x, w, np.full_like(t, V + 5)).exception(timeout=60)
        assert isinstance(err, lossd.InvalidArgumentError)
    err = pool.compute_async(x, w, t).exception(timeout=5)
    assert isinstance(err, lossd.ClientClosedError)
