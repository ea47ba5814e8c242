# SPDX-License-Identifier: Apache-2.0
"""PyTorch integration: a drop-in for Liger-Kernel's LigerFusedLinearCrossEntropyLoss that runs
the linear + cross-entropy (forward and backward) on a lossd server; and RemoteLMHead, an LM
head whose parameters and optimizer live on lossd (lossd._remote_head, _remote_head_opt).

Same constructor and forward arguments as Liger's module, plus keyword-only connection
settings. Never materialises the logits locally; tensors on a GPU are copied to the host to
travel. Importing this module imports torch. Mixed precision: a call computes in the hidden
states' dtype, or under torch.autocast in its dtype (compute_dtype); W and the bias travel
cast to it, and every gradient comes back in its own tensor's dtype.

Two ways a call runs (both give the gradients torch would):
  eager    (reduction mean/sum, no server accumulator): one Compute in forward returns the
           loss and dX, dW, db; backward only scales them by the upstream gradient.
  deferred (reduction none, or a server accumulator): forward asks for the loss only;
           backward sends a second Compute carrying the upstream gradient (per-token for none,
           grad_scale for mean/sum), so `(loss / k).backward()` accumulates exactly on the
           server. X travels twice; W does not when weight caching is on.
"""

import dataclasses
from typing import Optional

import torch

from lossd import errors
# Re-exported: lossd.nn.LossdRuntime is public, and the other modules import both from here.
from lossd._runtime import LossdRuntime, _to_torch  # noqa: F401


_WIRE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def compute_dtype(x):
    """The dtype the head's GEMM runs in for hidden states `x`: under torch.autocast (for x's
    device type) its dtype, as Liger-Kernel's losses compute there; else x's own. The weight
    (and bias) travel cast to it, and each gradient comes back in its parameter's dtype."""
    dev = x.device.type
    try:
        on = torch.is_autocast_enabled(dev)
        dt = torch.get_autocast_dtype(dev)
    except TypeError:  # torch < 2.4: no device-type argument
        cpu = dev == "cpu"
        on = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
        dt = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
    if on and x.is_floating_point() and dt in _WIRE_FLOATS:
        return dt
    return x.dtype


def mixed_grad_fp32(cdt, *params):
    """Whether a compute in `cdt` should return its gradients in fp32 for `params` (None
    skipped): where one of them is fp32 and the compute is not, so that its gradient is summed
    and returned in fp32 and cast once, not rounded to cdt first (as Liger's fp32 gradient
    accumulators for an fp32 head under autocast)."""
    return cdt != torch.float32 and any(p is not None and p.dtype == torch.float32
                                        for p in params)


@dataclasses.dataclass
class CrossEntropyOutput:
    """Returned instead of the bare loss when any return_* flag is set (Liger's shape)."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def _check_liger_arguments(weight, ce_weight, softcap, runtime):
    """What Liger-Kernel's function asserts (as ArgumentAssertionError), and lossd's own slot
    for the runtime, where Liger's Function takes ce_impl, ce_mode and chunk_mem_const."""
    if not hasattr(runtime, "compute"):  # a LossdRuntime, or a test's stand-in for one
        raise errors.InvalidArgumentError(
            "runtime must be a lossd.nn.LossdRuntime, got %r: LossdFusedLinearCrossEntropy"
            "Function.apply takes (..., return_predicted_tokens, chunk_size, runtime) where "
            "Liger's Function takes ce_impl, ce_mode and chunk_mem_const; call "
            "lossd_fused_linear_cross_entropy or the module instead" % (runtime,), method="nn")
    if ce_weight is not None:
        if ce_weight.dim() != 1 or ce_weight.shape[0] != weight.shape[0]:
            raise errors.ArgumentAssertionError(
                "ce_weight must be a tensor of size V = %d, got shape %s" % (
                    weight.shape[0], tuple(ce_weight.shape)), method="nn")
        if not torch.is_floating_point(ce_weight):
            raise errors.ArgumentAssertionError(
                "ce_weight must have a floating point dtype, got %s" % ce_weight.dtype,
                method="nn")
    if softcap is not None and not softcap > 0:
        # 0 would divide by zero in the softcap; lossd's wire would read it as "off".
        raise errors.ArgumentAssertionError(
            "softcap must be greater than 0.0 or None, got %s" % (softcap,), method="nn")


