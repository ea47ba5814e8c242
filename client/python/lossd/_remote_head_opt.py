# SPDX-License-Identifier: Apache-2.0
"""The optimizer of a hosted head (lossd.nn.RemoteHeadOptimizer), a torch.optim.Optimizer whose
step is lossd's Step barrier, and clip_grad_norm_ over a local backbone plus the head.

GradScaler: the head's Computes add its gradient scaled by the scaler's scale (the module
reads it in forward); the step unscales on the server (clip coefficient 1/scale), asks the
server whether the summed gradient is finite first, skips the update where it is not (the
Step still runs, so every rank's barrier completes) and tells the scaler, so that update()
backs off. Never holds the head's gradient locally.
"""

import dataclasses

import numpy as np
import torch

from lossd import errors
from lossd._heads import HeadExport, OptimizerConfig
from lossd.tensors import BF16Array


class RemoteHeadOptimizer(torch.optim.Optimizer):
    """Steps a RemoteLMHead on its server; use it for the head in place of a torch optimizer.

    param_groups: one group with "lr" (sent with every Step, so torch LR schedulers work);
      its only parameter is an empty placeholder (torch.optim.Optimizer needs one; the head's
      parameters are on the server).
    zero_grad(): nothing to do: the server starts each step's gradient sum at zero.
    step(skip=False): this rank's Step of the head's current version, a barrier over the
      head's ranks (it returns once every rank has called it); the head's version then
      advances. `last_result` holds its StepResult. A summed gradient that is not finite is
      refused (FailedPreconditionError) unless a GradScaler is attached; step(skip=True) then
      drops it, W unchanged. So is a step with nothing in it (no forward and backward since
      the last step, or its gradients dropped): W never moves on nothing; redo the step's
      forward and backward, or step(skip=True) to move past it.
    max_norm: clip the head alone by its own norm (clip_grad_norm_ over the head's weight and
      bias), on the server, in the same one barrier; clip_grad_norm_ below clips backbone and
      head together instead.
    state_dict() / load_state_dict(): the head's export (master, bias, optimizer state,
      version) as torch tensors, with the param groups; loading imports it into the server.
    With torch.amp.GradScaler (attached to the head, RemoteLMHead(grad_scaler=)):
      scaler.step(head_opt) always calls step() (_step_supports_amp_scaling), which asks the
      server whether the gradient is finite (Step phase reduce), then applies it unscaled or
      skips it (phase apply, skip=True: W unchanged, the version still advances), and records
      an Inf for the scaler so scaler.update() backs off.
    """

    # GradScaler.step calls step() even where it found an Inf among the (no) local gradients:
    # the Step must run on every rank, or the other ranks' barrier never completes.
    _step_supports_amp_scaling = True

    def __init__(self, head, lr=None, max_norm=None):
        if max_norm is not None and not float(max_norm) > 0:
            raise errors.InvalidArgumentError("max_norm must be > 0, got %r" % (max_norm,),
                                              method="nn")
        self.max_norm = None if max_norm is None else float(max_norm)
        if lr is None:
            lr = head.info.optimizer.lr if head.info.optimizer.lr is not None else 1e-3
        self.head = head
        self._placeholder = torch.nn.Parameter(torch.zeros(0))
        super().__init__([self._placeholder], {"lr": float(lr)})
        self._reduced = None  # this step's reduce phase (StepResult), from clip_grad_norm_
        self._clip = None  # this step's clip coefficient (fp32), from clip_grad_norm_
        self.last_result = None

    def zero_grad(self, set_to_none=True):
        """Nothing to clear: the head's gradient is the server's sum for the current version,
        and a completed step starts the next version's at zero."""

    def reduce(self):
        """The step's reduce phase (a barrier): the summed gradient's norm and finiteness,
        nothing changed. step() applies after it; clip_grad_norm_ calls it."""
        if self._reduced is None:
            self._reduced = self.head.step_phase("reduce")
        return self._reduced

    @torch.no_grad()
    def step(self, closure=None, skip=False):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        head = self.head
        lr = float(self.param_groups[0]["lr"])
        scaler = head.grad_scaler
        scaled = scaler is not None and scaler.is_enabled()
        inv = head.unscale_coef()
        if self.max_norm is not None and self._clip is None and (scaled or self._reduced):
            # The head's own clipping of its unscaled gradient: the coefficient from the
            # reduce phase's norm, as clip_grad_norm_ computes it.
            red = self.reduce()
            norm = torch.tensor(red.grad_norm * (1.0 if inv is None else inv),
                                dtype=torch.float32)
            self._clip = float(torch.clamp(self.max_norm / (norm + 1e-6), max=1.0))
        coef = _combine(self._clip, inv)
        try:
            if self._reduced is None and not scaled:
                # One barrier: reduce and apply together (the server clips by max_norm).
                r = head.step_phase("full", lr=lr, clip_coef=coef, skip=bool(skip),
                                    max_norm=self.max_norm if coef is None else None)
                skipped = bool(skip)
            else:
                red = self.reduce()
                skipped = bool(skip) or not red.finite
                r = head.step_phase("apply", lr=lr, clip_coef=coef, skip=skipped)
        except errors.LossdError:
            # A refused apply (an empty step, ranks that disagree, a timeout) leaves the
            # version where it was; the next step() asks for the reduce again (the server
            # answers one it still holds), so step(skip=True) can move past it.
            self._reduced = self._clip = None
            raise
        if scaled:
            _record_found_inf(scaler, self, skipped)
        head.stepped(r)
        self._reduced = self._clip = None
        self.last_result = r
        return loss

    def state_dict(self):
        sd = super().state_dict()
        exp = self.head.export()
        tensors = {}
        for name, arr in exp.tensors.items():
            if isinstance(arr, BF16Array):
                tensors[name] = torch.from_numpy(arr.bits.view(np.int16).copy()).view(
                    torch.bfloat16)
            else:
                tensors[name] = torch.from_numpy(np.array(arr))
        sd["lossd_head"] = {"name": exp.name, "version": exp.version,
                            "optimizer_step": exp.optimizer_step,
                            "optimizer": dataclasses.asdict(exp.optimizer),
                            "compute_dtype": exp.compute_dtype, "tensors": tensors}
        return sd

    def load_state_dict(self, state_dict):
        h = state_dict.get("lossd_head")
        if h is None:
            raise errors.InvalidArgumentError(
                "not a RemoteHeadOptimizer state dict (no 'lossd_head' entry)", method="nn")
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.head.load_export(HeadExport(
            name=h["name"], version=int(h["version"]), optimizer_step=int(h["optimizer_step"]),
            optimizer=OptimizerConfig(**h["optimizer"]), compute_dtype=h["compute_dtype"],
            tensors=dict(h["tensors"])))
        self._reduced = self._clip = None


