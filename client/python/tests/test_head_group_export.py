# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of a head group (docs/hosted_head.md "Head groups"), with three lossd processes
on 127.0.0.1: the export of a group's head is one whole export (the one-server format) that
any group size imports, S = 3 -> 2 -> 1 -> 3 continuing bit for bit as uninterrupted runs do;
RemoteHeadOptimizer.state_dict of a group's head; what a member writes as it drains."""

import os
import signal
import subprocess
import uuid

import numpy as np
import pytest

import lossd
from lossd.tensors import BF16Array
from lossd_servers import find_lossd_binary, free_port, run_all, start_lossd, wait_serving

MEMBERS, WORLD = 3, 6  # WORLD >= every S used, so each member serves a rank
V, H, BT = 37, 12, 9
TIMEOUT = "15s"  # --head_group_timeout


def _start(binary, port, log, *extra):
    return start_lossd(binary, port, log, "--head_group_address=127.0.0.1",
                       "--head_group_timeout=" + TIMEOUT, *extra)


_wait_serving = wait_serving
_all = run_all  # a group's members join together; a step's ranks meet at a barrier


class Members:
    """Three lossd processes; each may be stopped and started again on its port."""

    def __init__(self, d, extra=()):
        self.binary, self.dir, self.extra = find_lossd_binary(), d, extra
        self.addrs = ["127.0.0.1:%d" % free_port() for _ in range(MEMBERS)]
        self.procs, self.logs, self.clients = [None] * MEMBERS, [], [None] * MEMBERS
        for m in range(MEMBERS):
            self.start(m)
        for m in range(MEMBERS):
            _wait_serving(self.procs[m], self.addrs[m])
            self.clients[m] = lossd.Client(self.addrs[m], timeout=120.0)

    def start(self, m):
        self.logs.append(open(str(self.dir / ("member-%d.log" % m)), "ab"))
        port = int(self.addrs[m].rsplit(":", 1)[1])
        extra = [e.format(m=m) for e in self.extra]
        self.procs[m] = _start(self.binary, port, self.logs[-1], *extra)

    def close(self):
        for c in self.clients:
            if c is not None:
                c.close()
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in self.procs:
            if p is not None:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in self.logs:
            log.close()


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    g = Members(tmp_path_factory.mktemp("group_export"))
    try:
        if "hosted_head" not in g.clients[0].server_info().features:
            pytest.skip("this lossd does not list the hosted_head feature")
        yield g
    finally:
        g.close()


class Head:
    """A head on S of the members (S = 1: member 0 alone, no group)."""

    def __init__(self, g, name, S):
        self.g, self.name, self.S = g, name, S

    def client(self, rank):
        return self.g.clients[rank % self.S]

    def export(self, via=0):
        return self.g.clients[via].export_head(self.name)


def _new(g, S, make):
    """Creates (make(client, group)) a head on S members at once: returns a Head."""
    name = "h-%s" % uuid.uuid4().hex[:8]
    if S == 1:
        make(g.clients[0], name, None)
    else:
        gid = "g-%s" % uuid.uuid4().hex
        addrs = g.addrs[:S]
        _all([lambda m=m: make(g.clients[m], name, {"members": addrs, "member": m, "id": gid})
              for m in range(S)])
    return Head(g, name, S)


def _create(g, S, w, b, opt):
    return _new(g, S, lambda c, n, grp: c.create_head(n, w, b, optimizer=opt, group=grp))


def _import(g, S, export):
    return _new(g, S, lambda c, n, grp: c.import_head(export, n, group=grp))


def _data(k, r, mb):
    rng = np.random.default_rng(1000 * k + 10 * r + mb)
    return rng.standard_normal((BT, H)).astype(np.float32), rng.integers(0, V, BT)


def _run(head, first, last, ranks):
    """Steps [first, last): each rank in `ranks` sends two micro-batches, in order, to its
    member; then every rank of WORLD calls Step at once. Returns the losses, in order."""
    losses = []
    for k in range(first, last):
        for r in ranks:
            for mb in range(2):
                x, t = _data(k, r, mb)
                res = head.client(r).compute(x, None, t, head=head.name, head_version=k,
                                             rank=r, micro_batch=mb)
                losses.append(res.loss)
        got = _all([lambda r=r: head.client(r).step(head.name, k, rank=r, world_size=WORLD)
                    for r in range(WORLD)])
        assert all(s.version == k + 1 and s.applied for s in got)
    return losses


