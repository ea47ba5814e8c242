# SPDX-License-Identifier: Apache-2.0
"""lossd.pipeline.Pipeline against the synchronous loop it replaces, on the CPU backend: the
backbone's gradients (and the loss mode's dW, db) bit for bit those of RemoteLMHead's and
lossd.nn's synchronous paths at depth 1, 2 and 3, with a GradScaler and under bf16 autocast;
the hosted head's step bit for bit with its calls in order (max_in_flight 1) and to fp32
rounding with two in flight; that the schedule overlaps (the trunk's forward of k+1 runs
while k's head call is in flight: a gate a synchronous loop would never open); and the
refusals. Skipped where torch is not installed or the server has no hosted heads."""

import threading

import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd.nn import LossdFusedLinearCrossEntropyLoss, RemoteLMHead  # noqa: E402
from lossd.pipeline import Pipeline  # noqa: E402
from head_harness import made_heads, make_head  # noqa: E402

V, H, B, T, M = 53, 16, 2, 7, 4  # T * B = 14 rows a micro-batch, nothing a multiple of 8


@pytest.fixture
def heads(client):
    yield from made_heads(client)


class Trunk(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(V, H)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(),
                                       torch.nn.Linear(2 * H, H))
        self.norm = torch.nn.LayerNorm(H)

    def forward(self, ids):
        h = self.emb(ids)
        return self.norm(h + self.mlp(h))


def micro_batches(seed, m=M):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        ids = torch.randint(0, V, (B, T), generator=g)
        labels = torch.randint(0, V, (B, T), generator=g)
        labels[0, 0] = -100  # an ignored token
        out.append((ids, labels))
    return out


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def assert_bitwise(got, want):
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), (
            n, float((got[n].double() - want[n].double()).abs().max()))


def _hosted(client, heads, tag, w, b, **kw):
    return RemoteLMHead(heads.name(tag), w, b, client=client,
                        optimizer=lossd.OptimizerConfig.sgd(lr=0.1, momentum=0.9), **kw)


def _sync_hosted(trunk, head, mbs, s):
    losses = []
    for ids, labels in mbs:
        loss = head(trunk(ids), labels, loss_scale=s)
        (loss * s).backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_hosted_head_gives_the_synchronous_gradients(client, lossd_server, heads, depth):
    w, b = make_head(3, v=V, h=H)
    ordered = lossd.Client(lossd_server.address, max_in_flight=1)
    ref_trunk, trunk = Trunk(), Trunk()
    ref_head = _hosted(client, heads, "sync", w, b)
    head = _hosted(ordered, heads, "pipe", w, b)
    mbs = micro_batches(depth)
    ref_losses = _sync_hosted(ref_trunk, ref_head, mbs, 1.0 / M)
    pipe = Pipeline(head, depth=depth)
    losses = pipe.accumulate(mbs, lambda mb: (trunk(mb[0]), mb[1]))
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    assert all(not x.requires_grad for x in losses)
    assert_bitwise(grads(trunk), grads(ref_trunk))
    # The step: every micro-batch once, under the same keys, summed in the same order (the
    # client sends one call at a time here): the same master weight, bit for bit.
    for h in (ref_head, head):
        h.optimizer().step()
        assert h.optimizer().last_result.contributions == M
    assert torch.equal(head.weight(), ref_head.weight())
    ordered.close()


def test_two_head_calls_in_flight_sum_the_step_to_rounding(client, lossd_server, heads):
    w, b = make_head(4, v=V, h=H)
    two = lossd.Client(lossd_server.address, max_in_flight=2)
    ref_trunk, trunk = Trunk(), Trunk()
    ref_head, head = _hosted(client, heads, "sync", w, b), _hosted(two, heads, "pipe", w, b)
    mbs = micro_batches(11, m=6)
    _sync_hosted(ref_trunk, ref_head, mbs, 1.0 / 6)
    Pipeline(head, depth=2).accumulate(mbs, lambda mb: (trunk(mb[0]), mb[1]))
    assert_bitwise(grads(trunk), grads(ref_trunk))
    for h in (ref_head, head):
        h.optimizer().step()
    # The server sums a step's Computes in arrival order (docs/hosted_head.md): two in flight
    # may arrive swapped, a different fp32 rounding of the same sum.
    got, want = head.weight(), ref_head.weight()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), float((got - want).abs().max())
    two.close()


def _loss_module(client, **kw):
    return LossdFusedLinearCrossEntropyLoss(client=client, **kw)


