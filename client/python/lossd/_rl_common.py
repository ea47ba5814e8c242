# SPDX-License-Identifier: Apache-2.0
"""What lossd.rl's losses share: the runtime a function uses when given none, the gradient
keywords of a call, received gradients as tensors, and the input checks. Imports torch."""

import torch

from lossd import errors
from lossd.nn import LossdRuntime, _to_torch, mixed_grad_fp32
from lossd.tensors import check_fits_int64

_RUNTIMES = {}  # server address -> the LossdRuntime the functions use when given none


def _runtime(runtime, server):
    if runtime is None:
        runtime = _RUNTIMES.get(server)
        if runtime is None:
            runtime = _RUNTIMES[server] = LossdRuntime(server=server)
    return runtime


def _grad_kw(runtime, upstream=1.0):
    """compute()'s accumulator and grad_scale for a call that returns gradients: with an
    accumulator, dW and db go there, scaled by the upstream gradient and the runtime's
    grad_scale (dX comes back scaled alike, as lossd.nn's)."""
    if runtime.accumulator is None:
        return {}
    return dict(accumulator=runtime.accumulator, grad_scale=float(upstream) * runtime.grad_scale)


def _nonfinite_kw(runtime, grad_kw):
    """compute()'s allow_nonfinite_loss for a scalar loss's call: a loss that overflows fp32
    (a KL term exp(ref_logp - logp) past ~88.7) then comes back inf, with its non-finite
    gradients, as Liger-Kernel's losses return it for the trainer to skip the step. Not for
    a call into an accumulator (the server refuses there, naming what overflowed), nor where
    the server does not list "nonfinite_loss" (asked once per runtime)."""
    if grad_kw.get("accumulator") is not None:
        return {}
    if runtime.nonfinite_loss is None:
        try:
            runtime.client.require_feature("nonfinite_loss", timeout=runtime.timeout)
            runtime.nonfinite_loss = True
        except errors.UnimplementedError:
            runtime.nonfinite_loss = False
    return {"allow_nonfinite_loss": True} if runtime.nonfinite_loss else {}


def _grad_dtype(cdt, *params):
    """compute()'s grad_dtype for a compute in `cdt` whose gradients go to `params`: fp32
    where the compute is fp16 (its gradients would lose small values to underflow before the
    upstream gradient, applied afterwards, scales them) or a parameter is fp32 and the compute
    is not (lossd.nn.mixed_grad_fp32); cast to each parameter's dtype on arrival."""
    if cdt == torch.float16 or mixed_grad_fp32(cdt, *params):
        return "fp32"
    return None


def _grad(value, like):
    """A received gradient as a tensor of `like`'s dtype and device (None stays None)."""
    if value is None:
        return None
    return _to_torch(value, like.device).to(dtype=like.dtype, device=like.device)


def _fp32(t):
    return None if t is None else t.detach().to(torch.float32).reshape(-1)


def _once():
    """Refuses backward(create_graph=True): the server's gradients carry no graph, so a
    gradient penalty built on them would silently lose its second-order terms."""
    if torch.is_grad_enabled():
        raise errors.UnimplementedError(
            "lossd.rl's losses are differentiable once: double backward (create_graph=True) "
            "is not supported", method="rl")


def _flat(hidden, ids):
    """(BT, H) hidden states and (BT) ids from (..., H) and (...)."""
    if hidden.dim() < 2:
        raise errors.InvalidArgumentError(
            "hidden states must be (..., H), got shape %s" % (tuple(hidden.shape),), method="rl")
    if ids is not None and tuple(ids.shape) != tuple(hidden.shape[:-1]):
        raise errors.InvalidArgumentError(
            "labels of shape %s do not match hidden states %s" % (
                tuple(ids.shape), tuple(hidden.shape)), method="rl")
    x2 = hidden.reshape(-1, hidden.shape[-1])
    return x2, (None if ids is None else _int64(ids, "labels"))


def _int64(ids, name):
    """Token ids flattened, as int64, refusing (by `name`, index and value) unsigned 64-bit
    ids above 2**63 - 1, which torch's cast would wrap to negatives (2**64 - 100 to -100: an
    ignored row)."""
    if ids.dtype == getattr(torch, "uint64", None):
        check_fits_int64(ids.detach().cpu().numpy(), name)
    return ids.reshape(-1).to(torch.int64)
