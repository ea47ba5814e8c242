# SPDX-License-Identifier: Apache-2.0
"""A hosted LM head as a torch module (lossd.nn.RemoteLMHead): the head's parameters, its
optimizer state and the sum of every data-parallel rank's gradient live on lossd; forward sends
X and the labels, backward hands dX to the hidden states, and the step runs on the server.

Its optimizer-like object and the clipping helper live in lossd._remote_head_opt. Imports
torch; never materialises the logits or the head's gradient locally.
"""

import math

import torch

from lossd import errors
from lossd._heads import OptimizerConfig
from lossd.client import Client
from lossd.nn import (CrossEntropyOutput, _forward_outputs, _options, _to_torch, _wants,
                      compute_dtype)

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Errors after which the same Compute may be sent again: the call may or may not have reached
# the server, and its (rank, micro-batch) key keeps a second arrival from adding twice.
_RETRIABLE = (errors.UnavailableError, errors.DeadlineExceededError)


def _dist_rank_world():
    """(rank, world_size) of torch.distributed where it is initialised, else None."""
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _is_power_of_two(x):
    return x > 0 and math.frexp(x)[0] == 0.5


class RemoteLMHead(torch.nn.Module):
    """An LM head (V, H) whose parameters live on a lossd server.

    forward(hidden (..., H), labels (...)) returns the loss (or a CrossEntropyOutput with any
    return_* flag) with LossdFusedLinearCrossEntropyLoss's options; backward gives dX to
    `hidden`, and each call's dW/db go straight into the head's current step on the server.
    The head's optimizer (`optimizer()`, a torch.optim.Optimizer) steps it there.

    name: the head's name on the server (1-128 of [A-Za-z0-9._:/-]).
    client: a lossd.Client, or a lossd.ReplicaPool (every call goes to the head's replica;
      where that replica is lost, forward or the step raises HeadLostError: load_export(the
      last export) and redo the step). Over a pool, a head served by a head group sends this
      rank's Computes and Steps to member rank % S of its group.
    group: with a ReplicaPool and weights, create the head as a head group of the pool's
      replicas: {"members": [...], "id": ...} (both optional), as ReplicaPool.create_head.
    weight, bias: the initial (V, H) weight and (V) bias to create the head from (fp32, or
      bf16/fp16: the fp32 master is their upcast); None attaches to an existing head. With
      torch.distributed initialised rank 0 creates and every rank waits at a barrier;
      without it, a module given weights creates (repeating a create of the same head at
      the same version changes nothing).
    optimizer: OptimizerConfig (or "sgd", "adamw", a dict); state, version, optimizer_step:
      an imported optimizer state (see head_state_from_torch, or a HeadExport's).
    compute_dtype: the compute copy's dtype, the hidden states' (default: weight's).
    rank, world_size: this trainer's place among the data-parallel ranks that share the
      head (default: torch.distributed's, else 0 and 1).
    grad_scale: the factor every rank's contribution to the head's gradient is summed with;
      default 1/world_size, the average DDP takes of a replicated head's gradient. dX is
      returned unscaled by it (the backbone's DDP averages dX's effect itself); where
      1/world_size is not a power of two, dX travels in fp32 and is rescaled here (one
      rounding more than a local head's for bf16/fp16).
    grad_scaler: a torch.amp.GradScaler: the head's gradient is then added scaled by its
      current scale (as scaler.scale(loss).backward() scales a local head's) and the step
      unscales it (see RemoteHeadOptimizer).
    deferred: False (default): forward's one Compute also adds dW/db, with the upstream
      gradient backward will bring, which must then be known: 1, times loss_scale (a forward
      argument, e.g. 1/k for k accumulated micro-batches), times the GradScaler's scale.
      True (and reduction "none"): forward asks for the loss only, backward sends a second
      Compute with the actual upstream gradient (X travels twice).
    retries: a Compute that fails with UNAVAILABLE or DEADLINE_EXCEEDED is sent again this
      many times with the same (rank, micro-batch) key (never added twice).
    """

    def __init__(self, name, weight=None, bias=None, *, client=None, server="localhost:50051",
                 optimizer=None, compute_dtype=None, state=None, version=0, optimizer_step=0,
                 rank=None, world_size=None, grad_scale=None, grad_scaler=None, deferred=False,
                 ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                 use_token_scaling=False, return_token_accuracy=False,
                 return_predicted_tokens=False, chunk_size=None, retries=2, group=None,
                 timeout=None):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise errors.InvalidArgumentError(
                "reduction must be 'mean', 'sum' or 'none', got %r" % (reduction,))
        if not 0.0 <= label_smoothing <= 1.0:
            raise errors.InvalidArgumentError(
                "label_smoothing must be in [0, 1], got %r" % (label_smoothing,))
        self.client = client if client is not None else Client(
            server, **({} if timeout is None else {"timeout": timeout}))
        self.name = str(name)
        self.timeout = timeout
        dist = _dist_rank_world()
        self.rank = int(rank if rank is not None else (dist[0] if dist else 0))
        self.world_size = int(world_size if world_size is not None else (dist[1] if dist else 1))
        if not 0 <= self.rank < self.world_size:
            raise errors.InvalidArgumentError("rank %d is not in [0, world_size %d)" % (
                self.rank, self.world_size))
        self.grad_scale = float(1.0 / self.world_size if grad_scale is None else grad_scale)
        if not self.grad_scale > 0:
            raise errors.InvalidArgumentError("grad_scale must be > 0, got %r" % grad_scale)
        self.grad_scaler = grad_scaler
        self.deferred = bool(deferred) or reduction == "none"
        self.retries = int(retries)
        self.ce_weight, self.ignore_index = ce_weight, ignore_index
        self.lse_square_scale, self.label_smoothing = lse_square_scale, label_smoothing
        self.reduction, self.softcap = reduction, softcap
        self.return_z_loss, self.accum_dtype = return_z_loss, accum_dtype
        self.use_token_scaling, self.chunk_size = use_token_scaling, chunk_size
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self._micro_batch = 0  # the next key of this rank's current step
        self._step_scale = None  # the GradScaler scale this step's Computes were sent with
        self._eval = None  # (version, WeightHandle of the compute copy) for loss-only calls
        self._optimizer = None
        # Not a parameter (nothing here is trained locally): an input of the loss's graph
        # that requires grad, so backward reaches the head even where the hidden states do
        # not need a gradient (a frozen backbone), and the head's gradient is added.
        self._anchor = torch.zeros((), requires_grad=True)
        if group is not None and not getattr(self.client, "is_pool", False):
            raise errors.InvalidArgumentError(
                "group: a head group is created through a lossd.ReplicaPool of its members "
                "(client=ReplicaPool(...)), not one lossd.Client", method="nn")
        if weight is not None:
            self._create(weight, bias, optimizer, compute_dtype, state, version, optimizer_step,
                         dist is not None, group)
        self.info = self.client.head_info(self.name, timeout=timeout)
        self.version = self.info.version

    def _create(self, weight, bias, optimizer, compute_dtype, state, version, optimizer_step,
                distributed, group):
        if not distributed or self.rank == 0:
            cdt = compute_dtype if compute_dtype is not None else weight.dtype
            kw = {} if group is None else {"group": group}
            self.client.create_head(self.name, weight.detach(),
                                    None if bias is None else bias.detach(),
                                    optimizer=optimizer, compute_dtype=cdt, state=state,
                                    version=version, optimizer_step=optimizer_step,
                                    timeout=self.timeout, **kw)
        if distributed:
            torch.distributed.barrier()

    # -- what the step and the optimizer need -------------------------------------------

    def loss_scale_of_scaler(self):
        """The GradScaler's current scale (1 without one, or one disabled)."""
        s = self.grad_scaler
        if s is None or not s.is_enabled():
            return 1.0
        return float(s.get_scale())

    def step_phase(self, phase, **kw):
        """This rank's Step of the head's current version (a barrier over world_size)."""
        return self.client.step(self.name, self.version, rank=self.rank,
                                world_size=self.world_size, phase=phase, timeout=self.timeout,
                                **kw)

    def stepped(self, result):
        """A step completed (applied or skipped): the next version, and new keys."""
        self.version = result.version
        self._micro_batch = 0
        self._step_scale = None

    def unscale_coef(self):
        """1/scale (fp32, as GradScaler.unscale_ computes it) when this step's Computes were
        scaled by a GradScaler, else None."""
        if self._step_scale is None or self._step_scale == 1.0:
            return None
        return float(torch.tensor(self._step_scale, dtype=torch.float64).reciprocal().float())

    def optimizer(self, lr=None, max_norm=None):
        """The head's RemoteHeadOptimizer (one per module, made by the first call; lr: its
        param_groups' lr, default the head's; max_norm: clip the head alone)."""
        from lossd._remote_head_opt import RemoteHeadOptimizer

        if self._optimizer is None:
            self._optimizer = RemoteHeadOptimizer(self, lr=lr, max_norm=max_norm)
        elif lr is not None or max_norm is not None:
            raise errors.FailedPreconditionError(
                "head %r already has its optimizer: lr and max_norm go to the first "
                "optimizer() call" % self.name, method="nn")
        return self._optimizer

    def export(self, tensors=None):
        """The head's HeadExport at the version this module computes against."""
        return self.client.export_head(self.name, version=self.version, tensors=tensors,
                                       timeout=self.timeout)

    def load_export(self, export, group=None):
        """Makes the head the export's (a checkpoint): rank 0 (or a module without
        torch.distributed) imports it, dropping a head of that name at another version
        first; every rank then computes against the export's version. group (over a
        ReplicaPool): the head group to import into, {"members": [...], "id": ...}; a head
        served by a group is imported into a new group of the same members by default (after
        a member was lost, name the live ones)."""
        dist = _dist_rank_world()
        if group is None and getattr(self.client, "is_pool", False) and self.info.group:
            # A group's id is used once: an import makes a new group.
            group = {"members": list(self.info.group["members"])}
        kw = {} if group is None else {"group": group}
        if dist is None or self.rank == 0:
            try:
                self.client.import_head(export, self.name, timeout=self.timeout, **kw)
            except errors.AlreadyExistsError:
                self.client.drop_head(self.name, timeout=self.timeout)
                self.client.import_head(export, self.name, timeout=self.timeout, **kw)
        if dist is not None:
            torch.distributed.barrier()
        self.info = self.client.head_info(self.name, timeout=self.timeout)
        self.version = self.info.version
        self._micro_batch = 0
        self._step_scale = None

    def weight(self):
        """The fp32 master weight (V, H) as a torch tensor (an export of it alone)."""
        return torch.from_numpy(self.export(tensors=("master_w",)).tensors["master_w"].copy())

    def drop(self):
        """Drops the head on the server (every rank's module then fails to compute)."""
        self._drop_eval()
        self.client.drop_head(self.name, timeout=self.timeout)

    # -- computes -------------------------------------------------------------------------

    def next_key(self):
        k = self._micro_batch
        self._micro_batch += 1
        return k

    def head_compute(self, x2, t1, opts, key, **kw):
        """A Compute on the head that adds to its step, retried with the same key."""
        for attempt in range(self.retries + 1):
            try:
                return self.client.compute(x2, None, t1, head=self.name,
                                           head_version=self.version, rank=self.rank,
                                           micro_batch=key, want_dw=False, want_db=False,
                                           timeout=self.timeout, **opts, **kw)
            except _RETRIABLE:
                if attempt == self.retries:
                    raise

    def head_compute_async(self, x2, t1, opts, key, *, ready=None, **kw):
        """head_compute on the client's executor (lossd._async): a concurrent.futures.Future
        of its result, retried there; the key is the caller's, fixed before the call waits.
        ready: a torch.cuda.Event the call waits for first (x2 copied to the host by a
        non_blocking copy), or None."""
        def call():
            if ready is not None:
                ready.synchronize()
            return self.head_compute(x2, t1, opts, key, **kw)

        return self.client.call_async(call)

    def loss_only(self, x2, t1, opts, **kw):
        """A Compute that adds nothing to the step (evaluation, a deferred forward): on a
        weight handle holding this version's compute copy, fetched once per version."""
        if self._eval is None or self._eval[0] != self.version:
            self._drop_eval()
            got = self.export(tensors=("copy_w", "copy_bias")).tensors
            handle = self.client.put_weights(got["copy_w"], got.get("copy_bias"),
                                             timeout=self.timeout)
            self._eval = (self.version, handle)
        return self.client.compute(x2, self._eval[1], t1, want_dx=False, want_dw=False,
                                   want_db=False, timeout=self.timeout, **opts, **kw)

    def _drop_eval(self):
        if self._eval is not None:
            try:
                self.client.drop_weights(self._eval[1], timeout=self.timeout)
            except errors.LossdError:
                pass  # evicted already: nothing left to free
            self._eval = None

    def forward(self, hidden, labels, *, loss_scale=1.0):
        """hidden (..., H) in the head's compute dtype, labels (...) int. loss_scale: what the
        loss is multiplied by before backward besides a GradScaler's scale (e.g. 1/k for k
        accumulated micro-batches); the eager mode needs it in advance. In training mode with
        grad enabled each call adds to the head's step; in eval mode (module.eval()) or under
        torch.no_grad() it adds nothing (the loss alone, on this version's weights)."""
        loss, z_loss, acc, pred = _RemoteHeadFunction.apply(hidden, labels, self._anchor, self,
                                                            float(loss_scale),
                                                            torch.is_grad_enabled())
        if not (self.return_z_loss or self.return_token_accuracy
                or self.return_predicted_tokens):
            return loss
        return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=acc,
                                  predicted_tokens=pred)

    def options(self, dtype):
        return _options(self.ce_weight, self.ignore_index, self.lse_square_scale,
                        self.label_smoothing, self.reduction, self.softcap, self.accum_dtype,
                        dtype, self.chunk_size, self.use_token_scaling)

    def extra_repr(self):
        return "name=%r, V=%d, H=%d, version=%d, rank=%d/%d" % (
            self.name, self.info.v, self.info.h, self.version, self.rank, self.world_size)