def _sync_loss(trunk, lm, loss_fn, mbs, s, scaler=None):
    losses = []
    for ids, labels in mbs:
        loss = loss_fn(lm.weight, trunk(ids), labels, lm.bias)
        scaled = loss * s
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        losses.append(loss.detach())
    return losses


def _models(dtype=torch.float32):
    trunk = Trunk(1).to(dtype)
    torch.manual_seed(2)
    lm = torch.nn.Linear(H, V).to(dtype)
    return trunk, lm


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("case", ["fp32", "label_smoothing_softcap", "grad_scaler",
                                  "bf16_autocast"])
def test_loss_mode_gives_lossd_nn_synchronous_gradients(client, depth, case):
    kw = dict(label_smoothing=0.1, softcap=15.0) if case == "label_smoothing_softcap" else {}
    ref_trunk, ref_lm = _models()
    trunk, lm = _models()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if case == "grad_scaler" else None
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    ref_fn, fn = _loss_module(client, **kw), _loss_module(client, **kw)
    mbs = micro_batches(20 + depth, m=3)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16_autocast")
    with autocast:
        ref_losses = _sync_loss(ref_trunk, ref_lm, ref_fn, mbs, 1.0 / 3, ref_scaler)
    pipe = Pipeline(fn, weight=lm.weight, bias=lm.bias, depth=depth, scaler=scaler)
    with autocast:
        losses = pipe.accumulate(mbs, lambda mb: (trunk(mb[0]), mb[1]))
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    assert_bitwise(grads(trunk), grads(ref_trunk))
    assert_bitwise(grads(lm), grads(ref_lm))
    # Clipping sees the same gradients, so it clips them alike.
    params = list(trunk.parameters()) + list(lm.parameters())
    ref_params = list(ref_trunk.parameters()) + list(ref_lm.parameters())
    if scaler is not None:
        for s, o in ((scaler, torch.optim.SGD(params, lr=0.1)),
                     (ref_scaler, torch.optim.SGD(ref_params, lr=0.1))):
            s.unscale_(o)
    n1 = torch.nn.utils.clip_grad_norm_(params, 0.5)
    n2 = torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
    assert torch.equal(n1, n2)
    for p, q in zip(params, ref_params):
        assert torch.equal(p.grad, q.grad)
    ref_fn.release()
    fn.release()


def test_the_trunk_forward_of_k_plus_1_runs_while_ks_head_call_is_in_flight(client, heads):
    """Head call k waits (up to 30 s) for the trunk to start micro-batch k+1's forward: a
    pipeline opens that gate at once; a synchronous loop would leave every call waiting out
    the whole 30 s (and the test says so)."""
    w, b = make_head(5, v=V, h=H)
    head = _hosted(client, heads, "gate", w, b)
    trunk = Trunk()
    mbs = micro_batches(30)
    started = [threading.Event() for _ in mbs]  # forward k has started
    opened = []
    plain = head.head_compute

    def gated(x2, t1, opts, key, **kw):
        if key + 1 < len(mbs):
            opened.append((key, started[key + 1].wait(30)))
        return plain(x2, t1, opts, key, **kw)

    head.head_compute = gated

    def forward(mb):
        k = next(i for i, m in enumerate(mbs) if m is mb)
        started[k].set()
        return trunk(mb[0]), mb[1]

    Pipeline(head, depth=2).accumulate(mbs, forward)
    assert sorted(opened) == [(k, True) for k in range(len(mbs) - 1)]


def test_a_failed_head_call_raises_its_error_after_the_others_end(client, heads):
    w, b = make_head(6, v=V, h=H)
    head = _hosted(client, heads, "fail", w, b)
    trunk = Trunk()
    mbs = micro_batches(40)
    mbs[2] = (mbs[2][0], torch.full((B, T), V + 3))  # a label past V: the server refuses it
    with pytest.raises(lossd.InvalidArgumentError) as e:
        Pipeline(head, depth=3).accumulate(mbs, lambda mb: (trunk(mb[0]), mb[1]))
    assert e.value.request_id and "target" in e.value.message.lower()
    # The micro-batches before it were added, and none is left running.
    assert head.client.head_info(head.name).contributions >= 2


