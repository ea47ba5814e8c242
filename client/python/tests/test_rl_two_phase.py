# SPDX-License-Identifier: Apache-2.0
"""lossd.rl's two-phase log-probs (keep_ms: the server keeps X under a ticket, backward sends
only dlogp and dentropy) against torch float64 autograd and against the one-phase form, and
each way back to the one-phase call: a ticket gone at backward, a retained graph's second
backward, a server that keeps none or refuses to, and an error that is not the ticket's.

Two backends as test_rl_torch.py's: "reference" (ReferenceClient: the float64 formulas
in-process, tickets as the contract says) and "server" (conftest's lossd; skipped where it
lacks the feature "logprob_two_phase"). test_two_phase_server.py has the server-only cases
(List, expiry, a restart, a replica pool)."""

import logging
import re

import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd import rl  # noqa: E402
from lossd.nn import LossdRuntime  # noqa: E402
from conftest import TOLERANCES  # noqa: E402
from rl_torch_reference import ReferenceClient, as64, logprob_entropy  # noqa: E402
from test_rl_torch import (B, H, S, V, expect_close, expect_grads, leaves,  # noqa: E402
                           ratios_away_from_bounds, ref_leaves)

FEATURE = "logprob_two_phase"


@pytest.fixture(params=["reference", "server"])
def backend(request):
    """(a LossdRuntime factory taking LossdRuntime's keywords, the ReferenceClient or None)."""
    if request.param == "reference":
        fake = ReferenceClient()
        return (lambda **kw: LossdRuntime(client=fake, cache_weights=False, **kw)), fake
    client = request.getfixturevalue("client")
    if FEATURE not in client.server_info().features:
        pytest.skip("the server lacks the feature %s" % FEATURE)
    return (lambda **kw: LossdRuntime(client=client, cache_weights=True, **kw)), None


def ticket_of(t):
    """The ticket held by the log-prob node behind `t` (None once used, or never taken)."""
    fn = t.grad_fn
    while not hasattr(fn, "ticket"):
        fn = fn.next_functions[0][0]
    return fn.ticket


def counts(runtime):
    return {k: v for k, v in runtime.two_phase_counts.items() if v}


def run_ppo(runtime, hidden, w, b, ids, temperature, g1, g2, keep_ms=rl.DEFAULT_KEEP_MS,
            between=None):
    """fused_linear_for_ppo, then backward of sum(g1 logp + g2 entropy); `between(logp)`
    runs in between. Returns (logp, entropy) detached."""
    logp, entropy = rl.fused_linear_for_ppo(hidden, w, ids, temperature, bias=b,
                                            runtime=runtime, keep_ms=keep_ms)
    if between is not None:
        between(logp)
    (g1 * logp + g2 * entropy).sum().backward()
    return logp.detach(), entropy.detach()


def fresh(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def inputs(seed, with_bias=True):
    hidden, w, b = leaves((B, S, H), (V, H), (V,), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, S), generator=g)
    g1, g2 = torch.randn(B, S, generator=g), torch.randn(B, S, generator=g)
    return hidden, w, (b if with_bias else None), ids, g1, g2


