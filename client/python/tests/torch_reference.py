# SPDX-License-Identifier: Apache-2.0
"""The float64 oracle of the torch tests: torch's own linear + cross_entropy (autograd, with
Liger's options: z-loss, label smoothing, softcap, class weights, token scaling), and the
random leaf tensors the tests feed both it and lossd. Import it after
pytest.importorskip("torch")."""

import os

import torch

F = torch.nn.functional

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