def _options(ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
             accum_dtype, input_dtype, chunk_rows, use_token_scaling):
    kw = dict(ignore_index=int(ignore_index), lse_square_scale=float(lse_square_scale),
              label_smoothing=float(label_smoothing), reduction=reduction,
              softcap=float(softcap) if softcap else None, chunk_rows=int(chunk_rows or 0))
    if use_token_scaling:
        kw["token_scaling"] = True  # left out otherwise: a server without the feature is fine
    if ce_weight is not None:
        kw["class_weights"] = ce_weight.detach().to(torch.float32)
    if accum_dtype is not None and accum_dtype != input_dtype:
        if accum_dtype != torch.float32:
            raise errors.InvalidArgumentError(
                "accum_dtype must be None, the input dtype or torch.float32, got %s" % accum_dtype)
        kw["grad_dtype"] = "fp32"
    return kw


_NOT_PASSED = object()  # LossdFusedLinearCrossEntropyFunction.apply without grad_enabled


def _eager_compute(runtime, x2, weight, t1, bias, opts, wants, needs, dtype):
    """The forward's compute when the gradients come with it: (result, the accumulator's
    note of this micro-batch or None). dtype: the compute dtype (x2's; W travels in it)."""
    need_dx, need_dw, need_db = needs
    acc = runtime.accumulator
    noted = None
    eager_opts = dict(opts)
    if dtype == torch.float16 and acc is None:
        # The upstream gradient (a loss scale of 65536, say) is applied in backward,
        # after the fact: fp16 gradients returned unscaled would already have lost
        # their small values to underflow. fp32 ones are scaled, then rounded once.
        eager_opts["grad_dtype"] = "fp32"
    key = None
    redo = False
    if acc is not None:
        key = runtime.micro_batch_key(x2, t1, weight, bias, opts)
        # Inside a backward: activation checkpointing running the forward again.
        redo = torch._C._current_graph_task_id() != -1 and runtime.take_redo(key)
    if redo:
        # Its first forward added dW and db already; this one only gives the
        # backward its saved dX again (scaled alike).
        r = runtime.compute(x2, weight, t1, bias, want_dx=need_dx, want_dw=False,
                            want_db=False, grad_scale=runtime.grad_scale, weight_dtype=dtype,
                            **eager_opts, **wants)
    else:
        r = runtime.compute(x2, weight, t1, bias, want_dx=need_dx, want_dw=need_dw,
                            want_db=need_db, accumulator=acc, weight_dtype=dtype,
                            grad_scale=runtime.grad_scale if acc else None,
                            **eager_opts, **wants)
        if acc is not None:
            noted = runtime.note_added(key)
    return r, noted


def _wants(reduction, return_z_loss, return_token_accuracy, return_predicted_tokens):
    """compute()'s want_* for the return_* flags. reduction 'none' gives a per-token accuracy,
    made from the server's argmax (_forward_outputs)."""
    return dict(want_z_loss=bool(return_z_loss), want_accuracy=bool(return_token_accuracy),
                want_predictions=bool(return_predicted_tokens) or (
                    bool(return_token_accuracy) and reduction == "none"))


