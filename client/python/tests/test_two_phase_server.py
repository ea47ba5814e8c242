# SPDX-License-Identifier: Apache-2.0
"""The two-phase log-prob through real lossd servers (CPU backend; skipped where a server lacks
the feature "logprob_two_phase"): compute(keep_ms=) and compute(ticket=) against the
one-phase call, tickets in List until their backward or their expiry, a hosted head's ticket,
a restarted server, a server that keeps none, and a ReplicaPool (the backward on the forward's
replica, and lossd.rl's one-phase call where it cannot be). test_rl_two_phase.py checks
lossd.rl's gradients on one server."""

import time

import numpy as np
import pytest

import lossd
from conftest import LossdProcess, assert_close
from lossd_servers import find_lossd_binary
from pool_cluster import HOSTS

torch = pytest.importorskip("torch")

from lossd import rl  # noqa: E402
from lossd.nn import LossdRuntime  # noqa: E402
from rl_torch_reference import as64, logprob_entropy  # noqa: E402
from test_rl_torch import expect_grads, ref_leaves  # noqa: E402

FEATURE = "logprob_two_phase"
BT, H, V = 24, 16, 40
_POLL_S = 0.02
_DEADLINE_S = 60.0


def needs_feature(client):
    if FEATURE not in client.server_info().features:
        pytest.skip("the server lacks the feature %s" % FEATURE)


def tickets_held(client):
    return {e.name: e for e in client.list_state() if e.kind == "ticket"}


def wait_until_gone(client, ticket):
    """Polls List until `ticket` is no longer held (its expiry: List drops what expired)."""
    deadline = time.monotonic() + _DEADLINE_S
    while ticket in tickets_held(client):
        assert time.monotonic() < deadline, "ticket %s still held after %.0f s" % (
            ticket, _DEADLINE_S)
        time.sleep(_POLL_S)


def problem(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) / 2).astype(np.float32)
    b = (rng.standard_normal(V) / 4).astype(np.float32)
    t = rng.integers(0, V, BT)
    t[5] = -100  # an ignored row
    up = rng.standard_normal((2, BT)).astype(np.float32)
    return x, w, b, t, up[0], up[1]


FWD = dict(kind="logprob", temperature=0.9, want_entropy=True, want_dx=False, want_dw=False,
           want_db=False)


def test_a_ticket_is_listed_until_its_backward_consumes_it(client):
    needs_feature(client)
    x, w, b, t, dlogp, dent = problem(201)
    before_ms = time.time() * 1000
    r = client.compute(x, w, t, bias=b, keep_ms=60_000, **FWD)
    assert r.ticket and r.logp.shape == (BT,) and r.entropy.shape == (BT,)
    # The server's clock is this machine's: the expiry is keep_ms from the forward.
    assert before_ms + 50_000 < r.ticket_expires_unix_ms < time.time() * 1000 + 70_000
    held = tickets_held(client)
    assert r.ticket in held and held[r.ticket].bytes >= x.nbytes + w.nbytes
    plain = client.compute(x, w, t, bias=b, **FWD)
    assert np.array_equal(r.logp, plain.logp) and np.array_equal(r.entropy, plain.entropy)

    got = client.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp,
                         dentropy=dent)
    one = client.compute(x, w, t, bias=b, kind="logprob", temperature=0.9, dlogp=dlogp,
                         dentropy=dent)
    for name in ("dx", "dw", "db"):
        assert np.array_equal(getattr(got, name), getattr(one, name)), name
    assert got.loss == one.loss and got.tokens == one.tokens == BT - 1
    assert r.ticket not in tickets_held(client)
    with pytest.raises(lossd.NotFoundError, match="consumed"):
        client.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp)


def test_an_expired_ticket_is_not_found(client):
    needs_feature(client)
    x, w, b, t, dlogp, _ = problem(211)
    r = client.compute(x, w, t, bias=b, keep_ms=1, **FWD)
    wait_until_gone(client, r.ticket)
    with pytest.raises(lossd.NotFoundError, match="expired"):
        client.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp)