def _bits(a):
    a = np.asarray(a.bits if isinstance(a, BF16Array) else a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _same(e1, e2):
    """Two exports hold the same head bit for bit (version, optimizer step, every tensor)."""
    assert (e1.version, e1.optimizer_step) == (e2.version, e2.optimizer_step)
    assert sorted(e1.tensors) == sorted(e2.tensors)
    for n in e1.tensors:
        assert np.array_equal(_bits(e1.tensors[n]), _bits(e2.tensors[n])), n


def _start_state(seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((V, H)) * 0.4).astype(np.float32)
    b = rng.standard_normal(V).astype(np.float32)
    return w, b, lossd.OptimizerConfig.adamw(lr=0.01, weight_decay=0.1)


def test_a_group_export_imports_into_any_size_and_continues_bit_for_bit(members):
    """S = 3 -> export -> S = 2 -> export -> S = 1 -> export -> S = 3, two steps on each,
    against uninterrupted runs on S = 3, 2 and 1 for all eight steps. Only rank 0 computes
    (two micro-batches a step, summed in order on its member): the step's sum is then rank
    0's gradient whatever S (adding the other members' zeros is exact), so every S computes
    the same bits, and the chain must equal each uninterrupted run exactly: weights, optimizer
    state, compute copy and every loss. (With every rank computing, S changes the order of
    the sum, and runs of different S differ by fp32 rounding: the next test.)"""
    w, b, opt = _start_state(3)
    refs = {S: _create(members, S, w, b, opt) for S in (3, 2, 1)}
    ref_losses = {S: _run(h, 0, 8, [0]) for S, h in refs.items()}
    ref_exports = {S: h.export() for S, h in refs.items()}
    # Uninterrupted runs of each S agree (the premise above).
    assert ref_losses[3] == ref_losses[2] == ref_losses[1]
    _same(ref_exports[3], ref_exports[1])
    _same(ref_exports[2], ref_exports[1])

    head = _create(members, 3, w, b, opt)
    losses = _run(head, 0, 2, [0])
    for S, first in ((2, 2), (1, 4), (3, 6)):
        # Exported through a member other than 0 where there is one: each member's export
        # gathers every member's slices.
        e = head.export(via=min(1, head.S - 1))
        head = _import(members, S, e)
        _same(head.export(), e)  # import then export gives back every bit
        losses += _run(head, first, first + 2, [0])
    assert losses == ref_losses[3]
    _same(head.export(), ref_exports[3])


def test_every_rank_computing_continues_bit_for_bit_on_the_same_size(members):
    """Six ranks, each adding two micro-batches through its member, AdamW with a bias. On one
    S an export and an import into a new group continue exactly as the uninterrupted group
    (bit for bit: losses and the final export); an export imported into another S is that
    head bit for bit, from which that S continues."""
    w, b, opt = _start_state(5)
    ranks = list(range(WORLD))
    for S in (3, 2):
        ref = _create(members, S, w, b, opt)
        ref_losses = _run(ref, 0, 4, ranks)
        head = _create(members, S, w, b, opt)
        losses = _run(head, 0, 2, ranks)
        e = head.export(via=S - 1)
        moved = _import(members, 5 - S, e)  # 3 -> 2, 2 -> 3: the same head, bit for bit
        _same(moved.export(), e)
        head = _import(members, S, e)
        losses += _run(head, 2, 4, ranks)
        assert losses == ref_losses
        _same(head.export(), ref.export())


def test_state_dict_of_a_group_head(members):
    """RemoteHeadOptimizer.state_dict of a module on any member of a group is the group's
    whole export (the master as torch's (V, H) tensor)."""
    torch = pytest.importorskip("torch")
    import lossd.nn  # noqa: F401 -- torch is there
    w, b, opt = _start_state(9)
    head = _create(members, 3, w, b, opt)
    _run(head, 0, 1, [0, 1, 2])
    want = head.export()
    module = lossd.nn.RemoteLMHead(head.name, client=members.clients[2], rank=2,
                                   world_size=WORLD)
    sd = module.optimizer().state_dict()["lossd_head"]
    assert sd["version"] == 1 and sd["optimizer_step"] == 1
    for n, arr in want.tensors.items():
        got = sd["tensors"][n]
        assert tuple(got.shape) == np.asarray(arr).shape
        assert np.array_equal(got.numpy().view(np.uint32), _bits(arr)), n
    assert torch.equal(sd["tensors"]["master_w"], torch.from_numpy(np.asarray(want.tensors[
        "master_w"])))


def test_an_export_asked_of_one_member_only_fails_and_leaves_the_head(members):
    """The gather needs every member: asked of member 0 alone (a raw ExportHead, not the
    client's fan-out) it fails after --head_group_timeout naming the members that never
    joined; the head is unchanged and steps on, and an export then works."""
    w, b, opt = _start_state(11)
    head = _create(members, 3, w, b, opt)
    c = members.clients[0]
    with pytest.raises(lossd.DeadlineExceededError) as e:
        c._export_one(head.name, 0, None, 1 << 20, 0, None)
    msg = str(e.value)
    assert "ExportHead must reach every member at once" in msg, msg
    assert "1 (%s), 2 (%s) never joined" % (members.addrs[1], members.addrs[2]) in msg, msg
    assert "The head is unchanged; export again" in msg, msg
    _run(head, 0, 1, [0])
    assert head.export().version == 1


def test_each_member_writes_its_part_on_drain_and_never_rejoins(tmp_path):
    """With --head_export_dir, a group's member that drains (SIGTERM) writes its part (its
    slices of the master and the state) to <head>.member-<m>-of-3.lossd-head in its own
    folder. Started again, it imports no part (a member never rejoins a group, a part is no
    head) and keeps the file; lossd.head_files.read_head_files puts the three parts together
    into the head as it was, bit for bit, which a new group imports and steps on."""
    import lossd.head_files

    g = Members(tmp_path, extra=["--head_export_dir=%s" % (tmp_path / "export-{m}")])
    try:
        w, b, opt = _start_state(13)
        head = _create(g, 3, w, b, opt)
        _run(head, 0, 2, list(range(WORLD)))
        want = head.export()
        for p in g.procs:
            p.send_signal(signal.SIGTERM)
        for p in g.procs:
            assert p.wait(timeout=30) == 0
        parts = [str(tmp_path / ("export-%d" % m) / ("%s.member-%d-of-3.lossd-head" % (
            head.name, m))) for m in range(MEMBERS)]
        for m in range(MEMBERS):
            assert os.listdir(str(tmp_path / ("export-%d" % m))) == [os.path.basename(parts[m])]
            g.start(m)
        for m in range(MEMBERS):
            _wait_serving(g.procs[m], g.addrs[m])
            with pytest.raises(lossd.NotFoundError):
                g.clients[m].head_info(head.name)
            assert os.path.exists(parts[m])  # kept: not imported
        log = (tmp_path / "member-2.log").read_text(errors="replace")
        assert "is member 2's part (of 3) of head '%s'" % head.name in log
        assert "a member never rejoins a group" in log
        got = lossd.head_files.read_head_files(reversed(parts))
        assert (got.name, got.version, got.optimizer_step) == (head.name, 2, 2)
        assert sorted(got.tensors) == sorted(n for n in want.tensors if not
                                             n.startswith("copy_"))
        for n, arr in got.tensors.items():
            assert np.array_equal(_bits(arr), _bits(want.tensors[n])), n
        with pytest.raises(lossd.InvalidArgumentError) as e:
            lossd.head_files.read_head_files(parts[:2])
        assert "the parts of member(s) 2 are missing" in str(e.value)
        infos = g.clients[0].import_head_into_group(got, g.addrs[:2], "g-%s" % uuid.uuid4().hex)
        assert [i.group["member"] for i in infos] == [0, 1]
        moved = Head(g, head.name, 2)
        for m in range(2):  # these clients knew the head on the instances that stopped
            assert g.clients[m].head_info(head.name).group["members"] == g.addrs[:2]
        _same(moved.export(), want)
        _run(moved, 2, 3, list(range(WORLD)))
    finally:
        g.close()