@pytest.mark.parametrize("with_bias, temperature", [(False, 1.0), (True, 0.7)])
def test_two_phase_equals_torch_and_the_one_phase_form(backend, with_bias, temperature):
    make, fake = backend
    hidden, w, b, ids, g1, g2 = inputs(101, with_bias)
    two = make()
    logp, entropy = run_ppo(two, hidden, w, b, ids, temperature, g1, g2)
    assert counts(two) == {"tickets": 1, "two_phase": 1}

    rx, rw, rb = ref_leaves(hidden.reshape(-1, H), w, b)
    rlogp, rent = logprob_entropy(rx, rw, rb, ids.reshape(-1), temperature)
    (as64(g1).reshape(-1) * rlogp + as64(g2).reshape(-1) * rent).sum().backward()
    expect_close("logp", logp, rlogp.detach())
    expect_close("entropy", entropy, rent.detach())
    expect_grads([("dx", hidden, rx), ("dw", w, rw), ("db", b, rb)])

    # The same upstream gradients in one phase: bit for bit the same values and gradients.
    one = make()
    h1, w1, b1 = fresh(hidden, w, b)
    logp1, entropy1 = run_ppo(one, h1, w1, b1, ids, temperature, g1, g2, keep_ms=0)
    assert counts(one) == {"one_phase": 1}
    assert torch.equal(logp1, logp) and torch.equal(entropy1, entropy)
    for name, a, c in (("dx", h1, hidden), ("dw", w1, w), ("db", b1, b)):
        assert (a is None) == (c is None), name
        if a is not None:
            assert torch.equal(a.grad, c.grad), name
    if fake is not None:  # the backward named the ticket and sent neither X nor W
        kept, by_ticket = fake.calls[0], fake.calls[1]
        assert kept["keep_ms"] == rl.DEFAULT_KEEP_MS and not kept["want_dx"]
        assert by_ticket["ticket"] and by_ticket["has_dlogp"]
        assert fake.tickets == {}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_each_dtype_within_its_tolerance_and_as_one_phase(backend, dtype):
    """X and W in each input dtype: within conftest's tolerance table of the float64
    reference of the same (rounded) inputs, and bit for bit the one-phase form's."""
    make, _ = backend
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    hidden, w, b, ids, g1, g2 = inputs(105)
    hidden, w, b = (t.detach().to(tdt).requires_grad_(True) for t in (hidden, w, b))
    runtime = make()
    logp, entropy = run_ppo(runtime, hidden, w, b, ids, 0.8, g1, g2)
    assert counts(runtime) == {"tickets": 1, "two_phase": 1}
    assert hidden.grad.dtype == tdt and w.grad.dtype == tdt and entropy.dtype == tdt
    rx, rw, rb = ref_leaves(hidden.reshape(-1, H), w, b)
    rlogp, rent = logprob_entropy(rx, rw, rb, ids.reshape(-1), 0.8)
    (as64(g1).reshape(-1) * rlogp + as64(g2).reshape(-1) * rent).sum().backward()
    tol = TOLERANCES[dtype]
    for name, got, want in (("logp", logp, rlogp.detach()), ("entropy", entropy, rent.detach()),
                            ("dx", hidden.grad, rx.grad), ("dw", w.grad, rw.grad),
                            ("db", b.grad, rb.grad)):
        expect_close(name, got, want, **tol)
    one = make()
    h1, w1, b1 = fresh(hidden, w, b)
    run_ppo(one, h1, w1, b1, ids, 0.8, g1, g2, keep_ms=0)
    for name, a, c in (("dx", h1, hidden), ("dw", w1, w), ("db", b1, b)):
        assert torch.equal(a.grad, c.grad), name


def test_a_clipped_ratio_loss_of_the_log_probs_backpropagates(backend):
    """PPO's clipped surrogate built in torch from the returned log-probs, with an entropy
    bonus: its gradient through the two phases equals float64 autograd's."""
    make, _ = backend
    runtime = make()
    hidden, w, b, ids, _, _ = inputs(111)
    g = torch.Generator().manual_seed(112)
    adv = torch.randn(B, S, generator=g)
    with torch.no_grad():
        cur, _ = logprob_entropy(as64(hidden).reshape(-1, H), as64(w), as64(b), ids.reshape(-1),
                                 0.9)
    old = (cur - torch.log(ratios_away_from_bounds(B * S, 0.2, 0.28, 113))).reshape(B, S)

    def surrogate(logp, entropy, old, adv):
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 0.8, 1.28)
        return -torch.min(ratio * adv, clipped * adv).mean() - 0.01 * entropy.mean()

    logp, entropy = rl.fused_linear_for_ppo(hidden, w, ids, 0.9, bias=b, runtime=runtime)
    loss = surrogate(logp, entropy.float(), old.float(), adv)
    loss.backward()
    assert counts(runtime) == {"tickets": 1, "two_phase": 1}

    rx, rw, rb = ref_leaves(hidden.reshape(-1, H), w, b)
    rlogp, rent = logprob_entropy(rx, rw, rb, ids.reshape(-1), 0.9)
    rloss = surrogate(rlogp.reshape(B, S), rent, old, as64(adv))
    rloss.backward()
    expect_close("loss", loss, rloss.detach())
    expect_grads([("dx", hidden, rx), ("dw", w, rw), ("db", b, rb)])


def drop_ticket(client, fake):
    """`between` for run_ppo: the ticket is gone before backward (the reference forgets it;
    a server, with keep_ms 1, lets it expire: waited for through List)."""
    def between(logp):
        ticket = ticket_of(logp)
        assert ticket
        if fake is not None:
            fake.tickets.pop(ticket)
        else:
            from test_two_phase_server import wait_until_gone
            wait_until_gone(client, ticket)
    return between


