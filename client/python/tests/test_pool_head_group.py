# SPDX-License-Identifier: Apache-2.0
"""A head group through lossd.ReplicaPool (docs/hosted_head.md "Head groups"): a pool of the
three lossd of test_head_group creates the head on every member at once, each rank's pool
sends its Computes and Steps to member rank % 3 of HeadInfo.group, and the results equal a
one-server head's fed the same Computes (test_head_group's tolerances). Also: RemoteLMHead
and RemoteHeadOptimizer over pools (state_dict through the group's export, load_state_dict
into a new group of the same members), a member answering "go to member" (raised, never resent
elsewhere), and a member SIGKILLed (HeadLostError naming it)."""

import signal
import uuid

import numpy as np
import pytest

import lossd
from lossd_servers import find_lossd_binary, free_port, stop_all
from test_head_group import (BT, DX_ULPS_PER_STEP, H, S, V, _all, _data, _fp32_close, _start,
                             _wait_serving, members)  # noqa: F401 (members: the fixture)

STEPS = 3


def _pools(addrs, world):
    return [lossd.ReplicaPool(addrs, rank=r, timeout=120.0) for r in range(world)]


def _close(pools):
    for p in pools:
        p.close()


@pytest.mark.parametrize("world", [3, 6])
def test_a_pool_routes_each_rank_to_its_member(members, world):
    addrs, clients = members
    rng = np.random.default_rng(11 + world)
    w = (rng.standard_normal((V, H)) * 0.4).astype(np.float32)
    b = rng.standard_normal(V).astype(np.float32)
    opt = lossd.OptimizerConfig.adamw(lr=0.01, weight_decay=0.1)
    name, ref = "pool-group-%s" % uuid.uuid4().hex[:8], "one-%s" % uuid.uuid4().hex[:8]
    gid = "g-%s" % uuid.uuid4().hex
    pools = _pools(addrs, world)
    try:
        info = pools[0].create_head(name, w, b, optimizer=opt,
                                    group={"members": addrs, "id": gid})
        assert info.created and info.group == {"members": addrs, "member": 0, "id": gid}
        for m in range(S):  # every member holds it, with its own index
            assert clients[m].head_info(name).group == {"members": addrs, "member": m,
                                                        "id": gid}
        clients[0].create_head(ref, w, b, optimizer=opt)
        worst = 0.0
        for k in range(STEPS + 1):
            for r in range(world):
                x, t = _data(1000 * world + 100 * k + r)
                g = pools[r].compute(x, None, t, head=name, head_version=k, rank=r,
                                     micro_batch=0)
                o = clients[0].compute(x, None, t, head=ref, head_version=k, rank=r,
                                       micro_batch=0)
                worst = max(worst, _fp32_close(g.dx, o.dx, DX_ULPS_PER_STEP, k))
                assert g.loss == pytest.approx(o.loss, rel=1e-5)
            if k == 0:
                # Each member added its own ranks' Computes only (r % 3 == m).
                for m in range(S):
                    assert clients[m].head_info(name).contributions == len(
                        range(m, world, S))
            if k == STEPS:
                break
            gs = _all([lambda r=r: pools[r].step(name, k, rank=r, world_size=world)
                       for r in range(world)])
            os_ = _all([lambda r=r: clients[0].step(ref, k, rank=r, world_size=world)
                        for r in range(world)])
            for g_res, o_res in zip(gs, os_):
                assert (g_res.version, g_res.applied, g_res.contributions, g_res.tokens) == \
                       (o_res.version, o_res.applied, o_res.contributions, o_res.tokens)
                assert g_res.version == k + 1 and g_res.contributions == world
                assert g_res.grad_norm == pytest.approx(o_res.grad_norm, rel=1e-5)
                assert g_res.clip_coef == o_res.clip_coef
        print("pool, group of %d, %d ranks vs one server: worst dX %.2f ulps of max" % (
            S, world, worst))
        # Rank r's compute and step went to member r % 3 only: the other members saw no call
        # of its pool beyond the head_info that found the head.
        for r in range(world):
            calls = pools[r].stats().calls
            mine = addrs[r % S]
            assert calls[mine] >= 2 * STEPS + 1, (r, calls)
            assert all(n <= 1 for a, n in calls.items() if a != mine), (r, calls)
        pools[0].drop_head(name)
        for c in clients:
            with pytest.raises(lossd.NotFoundError):
                c.head_info(name)
    finally:
        _close(pools)


