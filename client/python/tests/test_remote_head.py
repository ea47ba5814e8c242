# SPDX-License-Identifier: Apache-2.0
"""lossd.nn.RemoteLMHead and RemoteHeadOptimizer against a local torch head: K steps with 2-3
simulated data-parallel ranks (threads, one head), after each step the server's master,
optimizer state and compute copy against torch.optim.SGD / AdamW (foreach=False,
fused=False) applied to the summed gradient, and every rank's dX against torch's autograd.
Skipped where torch is not installed or the server has no hosted heads."""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd.nn import RemoteLMHead  # noqa: E402
from conftest import BACKEND, assert_close, assert_scalar  # noqa: E402
from head_harness import (  # noqa: E402
    Reference,
    Turns,
    assert_matches_reference,
    make_batch,
    made_heads,
    make_head,
    rank_modules,
    run_ranks,
    shadow_gradient,
)
from torch_reference import torch_reference  # noqa: E402

OPTIMIZERS = {
    "sgd": lossd.OptimizerConfig.sgd(lr=0.05),
    "sgd-momentum-nesterov-wd": lossd.OptimizerConfig.sgd(
        lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, bias_weight_decay=0.001),
    "sgd-momentum-dampening": lossd.OptimizerConfig.sgd(lr=0.05, momentum=0.8,
                                                        dampening=0.25),
    "adamw": lossd.OptimizerConfig.adamw(lr=0.01, weight_decay=0.05, bias_weight_decay=0.0),
    "adamw-amsgrad": lossd.OptimizerConfig.adamw(lr=0.02, betas=(0.8, 0.95), eps=1e-6,
                                                 weight_decay=0.1, amsgrad=True,
                                                 bias_weight_decay=0.01),
}
STEPS, MICRO = 4, 2


@pytest.fixture
def heads(client):
    yield from made_heads(client)


def _train(client, heads, cfg, world, dtype="fp32", steps=STEPS, micro=MICRO, seed=0,
           lr_schedule=None):
    """Trains one head with `world` ranks and a local torch head beside it; returns the worst
    ulp distance seen."""
    name = heads.name("train")
    w, b = make_head(seed)
    info = client.create_head(name, w, b, optimizer=cfg, compute_dtype=dtype)
    assert info.created and info.version == 0 and info.compute_dtype == dtype
    mods = rank_modules(client, name, world)
    opts = [m.optimizer() for m in mods]
    scheds = ([torch.optim.lr_scheduler.LambdaLR(o, lr_schedule) for o in opts]
              if lr_schedule else None)
    ref = Reference(w, b, cfg)
    exp = client.export_head(name)
    worst = (0.0, 0)
    for k in range(steps):
        batches = {(r, i): make_batch(1000 * seed + 100 * k + 10 * r + i, dtype)
                   for r in range(world) for i in range(micro)}
        order = [(r, i) for r in range(world) for i in range(micro)]
        turns = Turns()

        def rank(r):
            got = []
            for i in range(micro):
                turns.wait(order.index((r, i)))
                x, t = batches[(r, i)]
                x = x.clone().requires_grad_()
                loss = mods[r](x, t)
                loss.backward()
                turns.done()
                got.append((float(loss.detach()), x.grad))
            opts[r].step()
            return got, opts[r].last_result

        out = run_ranks(world, rank)
        results = [o[1] for o in out]
        assert all(res == results[0] for res in results), "ranks got different results"
        res = results[0]
        assert res.applied and res.version == k + 1 and res.finite
        assert res.contributions == world * micro, res
        # Every rank's loss and dX against float64 torch on the compute copy of this step.
        cw, cb = exp.tensors["copy_w"], exp.tensors.get("copy_bias")
        wt = torch.from_numpy(lossd.tensors.to_float64(cw)).float()
        bt = None if cb is None else torch.from_numpy(lossd.tensors.to_float64(cb)).float()
        for r in range(world):
            for i, (loss, dx) in enumerate(out[r][0]):
                x, t = batches[(r, i)]
                want = torch_reference(x.float(), wt, t, bt)
                assert_scalar("step %d rank %d loss" % (k, r), loss, float(want["loss"]), dtype)
                assert_close("step %d rank %d dX" % (k, r), dx, want["dx"], dtype)
        dw, db = shadow_gradient(client, mods[0], [batches[o] for o in order], cw, cb)
        lr = scheds[0].get_last_lr()[0] if scheds else None
        ref.step(dw, db, lr=lr)
        if scheds:
            for s in scheds:
                s.step()
        exp = client.export_head(name)
        assert exp.version == k + 1
        got = assert_matches_reference(exp, ref, cfg, k + 1, "step %d: " % k)
        worst = (max(worst[0], got[0]), max(worst[1], got[1]))
    return worst


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_steps_match_torch(client, heads, opt):
    worst = _train(client, heads, OPTIMIZERS[opt], world=3 if "adamw" in opt else 2)
    print("%s on %s: max %.2f fp32 ulps of the max (%d elementwise) from torch over %d steps" % (
        opt, BACKEND, worst[0], worst[1], STEPS))


