# SPDX-License-Identifier: Apache-2.0
"""LossdFusedLinearCrossEntropyLoss against torch's own linear + cross_entropy (float64,
autograd) forward and backward, for every option. Skipped where torch is not installed."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import lossd  # noqa: E402
from lossd.nn import (  # noqa: E402
    CrossEntropyOutput,
    LossdFusedLinearCrossEntropyLoss,
    lossd_fused_linear_cross_entropy,
)
from conftest import (  # noqa: E402
    assert_accuracy,
    assert_close,
    assert_predictions,
    assert_scalar,
)
from torch_reference import BT, DEVICE, H, V, make, torch_reference  # noqa: E402



CASES = {
    "plain": {},
    "bias": {"bias": True},
    "ce_weight": {"ce_weight": True},
    "ce_weight_signed": {"ce_weight": "signed", "ignore": True},  # torch.randn-like weights
    "ignore_index": {"ignore": True},
    "ignore_index_custom": {"ignore_index": 3},
    "lse_square_scale": {"lse_square_scale": 0.05},
    "label_smoothing": {"label_smoothing": 0.2},
    "ce_weight_label_smoothing": {"ce_weight": True, "label_smoothing": 0.3, "ignore": True},
    "reduction_sum": {"reduction": "sum"},
    "reduction_none": {"reduction": "none"},
    "softcap": {"softcap": 2.0},
    "return_z_loss": {"lse_square_scale": 0.03, "return_z_loss": True},
    "return_z_loss_none": {"lse_square_scale": 0.03, "return_z_loss": True,
                           "reduction": "none"},
    "return_token_accuracy": {"return_token_accuracy": True},
    "return_predicted_tokens": {"return_predicted_tokens": True},
    "return_predicted_tokens_ignored": {"return_predicted_tokens": True, "ignore": True,
                                        "ignore_index": 2},
    "accum_dtype_fp32": {"accum_dtype": torch.float32},
    "token_scaling": {"use_token_scaling": True, "ignore": True},
    "token_scaling_none": {"use_token_scaling": True, "reduction": "none",
                           "lse_square_scale": 0.03, "return_z_loss": True, "ignore": True},
    "token_scaling_everything": {"use_token_scaling": True, "bias": True, "ce_weight": True,
                                 "ignore": True, "lse_square_scale": 0.02,
                                 "label_smoothing": 0.1, "softcap": 3.0,
                                 "return_z_loss": True},
    "chunk_size": {"chunk_size": 8},
    "batch_by_time_input": {"shape": (5, 9)},
    "no_weight_cache": {"cache_weights": False, "bias": True},
    "everything": {"bias": True, "ce_weight": True, "ignore": True, "lse_square_scale": 0.02,
                   "label_smoothing": 0.1, "softcap": 3.0, "return_z_loss": True,
                   "return_token_accuracy": True, "return_predicted_tokens": True},
}
MODULE_ARGS = ("ignore_index", "lse_square_scale", "label_smoothing", "reduction", "softcap",
               "return_z_loss", "accum_dtype", "return_token_accuracy",
               "return_predicted_tokens", "chunk_size")


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_module_matches_torch(client, dtype, case):
    o = dict(CASES[case])
    shape = o.pop("shape", (BT,))
    x, w, b, t = make(dtype, bias=o.pop("bias", False), seed=len(case), shape=shape)
    g = torch.Generator().manual_seed(7)
    ignore_index = o.get("ignore_index", -100)
    if o.pop("ignore", False):
        t[(torch.rand(t.shape, generator=g) < 0.3).to(DEVICE)] = ignore_index
    if "ignore_index" in o:
        t.view(-1)[:4] = ignore_index
    cw_kind = o.pop("ce_weight", False)
    ce_weight = ((torch.rand(V, generator=g) * 1.8 + 0.2).to(DEVICE) if cw_kind else None)
    if cw_kind == "signed":
        ce_weight = (torch.randn(V, generator=g) + 0.5).to(DEVICE)
        assert bool((ce_weight < 0).any())
    cache = o.pop("cache_weights", True)
    module = LossdFusedLinearCrossEntropyLoss(ce_weight=ce_weight, client=client,
                                              cache_weights=cache, **o)
    reduction = o.get("reduction", "mean")
    upstream = ((torch.rand(t.shape, generator=g) * 3 - 1).to(DEVICE)
                if reduction == "none" else None)
    out = module(w, x, t, b)
    returns = any(o.get(k) for k in ("return_z_loss", "return_token_accuracy",
                                     "return_predicted_tokens"))
    assert isinstance(out, CrossEntropyOutput) == returns
    loss = out.loss if returns else out
    if returns:
        for extra in (out.z_loss, out.token_accuracy, out.predicted_tokens):
            assert extra is None or not extra.requires_grad, "z-loss, accuracy, predictions " \
                "are not differentiable outputs"
    loss.backward(upstream) if upstream is not None else loss.backward()
    ref = torch_reference(x, w, t, b, ce_weight=ce_weight, ignore_index=ignore_index,
                          lse_square_scale=o.get("lse_square_scale", 0.0),
                          label_smoothing=o.get("label_smoothing", 0.0), reduction=reduction,
                          softcap=o.get("softcap"), upstream=upstream,
                          token_scaling=o.get("use_token_scaling", False))
    if reduction == "none":
        assert loss.shape == t.shape
        assert_close("loss", loss, ref["loss"], dtype)
    else:
        assert loss.dim() == 0
        assert_scalar("loss", float(loss.detach()), float(ref["loss"]), dtype)
    if o.get("return_z_loss"):
        if reduction == "none":
            assert_close("z_loss", out.z_loss, ref["z_loss"], dtype)
        else:
            assert_scalar("z_loss", float(out.z_loss.detach()), float(ref["z_loss"]), dtype)
    if o.get("return_predicted_tokens"):
        assert out.predicted_tokens.shape == t.shape
        assert out.predicted_tokens.dtype == torch.int64
        ignored = (t == ignore_index).cpu().numpy()
        assert_predictions(out.predicted_tokens.cpu().numpy(), ref["z"].cpu().numpy(), dtype,
                           ignored=ignored if ignored.any() else None)
    if o.get("return_token_accuracy"):
        assert out.token_accuracy.dim() == 0
        # The server's own predictions (a separate call when the module did not return them)
        # say what the accuracy must be; they are checked against the logits themselves.
        pred = (out.predicted_tokens if o.get("return_predicted_tokens") else None)
        ignored = None
        if pred is not None:
            ignored = (t == ignore_index).cpu().numpy()
            ignored = ignored if ignored.any() else None
        else:
            pred = torch.from_numpy(client.compute(
                x.detach().reshape(-1, x.shape[-1]), w.detach(), t.reshape(-1),
                bias=None if b is None else b.detach(), ignore_index=ignore_index,
                softcap=o.get("softcap"), want_dx=False, want_dw=False,
                want_predictions=True).predictions)
        assert_predictions(pred.cpu().numpy(), ref["z"].cpu().numpy(), dtype, ignored=ignored)
        assert_accuracy(float(out.token_accuracy), pred.cpu().numpy(), t.cpu().numpy(),
                        ignore_index)
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    assert_close("x.grad", x.grad, ref["dx"], dtype)
    assert_close("w.grad", w.grad, ref["dw"], dtype)
    if b is not None:
        assert b.grad.dtype == b.dtype
        assert_close("b.grad", b.grad, ref["db"], dtype)
    module.release()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upstream_gradient_scales_the_gradients(client, reduction):
    x, w, b, t = make("fp32", bias=True, seed=11)
    module = LossdFusedLinearCrossEntropyLoss(reduction=reduction, client=client)
    (module(w, x, t, b) * 2.5).backward()
    x2, w2, b2 = (a.detach().clone().requires_grad_() for a in (x, w, b))
    ref = torch_reference(x2, w2, t, b2, reduction=reduction, upstream=torch.tensor(2.5))
    assert_close("x.grad", x.grad, ref["dx"], "fp32")
    assert_close("w.grad", w.grad, ref["dw"], "fp32")
    assert_close("b.grad", b.grad, ref["db"], "fp32")


def test_only_hidden_states_need_grad(client):
    x, w, _, t = make("fp32", seed=12)
    w.requires_grad_(False)
    module = LossdFusedLinearCrossEntropyLoss(client=client)
    module(w, x, t).backward()
    ref = torch_reference(x, w, t)
    assert w.grad is None
    assert_close("x.grad", x.grad, ref["dx"], "fp32")
    with torch.no_grad():
        loss = module(w, x, t)
    assert_scalar("loss", float(loss.detach()), float(ref["loss"]), "fp32")


def test_weight_cache_uploads_again_after_an_inplace_update(client):
    x, w, b, t = make("fp32", bias=True, seed=13)
    module = LossdFusedLinearCrossEntropyLoss(client=client)
    module(w, x, t, b).backward()
    first = module.runtime._handle
    module(w, x.detach(), t, b)
    assert module.runtime._handle == first, "unchanged weights travel by handle"
    with torch.no_grad():
        w.add_(0.01 * torch.ones_like(w))  # what an optimizer step does
    w.grad = None
    module(w, x.detach(), t, b).backward()
    assert module.runtime._handle != first
    ref = torch_reference(x, w, t, b)
    assert_close("w.grad after update", w.grad, ref["dw"], "fp32")
    module.release()
    with pytest.raises(lossd.NotFoundError):
        client.compute(x.detach(), first, t)


@pytest.mark.parametrize("eager", [False, True])
def test_gradient_accumulation_on_the_server(client, eager):
    k = 3
    w = (torch.randn(V, H, generator=torch.Generator().manual_seed(1)) / H ** 0.5 * 3)
    w = w.to(DEVICE).requires_grad_()
    b = torch.randn(V, generator=torch.Generator().manual_seed(2)).to(DEVICE).requires_grad_()
    module = LossdFusedLinearCrossEntropyLoss(client=client, accumulator=True,
                                              eager_accumulation=eager,
                                              grad_scale=1.0 / k if eager else 1.0)
    ref_dw = torch.zeros(V, H, dtype=torch.float64, device=DEVICE)
    ref_db = torch.zeros(V, dtype=torch.float64, device=DEVICE)
    for i in range(k):
        x, _, _, t = make("fp32", seed=20 + i)
        loss = module(w, x, t, b)
        (loss if eager else loss / k).backward()
        ref = torch_reference(x, w, t, b, upstream=torch.tensor(1.0 / k))
        ref_dw += ref["dw"]
        ref_db += ref["db"]
        assert_close("x.grad", x.grad, ref["dx"], "fp32")
        assert w.grad is None and b.grad is None, "dW and db stay on the server until fetched"
    got = module.apply_accumulated_gradients(w, b)
    assert got.micro_batches == k
    assert_close("w.grad", w.grad, ref_dw, "fp32")
    assert_close("b.grad", b.grad, ref_db, "fp32")
    assert module.fetch_gradients().micro_batches == 0, "apply resets the accumulator"
    # Applying again adds nothing: refused rather than making the step look done.
    grad_before = w.grad.clone()
    with pytest.raises(lossd.FailedPreconditionError, match="holds no micro-batches"):
        module.apply_accumulated_gradients(w, b)
    assert torch.equal(w.grad, grad_before)
    module.runtime.drop_accumulator()
    module.release()


def test_the_module_has_the_clients_default_deadline(lossd_server):
    """timeout=None means the Client's default (600 s), not no deadline at all."""
    module = LossdFusedLinearCrossEntropyLoss(server=lossd_server.address)
    assert module.runtime.client.timeout == lossd.client.DEFAULT_TIMEOUT_S
    module.release()
    module = LossdFusedLinearCrossEntropyLoss(server=lossd_server.address, timeout=7.0)
    assert module.runtime.client.timeout == 7.0
    module.release()