def test_a_member_naming_another_is_raised_not_resent(members):
    addrs, clients = members
    w = np.random.default_rng(3).standard_normal((V, H)).astype(np.float32)
    name = "misroute-%s" % uuid.uuid4().hex[:8]
    pools = _pools(addrs, 2)
    try:
        pools[0].create_head(name, w, optimizer="sgd", group={"members": addrs})
        pools[1].head_info(name)  # learns the group
        # The pool's group made wrong (members in another order): rank 1 goes to addrs[2].
        with pools[1]._lock:
            g = pools[1]._head_groups[name]
            g["members"] = (addrs[0], addrs[2], addrs[1])
            i = g["instances"]
            g["instances"] = [i[0], i[2], i[1]]
        before = pools[1].stats().calls
        x, t = _data(5)
        with pytest.raises(lossd.FailedPreconditionError) as e:
            pools[1].compute(x, None, t, head=name, head_version=0, rank=1, micro_batch=0)
        msg = str(e.value)
        assert "this pool sent rank 1 to member 1 (%s)" % addrs[2] in msg
        assert "go to member 1 (%s, rank %% 3)" % addrs[1] in msg
        assert "head_info(%r)" % name in msg
        after = pools[1].stats().calls
        assert after[addrs[2]] == before[addrs[2]] + 1
        assert after[addrs[1]] == before[addrs[1]] and after[addrs[0]] == before[addrs[0]]
        # head_info learns the group again; the same call then goes to its member.
        assert pools[1].head_info(name).group["members"] == addrs
        r = pools[1].compute(x, None, t, head=name, head_version=0, rank=1, micro_batch=0)
        assert r.dx.shape == (BT, H)
    finally:
        _close(pools)


def test_group_arguments_are_checked(members):
    addrs, _ = members
    w = np.ones((V, H), np.float32)
    with lossd.ReplicaPool(addrs) as pool:
        with pytest.raises(lossd.InvalidArgumentError, match=r"group\['member'\]: a pool "):
            pool.create_head("x", w, group={"members": addrs, "member": 0})
        with pytest.raises(lossd.InvalidArgumentError,
                           match=r"group\['members'\]\[1\] '10.9.9.9:1' is not one of this "
                                 r"pool's replicas"):
            pool.create_head("x", w, group={"members": [addrs[0], "10.9.9.9:1"]})
        with pytest.raises(lossd.InvalidArgumentError, match="lists a member twice"):
            pool.create_head("x", w, group={"members": [addrs[0], addrs[0]]})
        with pytest.raises(lossd.InvalidArgumentError, match=r"unknown key\(s\) 'size'"):
            pool.create_head("x", w, group={"size": 3})


