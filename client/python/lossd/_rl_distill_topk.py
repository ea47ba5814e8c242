# SPDX-License-Identifier: Apache-2.0
"""Distillation from the teacher's top-k log-probs, no teacher head (import from lossd.rl):
`LossdTopkDistillLoss` and `topk_distill_loss`. An offline or served teacher usually keeps
its k most likely ids per token and their log-probs, not its head; the student's head runs
on the server as for lossd.rl's other losses (docs/rl_losses.md has the math).
"""

import torch

from lossd import errors
from lossd._kinds import TOPK_TAILS
from lossd._rl_common import _grad_dtype, _int64, _nonfinite_kw, _runtime
from lossd.nn import compute_dtype
from lossd.rl import _OnServer, _ScalarLossFunction


def _check_options(jsd_beta, topk_tail, temperature, weight_hard_loss, weight_soft_loss):
    """What a wrong argument would otherwise only meet at the first call, named here."""
    if topk_tail not in TOPK_TAILS:
        raise errors.InvalidArgumentError("topk_tail must be one of %s, got %r" % (
            ", ".join(TOPK_TAILS), topk_tail), method="rl")
    if not 0.0 <= jsd_beta <= 1.0:
        raise errors.InvalidArgumentError("jsd_beta must be in [0, 1], got %s" % (jsd_beta,),
                                          method="rl")
    if temperature == 0:
        raise errors.ArgumentAssertionError("temperature cannot be 0", method="rl")
    for name, value in (("weight_hard_loss", weight_hard_loss),
                        ("weight_soft_loss", weight_soft_loss)):
        if not value >= 0:
            raise errors.InvalidArgumentError(
                "%s must be finite and >= 0, got %s" % (name, value), method="rl")


class LossdTopkDistillLoss(_OnServer):
    """Distillation against the teacher's top-k log-probs (servers listing "distill_topk").

    forward(student_input (..., H), student_weight (V, H), teacher_topk_ids (..., k) int32 or
    int64, teacher_topk_logp (..., k) the teacher's log-probs of those ids (sent as fp32),
    labels (...) or None, student_bias (V) or None) -> the scalar loss: over the rows whose
    label is not ignore_index (all rows without labels), the mean of weight_soft_loss x the
    divergence between the teacher's top-k and the student's softmax(logits / temperature)
    at jsd_beta (0 forward KL(teacher || student), the default; 1 reverse KL; in between the
    generalised JSD), plus weight_hard_loss x the labels' cross-entropy at temperature 1
    (servers listing "distill_hard_loss"). topk_tail, the teacher's mass outside its k ids:
    "bucket" (the default: one more event, 1 - sum p against the student's mass outside the
    ids), "renormalize" (both distributions over the k ids) or "none" (the k terms alone,
    verl's forward_kl_topk). The log-probs are taken as sent (the teacher's temperature is
    the teacher's); the server checks them (ids in [0, V) and distinct per row, log-probs
    finite, a bucket row's probabilities summing to at most 1) and names the row it refuses.
    Autograd gives dX, dW and db; connection settings as lossd.rl's other modules."""

    def __init__(self, jsd_beta=0.0, topk_tail="bucket", ignore_index=-100, temperature=1.0,
                 weight_hard_loss=0.0, weight_soft_loss=1.0, *, client=None,
                 server="localhost:50051", cache_weights=True, timeout=None, accumulator=None,
                 grad_scale=1.0, runtime=None):
        super().__init__()
        _check_options(jsd_beta, topk_tail, temperature, weight_hard_loss, weight_soft_loss)
        self.jsd_beta, self.topk_tail = jsd_beta, topk_tail
        self.ignore_index, self.temperature = ignore_index, temperature
        self.weight_hard_loss, self.weight_soft_loss = weight_hard_loss, weight_soft_loss
        self._setup(runtime, client, server, cache_weights, timeout, accumulator, grad_scale)

    def _distill_options(self, runtime):
        d = {"jsd_beta": float(self.jsd_beta), "topk_tail": self.topk_tail}
        weights = (float(self.weight_hard_loss), float(self.weight_soft_loss))
        if weights != (0.0, 1.0):
            runtime.client.require_feature("distill_hard_loss", timeout=runtime.timeout)
            d.update(weight_hard_loss=weights[0], weight_soft_loss=weights[1])
        return d

    def forward(self, student_input, student_weight, teacher_topk_ids, teacher_topk_logp,
                labels=None, student_bias=None):
        x2 = student_input.reshape(-1, student_input.shape[-1])
        if teacher_topk_ids.dim() == 0 or teacher_topk_ids.shape[-1] == 0:
            raise errors.InvalidArgumentError(
                "teacher_topk_ids must be (..., k) with k >= 1, got shape %s"
                % (tuple(teacher_topk_ids.shape),), method="rl")
        k = teacher_topk_ids.shape[-1]
        ids = teacher_topk_ids.detach().reshape(-1, k)
        if ids.dtype not in (torch.int32, torch.int64):
            ids = _int64(ids, "teacher_topk_ids").reshape(-1, k)
        logp = teacher_topk_logp.detach().to(torch.float32).reshape(-1, k)
        if labels is None and self.weight_hard_loss != 0:
            raise errors.InvalidArgumentError(
                "labels is None: weight_hard_loss %s needs the labels of its cross-entropy "
                "term" % (self.weight_hard_loss,), method="rl")
        targets = None if labels is None else _int64(labels, "labels")
        cdt = compute_dtype(x2)  # as lossd.rl's other losses: autocast's dtype, else X's
        xc = x2.detach().to(cdt)
        runtime = _runtime(self.runtime, None)
        opts = dict(kind="distill", temperature=float(self.temperature),
                    ignore_index=int(self.ignore_index), distill=self._distill_options(runtime),
                    teacher_topk_ids=ids, teacher_topk_logp=logp, weight_dtype=cdt)

        def call(want_dx, want_dw, want_db, **grad_kw):
            gdt = _grad_dtype(cdt, x2 if want_dx else None, student_weight if want_dw else None,
                              student_bias if want_db else None)
            return runtime.compute(xc, student_weight, targets, student_bias, want_dx=want_dx,
                                   want_dw=want_dw, want_db=want_db, grad_dtype=gdt,
                                   **opts, **_nonfinite_kw(runtime, grad_kw), **grad_kw)

        loss, = _ScalarLossFunction.apply(x2, student_weight, student_bias, call, runtime)
        return loss


def topk_distill_loss(student_input, student_weight, teacher_topk_ids, teacher_topk_logp,
                      labels=None, student_bias=None, *, jsd_beta=0.0, topk_tail="bucket",
                      ignore_index=-100, temperature=1.0, weight_hard_loss=0.0,
                      weight_soft_loss=1.0, runtime=None, server="localhost:50051"):
    """LossdTopkDistillLoss's loss as a function, on `runtime` (a lossd.nn.LossdRuntime) or
    the shared one of `server`, as lossd.rl's other functions."""
    module = LossdTopkDistillLoss(jsd_beta, topk_tail, ignore_index, temperature,
                                  weight_hard_loss, weight_soft_loss,
                                  runtime=_runtime(runtime, server))
    return module(student_input, student_weight, teacher_topk_ids, teacher_topk_logp, labels,
                  student_bias)