def test_reduction_none_accumulates_with_the_per_token_upstream_gradient(client):
    w = (torch.randn(V, H, generator=torch.Generator().manual_seed(5)) / H ** 0.5 * 3)
    w = w.to(DEVICE).requires_grad_()
    module = LossdFusedLinearCrossEntropyLoss(client=client, reduction="none",
                                              accumulator="none-acc", label_smoothing=0.1)
    ref_dw = torch.zeros(V, H, dtype=torch.float64, device=DEVICE)
    for i in range(2):
        x, _, _, t = make("fp32", seed=50 + i)
        up = torch.rand(BT, generator=torch.Generator().manual_seed(60 + i)).to(DEVICE)
        module(w, x, t).backward(up)
        ref = torch_reference(x, w, t, label_smoothing=0.1, reduction="none", upstream=up)
        ref_dw += ref["dw"]
        assert_close("x.grad", x.grad, ref["dx"], "fp32")
    module.apply_accumulated_gradients(w)
    assert_close("w.grad", w.grad, ref_dw, "fp32")
    module.runtime.drop_accumulator()
    module.release()


def test_eager_accumulation_refuses_a_scaled_loss(client):
    x, w, _, t = make("fp32", seed=30)
    module = LossdFusedLinearCrossEntropyLoss(client=client, accumulator="eager-refuse",
                                              eager_accumulation=True)
    with pytest.raises(lossd.FailedPreconditionError):
        (module(w, x, t) * 0.5).backward()
    module.runtime.drop_accumulator()
    module.release()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_functional_token_scaling(client, reduction):
    x, w, b, t = make("fp32", bias=True, seed=33)
    t[:5] = -100
    out = lossd_fused_linear_cross_entropy(x, w, t, b, reduction=reduction,
                                           use_token_scaling=True,
                                           runtime=lossd.nn.LossdRuntime(client=client))
    (out * 1.5).backward()
    ref = torch_reference(x, w, t, b, reduction=reduction, upstream=torch.tensor(1.5),
                          token_scaling=True)
    plain = torch_reference(x, w, t, b, reduction=reduction)
    # The scaled loss is visibly not the plain one, so the comparison below can fail.
    assert abs(float(ref["loss"]) - float(plain["loss"])) > 0.1 * abs(float(plain["loss"]))
    assert_scalar("loss", float(out.detach()), float(ref["loss"]), "fp32")
    assert_close("x.grad", x.grad, ref["dx"], "fp32")
    assert_close("w.grad", w.grad, ref["dw"], "fp32")
    assert_close("b.grad", b.grad, ref["db"], "fp32")


