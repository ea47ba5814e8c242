# SPDX-License-Identifier: Apache-2.0
"""The replica pool over three real lossd replicas (CPU backend) on 127.0.0.1-3 and one port,
named through an injected resolver: several trainers (ranks as threads, each with its own
pool, as separate processes would have) train with weights by handle, accumulators and one
hosted head shared by all ranks; one replica is SIGKILLed mid-step and another restarted
mid-step. Every trainer must finish with the losses and gradients of a single-server run,
nothing added twice, W re-uploaded once per moved handle, and the documented errors (redo
the step, import the head) where state was lost."""

import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
import lossd
from conftest import assert_close
from lossd._pool_route import rendezvous_order
from pool_cluster import HOSTS

R, S, M = 3, 4, 2  # ranks, steps, micro-batches a step
BT, H, V = 12, 8, 24
KILL_AT, RESTART_AT = (1, 1), (3, 1)  # (step, micro-batch) before which each event happens


def data(r, s, m):
    rng = np.random.default_rng([r, s, m, 7])
    x = rng.standard_normal((BT, H)).astype(np.float32)
    t = rng.integers(0, V, BT)
    t[3] = -100  # one ignored row
    return x, t


def weights(r, s):
    rng = np.random.default_rng([r, s, 11])
    return (rng.standard_normal((V, H)) / 3).astype(np.float32)


class Checkpoints:
    """The head's exports by version, as a trainer's checkpoint directory would hold them."""

    def __init__(self):
        self.cv = threading.Condition()
        self.by_version = {}

    def put(self, export):
        with self.cv:
            self.by_version[export.version] = export
            self.cv.notify_all()

    def get(self, version):
        with self.cv:
            assert self.cv.wait_for(lambda: version in self.by_version, timeout=120), version
            return self.by_version[version]


def names_for(prefix, r, salt):
    return dict(w="%s/w%d.%d" % (prefix, r, salt), wa="%s/wa%d.%d" % (prefix, r, salt),
                acc="%s/acc%d.%d" % (prefix, r, salt), head="%s/lm" % prefix)


class Trainer:
    """One rank's training loop, with the recovery the pool's errors ask for."""

    def __init__(self, pool, r, names, ckpt, hook):
        self.pool, self.r, self.n, self.ckpt, self.hook = pool, r, names, ckpt, hook
        self.out = {}
        self.recoveries = []

    def run(self):
        v = self.pool.head_info(self.n["head"]).version
        for s in range(S):
            w = weights(self.r, s)
            pw = self.pool.put_weights(w, name=self.n["w"])
            pwa = self.pool.put_weights(w, name=self.n["wa"], place=False)  # the acc's replica
            while True:
                try:
                    v_next = self.step(s, v, w, pw, pwa)
                    break
                except lossd.StepLostError as e:
                    assert e.accumulator == self.n["acc"] and "redo the step" in str(e)
                    self.recoveries.append(("step", s, e.replica))
                except lossd.HeadLostError as e:
                    assert e.head == self.n["head"] and e.import_rank == 0
                    assert "rank 0 should call import_head" in str(e)
                    self.recoveries.append(("head", s, e.replica))
                    info = self.pool.import_head(self.ckpt.get(v), self.n["head"])
                    assert info.version == v and info.instance
                # Redo the whole step: its partial sum (if any was added) goes first.
                self.pool.drop_accumulator(self.n["acc"])
            v = v_next
        return self

    def step(self, s, v, w, pw, pwa):
        pool, r, n = self.pool, self.r, self.n
        for m in range(M):
            self.hook(r, s, m)
            x, t = data(r, s, m)
            ev = pool.compute(x, w, t, want_dx=False, want_dw=False)  # stateless: by rank
            plain = pool.compute(x, pw, t)  # by the weights' name
            acc = pool.compute(x, pwa, t, accumulator=n["acc"])  # by the accumulator
            hd = pool.compute(x, None, t, head=n["head"], head_version=v, rank=r,
                              micro_batch=m, grad_scale=1.0 / R, want_dw=False, want_db=False)
            self.out[("mb", s, m)] = dict(
                eval=ev.loss, plain=(plain.loss, plain.dx, plain.dw), acc=(acc.loss, acc.dx),
                head=(hd.loss, hd.dx))
        g = pool.fetch_gradients(n["acc"], reset=True)
        assert g.micro_batches == M, "accumulator %s: %d micro-batches, %d sent" % (
            n["acc"], g.micro_batches, M)  # nothing added twice, nothing lost
        self.out[("acc", s)] = g.dw
        st = pool.step(n["head"], v, rank=r, world_size=R)
        assert st.contributions == R * M and st.applied, st
        if r == 0:
            self.ckpt.put(pool.export_head(n["head"], version=st.version))
        return st.version