def test_a_backward_at_other_options_is_refused(client):
    needs_feature(client)
    x, w, b, t, dlogp, _ = problem(221)
    r = client.compute(x, w, t, bias=b, keep_ms=60_000, **FWD)
    with pytest.raises(lossd.InvalidArgumentError, match="temperature"):
        client.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp,
                       temperature=0.5)
    got = client.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp,
                         temperature=0.9)  # the forward's is accepted
    assert got.dx.shape == (BT, H)


def test_a_server_that_keeps_no_tickets_has_the_one_phase_call_stand_in(client, tmp_path):
    needs_feature(client)  # the same binary: one without the feature lacks --max_tickets too
    srv = LossdProcess(find_lossd_binary(), str(tmp_path / "lossd.log"),
                       extra_flags=["--max_tickets=0"])
    try:
        with lossd.Client(srv.address, timeout=60) as c:
            needs_feature(c)
            x, w, t, g1, g2 = torch_problem(271)
            with pytest.raises(lossd.ResourceExhaustedError, match="max_tickets"):
                c.compute(x.detach(), w.detach(), t, keep_ms=1000, **FWD)
            runtime = LossdRuntime(client=c, cache_weights=True)
            ppo_backward(runtime, x, w, t, g1, g2)
            assert runtime.two_phase_counts["not_kept"] == 1
            assert runtime.two_phase_counts["one_phase"] == 1
            rx, rw = reference_grads(x.detach(), w.detach(), t, g1, g2, 1.2)
            expect_grads([("dx", x, rx), ("dw", w, rw)])
    finally:
        srv.stop()


def head_two_phase(c, name, seed):
    """On client or pool `c`: a hosted head, a forward that keeps against it and its backward
    by ticket with a step key, against the one-phase call with another key. Returns the
    backward's result."""
    x, w, b, t, dlogp, dent = problem(seed)
    info = c.create_head(name, w, b, optimizer="sgd")
    r = c.compute(x, None, t, head=name, head_version=info.version, keep_ms=60_000, **FWD)
    got = c.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp,
                    dentropy=dent, rank=0, micro_batch=0, want_dw=False, want_db=False)
    one = c.compute(x, None, t, head=name, head_version=info.version, rank=0, micro_batch=1,
                    kind="logprob", temperature=0.9, dlogp=dlogp, dentropy=dent, want_dw=False,
                    want_db=False)
    assert got.head_added and one.head_added and got.head_version == info.version
    assert np.array_equal(got.dx, one.dx)
    assert c.head_info(name).contributions == 2
    # The same key again, by a new ticket: answered, not added twice.
    r = c.compute(x, None, t, head=name, head_version=info.version, keep_ms=60_000, **FWD)
    again = c.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp,
                      dentropy=dent, rank=0, micro_batch=0, want_dw=False, want_db=False)
    assert not again.head_added and np.array_equal(again.dx, got.dx)
    assert c.head_info(name).contributions == 2
    c.drop_head(name)
    return got


def test_a_head_ticket_adds_to_the_heads_step_once(client):
    needs_feature(client)
    head_two_phase(client, "tp-head-1", 281)


def test_a_pools_head_ticket_goes_to_the_heads_replica(cluster):
    cluster.ensure_all()
    with _pool(cluster, rank=0) as pool:
        needs_feature(pool)
        name = next("tp-head-%d" % i for i in range(2, 100)
                    if pool.order("head:tp-head-%d" % i)[0] != pool.order("rank:0")[0])
        head_two_phase(pool, name, 291)
        assert not pool._tickets


def reference_grads(x, w, t, g1, g2, temperature):
    rx, rw = ref_leaves(x, w)
    rlogp, rent = logprob_entropy(rx, rw, None, t, temperature)
    (as64(g1) * rlogp + as64(g2) * rent).sum().backward()
    return rx, rw