class _RemoteHeadFunction(torch.autograd.Function):
    """apply(hidden, labels, anchor, head, loss_scale, grad_enabled) -> (loss, z_loss, accuracy,
    predictions). Eager: forward's Compute adds dW/db scaled by grad_scale * loss_scale *
    the GradScaler's scale and returns dX; backward checks that the upstream gradient is that
    scale and hands dX on. Deferred: backward's Compute carries the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, labels, anchor, head, loss_scale, grad_enabled):
        if tuple(labels.shape) != tuple(hidden.shape[:-1]):
            raise errors.InvalidArgumentError(
                "labels shape %s must be the hidden states' shape %s without its last "
                "dimension" % (tuple(labels.shape), tuple(hidden.shape)), method="nn")
        cdt = _head_dtype(head, hidden)
        if torch._C._current_graph_task_id() != -1:
            # A forward run again inside backward (activation checkpointing) would add the
            # micro-batch a second time under a new key.
            raise errors.FailedPreconditionError(
                "RemoteLMHead ran inside a backward (activation checkpointing?): keep the "
                "head's call outside checkpointed regions", method="nn")
        h = hidden.shape[-1]
        x2, t1 = hidden.reshape(-1, h).to(cdt), labels.reshape(-1)
        opts = head.options(cdt)
        wants = _wants(head.reduction, head.return_z_loss, head.return_token_accuracy,
                       head.return_predicted_tokens)
        add = bool(grad_enabled) and head.training
        need_dx = add and ctx.needs_input_grad[0]
        ctx.head, ctx.mode = head, "none"
        if add and not head.deferred:
            r, ctx.dx, ctx.expected = _eager(head, x2, t1, opts, wants, loss_scale, hidden,
                                             need_dx)
            ctx.mode, ctx.done = "eager", False
        else:
            r = head.loss_only(x2, t1, opts, **wants)
            if add:
                ctx.mode = "deferred"
                ctx.need_dx = need_dx
                ctx.save_for_backward(hidden, labels)
                ctx.opts = opts
        out = _forward_outputs(r, head.reduction, labels, head.ignore_index, hidden.device,
                               hidden.dtype, head.return_z_loss, head.return_token_accuracy,
                               head.return_predicted_tokens)
        ctx.mark_non_differentiable(*[e for e in out[1:] if e is not None])
        return out

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        head = ctx.head
        if ctx.mode == "eager":
            got = grad_loss.detach()
            if not bool(torch.all(got == ctx.expected)):
                raise errors.FailedPreconditionError(
                    "the head's gradient went into step %d with an upstream gradient of %.9g "
                    "(loss_scale times the GradScaler's scale), but backward brought %s: pass "
                    "the factor as forward(..., loss_scale=), attach the GradScaler "
                    "(RemoteLMHead(grad_scaler=)), or use deferred=True" % (
                        head.version, ctx.expected, got.flatten()[:3].tolist()), method="nn")
            dx = ctx.dx
            ctx.dx = None  # a second backward through a retained graph would add nothing
            if ctx.done:
                raise errors.FailedPreconditionError(
                    "a second backward through the head: its gradient was added once, in "
                    "forward (use deferred=True)", method="nn")
            ctx.done = True
        elif ctx.mode == "deferred":
            hidden, labels = ctx.saved_tensors
            dx = _deferred(head, hidden, labels, ctx.opts, grad_loss.detach(), ctx.need_dx)
        else:
            dx = None
        return dx, None, None, None, None, None


def _head_dtype(head, hidden):
    """The dtype `hidden` travels in: the head's compute dtype (its copy's, fixed at creation:
    create the head with compute_dtype = the autocast dtype to compute as Liger does under
    autocast). Cast to it under torch.autocast, or where the cast is exact (bf16 or fp16
    hidden states into an fp32 head); a narrowing cast outside autocast is refused, naming
    both dtypes."""
    want = head.info.compute_dtype
    cdt = _TORCH_DTYPES.get(want)
    got = hidden.dtype
    if got == cdt:
        return cdt
    autocast = compute_dtype(hidden) != got
    if cdt is not None and (autocast or (cdt == torch.float32 and got in _TORCH_DTYPES.values())):
        return cdt
    raise errors.InvalidArgumentError(
        "hidden is %s but head %r computes in %s: a narrowing cast outside torch.autocast is "
        "refused (run the forward under autocast, cast the hidden states, or create the head "
        "with compute_dtype=%s)" % (str(got).replace("torch.", ""), head.name, want,
                                    str(got).replace("torch.", "")), method="nn")


def _dx_dtype_opts(head, opts, dtype, hidden_dtype=None):
    """Options for a head compute in `dtype` whose dX is divided by grad_scale afterwards and
    goes to hidden states of `hidden_dtype` (default: dtype): fp32 dX where that division is
    not exact (grad_scale not a power of two) in a narrower dtype, or where the hidden states
    are fp32 and the compute is not (no rounding to the compute dtype first)."""
    narrower = dtype != torch.float32
    if narrower and (not _is_power_of_two(head.grad_scale) or hidden_dtype == torch.float32):
        return dict(opts, grad_dtype="fp32")
    return opts


def _unscaled_dx(head, r, hidden):
    """dX as the trainer's own autograd gives it: the server's, divided by grad_scale."""
    if r.dx is None:
        return None
    dx = _to_torch(r.dx, hidden.device)
    if head.grad_scale != 1.0:
        dx = dx.float() / torch.tensor(head.grad_scale, dtype=torch.float32)
    return dx.reshape(hidden.shape).to(hidden.dtype)


def _eager(head, x2, t1, opts, wants, loss_scale, hidden, need_dx):
    """Forward's Compute adding dW/db: (result, dX scaled by the expected upstream gradient,
    that upstream gradient)."""
    kw, expected = eager_options(head, opts, loss_scale, x2.dtype, hidden.dtype)
    r = head.head_compute(x2, t1, kw, head.next_key(), want_dx=need_dx, **wants)
    return r, _unscaled_dx(head, r, hidden), expected


def eager_options(head, opts, loss_scale, dtype, hidden_dtype):
    """An eager Compute's options in `dtype` for hidden states of `hidden_dtype`, and the
    upstream gradient backward must bring (loss_scale times the GradScaler's scale, which
    this step's Computes are then bound to). lossd.pipeline sends the same."""
    scaler_scale = head.loss_scale_of_scaler()
    if head._step_scale is not None and head._step_scale != scaler_scale:
        raise errors.FailedPreconditionError(
            "the GradScaler's scale changed from %g to %g within step %d of head %r: call "
            "scaler.update() only after the head's optimizer stepped" % (
                head._step_scale, scaler_scale, head.version, head.name), method="nn")
    head._step_scale = scaler_scale
    expected = float(loss_scale) * scaler_scale
    if not expected > 0 or not math.isfinite(expected):
        raise errors.InvalidArgumentError("loss_scale %r times the GradScaler's scale %r must "
                                          "be finite and > 0" % (loss_scale, scaler_scale))
    kw = _dx_dtype_opts(head, opts, dtype, hidden_dtype)
    kw["grad_scale"] = expected * head.grad_scale
    return kw, expected


def _deferred(head, hidden, labels, opts, grad_loss, need_dx):
    """Backward's Compute adding dW/db with the actual upstream gradient."""
    scaler_scale = head.loss_scale_of_scaler()
    head._step_scale = scaler_scale  # the scale is in the upstream gradient already
    cdt = _TORCH_DTYPES[head.info.compute_dtype]
    kw = _dx_dtype_opts(head, opts, cdt, hidden.dtype)
    if head.reduction == "none":
        kw["grad_output"] = (grad_loss.reshape(-1).to(torch.float32).cpu()
                             * head.grad_scale)
    else:
        kw["grad_scale"] = float(grad_loss) * head.grad_scale
    h = hidden.shape[-1]
    r = head.head_compute(hidden.reshape(-1, h).to(cdt), labels.reshape(-1), kw,
                          head.next_key(),
                          want_dx=need_dx)
    return _unscaled_dx(head, r, hidden)


def head_state_from_torch(optimizer, weight, bias=None):
    """What RemoteLMHead / Client.create_head take to move a running job's head and its torch
    optimizer to lossd: {"optimizer": OptimizerConfig, "state": {...} or None,
    "optimizer_step": int}. optimizer: torch.optim.AdamW, Adam (weight_decay 0) or SGD
    holding `weight` (and `bias`, whose parameter group gives bias_weight_decay); their state
    is copied as fp32 (exp_avg, exp_avg_sq, max_exp_avg_sq, step; momentum_buffer)."""
    def group_of(p):
        for g in optimizer.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise errors.InvalidArgumentError("the optimizer does not hold the %s" % (
            "weight" if p is weight else "bias"), method="nn")

    gw = group_of(weight)
    gb = group_of(bias) if bias is not None else None
    if gw.get("maximize") or (gb is not None and gb.get("maximize")):
        raise errors.UnimplementedError("maximize=True is not supported by a hosted head",
                                        method="nn")
    cfg = _config_of(optimizer, gw, gb)
    st_w = optimizer.state.get(weight, {})
    st_b = optimizer.state.get(bias, {}) if bias is not None else {}
    if cfg.kind == "adamw":
        if not st_w:
            return {"optimizer": cfg, "state": None, "optimizer_step": 0}
        step = int(float(st_w["step"]))
        if bias is not None and int(float(st_b.get("step", -1))) != step:
            raise errors.InvalidArgumentError(
                "the weight's and the bias's AdamW steps differ (%d and %s): a hosted head "
                "steps both together" % (step, st_b.get("step")), method="nn")
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if cfg.amsgrad else [])
    else:
        if not cfg.momentum or st_w.get("momentum_buffer") is None:
            return {"optimizer": cfg, "state": None, "optimizer_step": 0}
        step = 1  # the momentum buffer holds a value
        names = ["momentum_buffer"]
    state = {}
    for n in names:
        key = "exp_avg" if n == "momentum_buffer" else n
        state[key + "_w"] = st_w[n].detach().to(torch.float32).cpu()
        if bias is not None:
            if st_b.get(n) is None:
                raise errors.InvalidArgumentError("the bias has no %s in the optimizer's "
                                                  "state, the weight has" % n, method="nn")
            state[key + "_bias"] = st_b[n].detach().to(torch.float32).cpu()
    return {"optimizer": cfg, "state": state, "optimizer_step": step}