def test_functional_form(client):
    x, w, _, t = make("bf16", seed=31)
    out = lossd_fused_linear_cross_entropy(x, w, t, return_token_accuracy=True,
                                           runtime=lossd.nn.LossdRuntime(client=client))
    ref = torch_reference(x, w, t)
    assert_scalar("loss", float(out.loss.detach()), float(ref["loss"]), "bf16")


def test_numpy_client_takes_torch_tensors(client):
    x, w, _, t = make("bf16", seed=32)
    a = client.compute(x, w, t)
    xb = lossd.bf16(x.detach().cpu().view(torch.int16).numpy().view(np.uint16))
    wb = lossd.bf16(w.detach().cpu().view(torch.int16).numpy().view(np.uint16))
    c = client.compute(xb, wb, t.cpu().numpy())
    assert a.loss == c.loss
    np.testing.assert_array_equal(a.dw.bits, c.dw.bits)


def test_same_signature_as_liger():
    """Liger-Kernel 0.8.5's LigerFusedLinearCrossEntropyLoss arguments in its order, then
    lossd's chunk_size (test_liger_parity.py has the full table)."""
    liger_init = ["ce_weight", "ignore_index", "lse_square_scale", "label_smoothing",
                  "reduction", "softcap", "return_z_loss", "accum_dtype", "use_token_scaling",
                  "return_token_accuracy", "return_predicted_tokens", "chunk_size"]
    params = list(inspect.signature(LossdFusedLinearCrossEntropyLoss.__init__).parameters)
    assert params[1:1 + len(liger_init)] == liger_init
    fwd = list(inspect.signature(LossdFusedLinearCrossEntropyLoss.forward).parameters)
    assert fwd == ["self", "lin_weight", "_input", "target", "bias"]