def torch_problem(seed):
    x, w, _, t, g1, g2 = problem(seed)
    return (torch.from_numpy(x).requires_grad_(True), torch.from_numpy(w).requires_grad_(True),
            torch.from_numpy(t), torch.from_numpy(g1), torch.from_numpy(g2))


def ppo_backward(runtime, x, w, t, g1, g2, between=None, **kw):
    logp, entropy = rl.fused_linear_for_ppo(x, w, t, 1.2, runtime=runtime, **kw)
    if between is not None:
        between()
    (g1 * logp + g2 * entropy).sum().backward()


def _restartable_client(address):
    # A restart's new process is back within a second: retry connecting that soon, and wait.
    return lossd.Client(address, timeout=60, wait_for_ready=True, channel_options=[
        ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100)])


def test_a_restart_between_the_phases_falls_back_to_the_same_gradients(cluster):
    cluster.ensure_all()
    host = HOSTS[1]
    with _restartable_client(cluster.address(host)) as c:
        needs_feature(c)
        x, w, t, g1, g2 = torch_problem(231)
        runtime = LossdRuntime(client=c, cache_weights=True)
        ppo_backward(runtime, x, w, t, g1, g2, between=lambda: cluster.restart(host))
        assert runtime.two_phase_counts["gone"] == 1
        assert runtime.two_phase_counts["one_phase"] == 1
        x2, w2 = (a.detach().clone().requires_grad_(True) for a in (x, w))
        ppo_backward(runtime, x2, w2, t, g1, g2)  # the restarted server, by ticket
        assert runtime.two_phase_counts["two_phase"] == 1
        assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
        rx, rw = reference_grads(x.detach(), w.detach(), t, g1, g2, 1.2)
        expect_grads([("dx", x, rx), ("dw", w, rw)])


def _pool(cluster, rank=0):
    return lossd.ReplicaPool(cluster.target(), resolver=cluster.resolver, rank=rank,
                             probe_timeout=5, timeout=60)


@pytest.mark.parametrize("cache_weights, accumulator", [(False, None), (True, None),
                                                        (True, "tp-acc"), (False, "tp-acc2")])
def test_a_pool_sends_the_backward_to_the_forwards_replica(cluster, cache_weights,
                                                           accumulator):
    cluster.ensure_all()
    with _pool(cluster, rank=3) as pool:
        needs_feature(pool)
        runtime = LossdRuntime(client=pool, cache_weights=cache_weights,
                               accumulator=accumulator)
        x, w, t, g1, g2 = torch_problem(241)
        for _ in range(2):  # two micro-batches: the second finds the accumulator begun
            ppo_backward(runtime, x, w, t, g1, g2)
        assert runtime.two_phase_counts["two_phase"] == 2, runtime.two_phase_counts
        assert runtime.two_phase_counts["gone"] == 0 and not pool._tickets
        rx, rw = reference_grads(x.detach(), w.detach(), t, 2 * g1, 2 * g2, 1.2)
        if accumulator is not None:
            assert w.grad is None
            runtime.apply_accumulated_gradients(w)
            runtime.drop_accumulator()
        expect_grads([("dx", x, rx), ("dw", w, rw)])
        runtime.close()


def test_a_pools_backward_goes_to_the_forwards_replica_not_the_ranks(cluster):
    """Weights by name live on another replica than this rank's stateless calls: the forward
    goes to the weights, and so must the backward (it names no weights)."""
    cluster.ensure_all()
    with _pool(cluster, rank=0) as pool:
        needs_feature(pool)
        rank_home = pool.order("rank:0")[0]
        name = next("tp-w-%d" % i for i in range(100)
                    if pool.order("weights:tp-w-%d" % i)[0] != rank_home)
        x, w, b, t, dlogp, dent = problem(245)
        pw = pool.put_weights(w, b, name=name)
        r = pool.compute(x, pw, t, keep_ms=60_000, **FWD)
        assert pool.home(pw.key) != rank_home
        got = pool.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp,
                           dentropy=dent)
        one = pool.compute(x, pw, t, kind="logprob", temperature=0.9, dlogp=dlogp,
                           dentropy=dent)
        for field in ("dx", "dw", "db"):
            assert np.array_equal(getattr(got, field), getattr(one, field)), field
        assert got.instance == r.instance == one.instance and not pool._tickets
        with pytest.raises(lossd.NotFoundError, match="not taken through this pool"):
            pool.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp)
        pool.drop_weights(pw)