def _combine(clip, inv):
    """The one coefficient the server multiplies the gradient by: the clip coefficient times
    the GradScaler's 1/scale, in fp32 (a power-of-two 1/scale makes it exact, so it equals
    unscaling and then clipping in two steps, as torch does)."""
    if clip is None and inv is None:
        return None
    c = np.float32(1.0) if clip is None else np.float32(clip)
    i = np.float32(1.0) if inv is None else np.float32(inv)
    return float(c * i)


def _record_found_inf(scaler, optimizer, found):
    """Tells the GradScaler whether this optimizer's step found an Inf, as its unscale_ would
    have for local gradients, so update() backs off (or grows) as for a local head. GradScaler
    keeps this in its per-optimizer state; there is no public way to add to it."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise errors.UnimplementedError(
            "this torch's GradScaler has no _per_optimizer_states: the hosted head cannot "
            "report an Inf to it", method="nn")
    states[id(optimizer)]["found_inf_per_device"] = {
        torch.device("cpu"): torch.tensor(1.0 if found else 0.0, dtype=torch.float32)}


@torch.no_grad()
def clip_grad_norm_(parameters, head, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_ over the local `parameters` (a backbone) and a hosted
    head together; returns the total norm (fp32) as torch's does.

    The head's part of the norm comes from the server (the step's reduce phase: a barrier
    over the head's ranks, so every rank calls this). The local gradients are scaled in place
    by the coefficient; the head's by the server when its optimizer steps (the coefficient,
    times 1/scale under a GradScaler, goes with the Step). head: the RemoteLMHead or its
    RemoteHeadOptimizer. Under a GradScaler, call scaler.unscale_(backbone_optimizer) first,
    as for torch's clip_grad_norm_; the head's unscale is the server's. L2 norms only.
    """
    opt = head if isinstance(head, RemoteHeadOptimizer) else head.optimizer()
    if float(norm_type) != 2.0:
        raise errors.UnimplementedError(
            "the hosted head's norm is L2: norm_type must be 2, got %r" % (norm_type,),
            method="nn")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    red = opt.reduce()
    inv = opt.head.unscale_coef()
    head_norm = red.grad_norm * (1.0 if inv is None else inv)  # exact for 1/2^k in double
    norms = []
    if grads:
        norms.append(_total_norm(grads, foreach))
    first = grads[0].device if grads else torch.device("cpu")
    norms.append(torch.tensor(head_norm if red.finite else float("inf"), dtype=torch.float32,
                              device=first))
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            "The total norm of order 2.0 for gradients from `parameters` and the hosted head "
            "is non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    opt._clip = float(coef)
    return total


def _total_norm(grads, foreach):
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, 2.0, foreach=foreach)
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, 2.0).to(grads[0].device) for g in grads]), 2.0)