def test_numpy_reference_agrees_with_torch():
    """The numpy oracle of test_client.py, checked against torch autograd (no server)."""
    from test_client import reference

    x, w, b, t = make("fp32", bias=True, seed=40, device="cpu")
    t[::5] = -100
    cw = torch.rand(V, generator=torch.Generator().manual_seed(3)) + 0.5
    for reduction in ("mean", "sum", "none"):
        up = torch.rand(BT, dtype=torch.float64) if reduction == "none" else None
        ref_t = torch_reference(x, w, t, b, ce_weight=cw, lse_square_scale=0.05,
                                label_smoothing=0.2, reduction=reduction, softcap=2.5,
                                upstream=up)
        ref_n = reference(x.detach().numpy(), w.detach().numpy(), t.numpy(),
                          b=b.detach().numpy(), cw=cw.numpy(), reduction=reduction, eps=0.2,
                          zs=0.05, softcap=2.5, grad_output=None if up is None else up.numpy())
        np.testing.assert_allclose(ref_n["loss"], float(ref_t["loss"].sum()), rtol=1e-12)
        for name in ("dx", "dw", "db"):
            np.testing.assert_allclose(ref_n[name], ref_t[name].numpy(), rtol=1e-10,
                                       atol=1e-12, err_msg=name)
