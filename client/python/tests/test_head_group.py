# SPDX-License-Identifier: Apache-2.0
"""A hosted head served by a group of three lossd processes (docs/hosted_head.md "Head
groups"): created on every member at once (each returns once all three have joined through
member 0's rendezvous), three trainer ranks each sending its Computes and Step to member
rank % 3, AdamW steps compared with a one-server head on member 0 fed the same Computes."""

import uuid

import numpy as np
import pytest

import lossd
from lossd_servers import (find_lossd_binary, free_port, run_all, start_lossd, stop_all,
                           wait_serving)

S, WORLD, STEPS = 3, 3, 3
# The engine's test holds the masters to 2 fp32 ulps of the largest value per step
# (engine/head_group_step_test); here the master is seen through dX = dlogits W, whose softmax
# and sum over V may grow a master's difference by a small factor, so dX gets 8 per step.
DX_ULPS_PER_STEP = 8
V, H, BT = 37, 12, 9


def _start(binary, port, log):
    return start_lossd(binary, port, log, "--head_group_address=127.0.0.1",
                       "--head_group_timeout=15s")


_wait_serving = wait_serving
_all = run_all  # a group's members join together; a step's ranks meet at a barrier


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    binary = find_lossd_binary()
    d = tmp_path_factory.mktemp("group")
    procs, addrs, logs = [], [], []
    try:
        for m in range(S):
            addrs.append("127.0.0.1:%d" % free_port())
            logs.append(open(str(d / ("member-%d.log" % m)), "wb"))
            procs.append(_start(binary, int(addrs[-1].rsplit(":", 1)[1]), logs[-1]))
        for p, a in zip(procs, addrs):
            _wait_serving(p, a)
        clients = [lossd.Client(a, timeout=120.0) for a in addrs]
        if "hosted_head" not in clients[0].server_info().features:
            pytest.skip("this lossd does not list the hosted_head feature")
        yield addrs, clients
        for c in clients:
            c.close()
    finally:
        stop_all(procs, logs=logs)


def _data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(np.float32)
    t = rng.integers(0, V, BT)
    return x, t


def _fp32_close(got, want, ulps_per_step, steps):
    """|got - want| within ulps_per_step * (steps + 1) fp32 spacings of want's largest value
    (the group sums its members' gradients in another order than one server does); returns
    the distance."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.spacing(np.float32(np.max(np.abs(want)))))
    worst = float(np.max(np.abs(got - want))) / scale
    assert worst <= ulps_per_step * (steps + 1), "%.1f ulps of max after %d steps" % (worst, steps)
    return worst


def test_a_group_of_three_matches_one_server(members):
    addrs, clients = members
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((V, H)) * 0.4).astype(np.float32)
    b = rng.standard_normal(V).astype(np.float32)
    opt = lossd.OptimizerConfig.adamw(lr=0.01, weight_decay=0.1)
    name, ref = "group-%s" % uuid.uuid4().hex[:8], "one-%s" % uuid.uuid4().hex[:8]
    gid = "g-%s" % uuid.uuid4().hex
    infos = _all([lambda m=m: clients[m].create_head(
        name, w, b, optimizer=opt, group={"members": addrs, "member": m, "id": gid})
        for m in range(S)])
    for m, info in enumerate(infos):
        assert info.created and info.version == 0
        assert info.group == {"members": addrs, "member": m, "id": gid}
    assert clients[1].head_info(name).group["member"] == 1
    clients[0].create_head(ref, w, b, optimizer=opt)

    worst = 0.0
    for k in range(STEPS + 1):
        for r in range(WORLD):
            x, t = _data(100 * k + r)
            g = clients[r % S].compute(x, None, t, head=name, head_version=k, rank=r,
                                       micro_batch=0)
            o = clients[0].compute(x, None, t, head=ref, head_version=k, rank=r, micro_batch=0)
            # The compute copy (fp32: the master, all-gathered) gives dX: it is W's twin.
            worst = max(worst, _fp32_close(g.dx, o.dx, DX_ULPS_PER_STEP, k))
            assert g.loss == pytest.approx(o.loss, rel=1e-5)
        if k == STEPS:
            break
        gs = _all([lambda r=r: clients[r % S].step(name, k, rank=r, world_size=WORLD)
                   for r in range(WORLD)])
        os_ = _all([lambda r=r: clients[0].step(ref, k, rank=r, world_size=WORLD)
                    for r in range(WORLD)])
        for g_res, o_res in zip(gs, os_):
            # The counts are the group's (pooled over the members), as one server's.
            assert (g_res.version, g_res.applied, g_res.contributions, g_res.tokens) == \
                   (o_res.version, o_res.applied, o_res.contributions, o_res.tokens)
            assert g_res.version == k + 1 and g_res.applied and g_res.contributions == WORLD
            assert g_res.grad_norm == pytest.approx(o_res.grad_norm, rel=1e-5)
            assert g_res.clip_coef == o_res.clip_coef
    print("group of %d vs one server: worst dX deviation %.2f ulps of max" % (S, worst))


def test_a_rank_sent_to_another_member_is_refused(members):
    addrs, clients = members
    w = np.ones((V, H), np.float32)
    name, gid = "misroute-%s" % uuid.uuid4().hex[:8], "g-%s" % uuid.uuid4().hex
    _all([lambda m=m: clients[m].create_head(
        name, w, optimizer="sgd", group={"members": addrs, "member": m, "id": gid})
        for m in range(S)])
    x, t = _data(1)
    with pytest.raises(lossd.FailedPreconditionError) as e:
        clients[0].compute(x, None, t, head=name, head_version=0, rank=1, micro_batch=0)
    assert "go to member 1 (%s, rank %% 3)" % addrs[1] in str(e.value)


def test_a_member_that_never_joins_is_named(members):
    addrs, clients = members
    w = np.ones((V, H), np.float32)
    name, gid = "absent-%s" % uuid.uuid4().hex[:8], "g-%s" % uuid.uuid4().hex
    # Members 0 and 1 only: member 2 is never asked. The timeout is the servers' (--head_group_timeout).
    with pytest.raises(lossd.DeadlineExceededError) as e:
        _all([lambda m=m: clients[m].create_head(
            name, w, optimizer="sgd", group={"members": addrs, "member": m, "id": gid})
            for m in range(2)])
    assert "never joined" in str(e.value) and "member 2 (%s)" % addrs[2] in str(e.value)
