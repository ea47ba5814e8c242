# SPDX-License-Identifier: Apache-2.0
"""The numpy-level hosted-head calls of lossd.Client: create, compute with the idempotency
key, step, export in ranges, import, info, list, drop, and the refusals (client-side checks
name the field; a server without the feature is told apart). Needs no torch."""

import time

import numpy as np
import pytest

import lossd
from lossd._heads import HEAD_TENSOR_NAMES

V, H, BT = 37, 12, 9


def _have_heads(client):
    if "hosted_head" not in client.server_info().features:
        pytest.skip("this lossd does not list the hosted_head feature")


def _data(seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((V, H)) * 0.4).astype(np.float32)
    b = rng.standard_normal(V).astype(np.float32)
    x = rng.standard_normal((BT, H)).astype(np.float32)
    t = rng.integers(0, V, BT)
    return w, b, x, t


@pytest.fixture
def head(client, request):
    _have_heads(client)
    name = "client-test-%s" % request.node.name.replace("[", "-").replace("]", "")
    w, b, _, _ = _data(1)
    client.create_head(name, w, b, optimizer=lossd.OptimizerConfig.sgd(lr=0.1, momentum=0.5))
    yield name
    try:
        client.drop_head(name)
    except lossd.NotFoundError:
        pass


def test_create_is_idempotent_and_info_describes_the_head(client, head):
    w, b, _, _ = _data(1)
    again = client.create_head(head, w, b,
                               optimizer=lossd.OptimizerConfig.sgd(lr=0.1, momentum=0.5))
    assert not again.created
    info = client.head_info(head)
    assert (info.v, info.h, info.has_bias, info.compute_dtype) == (V, H, True, "fp32")
    assert info.optimizer.kind == "sgd" and info.optimizer.lr == pytest.approx(0.1)
    assert info.optimizer.momentum == pytest.approx(0.5)
    assert info.version == 0 and info.bytes > 0 and info.instance
    entries = [e for e in client.list_state() if e.name == head]
    assert len(entries) == 1 and entries[0].kind == "head" and entries[0].version == 0


def test_the_same_key_is_added_once(client, head):
    _, _, x, t = _data(2)
    r1 = client.compute(x, None, t, head=head, head_version=0, rank=0, micro_batch=7)
    r2 = client.compute(x, None, t, head=head, head_version=0, rank=0, micro_batch=7)
    r3 = client.compute(x, None, t, head=head, head_version=0, rank=1, micro_batch=7)
    assert (r1.head_added, r2.head_added, r3.head_added) == (True, False, True)
    assert r1.head_version == 0 and r1.dw is None and r1.dx.shape == (BT, H)
    assert r1.dx.tobytes() == r2.dx.tobytes() and r1.loss == r2.loss
    assert client.head_info(head).contributions == 2
    res = client.step(head, 0, world_size=1)
    assert res.applied and res.contributions == 2 and res.version == 1
    # A retried Step of the completed step returns its result again.
    assert client.step(head, 0, world_size=1) == res
    with pytest.raises(lossd.FailedPreconditionError, match="version 1"):
        client.compute(x, None, t, head=head, head_version=0, rank=0, micro_batch=8)


def test_reduce_then_apply(client, head):
    _, _, x, t = _data(3)
    client.compute(x, None, t, head=head, head_version=0, micro_batch=0)
    red = client.step(head, 0, phase="reduce")
    assert red.finite and red.grad_norm > 0 and not red.applied and red.version == 0
    res = client.step(head, 0, phase="apply", clip_coef=0.5)
    assert res.applied and res.clip_coef == 0.5 and res.grad_norm == red.grad_norm


def test_export_in_ranges_equals_one_export_and_imports(client, head):
    _, _, x, t = _data(4)
    client.compute(x, None, t, head=head, head_version=0, micro_batch=0)
    client.step(head, 0)
    whole = client.export_head(head)
    small = client.export_head(head, range_bytes=64)
    assert small.ranges > whole.ranges
    assert sorted(whole.tensors) == sorted(small.tensors)
    assert set(whole.tensors) <= set(HEAD_TENSOR_NAMES)
    for n in whole.tensors:
        assert np.asarray(whole.tensors[n]).tobytes() == np.asarray(small.tensors[n]).tobytes()
    assert whole.tensors["master_w"].dtype == np.float32
    assert whole.version == 1 and whole.optimizer_step == 1
    only = client.export_head(head, tensors=("copy_w",))
    assert list(only.tensors) == ["copy_w"]
    assert only.tensors["copy_w"].tobytes() == whole.tensors["copy_w"].tobytes()
    copy = head + "-copy"
    try:
        info = client.import_head(whole, copy)
        assert info.version == 1 and info.optimizer_step == 1
        back = client.export_head(copy)
        for n in whole.tensors:
            assert np.asarray(back.tensors[n]).tobytes() == np.asarray(
                whole.tensors[n]).tobytes(), n
    finally:
        client.drop_head(copy)