def test_remote_head_over_pools_matches_one_server(members):
    torch = pytest.importorskip("torch")
    import lossd.nn  # noqa: F401 (imports torch)
    addrs, clients = members
    world = 3
    rng = np.random.default_rng(21)
    w = torch.from_numpy((rng.standard_normal((V, H)) * 0.4).astype(np.float32))
    name, ref = "nn-group-%s" % uuid.uuid4().hex[:8], "nn-one-%s" % uuid.uuid4().hex[:8]
    pools = _pools(addrs, world)
    try:
        opt = lossd.OptimizerConfig.sgd(lr=0.1, momentum=0.9)
        kw = dict(optimizer=opt, world_size=world)
        heads = [lossd.nn.RemoteLMHead(name, w if r == 0 else None, client=pools[r], rank=r,
                                       group={"members": addrs} if r == 0 else None, **kw)
                 for r in range(world)]
        refs = [lossd.nn.RemoteLMHead(ref, w if r == 0 else None, client=clients[0], rank=r,
                                      **kw) for r in range(world)]
        assert heads[1].info.group["members"] == addrs
        opts = [h.optimizer() for h in heads]
        ref_opts = [h.optimizer() for h in refs]
        for k in range(STEPS):
            for r in range(world):
                x, t = _data(500 + 10 * k + r)
                hg = torch.from_numpy(x).requires_grad_()
                ho = torch.from_numpy(x.copy()).requires_grad_()
                lg, lo = heads[r](hg, torch.from_numpy(t)), refs[r](ho, torch.from_numpy(t))
                lg.backward()
                lo.backward()
                assert float(lg.detach()) == pytest.approx(float(lo.detach()), rel=1e-5)
                _fp32_close(hg.grad.numpy(), ho.grad.numpy(), DX_ULPS_PER_STEP, k)
            _all([lambda o=o: o.step() for o in opts])
            _all([lambda o=o: o.step() for o in ref_opts])
            assert [o.last_result.version for o in opts] == [k + 1] * world
            assert opts[0].last_result.grad_norm == pytest.approx(
                ref_opts[0].last_result.grad_norm, rel=1e-5)
        # state_dict through a pool: the group's export (asked of every member at once),
        # the master and momentum within the engine's 2 ulps of max per step of the
        # one-server head's.
        got, want = opts[1].state_dict()["lossd_head"], ref_opts[1].state_dict()["lossd_head"]
        assert got["version"] == want["version"] == STEPS and got["name"] == name
        for n in ("master_w", "exp_avg_w"):
            _fp32_close(got["tensors"][n].numpy(), want["tensors"][n].numpy(), 2, STEPS - 1)
        # load_state_dict of a one-server head's state imports it into a new group of the
        # same members; every rank then computes against it.
        sd = ref_opts[0].state_dict()
        old_id = heads[0].info.group["id"]
        opts[0].load_state_dict(sd)
        assert heads[0].info.group["members"] == addrs and heads[0].info.group["id"] != old_id
        for r in range(1, world):  # the other ranks attach again (their pools learn it)
            heads[r] = lossd.nn.RemoteLMHead(name, client=pools[r], rank=r, **kw)
            assert heads[r].info.group["id"] == heads[0].info.group["id"]
            assert heads[r].version == sd["lossd_head"]["version"]
        for r in range(world):
            x, t = _data(900 + r)
            lg = heads[r](torch.from_numpy(x), torch.from_numpy(t))
            lo = refs[r](torch.from_numpy(x), torch.from_numpy(t))
            assert float(lg.detach()) == pytest.approx(float(lo.detach()), rel=1e-5)
    finally:
        _close(pools)


def test_a_member_killed_is_named_and_nothing_is_resent(tmp_path):
    binary = find_lossd_binary()
    addrs = ["127.0.0.1:%d" % free_port() for _ in range(2)]
    logs = [open(str(tmp_path / ("m%d.log" % m)), "wb") for m in range(2)]
    procs = [_start(binary, int(a.rsplit(":", 1)[1]), log) for a, log in zip(addrs, logs)]
    pools = []
    try:
        for p, a in zip(procs, addrs):
            _wait_serving(p, a)
        pools = [lossd.ReplicaPool(addrs, rank=r, timeout=60.0, probe_timeout=1.0)
                 for r in range(2)]
        name = "killed-%s" % uuid.uuid4().hex[:8]
        w = np.random.default_rng(9).standard_normal((V, H)).astype(np.float32)
        info = pools[0].create_head(name, w, optimizer="sgd", group={"members": addrs})
        x, t = _data(8)
        for r in range(2):
            pools[r].compute(x, None, t, head=name, head_version=0, rank=r, micro_batch=0)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        before = pools[1].stats().calls[addrs[0]]
        with pytest.raises(lossd.HeadLostError) as e:
            pools[1].compute(x, None, t, head=name, head_version=0, rank=1, micro_batch=1)
        msg = str(e.value)
        assert "member 1 (%s) of its group %r is down" % (addrs[1], info.group["id"]) in msg
        assert "Import the head's last export into a new group" in msg
        assert e.value.replica == addrs[1] and e.value.head == name
        assert pools[1].stats().calls[addrs[0]] == before  # never sent to member 0
        assert pools[1].stats().heads_lost == 1
        with pytest.raises(lossd.HeadLostError, match="member 1"):
            pools[1].step(name, 0, rank=1, world_size=2)
    finally:
        _close(pools)
        stop_all(procs, logs=logs)  # the killed member is already gone: terminate skips it
