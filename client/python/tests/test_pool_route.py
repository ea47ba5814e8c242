# SPDX-License-Identifier: Apache-2.0
"""The replica pool's routing without servers: the hashing contract shared with the C++ client
(its test vectors), balance over many keys, what losing a replica moves, how targets are
read and resolved, and the options' validation."""

import collections
import logging

import pytest

import lossd
from lossd._pool_route import (Target, fnv1a64, order_after_loss, rendezvous_order, resolve,
                               score, splitmix64_finalize)

EPS = ["127.0.0.1:50051", "127.0.0.2:50051", "127.0.0.3:50051"]


def _short(order):
    return [e.split(":")[0].rsplit(".", 1)[1] for e in order]


def test_hash_parts_match_their_definitions():
    # FNV-1a 64 of "a" and splitmix64's finalizer of 0 and 1 (published values).
    assert fnv1a64(b"") == 0xcbf29ce484222325
    assert fnv1a64(b"a") == 0xaf63dc4c8601ec8c
    assert splitmix64_finalize(0) == 0
    assert splitmix64_finalize(1) == 0x5692161d100b05e5


def test_contract_vectors():
    assert score("head:lm", "127.0.0.1:50051") == 0xa7b6fac87c987dbf
    want = {"head:lm": "123", "acc:step-7": "312", "rank:0": "321", "rank:1": "132",
            "rank:2": "213", "weights:w0": "213"}
    for key, order in want.items():
        assert "".join(_short(rendezvous_order(key, EPS))) == order, key
    owners = collections.Counter(rendezvous_order("rank:%d" % i, EPS)[0] for i in range(10000))
    assert [owners[e] for e in EPS] == [3344, 3321, 3335]


def test_order_after_loss_begins_after_the_lost_replica_and_wraps():
    # The C++ client's vectors (rendezvous_test.cc): head:lm's order is 1 2 3, acc:step-7's
    # 3 1 2.
    assert _short(order_after_loss("head:lm", EPS, EPS[0])) == ["2", "3"]
    assert _short(order_after_loss("head:lm", EPS, EPS[1])) == ["3", "1"]
    assert _short(order_after_loss("head:lm", EPS, EPS[2])) == ["1", "2"]
    assert _short(order_after_loss("acc:step-7", EPS, EPS[2])) == ["1", "2"]
    assert _short(order_after_loss("acc:step-7", EPS, EPS[0])) == ["2", "3"]
    # A lost replica no longer listed keeps its place in the order: the same answer.
    assert _short(order_after_loss("head:lm", EPS[1:], EPS[0])) == ["2", "3"]
    assert _short(order_after_loss("head:lm", [EPS[0], EPS[2]], EPS[1])) == ["3", "1"]
    assert order_after_loss("head:lm", EPS[:1], EPS[0]) == []