def _create_head(pool, name):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((V, H)) / 3).astype(np.float32)
    b = (rng.standard_normal(V) / 10).astype(np.float32)
    pool.create_head(name, w, b, optimizer=lossd.OptimizerConfig.sgd(lr=0.5, momentum=0.9))


def _train(pools, names, hooks=None):
    ckpt = Checkpoints()
    _create_head(pools[0], names[0]["head"])
    ckpt.put(pools[0].export_head(names[0]["head"]))
    trainers = [Trainer(p, r, names[r], ckpt, hooks or (lambda *a: None))
                for r, p in enumerate(pools)]
    with ThreadPoolExecutor(len(trainers)) as ex:
        futs = [ex.submit(t.run) for t in trainers]
        # The first failure is the cause (the other ranks then wait in Step until their
        # deadline): raise that one.
        for f in as_completed(futs, timeout=600):
            if f.exception() is not None:
                if hooks is not None:
                    hooks.abort()
                raise f.exception()
    return trainers, ckpt


class Events:
    """Barriers all ranks meet at once, before (step, micro-batch) of KILL_AT and RESTART_AT;
    the last to arrive kills or restarts a replica while the others wait."""

    def __init__(self, actions):
        self.barriers = {at: threading.Barrier(R, action=fn) for at, fn in actions.items()}
        self.passed = set()

    def __call__(self, r, s, m):
        b = self.barriers.get((s, m))
        if b is not None and (r, s, m) not in self.passed:
            self.passed.add((r, s, m))  # a redone step passes on
            b.wait(timeout=300)

    def abort(self):
        for b in self.barriers.values():
            b.abort()


def _choose_salt(addresses, prefix):
    """Names that put state everywhere it matters: some rank's weights and accumulator on the
    replica killed (the head's) and some on the one restarted (the head's next)."""
    head = rendezvous_order(names_for(prefix, 0, 0)["head"], addresses)
    x, y = head[0], head[1]
    for salt in range(1000):
        firsts = {k: [] for k in ("w", "acc")}
        for r in range(R):
            n = names_for(prefix, r, salt)
            for k, key in (("w", "weights:" + n["w"]), ("acc", "acc:" + n["acc"])):
                order = rendezvous_order(key, addresses)
                firsts[k].append((order[0], order[1] if order[0] == x else order[0]))
        if all(any(a == x for a, _ in firsts[k]) and any(b == y for _, b in firsts[k])
               and not all(a == x for a, _ in firsts[k]) for k in firsts):
            return salt
    raise AssertionError("no salt puts state on both victims")


def _same(name, got, ref):
    assert np.array_equal(np.asarray(got), np.asarray(ref)), name