def test_refusals(client, heads):
    w, b = make_head(7, v=V, h=H)
    head = _hosted(client, heads, "refuse", w, b)
    with pytest.raises(lossd.InvalidArgumentError, match="depth must be an integer >= 1"):
        Pipeline(head, depth=0)
    with pytest.raises(lossd.InvalidArgumentError, match="weight, bias: a hosted head"):
        Pipeline(head, weight=torch.zeros(V, H))
    with pytest.raises(lossd.InvalidArgumentError, match="scaler: a hosted head scales"):
        Pipeline(head, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(lossd.InvalidArgumentError, match="head must be a lossd.nn"):
        Pipeline(torch.nn.Linear(H, V))
    with pytest.raises(lossd.InvalidArgumentError, match="ddp must be a torch"):
        Pipeline(head, ddp=torch.nn.Linear(H, V))
    deferred = RemoteLMHead(head.name, client=client, deferred=True)
    with pytest.raises(lossd.FailedPreconditionError, match="deferred"):
        Pipeline(deferred)
    fn = _loss_module(client)
    with pytest.raises(lossd.InvalidArgumentError, match="weight: a LossdFused"):
        Pipeline(fn)
    with pytest.raises(lossd.FailedPreconditionError, match="reduction 'none'"):
        Pipeline(_loss_module(client, reduction="none"), weight=torch.zeros(V, H))
    with pytest.raises(lossd.FailedPreconditionError, match="server accumulator"):
        Pipeline(_loss_module(client, accumulator="acc-pipe"), weight=torch.zeros(V, H))
    pipe = Pipeline(head)
    with pytest.raises(lossd.InvalidArgumentError, match="micro_batches is empty"):
        pipe.accumulate([], lambda mb: mb)
    with pytest.raises(lossd.InvalidArgumentError, match="loss_scale must be finite"):
        pipe.accumulate([1], lambda mb: mb, loss_scale=float("nan"))
    with torch.no_grad(), pytest.raises(lossd.FailedPreconditionError, match="grad enabled"):
        pipe.accumulate([1], lambda mb: mb)
    with pytest.raises(lossd.InvalidArgumentError, match="labels shape"):
        pipe.accumulate([1], lambda mb: (torch.zeros(3, H), torch.zeros(4, dtype=torch.long)))
    head.eval()
    with pytest.raises(lossd.FailedPreconditionError, match="eval mode"):
        pipe.accumulate([1], lambda mb: (torch.zeros(3, H), torch.zeros(3, dtype=torch.long)))
    assert client.head_info(head.name).contributions == 0  # every refusal sent nothing


def test_over_a_replica_pool(client, lossd_server, heads):
    """The head's calls go through a ReplicaPool's compute_async (routed by the head, as its
    compute is): the same gradients as the synchronous loop on a plain client."""
    w, b = make_head(8, v=V, h=H)
    with lossd.connect_pool(lossd_server.address) as pool:
        ref_trunk, trunk = Trunk(), Trunk()
        ref_head = _hosted(client, heads, "sync", w, b)
        head = _hosted(pool, heads, "pool", w, b)
        mbs = micro_batches(50)
        ref_losses = _sync_hosted(ref_trunk, ref_head, mbs, 1.0 / M)
        losses = Pipeline(head, depth=2).accumulate(mbs, lambda mb: (trunk(mb[0]), mb[1]))
        assert [float(x) for x in losses] == [float(x) for x in ref_losses]
        assert_bitwise(grads(trunk), grads(ref_trunk))
        head.optimizer().step()
        assert head.optimizer().last_result.contributions == M


def test_a_head_call_retried_in_flight_is_added_once(client, lossd_server, heads):
    """A call whose reply is lost (UNAVAILABLE after the server added it) is sent again from
    the client's call thread under the same key: the server answers but adds nothing, and the
    backbone's gradients are the synchronous loop's."""
    w, b = make_head(9, v=V, h=H)
    lossy_client = lossd.Client(lossd_server.address, max_in_flight=2)
    real = lossy_client.compute
    answers = []
    lock = threading.Lock()

    def lossy(*args, **kw):
        r = real(*args, **kw)
        with lock:
            answers.append((kw["micro_batch"], r.head_added))
            lose = kw["micro_batch"] == 1 and len([a for a in answers if a[0] == 1]) == 1
        if lose:
            raise lossd.UnavailableError("reply lost", method="Compute")
        return r

    lossy_client.compute = lossy
    ref_trunk, trunk = Trunk(), Trunk()
    ref_head = _hosted(client, heads, "sync", w, b)
    head = _hosted(lossy_client, heads, "retry", w, b)
    mbs = micro_batches(60)
    _sync_hosted(ref_trunk, ref_head, mbs, 1.0 / M)
    Pipeline(head, depth=2).accumulate(mbs, lambda mb: (trunk(mb[0]), mb[1]))
    assert sorted(a for a in answers if a[0] == 1) == [(1, False), (1, True)]
    assert len(answers) == M + 1
    assert_bitwise(grads(trunk), grads(ref_trunk))
    assert client.head_info(head.name).contributions == M
    lossy_client.close()