@pytest.mark.parametrize("n_replicas", [3, 4, 8])
@pytest.mark.parametrize("kind", ["rank", "weights", "acc", "head"])
def test_balance_within_ten_percent(kind, n_replicas):
    eps = ["10.0.%d.%d:50051" % (i // 250, i % 250 + 1) for i in range(n_replicas)]
    n_keys = 1000 * n_replicas
    owners = collections.Counter(rendezvous_order("%s:%d" % (kind, i), eps)[0]
                                 for i in range(n_keys))
    even = n_keys / n_replicas
    worst = max(abs(owners[e] - even) / even for e in eps)
    assert worst <= 0.10, "%s keys over %d replicas: %s (worst %.1f%% off even)" % (
        kind, n_replicas, dict(owners), 100 * worst)


def test_losing_a_replica_moves_only_its_keys_to_their_next():
    eps = EPS + ["127.0.0.4:50051"]
    keys = ["acc:%d" % i for i in range(2000)]
    before = {k: rendezvous_order(k, eps) for k in keys}
    lost = eps[1]
    moved = 0
    for k in keys:
        after = rendezvous_order(k, [e for e in eps if e != lost])
        if before[k][0] == lost:
            moved += 1
            assert after[0] == before[k][1], k  # the next in its own order
        else:
            assert after[0] == before[k][0], k  # untouched
    assert 400 <= moved <= 600, moved  # about a quarter


def test_ties_go_to_the_smaller_endpoint(monkeypatch):
    import lossd._pool_route as route

    monkeypatch.setattr(route, "score", lambda key, ep: 7)
    assert route.rendezvous_order("k", ["b:1", "a:1", "c:1"]) == ["a:1", "b:1", "c:1"]


def test_targets():
    assert Target("127.0.0.2:1,127.0.0.1:2").fixed == ["127.0.0.2:1", "127.0.0.1:2"]
    assert Target(["[::1]:5", "10.0.0.1:6"]).fixed == ["[::1]:5", "10.0.0.1:6"]
    assert Target("10.0.0.1:7").fixed == ["10.0.0.1:7"] and not Target("10.0.0.1:7").resolves
    assert Target("dns:///svc.ns:50051").name == ("svc.ns", 50051)
    assert Target("svc:50051").name == ("svc", 50051)
    t = Target("dns:///svc:9")
    got = resolve(t, lambda host, port: ["10.0.0.2", "fd00::1", "10.0.0.2"])
    assert got == ["10.0.0.2:9", "[fd00::1]:9"]


@pytest.mark.parametrize("spec, words", [
    ("", "empty"), ("a:1,,b:2", "empty"), ("host", "host:port"), ("h:0", "port"),
    ("h:x", "port"), ("::1:5", "[addr]:port"), ("[::1]5", "[ipv6]:port"),
    ("a:1,a:1", "twice"), ("a:1,dns:///b:2", "stands alone"), (5, "string or a list"),
])
def test_bad_endpoints_are_refused_naming_the_field(spec, words):
    with pytest.raises(lossd.InvalidArgumentError) as e:
        lossd.ReplicaPool(spec)
    assert "endpoints" in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("kw, field", [
    (dict(rank=-1), "rank"), (dict(rank=1.5), "rank"), (dict(import_rank=-2), "import_rank"),
    (dict(resolve_interval=0), "resolve_interval"), (dict(probe_timeout=-1), "probe_timeout"),
    (dict(resolve_interval="x"), "resolve_interval"), (dict(resolver=3), "resolver"),
    (dict(clock="now"), "clock"), (dict(client_factory=1), "client_factory"),
    (dict(channel=object()), "channel"), (dict(target="x:1"), "target"),
])
def test_bad_options_are_refused_naming_the_field(kw, field):
    with pytest.raises(lossd.InvalidArgumentError) as e:
        lossd.ReplicaPool("127.0.0.1:1", **kw)
    assert e.value.message.startswith(field), e.value.message


def test_a_bad_resolver_answer_is_refused():
    with pytest.raises(lossd.InvalidArgumentError) as e:
        lossd.ReplicaPool("svc:1", resolver=lambda h, p: "10.0.0.1")
    assert "resolver" in str(e.value)
    with pytest.raises(lossd.InvalidArgumentError) as e:
        lossd.ReplicaPool("svc:1", resolver=lambda h, p: ["not-an-ip"])
    assert "not-an-ip" in str(e.value)
    with pytest.raises(lossd.UnavailableError) as e:
        lossd.ReplicaPool("svc:1", resolver=lambda h, p: [])
    assert "no replica" in str(e.value)


def test_resolution_periodic_with_an_injected_clock_and_resolver(caplog):
    """Replicas come and go with the resolver's answer, re-read once the interval has passed
    (channels open lazily: no server is needed to build the pool)."""
    now = [100.0]
    answer = [["10.1.0.1", "10.1.0.2"]]
    made = []

    def factory(address, **kw):
        made.append(address)
        return lossd.Client(address, **kw)

    with lossd.ReplicaPool("dns:///svc:7", resolver=lambda h, p: answer[0],
                           resolve_interval=10, clock=lambda: now[0],
                           client_factory=factory) as pool:
        assert pool.replicas() == ["10.1.0.1:7", "10.1.0.2:7"]
        answer[0] = ["10.1.0.2", "10.1.0.3"]
        now[0] += 9.5
        pool._maybe_resolve()
        assert pool.replicas() == ["10.1.0.1:7", "10.1.0.2:7"]  # not yet
        assert pool.stats().resolutions == 0
        now[0] += 1.0
        with caplog.at_level(logging.INFO, logger="lossd.pool"):
            pool._maybe_resolve()
        assert pool.replicas() == ["10.1.0.2:7", "10.1.0.3:7"]
        assert pool.stats().resolutions == 1
        assert made == ["10.1.0.1:7", "10.1.0.2:7", "10.1.0.3:7"]  # one client per address
        assert any("added ['10.1.0.3:7'], removed ['10.1.0.1:7']" in r.getMessage()
                   for r in caplog.records)
        assert pool.order("rank:0") == rendezvous_order("rank:0", ["10.1.0.2:7", "10.1.0.3:7"])
    with pytest.raises(lossd.ClientClosedError):
        pool.resolve()