def test_trainers_survive_a_kill_and_a_restart(cluster, caplog):
    cluster.ensure_all()
    # The single-server run: the same trainers on one replica.
    ref_pools = [lossd.ReplicaPool(cluster.address(HOSTS[0]), rank=r, timeout=60)
                 for r in range(R)]
    ref_names = [names_for("ref", r, 0) for r in range(R)]
    ref, ref_ckpt = _train(ref_pools, ref_names)
    ref_final = ref_pools[0].export_head(ref_names[0]["head"])
    for p in ref_pools:
        p.close()

    salt = _choose_salt(cluster.addresses, "run")
    names = [names_for("run", r, salt) for r in range(R)]
    pools = [lossd.ReplicaPool(cluster.target(), resolver=cluster.resolver, rank=r,
                               probe_timeout=5, timeout=60) for r in range(R)]
    keys = [dict(w="weights:" + n["w"], acc="acc:" + n["acc"], head="head:" + n["head"],
                 rank="rank:%d" % r) for r, n in enumerate(names)]
    expected = [collections.Counter() for _ in range(R)]
    victims = {}

    def event(kind, act):
        def action():
            homes = {p.owner(keys[0]["head"]) for p in pools}
            assert len(homes) == 1, homes  # every rank's pool agrees where the head is
            victim = homes.pop()
            victims[kind] = victim
            for r, p in enumerate(pools):
                on = [k for k in ("w", "acc", "head", "rank") if p.owner(keys[r][k]) == victim]
                if kind == "restart":
                    on = [k for k in on if k != "rank"]  # stateless: stays on the live replica
                expected[r]["moves"] += len(on)
                expected[r]["reuploads"] += sum(k in on for k in ("w", "acc"))
                expected[r]["steps_lost"] += "acc" in on
                expected[r]["recoveries"] = expected[r]["recoveries"] or []
                s = KILL_AT[0] if kind == "kill" else RESTART_AT[0]
                expected[r]["recoveries"] += ([("step", s, victim)] if "acc" in on else []) + [
                    ("head", s, victim)]
            before = cluster.instance(cluster.host_of(victim)) if kind == "restart" else None
            act(cluster.host_of(victim))
            if before is not None:
                assert cluster.instance(cluster.host_of(victim)) != before
        return action

    hooks = Events({KILL_AT: event("kill", cluster.kill),
                    RESTART_AT: event("restart", cluster.restart)})
    with caplog.at_level(logging.INFO, logger="lossd.pool"):
        got, ckpt = _train(pools, names, hooks)
    assert victims["kill"] != victims["restart"]
    stats = [p.stats() for p in pools]
    final = pools[0].export_head(names[0]["head"])

    for r in range(R):
        for s in range(S):
            for m in range(M):
                a, b = got[r].out[("mb", s, m)], ref[r].out[("mb", s, m)]
                where = "rank %d step %d micro-batch %d" % (r, s, m)
                _same(where + " eval loss", a["eval"], b["eval"])
                for i, what in enumerate(("loss", "dx", "dw")):
                    _same("%s plain %s" % (where, what), a["plain"][i], b["plain"][i])
                for i, what in enumerate(("loss", "dx")):
                    _same("%s acc %s" % (where, what), a["acc"][i], b["acc"][i])
                # The head sums the ranks' gradients in arrival order: fp32 tolerance.
                assert_close(where + " head loss", np.float32(a["head"][0]),
                             np.float32(b["head"][0]), "fp32")
                assert_close(where + " head dx", a["head"][1], b["head"][1], "fp32")
            _same("rank %d step %d accumulated dW" % (r, s), got[r].out[("acc", s)],
                  ref[r].out[("acc", s)])
        st = stats[r]
        assert got[r].recoveries == expected[r]["recoveries"], (r, got[r].recoveries)
        assert (st.moves, st.reuploads, st.steps_lost, st.heads_lost) == (
            expected[r]["moves"], expected[r]["reuploads"], expected[r]["steps_lost"], 2), (
                r, st, expected[r])
        assert st.resolutions >= 1  # the kill's UNAVAILABLE re-resolved at once
        assert st.down == [victims["kill"]]
        assert all(st.calls[a] > 0 for a in cluster.addresses), st.calls
    assert sum(e["reuploads"] for e in expected) >= 2  # the salt put handles on both victims
    assert final.version == ref_final.version == S
    for t in ("master_w", "master_bias", "exp_avg_w", "exp_avg_bias"):
        assert_close("head " + t, final.tensors[t], ref_final.tensors[t], "fp32")
    # Each move and re-upload logged once.
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == "lossd.pool"]
    assert sum(" moved from " in m for m in msgs) == sum(s.moves for s in stats)
    assert sum(" re-uploaded to " in m for m in msgs) == sum(s.reuploads for s in stats)
    for p in pools:
        p.close()
