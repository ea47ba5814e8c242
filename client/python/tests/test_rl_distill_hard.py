# SPDX-License-Identifier: Apache-2.0
"""lossd.rl's LossdFusedLinearJSDLoss and fused_linear_jsd_loss (LigerFusedLinearJSDLoss's
arguments: the generalised JSD plus a hard-label cross-entropy, weight_hard_loss /
weight_soft_loss): against torch float64 autograd of Liger's formulas and against
Liger-Kernel 0.8.5's own module, through the float64 reference client and a server listing
"distill_hard_loss" (test_rl_torch's backends); and the arguments it refuses.
"""

import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd import rl  # noqa: E402
from lossd.nn import LossdRuntime  # noqa: E402
from rl_torch_reference import (ReferenceClient, as64, hard_loss, jsd_loss,  # noqa: E402
                                log_softmax)
from test_rl_torch import (B, H, HT, S, V, backend, expect_close, expect_grads,  # noqa: E402,F401
                           leaves, needs, ref_leaves)


def skip_without_feature(make, fake):
    if fake is None and "distill_hard_loss" not in set(make().client.server_info().features):
        pytest.skip("the server does not compute the hard-label term")


def inputs(seed, with_bias):
    x, w, b = leaves((B * S, H), (V, H), (V,), seed=seed, scale=0.6)
    tx, tw, tb = (t.detach() for t in leaves((B * S, HT), (V, HT), (V,), seed=seed + 1,
                                              scale=0.6))
    labels = torch.randint(0, V, (B * S,), generator=torch.Generator().manual_seed(seed + 2))
    labels[::5] = -100
    return (x, w, b if with_bias else None, tx, tw, tb if with_bias else None, labels)


@needs("distill")
@pytest.mark.parametrize("weights, beta, temperature, with_bias", [
    ((0.5, 0.5), 0.5, 1.0, False), ((1.0, 0.0), 0.5, 2.0, True), ((0.3, 1.2), 0.0, 0.7, False),
    ((0.8, 0.4), 1.0, 1.5, True)])
def test_jsd_loss_matches_torch(backend, weights, beta, temperature, with_bias):
    make, fake = backend
    skip_without_feature(make, fake)
    x, w, b, tx, tw, tb, labels = inputs(61, with_bias)
    module = rl.LossdFusedLinearJSDLoss(weight_hard_loss=weights[0], weight_soft_loss=weights[1],
                                        beta=beta, temperature=temperature, runtime=make())
    loss = module(x, w, tx, tw, labels, student_bias=b, teacher_bias=tb)
    (1.5 * loss).backward()
    rx, rw, rb = ref_leaves(x, w, b)
    keep = labels != -100
    soft = jsd_loss(log_softmax(rx, rw, rb, temperature),
                    log_softmax(as64(tx), as64(tw), as64(tb), temperature), beta, keep)
    rloss = weights[0] * hard_loss(rx, rw, rb, labels, keep) + weights[1] * soft
    (1.5 * rloss).backward()
    expect_close("loss", loss, rloss.detach())
    expect_grads([("dx", x, rx), ("dw", w, rw), ("db", b, rb)])
    if fake is not None:
        assert fake.calls[-1]["distill"] == {"jsd_beta": beta, "weight_hard_loss": weights[0],
                                             "weight_soft_loss": weights[1]}


@needs("distill")
@pytest.mark.parametrize("weights, beta, temperature", [
    ((0.5, 0.5), 0.5, 1.0), ((0.7, 0.3), 0.0, 2.0), ((0.2, 0.9), 1.0, 0.5)])
def test_jsd_loss_matches_ligers_module(backend, weights, beta, temperature):
    from test_rl_reference_torch import import_liger
    jsd = import_liger("liger_kernel.chunked_loss.jsd_loss")
    make, fake = backend
    skip_without_feature(make, fake)
    x, w, b, tx, tw, tb, labels = inputs(71, True)
    args = dict(weight_hard_loss=weights[0], weight_soft_loss=weights[1], beta=beta,
                temperature=temperature, compiled=False, chunk_size=7)
    results = []
    for module in (rl.LossdFusedLinearJSDLoss(runtime=make(), **args),
                   jsd.LigerFusedLinearJSDLoss(**args)):
        now = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
        loss = module(now[0], now[1], tx, tw, labels, now[2], tb)
        loss.backward()
        results.append((loss.detach(), [t.grad for t in now]))
    (loss, grads), (lloss, lgrads) = results
    # Liger's log-softmax and sums are float32: 2e-5 of each output's largest magnitude.
    expect_close("loss", loss, lloss, rtol=0, atol=2e-5)
    for name, got, want in zip(("dx", "dw", "db"), grads, lgrads):
        expect_close(name, got, want, rtol=0, atol=2e-5)


@needs("distill")
def test_function_is_the_modules_loss(backend):
    make, fake = backend
    skip_without_feature(make, fake)
    x, w, b, tx, tw, tb, labels = inputs(81, True)
    runtime = make()
    got = rl.fused_linear_jsd_loss(x, w, tx, tw, labels, b, tb, 0.25, 0.75, 0.3, -100, 1.3,
                                   runtime=runtime)
    want = rl.LossdFusedLinearJSDLoss(0.25, 0.75, 0.3, -100, 1.3, runtime=runtime)(
        x, w, tx, tw, labels, b, tb)
    assert got.item() == want.item()
    assert got.item() > 0


def test_refusals_name_the_argument():
    client = ReferenceClient()
    with pytest.raises(lossd.InvalidArgumentError, match="return_soft_hard_loss=True is not "):
        rl.LossdFusedLinearJSDLoss(return_soft_hard_loss=True, client=client)
    with pytest.raises(lossd.InvalidArgumentError,
                       match=r"weight_hard_loss must be finite and >= 0, got -0.1"):
        rl.LossdFusedLinearJSDLoss(weight_hard_loss=-0.1, client=client)
    x, w, b, tx, tw, tb, labels = inputs(91, False)
    module = rl.LossdFusedLinearJSDLoss(runtime=LossdRuntime(client=client, cache_weights=False))
    with pytest.raises(lossd.InvalidArgumentError, match="true_labels is None: weight_hard_loss"):
        module(x, w, tx, tw, None)
    # A server without the feature: refused before anything is sent.
    old = LossdRuntime(client=ReferenceClient(features=()), cache_weights=False)
    with pytest.raises(lossd.UnimplementedError, match="distill_hard_loss"):
        rl.LossdFusedLinearJSDLoss(runtime=old)(x, w, tx, tw, labels)
    # The defaults of LigerFusedLinearJSD's weights (0, 1) need no feature.
    loss = rl.LossdFusedLinearJSDLoss(0.0, 1.0, runtime=old)(x, w, tx, tw, labels)
    assert loss.item() > 0
