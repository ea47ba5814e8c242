# SPDX-License-Identifier: Apache-2.0
"""LossdFusedLinearCrossEntropyLoss under autograd's harder paths: grad modes, retained graphs,
double backward, activation checkpointing, and the micro-batch keys that keep a server-side
accumulator from adding a micro-batch twice (or missing one). Skipped where torch is not
installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd.nn import LossdFusedLinearCrossEntropyLoss  # noqa: E402
from conftest import assert_close, assert_scalar  # noqa: E402
from torch_reference import BT, DEVICE, H, V, make, torch_reference  # noqa: E402


def _spy_on_computes(runtime):
    """Records the keyword arguments of every client.compute the runtime makes."""
    calls = []
    real = runtime.client.compute

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    runtime.client = type("Spy", (), {})()
    for name in ("put_weights", "drop_weights", "fetch_gradients", "drop_accumulator"):
        setattr(runtime.client, name, getattr(real.__self__, name))
    runtime.client.compute = spy
    return calls


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_without_grad_mode_no_gradient_is_computed_or_accumulated(client, mode):
    x, w, b, t = make("fp32", bias=True, seed=70)
    module = LossdFusedLinearCrossEntropyLoss(client=client, accumulator="nograd-acc",
                                              eager_accumulation=True)
    calls = _spy_on_computes(module.runtime)
    with (torch.no_grad() if mode == "no_grad" else torch.inference_mode()):
        loss = module(w, x, t, b)
    ref = torch_reference(x, w, t, b)
    assert_scalar("loss", float(loss), float(ref["loss"]), "fp32")
    assert len(calls) == 1
    assert not (calls[0]["want_dx"] or calls[0]["want_dw"] or calls[0]["want_db"])
    assert not calls[0].get("accumulator"), "an evaluation pass must not add to the sum"
    with pytest.raises(lossd.NotFoundError):
        client.fetch_gradients("nograd-acc")  # never created
    # With grad mode on the same module does accumulate.
    module(w, x, t, b)
    assert calls[-1]["accumulator"] == "nograd-acc"
    assert client.fetch_gradients("nograd-acc").micro_batches == 1
    client.drop_accumulator("nograd-acc")
    module.release()


def test_a_weight_made_anew_each_step_is_uploaded_again(client):
    """A bf16 copy of fp32 master weights is a new tensor every step, often in the memory the
    last one freed: the cache must not take it for the old one."""
    g = torch.Generator().manual_seed(71)
    master = torch.randn(V, H, generator=g) * 3.0 / H ** 0.5
    x = torch.randn(BT, H, generator=g).to(torch.bfloat16)
    t = torch.randint(0, V, (BT,), generator=g)
    module = LossdFusedLinearCrossEntropyLoss(client=client)
    for step in range(3):
        wd = master.to(torch.bfloat16).requires_grad_()
        loss = module(wd, x, t)
        ref = torch_reference(x, wd, t)
        assert_scalar("loss at step %d" % step, float(loss.detach()), float(ref["loss"]), "bf16")
        del wd, loss
        with torch.no_grad():
            master.mul_(1.5)  # an optimizer step on the master copy
    module.release()


def test_fp16_gradients_keep_their_small_values_under_a_loss_scale(client):
    """fp16 with a GradScaler-style loss scale: the mean over many tokens and a small W make
    the dX elements about 1e-6, among fp16's subnormals (steps of 6e-8); scaled by 65536 they
    are well inside its normal range."""
    g = torch.Generator().manual_seed(72)
    bt, h, v = 2048, 16, 1024
    x = torch.randn(bt, h, generator=g).to(torch.float16).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.003).to(torch.float16).requires_grad_()
    t = torch.randint(0, v, (bt,), generator=g)
    module = LossdFusedLinearCrossEntropyLoss(client=client)
    scale = 65536.0
    (module(w, x, t) * scale).backward()
    ref = torch_reference(x, w, t, upstream=torch.tensor(scale))
    assert_close("x.grad (scaled)", x.grad, ref["dx"], "fp16")
    assert_close("w.grad (scaled)", w.grad, ref["dw"], "fp16")
    module.release()


def test_a_retained_graph_gives_the_gradients_on_every_backward(client):
    x, w, b, t = make("fp32", bias=True, seed=73)
    module = LossdFusedLinearCrossEntropyLoss(client=client)
    loss = module(w, x, t, b)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = torch_reference(x, w, t, b, upstream=torch.tensor(2.0))
    assert_close("x.grad after two backwards", x.grad, ref["dx"], "fp32")
    assert_close("w.grad after two backwards", w.grad, ref["dw"], "fp32")
    module.release()


def test_double_backward_is_refused(client):
    x, w, _, t = make("fp32", seed=74)
    module = LossdFusedLinearCrossEntropyLoss(client=client)
    loss = module(w, x, t)
    with pytest.raises(lossd.UnimplementedError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)
    module.release()


def test_refused_arguments(client):
    with pytest.raises(lossd.InvalidArgumentError, match="grad_scale"):
        LossdFusedLinearCrossEntropyLoss(client=client, grad_scale=0.5)
    x, w, _, t = make("fp32", shape=(3, 5), seed=75)
    module = LossdFusedLinearCrossEntropyLoss(client=client)
    with pytest.raises(lossd.InvalidArgumentError, match=r"target shape \(5, 3\)"):
        module(w, x, t.t())  # (T, B) targets against (B, T, H) hidden states
    learnable = torch.rand(V, requires_grad=True)
    weighted = LossdFusedLinearCrossEntropyLoss(client=client, ce_weight=learnable)
    with pytest.raises(lossd.InvalidArgumentError, match="ce_weight requires grad"):
        weighted(w, x, t)
    with torch.no_grad():
        weighted(w, x, t)  # evaluation: nothing to differentiate, so no refusal
    module.release()
    weighted.release()


def test_eager_accumulation_refuses_a_second_backward_through_a_retained_graph(client):
    x, w, _, t = make("fp32", seed=76)
    module = LossdFusedLinearCrossEntropyLoss(client=client, accumulator="eager-twice",
                                              eager_accumulation=True)
    loss = module(w, x, t)
    loss.backward(retain_graph=True)
    with pytest.raises(lossd.FailedPreconditionError, match="second backward"):
        loss.backward()
    assert module.fetch_gradients().micro_batches == 1
    module.runtime.drop_accumulator()
    module.release()


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_adds_each_micro_batch_once(client, eager, use_reentrant):
    """torch.utils.checkpoint runs the loss's forward again inside backward. Every
    micro-batch must still be added to the accumulator once, with the gradients of one
    forward: x.grad and the accumulated dW against float64."""
    from torch.utils.checkpoint import checkpoint

    k = 2
    w = (torch.randn(V, H, generator=torch.Generator().manual_seed(71)) / H ** 0.5 * 3)
    w = w.to(DEVICE).requires_grad_()
    name = "ckpt-%s-%s" % (eager, use_reentrant)
    module = LossdFusedLinearCrossEntropyLoss(client=client, accumulator=name,
                                              eager_accumulation=eager,
                                              grad_scale=1.0 / k if eager else 1.0)
    ref_dw = torch.zeros(V, H, dtype=torch.float64, device=DEVICE)
    for i in range(k):
        x, _, _, t = make("fp32", seed=72 + i)
        # A layer before the loss, so that the checkpointed region has work to redo.
        y = checkpoint(lambda a: module(w, torch.tanh(a), t), x, use_reentrant=use_reentrant)
        (y if eager else y / k).backward()
        xt = torch.tanh(x.detach().double()).requires_grad_()
        ref = torch_reference(xt, w, t, upstream=torch.tensor(1.0 / k))
        ref_dw += ref["dw"]
        ref_dx = (1 - xt.detach() ** 2) * ref["dx"]  # through the tanh
        assert_close("x.grad", x.grad, ref_dx, "fp32")
    got = module.apply_accumulated_gradients(w)
    assert got.micro_batches == k
    assert_close("w.grad", w.grad, ref_dw, "fp32")
    module.runtime.drop_accumulator()
    module.release()


def test_the_same_micro_batch_twice_outside_backward_adds_twice(client):
    """Only a forward inside backward can be a redo: the same rows sent twice in one step
    are two micro-batches."""
    x, w, _, t = make("fp32", seed=75)
    module = LossdFusedLinearCrossEntropyLoss(client=client, accumulator="twice-same",
                                              eager_accumulation=True, grad_scale=0.5)
    (module(w, x, t) + module(w, x, t)).backward()
    ref = torch_reference(x, w, t, upstream=torch.tensor(1.0))
    got = module.apply_accumulated_gradients(w)
    assert got.micro_batches == 2
    assert_close("w.grad", w.grad, ref["dw"], "fp32")  # 2 x 0.5
    assert not module.runtime._added, "every forward's backward ran"
    module.runtime.drop_accumulator()
    module.release()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_micro_batch_key_follows_the_content(dtype):
    from lossd.nn import LossdRuntime

    x, w, _, t = make(dtype, seed=76)
    key = LossdRuntime.micro_batch_key
    x2 = x.detach().reshape(-1, H)
    same = key(x2.clone(), t.clone(), w, None, {"reduction": "mean"})
    assert key(x2, t, w, None, {"reduction": "mean"}) == same
    other_x = x2.clone()
    other_x[0, 0] += 1  # the first element is always in the sample
    assert key(other_x, t, w, None, {"reduction": "mean"}) != same
    other_t = t.clone()
    other_t[-1] = (other_t[-1] + 1) % V  # so is the last
    assert key(x2, other_t, w, None, {"reduction": "mean"}) != same
    assert key(x2, t, w, None, {"reduction": "sum"}) != same
    # W by content too: a copy made anew (a cast, a merged adapter) is the same micro-batch.
    w2 = w.detach().clone()
    assert key(x2, t, w2, None, {"reduction": "mean"}) == same
    w2.view(-1)[0] += 1
    assert key(x2, t, w2, None, {"reduction": "mean"}) != same
    b = torch.ones(V, dtype=w.dtype)
    assert key(x2, t, w, b, {"reduction": "mean"}) != same
    # A non-contiguous W (a transposed view) is sampled in place, by the same positions.
    wt = w.detach().t().contiguous().t()
    assert not wt.is_contiguous()
    assert key(x2, t, wt, None, {"reduction": "mean"}) == same


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_with_a_weight_made_inside_and_the_same_rows_twice(client, use_reentrant):
    """Under activation checkpointing with eager accumulation: a W made anew inside the
    checkpointed region (here w * 1.0, as a cast or a merged adapter would be) and the same
    rows sent as two micro-batches in one backward are still each added once."""
    from torch.utils.checkpoint import checkpoint

    w = (torch.randn(V, H, generator=torch.Generator().manual_seed(77)) / H ** 0.5 * 3)
    w = w.to(DEVICE).requires_grad_()
    name = "ckpt-inside-%s" % use_reentrant
    module = LossdFusedLinearCrossEntropyLoss(client=client, accumulator=name,
                                              eager_accumulation=True, grad_scale=0.5)
    x, _, _, t = make("fp32", seed=78)
    x2 = x.detach().clone().requires_grad_()

    def region(a, wt):
        return module(wt * 1.0, torch.tanh(a), t)

    ya = checkpoint(region, x, w, use_reentrant=use_reentrant)
    yb = checkpoint(region, x2, w, use_reentrant=use_reentrant)
    (ya + yb).backward()
    xt = torch.tanh(x.detach().double()).requires_grad_()
    ref = torch_reference(xt, w, t, upstream=torch.tensor(0.5))
    ref_dx = (1 - xt.detach() ** 2) * ref["dx"]
    assert_close("x.grad", x.grad, ref_dx, "fp32")
    assert_close("x2.grad", x2.grad, ref_dx, "fp32")
    got = module.apply_accumulated_gradients(w)
    assert got.micro_batches == 2
    assert_close("w.grad", w.grad, 2 * ref["dw"], "fp32")
    assert not module.runtime._added, "every forward's backward ran"
    module.runtime.drop_accumulator()
    module.release()


def test_micro_batch_key_of_a_large_tensor_stays_in_range():
    """2^25 elements: positions computed in floats would round past the end."""
    from lossd.nn import LossdRuntime

    x2 = torch.zeros(8192, 4096, dtype=torch.bfloat16)
    x2[-1, -1] = 3.0
    t1 = torch.zeros(8192, dtype=torch.int64)
    w = torch.zeros(16, 4096)
    key = LossdRuntime.micro_batch_key(x2, t1, w, None, {})
    assert np.frombuffer(key[0][2], dtype=np.float64)[-1] == 3.0  # the last element is sampled
