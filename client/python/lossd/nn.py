"""PyTorch integration: a drop-in for Liger-Kernel's LigerFusedLinearCrossEntropyLoss that runs
the linear + cross-entropy (forward and backward) on a lossd server; and RemoteLMHead, an LM
head whose parameters and optimizer live on lossd (lossd._remote_head, _remote_head_opt).

Same constructor and forward arguments as Liger's module, plus keyword-only connection
settings. Never materialises the logits locally; tensors on a GPU are copied to the host to
travel. Importing this module imports torch.

Two ways a call runs (both give the gradients torch would):
  eager    (reduction mean/sum, no server accumulator): one Compute in forward returns the
           loss and dX, dW, db; backward only scales them by the upstream gradient.
  deferred (reduction none, or a server accumulator): forward asks for the loss only;
           backward sends a second Compute carrying the upstream gradient (per-token for none,
           grad_scale for mean/sum), so `(loss / k).backward()` accumulates exactly on the
           server. X travels twice; W does not when weight caching is on.
"""

import collections
import dataclasses
import uuid
import weakref
from typing import Optional

import numpy as np
import torch

from lossd import errors
from lossd.client import Client
from lossd.tensors import BF16Array


@dataclasses.dataclass
class CrossEntropyOutput:
    """Returned instead of the bare loss when any return_* flag is set (Liger's shape)."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def _to_torch(value, device):
    """A received ndarray / BF16Array -> torch tensor on `device` (no copy on the host)."""
    if value is None:
        return None
    if isinstance(value, BF16Array):
        t = torch.from_numpy(value.bits.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(value)
    return t.to(device) if device is not None and device.type != "cpu" else t


class LossdRuntime:
    """Connection, weight cache and accumulator shared by the calls of one loss module.

    cache_weights: upload W (and bias) once with PutWeights and send only the handle while the
      tensors are unchanged: the same tensor objects at the same autograd version (in-place
      optimizer steps bump it). A weight made anew each step (a bf16 copy of fp32 master
      weights, a merged adapter) is another tensor, so it is uploaded again even where the
      allocator reuses the old one's memory. A handle the server dropped is uploaded again
      once. Writes that bypass the version counter (through `w.data`, a numpy view, or a
      buffer re-filled in place by a sharding wrapper) are not seen: call `drop_weights()`
      after them, or turn caching off.
    timeout: deadline of every call in seconds; None = the Client's default (600 s).
    accumulator: None, a name, or True for a fresh unique name: dW and db go into that
      server-side fp32 accumulator instead of weight.grad / bias.grad; call
      `apply_accumulated_gradients` before the optimizer step.
    eager_accumulation: accumulate in the forward Compute (one call per micro-batch instead of
      two). The upstream gradient of the loss must then be exactly 1: scale with `grad_scale`.
      Activation checkpointing runs the forward again inside backward; that forward adds
      nothing when it redoes one that already added (use_reentrant=False: it asks for dX
      alone), and adds when the first ran without grad (use_reentrant=True). Which is which
      is told by the micro-batch's content (samples of X, the targets, W and the bias).
    grad_scale: the factor dW and db are added to the accumulator with; only with an
      accumulator (without one, scale the loss).
    """

    def __init__(self, client=None, server="localhost:50051", *, cache_weights=True,
                 accumulator=None, eager_accumulation=False, grad_scale=1.0, timeout=None,
                 part_bytes=None):
        if float(grad_scale) != 1.0 and not accumulator:
            raise errors.InvalidArgumentError(
                "grad_scale %r applies to a server accumulator; without one, scale the loss "
                "(its backward scales every gradient)" % (grad_scale,), method="nn")
        if client is None:
            kw = {} if part_bytes is None else {"part_bytes": part_bytes}
            # timeout None: the Client's own default deadline, as for its methods (a Client
            # built with timeout=None would have no deadline at all, and a stalled call would
            # hang the training step).
            if timeout is not None:
                kw["timeout"] = timeout
            client = Client(server, **kw)
        self.client = client
        self.timeout = timeout
        self.cache_weights = cache_weights
        if accumulator is True:
            accumulator = "acc-" + uuid.uuid4().hex
        self.accumulator = accumulator or None
        self.eager_accumulation = eager_accumulation
        self.grad_scale = float(grad_scale)
        self._handle = None
        self._key = None
        # Eager forwards that added to the accumulator and whose backward has not run yet, by
        # micro-batch content: key -> [added, not yet redone; redone]. A forward run again
        # inside backward (activation checkpointing) that matches one of them redoes it.
        # Forwards of one key are interchangeable, so counts suffice.
        self._added = collections.OrderedDict()

    # -- eager accumulation under activation checkpointing ------------------------------

    _ADDED_KEPT = 256  # forwards without a backward (evaluation with grad on) age out

    @staticmethod
    def micro_batch_key(x2, t1, weight, bias, opts):
        """What identifies a micro-batch across a recomputation: a recomputed X is a new
        tensor with the same values, and so may W be (a cast or a merged adapter made inside
        the checkpointed region), so evenly spaced samples of X, the targets, W and the bias
        (gathers of at most 1024 elements each), their shapes and dtypes, and the options."""
        def sample(t):
            if t is None:
                return None
            t = t.detach()
            n = t.numel()
            if n == 0:
                return (tuple(t.shape), t.dtype, b"")
            k = min(n, 1024)
            # Integer positions: float ones (linspace) round past the end above 2^24 elements.
            idx = torch.arange(k, device=t.device, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
            if t.is_contiguous():
                vals = t.view(-1)[idx]
            else:  # a transposed W, say: gathered in place, not flattened by a full copy
                vals = t[torch.unravel_index(idx, t.shape)]
            vals = vals.cpu().double()  # exact for every input dtype
            return (tuple(t.shape), t.dtype, vals.numpy().tobytes())

        return (sample(x2), sample(t1), sample(weight), sample(bias),
                repr(sorted((k, v) for k, v in opts.items() if k != "class_weights")))

    def note_added(self, key):
        """An eager forward added its micro-batch; returns the key for forget_added."""
        counts = self._added.setdefault(key, [0, 0])
        counts[0] += 1
        self._added.move_to_end(key)
        while len(self._added) > self._ADDED_KEPT:
            self._added.popitem(last=False)
        return key

    def take_redo(self, key):
        """True when a forward of this content added and was not yet redone: this one (run
        inside backward) redoes it, and must not add again."""
        counts = self._added.get(key)
        if counts is None or counts[0] == 0:
            return False
        counts[0] -= 1
        counts[1] += 1
        return True

    def forget_added(self, key):
        """The backward of a forward that added has run: a redone forward of its key is done
        with (the redo ran for this backward), else one not redone (no checkpointing)."""
        counts = self._added.get(key)
        if counts is None:
            return
        if counts[1] > 0:
            counts[1] -= 1
        elif counts[0] > 0:
            counts[0] -= 1
        if counts == [0, 0]:
            del self._added[key]

    # -- weights ------------------------------------------------------------------------

    @staticmethod
    def _fingerprint(t):
        """What else must not change: the memory, shape and dtype (`w.data = other` keeps the
        tensor object and its version counter but not these)."""
        return (t.data_ptr(), t._version, tuple(t.shape), t.dtype, str(t.device))

    @classmethod
    def _key_of(cls, weight, bias):
        """What the cached handle was made from: weak references to the tensors themselves
        (an address alone would match a new tensor that took over a freed one's memory) and
        their fingerprints."""
        def k(t):
            if t is None:
                return None
            return (weakref.ref(t), cls._fingerprint(t))

        return (k(weight), k(bias))

    def _key_matches(self, weight, bias):
        if self._key is None:
            return False
        for t, cached in zip((weight, bias), self._key):
            if (t is None) != (cached is None):
                return False
            if t is not None and (cached[0]() is not t or cached[1] != self._fingerprint(t)):
                return False
        return True

    def weight_ref(self, weight, bias):
        """A WeightHandle for (weight, bias), uploading when they changed; None = send inline."""
        if not self.cache_weights:
            return None
        if self._handle is not None and self._key_matches(weight, bias):
            return self._handle
        key = self._key_of(weight, bias)
        self.drop_weights()
        kw = {}
        if getattr(self.client, "is_pool", False) and self.accumulator:
            # A replica pool: W lives on the accumulator's replica, where its computes go
            # (one upload a step, not two).
            kw["near"] = "acc:" + self.accumulator
        self._handle = self.client.put_weights(weight, bias, timeout=self.timeout, **kw)
        self._key = key
        return self._handle

    def drop_weights(self):
        if self._handle is not None:
            try:
                self.client.drop_weights(self._handle, timeout=self.timeout)
            except errors.LossdError:
                pass  # already evicted or the server restarted: nothing left to free
            self._handle = None
            self._key = None

    def compute(self, x, weight, target, bias, **kw):
        """client.compute with W by handle when caching, re-uploading once if it was dropped."""
        ref = self.weight_ref(weight, bias)
        try:
            if ref is None:
                return self.client.compute(x, weight, target, bias=bias, timeout=self.timeout, **kw)
            return self.client.compute(x, ref, target, timeout=self.timeout, **kw)
        except errors.NotFoundError:
            # Only a handle the server no longer holds is worth an upload; any other error
            # (a poisoned accumulator is FailedPrecondition) would fail the same way again.
            if ref is None:
                raise
            self._handle = None
            self._key = None
            ref = self.weight_ref(weight, bias)
            return self.client.compute(x, ref, target, timeout=self.timeout, **kw)

    # -- accumulator --------------------------------------------------------------------

    def fetch_gradients(self, reset=True):
        if self.accumulator is None:
            raise errors.FailedPreconditionError("no accumulator configured", method="nn")
        g = self.client.fetch_gradients(self.accumulator, reset=reset, timeout=self.timeout)
        if reset:
            self._added.clear()  # a new step: no forward before it is redone in it
        return g

    def apply_accumulated_gradients(self, weight, bias=None, reset=True):
        """Adds the accumulated fp32 dW (and db) into weight.grad (bias.grad); returns the
        Gradients read (micro_batches, tokens)."""
        g = self.fetch_gradients(reset=reset)
        if g.micro_batches == 0:
            # Nothing was added since the last reset: no backward ran, or a fetch that reset
            # the sum was lost on its way (the server zeroes when it takes the snapshot).
            # Adding zeros would make the step look done.
            raise errors.FailedPreconditionError(
                "accumulator %r holds no micro-batches: no backward added to it since its last "
                "reset, or the fetch that reset it did not arrive" % self.accumulator,
                method="nn")
        for p, val in ((weight, g.dw), (bias, g.db)):
            if p is None or val is None:
                continue
            t = torch.from_numpy(val).to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = t.clone()  # own the memory; t may share the received buffer
            else:
                p.grad.add_(t)
        return g

    def drop_accumulator(self):
        """Drops the server's sum (what a StepLostError asks before the step is redone)."""
        if self.accumulator is not None:
            self._added.clear()
            self.client.drop_accumulator(self.accumulator, timeout=self.timeout)

    def close(self):
        self.drop_weights()


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
    note of this micro-batch or None)."""
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
                            want_db=False, grad_scale=runtime.grad_scale,
                            **eager_opts, **wants)
    else:
        r = runtime.compute(x2, weight, t1, bias, want_dx=need_dx, want_dw=need_dw,
                            want_db=need_db, accumulator=acc,
                            grad_scale=runtime.grad_scale if acc else None,
                            **eager_opts, **wants)
        if acc is not None:
            noted = runtime.note_added(key)
    return r, noted


def _forward_outputs(r, reduction, target, ignore_index, dev, return_z_loss,
                     return_token_accuracy, return_predicted_tokens):
    """(loss, z_loss, accuracy, predictions) as torch tensors on `dev` from a compute's result;
    None for those not asked for."""
    if reduction == "none":
        loss = _to_torch(r.per_token_loss, dev).reshape(target.shape)
        z_loss = (_to_torch(r.per_token_z_loss, dev).reshape(target.shape)
                  if return_z_loss and r.per_token_z_loss is not None else None)
    else:
        loss = torch.tensor(r.loss, dtype=torch.float32, device=dev)
        z_loss = torch.tensor(r.z_loss, dtype=torch.float32, device=dev) if return_z_loss else None
    acc_t = (torch.tensor(r.accuracy, dtype=torch.float32, device=dev)
             if return_token_accuracy else None)
    pred = None
    if return_predicted_tokens and r.predictions is not None:
        # The server's tensor is the argmax of every row (lossd.proto); Liger's module
        # returns -1 where the target is ignore_index, and this module is its drop-in.
        # The targets are here, so the mapping is exact and needs nothing from the wire.
        pred = _to_torch(r.predictions, dev).reshape(target.shape)
        pred = pred.masked_fill(target == ignore_index, -1)
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
        x2 = _input.reshape(-1, h)
        t1 = target.reshape(-1)
        opts = _options(ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                        softcap, accum_dtype, _input.dtype, chunk_size, use_token_scaling)
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        need_db = grad_enabled and bias is not None and ctx.needs_input_grad[3]
        any_grad = need_dx or need_dw or need_db
        acc = runtime.accumulator
        deferred = any_grad and (reduction == "none" or (acc is not None
                                                         and not runtime.eager_accumulation))
        eager = any_grad and not deferred
        wants = dict(want_z_loss=bool(return_z_loss), want_accuracy=bool(return_token_accuracy),
                     want_predictions=bool(return_predicted_tokens))
        ctx.noted = None
        if eager:
            r, ctx.noted = _eager_compute(runtime, x2, weight, t1, bias, opts, wants,
                                          (need_dx, need_dw, need_db), _input.dtype)
        else:
            r = runtime.compute(x2, weight, t1, bias, want_dx=False, want_dw=False,
                                want_db=False, **opts, **wants)
        dev = _input.device
        loss, z_loss, acc_t, pred = _forward_outputs(r, reduction, target, ignore_index, dev,
                                                      return_z_loss, return_token_accuracy,
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
            r = runtime.compute(_input.reshape(-1, h), weight, target.reshape(-1), bias,
                                want_dx=need_dx, want_dw=need_dw, want_db=need_db,
                                accumulator=acc, **kw)
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
                                     return_predicted_tokens=False, chunk_size=None, *,
                                     runtime=None, **runtime_kwargs):
    """Functional form; `runtime` (a LossdRuntime) or its keyword arguments say where to go."""
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
            raise errors.InvalidArgumentError(
                "label_smoothing must be between 0.0 and 1.0. Got: %s" % label_smoothing)
        if reduction not in ("mean", "sum", "none"):
            raise errors.InvalidArgumentError(
                "reduction must be 'mean' or 'sum' or 'none'. Got: %s" % reduction)
        if softcap is not None and not softcap > 0:
            raise errors.InvalidArgumentError(
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
            self.return_token_accuracy, self.return_predicted_tokens, self.chunk_size,
            runtime=self.runtime)

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