def test_a_ticket_gone_at_backward_falls_back_to_the_same_gradients(backend, caplog):
    make, fake = backend
    hidden, w, b, ids, g1, g2 = inputs(121)
    first = make()
    keep_ms = rl.DEFAULT_KEEP_MS if fake is not None else 1
    with caplog.at_level(logging.WARNING, logger="lossd.rl"):
        run_ppo(first, hidden, w, b, ids, 1.3, g1, g2, keep_ms=keep_ms,
                between=drop_ticket(first.client, fake))
        h2, w2, b2 = fresh(hidden, w, b)
        run_ppo(first, h2, w2, b2, ids, 1.3, g1, g2, keep_ms=keep_ms,
                between=drop_ticket(first.client, fake))
    assert counts(first) == {"tickets": 2, "gone": 2, "one_phase": 2}
    gone = [r for r in caplog.records if "ticket was gone at backward" in r.getMessage()]
    assert len(gone) == 1, "logged once per runtime, not per fallback"
    for a, c in ((h2, hidden), (w2, w), (b2, b)):
        assert torch.equal(a.grad, c.grad)
    # The same gradients as a two-phase backward that found its ticket.
    other = make()
    h3, w3, b3 = fresh(hidden, w, b)
    run_ppo(other, h3, w3, b3, ids, 1.3, g1, g2)
    assert counts(other) == {"tickets": 1, "two_phase": 1}
    for a, c in ((h3, hidden), (w3, w), (b3, b)):
        assert torch.equal(a.grad, c.grad)


def test_a_retained_graphs_second_backward_sends_x(backend):
    make, fake = backend
    runtime = make()
    hidden, w, b, ids, g1, g2 = inputs(131)
    logp, entropy = rl.fused_linear_for_ppo(hidden, w, ids, bias=b, runtime=runtime)
    loss = (g1 * logp + g2 * entropy).sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (hidden, w, b)]
    assert ticket_of(logp) is None  # used
    loss.backward()
    assert counts(runtime) == {"tickets": 1, "two_phase": 1, "one_phase": 1}
    for name, t, g in zip(("dx", "dw", "db"), (hidden, w, b), first):
        assert torch.equal(t.grad, 2 * g), name
    if fake is not None:
        assert fake.calls[-1]["ticket"] is None and fake.calls[-2]["ticket"]


def test_no_ticket_where_no_backward_can_follow(backend):
    make, fake = backend
    runtime = make()
    hidden, w, b, ids, _, _ = inputs(141)
    with torch.no_grad():
        a, _ = rl.fused_linear_for_ppo(hidden, w, ids, bias=b, runtime=runtime)
    c, _ = rl.fused_linear_for_ppo(hidden.detach(), w.detach(), ids, bias=b.detach(),
                                   runtime=runtime)
    assert torch.equal(a, c) and not c.requires_grad
    assert counts(runtime) == {}
    if fake is not None:
        assert [call["keep_ms"] for call in fake.calls] == [0, 0]


def test_a_frozen_head_gets_dx_alone_by_ticket(backend):
    make, _ = backend
    runtime = make()
    hidden, w, _, ids, g1, g2 = inputs(151, with_bias=False)
    w = w.detach()
    run_ppo(runtime, hidden, w, None, ids, 1.0, g1, g2)
    assert counts(runtime) == {"tickets": 1, "two_phase": 1} and w.grad is None
    rx = ref_leaves(hidden.reshape(-1, H))[0]
    rlogp, rent = logprob_entropy(rx, as64(w), None, ids.reshape(-1), 1.0)
    (as64(g1).reshape(-1) * rlogp + as64(g2).reshape(-1) * rent).sum().backward()
    expect_close("dx", hidden.grad, rx.grad)


def test_helpers_take_keep_ms_and_check_it():
    runtime = LossdRuntime(client=ReferenceClient(), cache_weights=False)
    hidden, w, _, ids, _, _ = inputs(161, with_bias=False)
    x2 = hidden.reshape(-1, H)
    lp = rl.logprobs_from_hidden(x2, w, ids.reshape(-1), runtime=runtime, keep_ms=5000)
    ent = rl.entropy_from_hidden(x2, w, runtime=runtime, keep_ms=0)
    sums = rl.linear_cross_entropy(x2, w, ids.reshape(-1), reduction="sum", runtime=runtime)
    (lp.sum() + ent.sum() + sums[0] + sums[1]).backward()
    assert [c["keep_ms"] for c in runtime.client.calls[:3]] == [5000, 0, rl.DEFAULT_KEEP_MS]
    assert counts(runtime) == {"tickets": 2, "two_phase": 2, "one_phase": 1}
    assert rl.LossdFusedLinearForPPO(runtime=runtime, keep_ms=0).keep_ms == 0
    for bad in (-5, 1.5, "60000"):
        with pytest.raises(lossd.InvalidArgumentError, match="keep_ms must be a whole number"):
            rl.fused_linear_for_ppo(hidden, w, ids, runtime=runtime, keep_ms=bad)
        with pytest.raises(lossd.InvalidArgumentError, match="keep_ms must be a whole number"):
            rl.LossdFusedLinearForPPO(runtime=runtime, keep_ms=bad)