def test_drop_forgets_the_head(client, head):
    client.drop_head(head)
    with pytest.raises(lossd.NotFoundError):
        client.head_info(head)


def test_client_side_refusals_name_the_field(client, head):
    w, b, x, t = _data(5)
    cases = [
        (lambda: client.compute(x, w, t, head=head, head_version=0, micro_batch=0), "w"),
        (lambda: client.compute(x, None, t, head=head, head_version=0), "micro_batch"),
        (lambda: client.compute(x, None, t), "w is None"),
        (lambda: client.step(head, 0, rank=2, world_size=2), "rank"),
        (lambda: client.step(head, 0, clip_coef=0.5, max_norm=1.0), "max_norm"),
        (lambda: client.step(head, 0, phase="both"), "phase"),
        (lambda: client.create_head("x", w, optimizer="lamb"), "optimizer.kind"),
        (lambda: client.create_head("x", w, optimizer={"kind": "adamw", "betas": (1.0, 0.9)}),
         "betas"),
        (lambda: client.create_head("x", w, optimizer={"lr": 1, "momentun": 0.9}), "momentun"),
        (lambda: client.create_head("x", w, optimizer="adamw", state={"exp_avg_w": w}),
         "missing exp_avg_sq_w"),
        (lambda: client.create_head("x", w, optimizer="sgd", state={"exp_avg_w": w}),
         "unexpected exp_avg_w"),
        (lambda: client.create_head("x", w[0]), "(V, H)"),
        (lambda: client.export_head(head, tensors=("master",)), "master"),
    ]
    for call, words in cases:
        with pytest.raises(lossd.InvalidArgumentError, match=None) as e:
            call()
        assert words in str(e.value), "%r not in %s" % (words, e.value)


def test_server_refusals_come_back_with_their_code(client, head):
    _, _, x, t = _data(6)
    with pytest.raises(lossd.FailedPreconditionError):
        client.step(head, 3)  # not the head's version
    with pytest.raises(lossd.NotFoundError):
        client.step("no-such-head", 0)
    with pytest.raises(lossd.InvalidArgumentError):
        client.compute(x[:, :5].copy(), None, t, head=head, head_version=0, micro_batch=0)


def test_a_server_without_the_feature_is_told(client):
    c = lossd.Client(client.target)
    try:
        c._features = ("0.0-old", frozenset({"list_state"}))
        w, _, x, t = _data(7)
        for call in (lambda: c.create_head("h", w),
                     lambda: c.compute(x, None, t, head="h", head_version=0, micro_batch=0),
                     lambda: c.step("h", 0), lambda: c.export_head("h"),
                     lambda: c.head_info("h"), lambda: c.drop_head("h")):
            with pytest.raises(lossd.UnimplementedError, match="hosted_head"):
                call()
    finally:
        c.close()


def test_ranks_that_disagree_are_all_refused_and_the_sum_is_kept(client, head):
    """The rank already waiting hears of the disagreement at once (not after the server's
    --head_step_timeout), as the rank that disagrees does; an agreed Step then applies the
    kept sum."""
    import threading

    _, _, x, t = _data(8)
    for r in range(2):
        client.compute(x, None, t, head=head, head_version=0, rank=r, micro_batch=0,
                       grad_scale=0.5)

    def rank0(got):
        try:
            got[0] = client.step(head, 0, rank=0, world_size=2, lr=0.1, timeout=60)
        except lossd.LossdError as e:
            got[0] = e

    def wait_for_rank0():
        deadline = time.monotonic() + 30
        while client.head_info(head).ranks_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)

    got = {}
    first = threading.Thread(target=rank0, args=(got,))
    first.start()
    wait_for_rank0()
    with pytest.raises(lossd.FailedPreconditionError, match="every rank of a step must agree"):
        client.step(head, 0, rank=1, world_size=2, lr=0.2)
    first.join(30)
    assert isinstance(got[0], lossd.FailedPreconditionError), got
    assert "lr 0.2" in str(got[0]) and "lr 0.1" in str(got[0]), got[0]
    assert client.head_info(head).contributions == 2
    got = {}
    first = threading.Thread(target=rank0, args=(got,))
    first.start()
    wait_for_rank0()
    got[1] = client.step(head, 0, rank=1, world_size=2, lr=0.1)
    first.join(30)
    assert got[0] == got[1] and got[1].applied and got[1].contributions == 2