def _config_of(optimizer, gw, gb):
    """The OptimizerConfig of a torch optimizer's weight group (and bias group)."""
    same = ("lr", "betas", "eps", "amsgrad", "momentum", "dampening", "nesterov")
    if gb is not None:
        differ = [k for k in same if k in gw and gw[k] != gb.get(k)]
        if differ:
            raise errors.InvalidArgumentError(
                "the weight's and the bias's parameter groups differ in %s: a hosted head has "
                "one optimizer (only weight_decay may differ)" % ", ".join(differ), method="nn")
    bwd = float(gb["weight_decay"]) if gb is not None else 0.0
    lr = float(gw["lr"])
    if isinstance(optimizer, torch.optim.AdamW) or (
            isinstance(optimizer, torch.optim.Adam) and float(gw["weight_decay"]) == 0.0
            and bwd == 0.0):
        # Adam without weight decay is AdamW with weight_decay 0.
        wd = float(gw["weight_decay"]) if isinstance(optimizer, torch.optim.AdamW) else 0.0
        return OptimizerConfig.adamw(lr=lr, betas=tuple(float(b) for b in gw["betas"]),
                                     eps=float(gw["eps"]), weight_decay=wd,
                                     amsgrad=bool(gw["amsgrad"]), bias_weight_decay=bwd)
    if isinstance(optimizer, torch.optim.SGD):
        return OptimizerConfig.sgd(lr=lr, momentum=float(gw["momentum"]),
                                   dampening=float(gw["dampening"]),
                                   weight_decay=float(gw["weight_decay"]),
                                   nesterov=bool(gw["nesterov"]), bias_weight_decay=bwd)
    raise errors.UnimplementedError(
        "a hosted head steps with SGD or AdamW (or Adam without weight decay), not %s" %
        type(optimizer).__name__, method="nn")