class _Refusing(ReferenceClient):
    """A ReferenceClient whose keeping forwards, or backwards by ticket, raise `error`."""

    def __init__(self, error, when, **kw):
        super().__init__(**kw)
        self.error, self.when = error, when

    def compute(self, x, w, targets, **kw):
        if kw.get(self.when):
            raise self.error
        return super().compute(x, w, targets, **kw)


@pytest.mark.parametrize("make_client, event, message", [
    (lambda: ReferenceClient(features=()), "not_kept", "keeps no two-phase log-prob tickets"),
    (lambda: _Refusing(lossd.ResourceExhaustedError("the ticket store is full"), "keep_ms"),
     "not_kept", "would not keep a two-phase ticket \\(the ticket store is full\\)"),
    (lambda: _Refusing(lossd.FailedPreconditionError("issued by server instance 'a'"), "ticket"),
     "gone", "ticket was gone at backward \\(issued by server instance 'a'\\)"),
])
def test_the_one_phase_call_stands_in(make_client, event, message, caplog):
    runtime = LossdRuntime(client=make_client(), cache_weights=False)
    hidden, w, b, ids, g1, g2 = inputs(171)
    with caplog.at_level(logging.WARNING, logger="lossd.rl"):
        run_ppo(runtime, hidden, w, b, ids, 1.1, g1, g2)
    assert runtime.two_phase_counts[event] == 1 and runtime.two_phase_counts["one_phase"] == 1
    assert runtime.two_phase_counts["two_phase"] == 0
    assert any(r.name == "lossd.rl" and re.search(message, r.getMessage())
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    rx, rw, rb = ref_leaves(hidden.reshape(-1, H), w, b)
    rlogp, rent = logprob_entropy(rx, rw, rb, ids.reshape(-1), 1.1)
    (as64(g1).reshape(-1) * rlogp + as64(g2).reshape(-1) * rent).sum().backward()
    expect_grads([("dx", hidden, rx), ("dw", w, rw), ("db", b, rb)])


def test_after_a_refusal_forwards_keep_nothing_for_a_while():
    client = _Refusing(lossd.ResourceExhaustedError("the ticket store is full"), "keep_ms")
    runtime = LossdRuntime(client=client, cache_weights=False)
    hidden, w, b, ids, g1, g2 = inputs(175)
    run_ppo(runtime, hidden, w, b, ids, 1.0, g1, g2)  # refused: no call recorded
    run_ppo(runtime, *fresh(hidden, w, b), ids, 1.0, g1, g2)  # paused: not asked
    assert counts(runtime) == {"not_kept": 1, "one_phase": 2}
    assert [c["keep_ms"] for c in client.calls] == [0, 0, 0, 0]
    client.when = "never"  # the budget has room again, and the pause is over
    runtime.two_phase_paused_until = 0.0
    run_ppo(runtime, *fresh(hidden, w, b), ids, 1.0, g1, g2)
    assert counts(runtime) == {"not_kept": 1, "one_phase": 2, "tickets": 1, "two_phase": 1}


@pytest.mark.parametrize("error", [lossd.InternalError("boom"), lossd.UnavailableError("down"),
                                   lossd.ClientClosedError("closed")])
def test_other_errors_at_backward_propagate(error):
    """Only a ticket that is gone has the one-phase call stand in."""
    runtime = LossdRuntime(client=_Refusing(error, "ticket"), cache_weights=False)
    hidden, w, b, ids, g1, g2 = inputs(181)
    with pytest.raises(type(error), match=error.message):
        run_ppo(runtime, hidden, w, b, ids, 1.0, g1, g2)
    assert counts(runtime) == {"tickets": 1}
    assert hidden.grad is None


def test_an_accumulator_gets_dw_by_ticket(backend):
    make, fake = backend
    if fake is not None:
        pytest.skip("accumulators live on a server")
    runtime = make(accumulator=True, grad_scale=0.5)
    hidden, w, _, ids, g1, g2 = inputs(191, with_bias=False)
    run_ppo(runtime, hidden, w, None, ids, 1.0, g1, g2)
    assert counts(runtime) == {"tickets": 1, "two_phase": 1} and w.grad is None
    runtime.apply_accumulated_gradients(w)
    rx, rw = ref_leaves(hidden.reshape(-1, H), w)
    rlogp, rent = logprob_entropy(rx, rw, None, ids.reshape(-1), 1.0)
    # grad_scale scales what goes to the server: dX comes back halved too.
    (0.5 * (as64(g1).reshape(-1) * rlogp + as64(g2).reshape(-1) * rent).sum()).backward()
    expect_close("dx", hidden.grad, rx.grad)
    expect_close("dw", w.grad, rw.grad)
    runtime.drop_accumulator()
    runtime.close()