def test_bf16_compute_copy_with_an_lr_schedule(client, heads):
    """bf16 hidden states (the copy is the master's bf16 cast; world 3 makes dX travel in
    fp32 to be unscaled), and an LR scheduler changing the lr sent with each Step."""
    worst = _train(client, heads, OPTIMIZERS["adamw-amsgrad"], world=3, dtype="bf16",
                   lr_schedule=lambda k: 0.5 ** k)
    print("bf16 adamw-amsgrad on %s: max %.2f fp32 ulps of the max (%d elementwise) from torch" % (
        BACKEND, worst[0], worst[1]))


def test_export_import_continues_bit_for_bit(client, heads):
    """A head exported after two steps (through the optimizer's state_dict) and imported
    under another name continues exactly as the one that never stopped."""
    cfg = OPTIMIZERS["adamw-amsgrad"]
    w, b = make_head(7)
    a_name, b_name = heads.name("run-a"), heads.name("run-b")
    a = RemoteLMHead(a_name, w, b, client=client, optimizer=cfg)
    opt_a = a.optimizer()

    def step(mod, opt, k):
        for i in range(2):
            x, t = make_batch(700 + 10 * k + i)
            mod(x.requires_grad_(), t).backward()
        opt.step()

    for k in range(2):
        step(a, opt_a, k)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)  # a checkpoint, read back as torch.load reads it
    sd = torch.load(io.BytesIO(buf.getvalue()))
    assert sd["lossd_head"]["version"] == 2
    b_mod = RemoteLMHead(b_name, w * 0.5, b, client=client, optimizer=cfg)  # another start
    opt_b = b_mod.optimizer()
    opt_b.load_state_dict(sd)  # replaces head b (version 0) with a's export
    assert b_mod.version == 2 and client.head_info(b_name).optimizer_step == 2
    for k in range(2, 5):
        step(a, opt_a, k)
        step(b_mod, opt_b, k)
    ea, eb = client.export_head(a_name), client.export_head(b_name, range_bytes=1000)
    assert eb.ranges > 10, "the small ranges were not used (%d)" % eb.ranges
    assert ea.version == eb.version == 5
    assert sorted(ea.tensors) == sorted(eb.tensors)
    for n in ea.tensors:
        ga, gb = np.asarray(getattr(ea.tensors[n], "bits", ea.tensors[n])), np.asarray(
            getattr(eb.tensors[n], "bits", eb.tensors[n]))
        assert ga.tobytes() == gb.tobytes(), "%s differs after import and 3 more steps" % n