def test_a_pool_falls_back_where_the_ticket_cannot_be_reached(cluster):
    """The accumulator began on another replica than the rank's forwards go to; and then
    the forward's replica is killed between the phases. Either way the one-phase call
    stands in, with the same gradients."""
    cluster.ensure_all()
    with _pool(cluster, rank=0) as pool:
        needs_feature(pool)
        rank_home = pool.order("rank:0")[0]
        acc = next("tp-far-%d" % i for i in range(100)
                   if pool.order("acc:tp-far-%d" % i)[0] != rank_home)
        x, w, t, g1, g2 = torch_problem(251)
        h1, h2 = (torch.from_numpy(a) for a in problem(252)[4:])
        runtime = LossdRuntime(client=pool, cache_weights=False, accumulator=acc)
        ppo_backward(runtime, x, w, t, h1, h2, keep_ms=0)  # begins the accumulator
        assert pool.home("acc:" + acc) != rank_home
        ppo_backward(runtime, x, w, t, g1, g2)  # its ticket is on the rank's replica
        assert runtime.two_phase_counts["gone"] == 1, runtime.two_phase_counts
        runtime.apply_accumulated_gradients(w)
        runtime.drop_accumulator()
        # Both micro-batches of the same rows: the reference of the summed upstream gradients.
        rx, rw = reference_grads(x.detach(), w.detach(), t, g1 + h1, g2 + h2, 1.2)
        expect_grads([("dx", x, rx), ("dw", w, rw)])
        rx, rw = reference_grads(x.detach(), w.detach(), t, g1, g2, 1.2)

        plain = LossdRuntime(client=pool, cache_weights=False)
        x2, w2 = (a.detach().clone().requires_grad_(True) for a in (x, w))
        ppo_backward(plain, x2, w2, t, g1, g2,
                     between=lambda: cluster.kill(cluster.host_of(rank_home)))
        assert plain.two_phase_counts["gone"] == 1 and plain.two_phase_counts["one_phase"] == 1
        expect_grads([("dx", x2, rx), ("dw", w2, rw)])
    cluster.ensure_all()


def test_a_bf16_ticket_within_the_bf16_tolerance(client):
    """A bf16 forward's ticket, and its backward by ticket within bf16's tolerance of the
    float64 reference (the one tolerance table, conftest's)."""
    needs_feature(client)
    x, w, _, t, dlogp, dent = problem(261)
    xb, wb = lossd.bf16(lossd.float_to_bf16_bits(x)), lossd.bf16(lossd.float_to_bf16_bits(w))
    r = client.compute(xb, wb, t, keep_ms=60_000, **FWD)
    assert r.ticket in tickets_held(client)
    got = client.compute(None, None, None, kind="logprob", ticket=r.ticket, dlogp=dlogp,
                         dentropy=dent)
    x64 = torch.from_numpy(lossd.tensors.to_float64(xb)).requires_grad_(True)
    w64 = torch.from_numpy(lossd.tensors.to_float64(wb)).requires_grad_(True)
    rlogp, rent = logprob_entropy(x64, w64, None, torch.from_numpy(t), 0.9)
    (as64(dlogp) * rlogp + as64(dent) * rent).sum().backward()
    assert_close("logp", r.logp, rlogp.detach().numpy(), "bf16")
    assert_close("dx", got.dx, x64.grad.numpy(), "bf16")
    assert_close("dw", got.dw, w64.grad.numpy(), "bf16")