def _forward_outputs(r, reduction, target, ignore_index, dev, dtype, return_z_loss,
                     return_token_accuracy, return_predicted_tokens):
    """(loss, z_loss, accuracy, predictions) as torch tensors on `dev` from a compute's result;
    None for those not asked for. dtype: the hidden states' (the z-loss's)."""
    if reduction == "none":
        loss = _to_torch(r.per_token_loss, dev).reshape(target.shape)
        z_loss = (_to_torch(r.per_token_z_loss, dev).reshape(target.shape)
                  if return_z_loss and r.per_token_z_loss is not None else None)
    else:
        loss = torch.tensor(r.loss, dtype=torch.float32, device=dev)
        z_loss = torch.tensor(r.z_loss, dtype=torch.float32, device=dev) if return_z_loss else None
    if z_loss is not None:
        z_loss = z_loss.to(dtype)  # Liger's z-loss buffer is in the input's dtype
    valid = target != ignore_index
    argmax = None
    if (return_predicted_tokens or return_token_accuracy) and r.predictions is not None:
        argmax = _to_torch(r.predictions, dev).reshape(target.shape)
    acc_t = None
    if return_token_accuracy and reduction == "none":
        # Liger's per-token accuracy: 1.0 where the argmax is the target, 0.0 elsewhere and on
        # ignored rows. The server reports the fraction only; its argmax gives each row's.
        if argmax is None:
            raise errors.ProtocolError("the server sent no predictions for the per-token "
                                       "token_accuracy of reduction 'none'", method="nn")
        acc_t = ((argmax == target) & valid).to(torch.float32)
    elif return_token_accuracy:
        # The fraction over non-ignored rows; 0.0 when all are ignored (Liger's is 0/0, NaN).
        acc_t = torch.tensor(r.accuracy, dtype=torch.float32, device=dev)
    pred = None
    if return_predicted_tokens and argmax is not None:
        # The server's tensor is the argmax of every row (lossd.proto); Liger's module
        # returns -1 where the target is ignore_index, and this module is its drop-in.
        # The targets are here, so the mapping is exact and needs nothing from the wire.
        pred = argmax.masked_fill(~valid, -1)
    return loss, z_loss, acc_t, pred


class LossdFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """apply(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
    label_smoothing, reduction, softcap, return_z_loss, accum_dtype, use_token_scaling,
    return_token_accuracy, return_predicted_tokens, chunk_size, runtime[, grad_enabled])
    -> (loss, z_loss, token_accuracy, predicted_tokens); the last three may be None.
    grad_enabled: torch.is_grad_enabled() where apply is called (forward itself always runs
    with grad mode off, so it cannot tell); False asks the server for the loss alone and adds
    nothing to an accumulator. The functional form and the module pass it."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
                label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
                use_token_scaling, return_token_accuracy, return_predicted_tokens, chunk_size,
                runtime, grad_enabled=_NOT_PASSED):
        _check_liger_arguments(weight, ce_weight, softcap, runtime)
        if reduction not in ("mean", "sum", "none"):
            raise errors.InvalidArgumentError(
                "reduction must be 'mean', 'sum' or 'none', got %r" % (reduction,))
        if tuple(target.shape) != tuple(_input.shape[:-1]):
            # The server sees only BT rows and BT targets; a transposed (T, B) target against
            # (B, T, H) hidden states would pair tokens with the wrong rows.
            raise errors.InvalidArgumentError(
                "target shape %s must be the hidden states' shape %s without its last "
                "dimension" % (tuple(target.shape), tuple(_input.shape)), method="nn")
        ctx.n_inputs = 17 if grad_enabled is _NOT_PASSED else 18  # one gradient per input
        grad_enabled = True if grad_enabled is _NOT_PASSED else bool(grad_enabled)
        if grad_enabled and ce_weight is not None and ce_weight.requires_grad:
            # As torch's cross_entropy: the loss is not differentiable in the class weights,
            # and detaching them quietly would leave a learnable weight without a gradient.
            raise errors.InvalidArgumentError(
                "ce_weight requires grad, but the loss is not differentiable with respect to "
                "the class weights: pass ce_weight.detach()", method="nn")
        h = _input.shape[-1]
        # Under autocast its dtype, else the hidden states': W and the bias travel cast to it,
        # and each gradient comes back in its own tensor's dtype (backward).
        cdt = ctx.cdt = compute_dtype(_input)
        x2 = _input.reshape(-1, h).to(cdt)
        t1 = target.reshape(-1)
        opts = _options(ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                        softcap, accum_dtype, cdt, chunk_size, use_token_scaling)
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        need_db = grad_enabled and bias is not None and ctx.needs_input_grad[3]
        if mixed_grad_fp32(cdt, _input if need_dx else None, weight if need_dw else None,
                           bias if need_db else None):
            opts["grad_dtype"] = "fp32"
        any_grad = need_dx or need_dw or need_db
        acc = runtime.accumulator
        deferred = any_grad and (reduction == "none" or (acc is not None
                                                         and not runtime.eager_accumulation))
        eager = any_grad and not deferred
        wants = _wants(reduction, return_z_loss, return_token_accuracy,
                       return_predicted_tokens)
        ctx.noted = None
        if eager:
            r, ctx.noted = _eager_compute(runtime, x2, weight, t1, bias, opts, wants,
                                          (need_dx, need_dw, need_db), cdt)
        else:
            r = runtime.compute(x2, weight, t1, bias, want_dx=False, want_dw=False,
                                want_db=False, weight_dtype=cdt, **opts, **wants)
        dev = _input.device
        loss, z_loss, acc_t, pred = _forward_outputs(r, reduction, target, ignore_index, dev,
                                                      _input.dtype, return_z_loss,
                                                      return_token_accuracy,
                                                      return_predicted_tokens)
        # One call: each call replaces the set marked before.
        ctx.mark_non_differentiable(*[e for e in (z_loss, acc_t, pred) if e is not None])

        ctx.mode = "eager" if eager else ("deferred" if deferred else "none")
        ctx.runtime = runtime
        ctx.reduction = reduction
        ctx.opts = opts
        ctx.needs = (need_dx, need_dw, need_db)
        ctx.shapes = (_input.shape, _input.dtype, weight.dtype, weight.device,
                      None if bias is None else (bias.dtype, bias.device))
        if eager:
            dx = _to_torch(r.dx, dev) if need_dx else None
            dw = _to_torch(r.dw, weight.device) if need_dw and acc is None else None
            db = _to_torch(r.db, bias.device) if need_db and acc is None else None
            # Saved (not kept on ctx): freed after the last backward, not held until the graph
            # goes, and there again for a second backward through a retained graph.
            ctx.save_for_backward(dx, dw, db)
            ctx.backwards = 0
        elif deferred:
            ctx.save_for_backward(_input, weight, target, bias)
        return loss, z_loss, acc_t, pred

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        if torch.is_grad_enabled():
            # backward(create_graph=True): the server's gradients carry no graph, so a
            # gradient penalty built on them would silently lose its second-order terms.
            raise errors.UnimplementedError(
                "the lossd loss is differentiable once: double backward (create_graph=True) "
                "is not supported", method="nn")
        in_shape, in_dtype, w_dtype, w_dev, b_meta = ctx.shapes
        need_dx, need_dw, need_db = ctx.needs
        runtime = ctx.runtime
        acc = runtime.accumulator
        if ctx.mode == "eager":
            dx, dw, db = ctx.saved_tensors  # recomputed here, under activation checkpointing
            ctx.backwards += 1
            if ctx.noted is not None:
                runtime.forget_added(ctx.noted)  # no later forward can redo this one
                ctx.noted = None
            if acc is not None and ctx.backwards > 1:
                raise errors.FailedPreconditionError(
                    "eager_accumulation added this micro-batch to the accumulator once, in "
                    "forward; a second backward through a retained graph cannot add it again "
                    "(use the deferred mode, the default)", method="nn")
            g = grad_loss.detach()
            unit = bool(torch.all(g == 1.0))
            if acc is not None and not unit:
                raise errors.FailedPreconditionError(
                    "eager_accumulation needs an upstream gradient of exactly 1 (the server has "
                    "already accumulated dW); scale the loss with grad_scale instead", method="nn")
            if not unit:
                gf = g.to(torch.float32)
                dx = None if dx is None else (dx.float() * gf.to(dx.device)).to(dx.dtype)
                dw = None if dw is None else (dw.float() * gf.to(dw.device)).to(dw.dtype)
                db = None if db is None else (db.float() * gf.to(db.device)).to(db.dtype)
        elif ctx.mode == "deferred":
            _input, weight, target, bias = ctx.saved_tensors
            h = _input.shape[-1]
            kw = dict(ctx.opts)
            if ctx.reduction == "none":
                go = grad_loss.detach().reshape(-1).to(torch.float32).cpu()
                kw["grad_output"] = go * runtime.grad_scale if acc else go
            else:
                kw["grad_scale"] = float(grad_loss.detach()) * (runtime.grad_scale if acc else 1.0)
            r = runtime.compute(_input.reshape(-1, h).to(ctx.cdt), weight, target.reshape(-1),
                                bias, want_dx=need_dx, want_dw=need_dw, want_db=need_db,
                                accumulator=acc, weight_dtype=ctx.cdt, **kw)
            dx = _to_torch(r.dx, _input.device) if need_dx else None
            dw = _to_torch(r.dw, weight.device) if need_dw and acc is None else None
            db = _to_torch(r.db, bias.device) if need_db and acc is None else None
        else:
            dx = dw = db = None
        if dx is not None:
            dx = dx.reshape(in_shape).to(in_dtype)
        if dw is not None:
            dw = dw.to(device=w_dev, dtype=w_dtype)
        if db is not None:
            db = db.to(device=b_meta[1], dtype=b_meta[0])
        return (dx, dw, None, db) + (None,) * (ctx.n_inputs - 4)


def lossd_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None,
                                     ignore_index=-100, lse_square_scale=0.0,
                                     label_smoothing=0.0, reduction="mean", softcap=None,
                                     return_z_loss=False, accum_dtype=None,
                                     use_token_scaling=False, return_token_accuracy=False,
                                     return_predicted_tokens=False, chunk_mem_const=1, *,
                                     chunk_size=None, runtime=None, **runtime_kwargs):
    """Liger-Kernel's liger_fused_linear_cross_entropy (0.8.5), computed by a lossd server.

    Liger's arguments in Liger's order. chunk_mem_const (Liger's budget of transient logits)
    is checked as Liger checks it and otherwise unused: the server chooses its own chunks.
    Keyword-only: chunk_size (the server's rows per chunk), and `runtime` (a LossdRuntime) or
    its keyword arguments, saying where to go."""
    if isinstance(chunk_mem_const, bool) or not isinstance(chunk_mem_const, int) \
            or chunk_mem_const < 1:
        raise errors.InvalidArgumentError(
            "chunk_mem_const must be a positive integer, got %r" % (chunk_mem_const,),
            method="nn")
    if runtime is None:
        runtime = LossdRuntime(**runtime_kwargs)
    loss, z_loss, acc, pred = LossdFusedLinearCrossEntropyFunction.apply(
        input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
        reduction, softcap, return_z_loss, accum_dtype, use_token_scaling,
        return_token_accuracy, return_predicted_tokens, chunk_size, runtime,
        torch.is_grad_enabled())
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=acc,
                              predicted_tokens=pred)


class LossdFusedLinearCrossEntropyLoss(torch.nn.Module):
    """Liger's LigerFusedLinearCrossEntropyLoss, computed by a lossd server.

    forward(lin_weight, _input, target, bias=None): _input (..., H), lin_weight (V, H),
    target (...) int, bias (V). Returns the loss, or a CrossEntropyOutput when any of
    return_z_loss / return_token_accuracy / return_predicted_tokens is set.

    Keyword-only extras: server ("host:port") or client (a lossd.Client, or a
    lossd.ReplicaPool: W then goes to the replica of its weights' name, or of the accumulator;
    a StepLostError from backward asks for drop_accumulator() and the step again),
    cache_weights, accumulator, eager_accumulation, grad_scale, timeout, part_bytes (see
    LossdRuntime).
    chunk_size maps to the server's chunk_rows. use_token_scaling needs a server that lists
    the "token_scaling" feature (ServerInfo).
    """

    def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                 label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False,
                 accum_dtype=None, use_token_scaling=False, return_token_accuracy=False,
                 return_predicted_tokens=False, chunk_size=None, *, server="localhost:50051",
                 client=None, cache_weights=True, accumulator=None, eager_accumulation=False,
                 grad_scale=1.0, timeout=None, part_bytes=None):
        super().__init__()
        if not 0.0 <= label_smoothing <= 1.0:
            raise errors.ArgumentAssertionError(
                "label_smoothing must be between 0.0 and 1.0. Got: %s" % label_smoothing)
        if reduction not in ("mean", "sum", "none"):
            raise errors.ArgumentAssertionError(
                "reduction must be 'mean' or 'sum' or 'none'. Got: %s" % reduction)
        if softcap is not None and not softcap > 0:
            raise errors.ArgumentAssertionError(
                "softcap must greater than 0.0 or None. Got: %s" % softcap)
        self.ce_weight = ce_weight
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.accum_dtype = accum_dtype
        self.use_token_scaling = use_token_scaling
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self.chunk_size = chunk_size
        self.runtime = LossdRuntime(client=client, server=server, cache_weights=cache_weights,
                                    accumulator=accumulator,
                                    eager_accumulation=eager_accumulation,
                                    grad_scale=grad_scale, timeout=timeout,
                                    part_bytes=part_bytes)

    def forward(self, lin_weight, _input, target, bias=None):
        return lossd_fused_linear_cross_entropy(
            _input, lin_weight, target, bias, self.ce_weight, self.ignore_index,
            self.lse_square_scale, self.label_smoothing, self.reduction, self.softcap,
            self.return_z_loss, self.accum_dtype, self.use_token_scaling,
            self.return_token_accuracy, self.return_predicted_tokens,
            chunk_size=self.chunk_size, runtime=self.runtime)

    # Gradient accumulation on the server (accumulator=...).
    def apply_accumulated_gradients(self, lin_weight, bias=None, reset=True):
        return self.runtime.apply_accumulated_gradients(lin_weight, bias, reset=reset)

    def fetch_gradients(self, reset=True):
        return self.runtime.fetch_gradients(reset=reset)

    def drop_accumulator(self):
        """Drops the accumulator's sum on the server: with a lossd.ReplicaPool, do so before
        redoing a step after a StepLostError."""
        self.runtime.drop_accumulator()

    def release(self):
        """Drops the cached weight handle on the server."""
        self.runtime.close()


# The hosted head's names (lossd._remote_head, _remote_head_opt build on the names above):
# loaded on first use (PEP 562), so either side may be imported first.
_HOSTED_HEAD = {"RemoteLMHead": "_remote_head", "head_state_from_torch": "_remote_head",
                "RemoteHeadOptimizer": "_remote_head_opt", "clip_grad_norm_": "_remote_head_opt"}


def __getattr__(name):
    if name not in _HOSTED_HEAD:
        raise AttributeError("module 'lossd.nn' has no attribute %r" % name)
    import importlib

    return getattr(importlib.import_module("lossd." + _HOSTED_HEAD[name]), name)


__all__ = ["LossdFusedLinearCrossEntropyLoss", "LossdFusedLinearCrossEntropyFunction",
           "lossd_fused_linear_cross_entropy", "LossdRuntime", "CrossEntropyOutput",
           "RemoteLMHead", "RemoteHeadOptimizer", "clip_grad_norm_", "head_state_from_torch"]
