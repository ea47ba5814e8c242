# SPDX-License-Identifier: Apache-2.0
"""A hosted head with torch.amp.GradScaler, with clip_grad_norm_ over backbone plus head (the
two-phase Step), with a skipped step, and moved from a running torch optimizer: each against
a local torch head given the same gradients. Skipped where torch is not installed or the
server has no hosted heads."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd.nn import RemoteLMHead, clip_grad_norm_, head_state_from_torch  # noqa: E402
from head_harness import (  # noqa: E402
    H,
    Reference,
    Turns,
    assert_matches_reference,
    make_batch,
    made_heads,
    make_head,
    rank_modules,
    run_ranks,
    shadow_gradient,
    ulps,
)

ADAMW = lossd.OptimizerConfig.adamw(lr=0.01, weight_decay=0.05, amsgrad=True)


@pytest.fixture
def heads(client):
    yield from made_heads(client)


def _new_head(client, heads, cfg, seed, prefix):
    w, b = make_head(seed)
    name = heads.name(prefix)
    client.create_head(name, w, b, optimizer=cfg)
    return name, w, b


def test_grad_scaler_and_clipping_over_backbone_and_head(client, heads):
    """Two ranks, a GradScaler (scale 2^10) and clip_grad_norm_ over a local backbone
    parameter and the head: the total norm is torch's over the same gradients, the backbone
    gradient is clipped as torch clips it, and the head steps as torch's AdamW with the
    unscaled, clipped gradient."""
    world, steps = 2, 3
    name, w, b = _new_head(client, heads, ADAMW, 20, "amp")
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(world)]
    mods = rank_modules(client, name, world)
    for m, s in zip(mods, scalers):
        m.grad_scaler = s
    opts = [m.optimizer() for m in mods]
    ref = Reference(w, b, ADAMW)
    exp = client.export_head(name)
    for k in range(steps):
        batches = [make_batch(2000 + 10 * k + r) for r in range(world)]
        # A backbone parameter whose (already all-reduced) gradient every rank shares.
        bb = torch.randn(H, generator=torch.Generator().manual_seed(k)) * 3.0
        turns = Turns()
        max_norm = 0.5

        def rank(r):
            p = torch.nn.Parameter(torch.zeros(H))
            bopt = torch.optim.SGD([p], lr=0.1)
            x, t = batches[r]
            turns.wait(r)
            loss = mods[r](x.clone().requires_grad_(), t)
            scalers[r].scale(loss).backward()
            turns.done()
            p.grad = bb * scalers[r].get_scale()
            scalers[r].unscale_(bopt)
            total = clip_grad_norm_([p], mods[r], max_norm)
            scalers[r].step(bopt)
            scalers[r].step(opts[r])
            scalers[r].update()
            return total, p.grad.clone(), opts[r].last_result

        out = run_ranks(world, rank)
        res = out[0][2]
        assert all(o[2] == res for o in out) and res.applied and res.version == k + 1
        dw, db = shadow_gradient(client, mods[0], batches, exp.tensors["copy_w"],
                                 exp.tensors["copy_bias"], scaler_scale=2.0 ** 10)
        # torch: unscale (exact: 2^-10), then clip everything by the global norm.
        gw = torch.from_numpy(np.array(dw)) * 2.0 ** -10
        gb = torch.from_numpy(np.array(db)) * 2.0 ** -10
        tp = [torch.nn.Parameter(torch.zeros(H)), torch.nn.Parameter(torch.zeros_like(gw)),
              torch.nn.Parameter(torch.zeros_like(gb))]
        for p, g in zip(tp, (bb.clone(), gw, gb)):
            p.grad = g.clone()
        want_total = torch.nn.utils.clip_grad_norm_(tp, max_norm, foreach=False)
        for total, pgrad, _ in out:
            assert abs(float(total) - float(want_total)) <= 1e-5 * float(want_total), (
                float(total), float(want_total))
            torch.testing.assert_close(pgrad, tp[0].grad, rtol=1e-5, atol=0)
        coef = float(torch.clamp(max_norm / (out[0][0] + 1e-6), max=1.0))
        assert coef < 1.0, "clipping was not active (coef %g)" % coef
        assert res.clip_coef == np.float32(coef) * np.float32(2.0 ** -10), res.clip_coef
        ref.step(gw.numpy(), gb.numpy(), coef=coef)
        exp = client.export_head(name)
        worst = assert_matches_reference(exp, ref, ADAMW, k + 1, "step %d: " % k)
        print("amp + clip step %d: max %.2f fp32 ulps of the max (%d elementwise) from torch" % (
            k, worst[0], worst[1]))
        assert all(s.get_scale() == 2.0 ** 10 for s in scalers)


def test_an_overflow_skips_the_step_and_backs_the_scaler_off(client, heads):
    """A GradScaler scale of 2^127 overflows the head's summed gradient: the step is skipped
    on the server (W and the optimizer state unchanged, the version advances), and
    scaler.update() halves the scale, as for a local head."""
    name, w, b = _new_head(client, heads, ADAMW, 21, "overflow")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    mod = RemoteLMHead(name, client=client, grad_scaler=scaler, reduction="sum")
    opt = mod.optimizer()
    before = client.export_head(name)
    x, t = make_batch(2100, scale=4.0)
    scaler.scale(mod(x.clone().requires_grad_(), t)).backward()
    scaler.step(opt)
    scaler.update()
    r = opt.last_result
    assert not r.finite and not r.applied and r.version == 1, r
    assert scaler.get_scale() == 2.0 ** 126
    after = client.export_head(name)
    assert after.version == 1 and after.optimizer_step == 0
    for n in before.tensors:
        assert np.asarray(before.tensors[n]).tobytes() == np.asarray(
            after.tensors[n]).tobytes(), "%s changed in a skipped step" % n
    # The next step, at the lower scale, computes against version 1 and applies.
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    mod.grad_scaler = scaler2
    scaler2.scale(mod(make_batch(2101)[0].requires_grad_(), t)).backward()
    scaler2.step(opt)
    scaler2.update()
    assert opt.last_result.applied and mod.version == 2


def test_skip_keeps_w_and_drops_the_gradients(client, heads):
    name, w, b = _new_head(client, heads, ADAMW, 22, "skip")
    mod = RemoteLMHead(name, client=client)
    x, t = make_batch(2200)
    mod(x.requires_grad_(), t).backward()
    before = client.export_head(name)
    r = client.step(name, 0, skip=True)
    assert r.version == 1 and not r.applied and r.contributions == 1
    after = client.export_head(name)
    assert after.tensors["master_w"].tobytes() == before.tensors["master_w"].tobytes()
    info = client.head_info(name)
    assert info.contributions == 0 and info.optimizer_step == 0


@pytest.mark.parametrize("scaled", [False, True])
def test_a_step_with_no_contributions_moves_nothing(client, heads, scaled):
    """A Step with no Compute in it (a trainer that retries only the Step after its gradients
    were dropped) is refused naming the head and the version: W, the optimizer state and the
    step count stay (torch leaves a parameter without a gradient as it is). step(skip=True)
    then moves past it, under a GradScaler (two phases) too, and the next step applies."""
    name, w, b = _new_head(client, heads, ADAMW, 26, "empty")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if scaled else None
    mod = RemoteLMHead(name, client=client, grad_scaler=scaler)
    opt = mod.optimizer()
    before = client.export_head(name)
    with pytest.raises(lossd.FailedPreconditionError,
                       match="version 0 has no contributions") as e:
        opt.step()
    assert "call Step with skip" in str(e.value), e.value
    after = client.export_head(name)
    assert after.version == 0 and after.optimizer_step == 0
    for n in before.tensors:
        assert np.asarray(before.tensors[n]).tobytes() == np.asarray(
            after.tensors[n]).tobytes(), "%s changed in a refused empty step" % n
    opt.step(skip=True)
    assert not opt.last_result.applied and mod.version == 1
    assert client.head_info(name).optimizer_step == 0
    x, t = make_batch(2600)
    loss = mod(x.requires_grad_(), t)
    (scaler.scale(loss) if scaled else loss).backward()
    opt.step()
    assert opt.last_result.applied and mod.version == 2
    assert client.head_info(name).optimizer_step == 1


@pytest.mark.parametrize("how", ["clip_grad_norm_", "optimizer_max_norm", "max_norm_amp"])
def test_head_alone_clipped_by_max_norm(client, heads, how):
    """The head clipped by its own norm, as torch's clip_grad_norm_ over its weight and bias:
    through clip_grad_norm_ with no backbone (two phases), through the optimizer's max_norm
    (one barrier, the server's coefficient), and the latter under a GradScaler (the
    coefficient from the unscaled norm)."""
    name, w, b = _new_head(client, heads, ADAMW, 23, "clip-alone")
    scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 6) if how == "max_norm_amp"
              else None)
    mod = RemoteLMHead(name, client=client, grad_scaler=scaler)
    opt = mod.optimizer(max_norm=None if how == "clip_grad_norm_" else 1e-3)
    exp = client.export_head(name)
    x, t = make_batch(2300)
    loss = mod(x.requires_grad_(), t)
    (scaler.scale(loss) if scaler else loss).backward()
    if how == "clip_grad_norm_":
        total = clip_grad_norm_([], opt, 1e-3)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    dw, db = shadow_gradient(client, mod, [(x.detach(), t)], exp.tensors["copy_w"],
                             exp.tensors["copy_bias"], scaler_scale=2.0 ** 6 if scaler else 1)
    unscale = 2.0 ** -6 if scaler else 1.0
    tp = [torch.nn.Parameter(torch.zeros(g.shape)) for g in (dw, db)]
    for p, g in zip(tp, (dw, db)):
        p.grad = torch.from_numpy(np.array(g)) * unscale
    want = torch.nn.utils.clip_grad_norm_(tp, 1e-3, foreach=False)
    coef = float(torch.clamp(1e-3 / (want + 1e-6), max=1.0))
    r = opt.last_result
    if how == "clip_grad_norm_":
        assert abs(float(total) - float(want)) <= 1e-5 * float(want)
    assert r.applied and coef < 1.0
    # The coefficient the server applied: torch's, times 1/scale, up to the rounding of the
    # norm (accumulated in double on the server, in fp32 by torch).
    assert abs(r.clip_coef / unscale - coef) <= 1e-6 * coef, (r.clip_coef, coef)
    ref = Reference(w, b, ADAMW)
    # torch: unscale (exact, a power of two), then clip (tp's grads are clipped already).
    ref.step(np.array(dw) * np.float32(unscale), np.array(db) * np.float32(unscale),
             coef=r.clip_coef / unscale)
    assert_matches_reference(client.export_head(name), ref, ADAMW, 1)


def test_a_non_finite_step_without_a_scaler_is_refused_then_skipped(client, heads):
    name, w, b = _new_head(client, heads, ADAMW, 26, "refused")
    mod = RemoteLMHead(name, client=client, reduction="sum")
    opt = mod.optimizer()
    x, t = make_batch(2600, scale=4.0)
    (mod(x.requires_grad_(), t, loss_scale=2.0 ** 127) * 2.0 ** 127).backward()
    with pytest.raises(lossd.FailedPreconditionError, match="skip"):
        opt.step()
    assert mod.version == 0
    opt.step(skip=True)
    assert mod.version == 1 and not opt.last_result.applied


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_running_torch_optimizer_moves_to_lossd(client, heads, kind):
    """Two local steps with torch's optimizer, then head_state_from_torch into a hosted head:
    the next steps equal torch's continuing locally."""
    w, b = make_head(24)
    ref = Reference(w, b, lossd.OptimizerConfig.adamw(lr=0.01, weight_decay=0.1, amsgrad=True)
                    if kind == "adamw" else
                    lossd.OptimizerConfig.sgd(lr=0.05, momentum=0.9, weight_decay=0.01))
    for k in range(2):
        x, t = make_batch(2400 + k)
        ref.opt.zero_grad()
        torch.nn.functional.cross_entropy(x @ ref.w.T + ref.b, t).backward()
        ref.opt.step()
    moved = head_state_from_torch(ref.opt, ref.w, ref.b)
    cfg = moved["optimizer"]
    assert cfg.kind == kind and moved["optimizer_step"] == (2 if kind == "adamw" else 1)
    name = heads.name("moved")
    mod = RemoteLMHead(name, ref.w, ref.b, client=client, **moved)
    opt = mod.optimizer()
    for k in range(2):
        exp = client.export_head(name)
        x, t = make_batch(2500 + k)
        mod(x.requires_grad_(), t).backward()
        opt.step()
        dw, db = shadow_gradient(client, mod, [(x.detach(), t)], exp.tensors["copy_w"],
                                 exp.tensors["copy_bias"])
        ref.step(dw, db)
        assert_matches_reference(client.export_head(name), ref, cfg, k + 1)
    assert client.head_info(name).optimizer_step == (4 if kind == "adamw" else 3)


