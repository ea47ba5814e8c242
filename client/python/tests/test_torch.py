"""LossdFusedLinearCrossEntropyLoss against torch's own linear + cross_entropy (float64,
autograd) forward and backward, for every option. Skipped where torch is not installed."""

import inspect
import os

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

BT, H, V = 47, 31, 123
DEVICE = os.environ.get("LOSSD_TEST_DEVICE", "cpu")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _logits64(x, w, t, b, softcap):
    """float64 leaves (x, w, b) and the final logits (rows, V) with the targets flattened."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    z = F.linear(x64, w64, b64)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return (x64, w64, b64), z.reshape(-1, z.shape[-1]), t.reshape(-1)


def _backward64(loss, z_loss, z2, t1, valid, leaves, upstream):
    """Backpropagates `loss` (times `upstream`) and returns what the references return."""
    x64, w64, b64 = leaves
    up = torch.ones_like(loss) if upstream is None else upstream.double()
    loss.backward(up)
    pred = z2.argmax(-1)
    acc = ((pred == t1) & valid).sum().double() / valid.sum().clamp(min=1)
    return dict(loss=loss.detach(), z_loss=z_loss.detach(), acc=float(acc), pred=pred,
                dx=x64.grad, dw=w64.grad, db=None if b64 is None else b64.grad, z=z2.detach())


def torch_reference(x, w, t, b=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                    label_smoothing=0.0, reduction="mean", softcap=None, upstream=None,
                    token_scaling=False):
    """float64 torch: returns loss, z_loss, accuracy, predictions and grads of x, w, b.
    token_scaling: Liger's use_token_scaling, written out (each row's loss and z-loss times
    its target's detached softmax probability)."""
    if token_scaling:
        return _token_scaled_reference(x, w, t, b, ce_weight, ignore_index, lse_square_scale,
                                       label_smoothing, reduction, softcap, upstream)
    leaves, z2, t1 = _logits64(x, w, t, b, softcap)
    cw = None if ce_weight is None else ce_weight.double()
    loss = F.cross_entropy(z2, t1, weight=cw, ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    valid = t1 != ignore_index
    zl = lse_square_scale * torch.logsumexp(z2, -1) ** 2 * valid
    if reduction == "mean":
        n = valid.sum()
        z_loss = zl.sum() / n if n > 0 else zl.sum() * 0
        if n > 0:
            loss = loss + z_loss
        else:
            loss = z_loss  # torch gives NaN for an all-ignored mean; lossd gives 0
    elif reduction == "sum":
        z_loss = zl.sum()
        loss = loss + z_loss
    else:
        z_loss = zl.reshape(t.shape)
        loss = loss.reshape(t.shape) + z_loss
    return _backward64(loss, z_loss, z2, t1, valid, leaves, upstream)


def _token_scaled_reference(x, w, t, b, ce_weight, ignore_index, lse_square_scale,
                            label_smoothing, reduction, softcap, upstream):
    leaves, z2, t1 = _logits64(x, w, t, b, softcap)
    cw = None if ce_weight is None else ce_weight.double()
    valid = t1 != ignore_index
    ce = F.cross_entropy(z2, t1, weight=cw, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, reduction="none")
    zl = lse_square_scale * torch.logsumexp(z2, -1) ** 2 * valid
    safe_t = torch.where(valid, t1, torch.zeros_like(t1))
    s = torch.softmax(z2.detach(), -1).gather(1, safe_t.unsqueeze(1)).squeeze(1) * valid
    ce, zl = ce * s, zl * s
    if reduction == "mean":
        wsum = valid.sum() if cw is None else (cw[safe_t] * valid).sum()
        z_loss = zl.sum() / valid.sum()
        loss = ce.sum() / wsum + z_loss
    elif reduction == "sum":
        z_loss = zl.sum()
        loss = ce.sum() + z_loss
    else:
        z_loss = zl.reshape(t.shape)
        loss = ce.reshape(t.shape) + z_loss
    return _backward64(loss, z_loss, z2, t1, valid, leaves, upstream)


def make(dtype, bias=False, seed=0, shape=(BT,), v=V, h=H, device=None):
    """Random leaf tensors (made on the CPU for reproducibility, then moved to the device)."""
    dev = device or DEVICE
    g = torch.Generator().manual_seed(seed)
    td = TORCH_DTYPES[dtype]
    x = torch.randn(*shape, h, generator=g).to(dev, td).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 3.0 / h ** 0.5).to(dev, td).requires_grad_()
    b = torch.randn(v, generator=g).to(dev, td).requires_grad_() if bias else None
    t = torch.randint(0, v, shape, generator=g).to(dev)
    return x, w, b, t


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
    """Liger-Kernel's LigerFusedLinearCrossEntropyLoss arguments, in its order."""
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