def test_a_retried_compute_is_not_added_twice(client, heads, monkeypatch):
    """The module sends a Compute again after UNAVAILABLE (the reply lost): the server
    answers the retry but does not add it, so the step holds the micro-batch once."""
    cfg = OPTIMIZERS["sgd-momentum-nesterov-wd"]
    w, b = make_head(9)
    name = heads.name("retry")
    mod = RemoteLMHead(name, w, b, client=client, optimizer=cfg)
    opt = mod.optimizer()
    exp0 = client.export_head(name)
    real = client.compute
    answers = []

    def lossy(*args, **kw):
        r = real(*args, **kw)
        answers.append(r)
        if len(answers) == 1:
            raise lossd.UnavailableError("reply lost", method="Compute")
        return r

    monkeypatch.setattr(client, "compute", lossy)
    x, t = make_batch(900)
    xg = x.clone().requires_grad_()
    mod(xg, t).backward()
    monkeypatch.setattr(client, "compute", real)
    assert [r.head_added for r in answers] == [True, False]
    assert answers[1].dx.tobytes() == answers[0].dx.tobytes()
    assert client.head_info(name).contributions == 1
    opt.step()
    assert opt.last_result.contributions == 1
    ref = Reference(w, b, cfg)
    dw, db = shadow_gradient(client, mod, [(x, t)], exp0.tensors["copy_w"],
                             exp0.tensors["copy_bias"])
    ref.step(dw, db)
    assert_matches_reference(client.export_head(name), ref, cfg, 1)


def test_frozen_backbone_still_trains_the_head(client, heads):
    """Hidden states that need no gradient: the head's gradient is still added."""
    w, b = make_head(10)
    name = heads.name("frozen")
    mod = RemoteLMHead(name, w, b, client=client, optimizer="sgd")
    x, t = make_batch(1000)
    loss = mod(x, t)
    assert loss.requires_grad
    loss.backward()
    assert client.head_info(name).contributions == 1
    mod.optimizer().step()
    assert mod.version == 1
    assert not torch.equal(mod.weight(), w), "W did not move"


def test_eval_adds_nothing(client, heads):
    w, b = make_head(11)
    name = heads.name("eval")
    mod = RemoteLMHead(name, w, b, client=client, reduction="sum")
    x, t = make_batch(1100)
    with torch.no_grad():
        l1 = mod(x, t)
    mod.eval()
    l2 = mod(x.clone().requires_grad_(), t)
    mod.train()
    assert client.head_info(name).contributions == 0
    want = torch_reference(x, w, t, b, reduction="sum")
    assert_scalar("no_grad loss", float(l1), float(want["loss"]), "fp32")
    assert_scalar("eval loss", float(l2.detach()), float(want["loss"]), "fp32")


def test_deferred_and_reduction_none_take_the_actual_upstream_gradient(client, heads):
    """deferred (and reduction none, always deferred): backward's Compute carries the
    upstream gradient, so (loss * 0.25).backward() and a weighted per-token sum give torch's
    dX, and the step's sum is torch's dW."""
    w, b = make_head(12)
    for kw, up in (({"deferred": True}, None), ({"reduction": "none"}, "tokens")):
        name = heads.name("deferred")
        mod = RemoteLMHead(name, w, b, client=client, optimizer="sgd", **kw)
        x, t = make_batch(1200)
        xg = x.clone().requires_grad_()
        loss = mod(xg, t)
        g = torch.rand(t.shape, generator=torch.Generator().manual_seed(5)) if up else None
        (loss * g).sum().backward() if up else (loss * 0.25).backward()
        want = torch_reference(x, w, t, b, reduction="none" if up else "mean",
                               upstream=g if up else torch.tensor(0.25))
        assert_close("deferred dX", xg.grad, want["dx"], "fp32")
        assert client.head_info(name).contributions == 1


def test_a_scaled_loss_in_eager_mode_needs_loss_scale(client, heads):
    w, b = make_head(13)
    name = heads.name("scaled")
    mod = RemoteLMHead(name, w, b, client=client)
    x, t = make_batch(1300)
    with pytest.raises(lossd.FailedPreconditionError, match="loss_scale"):
        (mod(x.clone().requires_grad_(), t) * 0.5).backward()
    xg = x.clone().requires_grad_()
    (mod(xg, t, loss_scale=0.5) * 0.5).backward()
    want = torch_reference(x, w, t, b, upstream=torch.tensor(0.5))
    assert_close("dX of a loss scaled by 0.5", xg.grad, want["dx"], "fp32")


def test_hidden_of_another_dtype_is_refused(client, heads):
    w, b = make_head(14)
    name = heads.name("dtype")
    mod = RemoteLMHead(name, w, b, client=client, compute_dtype="bf16")
    x, t = make_batch(1400)
    with pytest.raises(lossd.InvalidArgumentError, match="computes in bf16"):
        mod(x, t)