def test_ulps_counts_the_values_between():
    one = np.float32(1.0)
    assert ulps([one], [np.nextafter(one, np.float32(2))])[0] == 1
    assert ulps([np.float32(-0.0)], [np.float32(0.0)])[0] == 0
    tiny = np.nextafter(np.float32(0), np.float32(1))
    assert ulps([-tiny], [tiny])[0] == 2
    assert ulps([np.float32(1.5)], [np.float32(1.5)])[0] == 0


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(client, heads):
    """Two ranks, two micro-batches each, and an overflow in the first: the later Computes of
    the step still answer (their gradient is dropped with the step), every rank's scaler
    skips and backs off, and the barrier completes."""
    world = 2
    name, w, b = _new_head(client, heads, ADAMW, 25, "overflow-dp")
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 127) for _ in range(world)]
    mods = rank_modules(client, name, world, reduction="sum")
    for m, s in zip(mods, scalers):
        m.grad_scaler = s
    opts = [m.optimizer() for m in mods]
    turns = Turns()

    def rank(r):
        for i in range(2):
            turns.wait(2 * r + i)
            try:
                x, t = make_batch(2500 + 2 * r + i, scale=4.0)
                scalers[r].scale(mods[r](x.requires_grad_(), t)).backward()
            finally:
                turns.done()
        scalers[r].step(opts[r])
        scalers[r].update()
        return opts[r].last_result

    out = run_ranks(world, rank)
    assert all(not o.finite and not o.applied and o.version == 1 for o in out), out
    assert all(s.get_scale() == 2.0 ** 126 for s in scalers)
