# SPDX-License-Identifier: Apache-2.0
"""Distillation losses of lossd.rl beyond LigerFusedLinearJSD (import them from lossd.rl):
LigerFusedLinearJSDLoss's module and function, the generalised JSD against a teacher head
plus a hard-label cross-entropy term (docs/rl_losses.md has the math).
"""

from lossd import errors
from lossd._rl_common import _runtime
from lossd.nn import LossdRuntime
from lossd.rl import LossdFusedLinearJSD


def _check_weights(weight_hard_loss, weight_soft_loss, return_soft_hard_loss):
    for name, value in (("weight_hard_loss", weight_hard_loss),
                        ("weight_soft_loss", weight_soft_loss)):
        if not value >= 0:
            raise errors.InvalidArgumentError(
                "%s must be finite and >= 0, got %s" % (name, value), method="rl")
    if return_soft_hard_loss:
        raise errors.InvalidArgumentError(
            "return_soft_hard_loss=True is not supported: the server returns the weighted loss "
            "only", method="rl")


class LossdFusedLinearJSDLoss(LossdFusedLinearJSD):
    """LigerFusedLinearJSDLoss (Liger-Kernel 0.8.5) on the server: the same constructor and
    forward arguments. loss = weight_hard_loss x the cross-entropy of true_labels at
    temperature 1 (Liger takes it before dividing the logits by the temperature) +
    weight_soft_loss x the generalised JSD at `temperature` (beta: 0 forward KL, 1 reverse
    KL), each summed over the rows whose label is not ignore_index and divided by their count.
    Weights other than (0, 1) need a server listing "distill_hard_loss". `compiled` and
    `chunk_size` are taken and unused (the server chunks); return_soft_hard_loss=True is
    refused (the server returns the weighted loss only). The teacher's head is cached on the
    server as LossdFusedLinearJSD's."""

    def __init__(self, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100,
                 temperature=1.0, compiled=True, chunk_size=1024, return_soft_hard_loss=False,
                 *, client=None, server="localhost:50051", cache_weights=True, timeout=None,
                 accumulator=None, grad_scale=1.0, runtime=None):
        _check_weights(weight_hard_loss, weight_soft_loss, return_soft_hard_loss)
        super().__init__(jsd_beta=beta, ignore_index=ignore_index, temperature=temperature,
                         client=client, server=server, cache_weights=cache_weights,
                         timeout=timeout, accumulator=accumulator, grad_scale=grad_scale,
                         runtime=runtime)
        self.weight_hard_loss, self.weight_soft_loss = weight_hard_loss, weight_soft_loss
        self.beta, self.compiled, self.chunk_size = beta, compiled, chunk_size
        self.return_soft_hard_loss = return_soft_hard_loss

    def _distill_options(self, runtime):
        d = {"jsd_beta": float(self.jsd_beta)}
        weights = (float(self.weight_hard_loss), float(self.weight_soft_loss))
        if weights != (0.0, 1.0):
            runtime.client.require_feature("distill_hard_loss", timeout=runtime.timeout)
            d.update(weight_hard_loss=weights[0], weight_soft_loss=weights[1])
        return d

    def forward(self, student_input, student_weight, teacher_input, teacher_weight,
                true_labels, student_bias=None, teacher_bias=None):
        if true_labels is None and self.weight_hard_loss != 0:
            raise errors.InvalidArgumentError(
                "true_labels is None: weight_hard_loss %s needs the labels of its "
                "cross-entropy term" % (self.weight_hard_loss,), method="rl")
        return super().forward(student_input, student_weight, teacher_input, teacher_weight,
                               true_labels, student_bias, teacher_bias)


def fused_linear_jsd_loss(student_input, student_weight, teacher_input, teacher_weight,
                          true_labels, student_bias=None, teacher_bias=None,
                          weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
                          ignore_index=-100, temperature=1.0, compiled=True, chunk_size=1024,
                          return_soft_hard_loss=False, *, runtime=None,
                          server="localhost:50051"):
    """Liger's liger_fused_linear_jsd (LigerFusedLinearJSDFunction.apply) with its positional
    arguments: LossdFusedLinearJSDLoss's loss, on `runtime` (a lossd.nn.LossdRuntime) or the
    shared one of `server`, as lossd.rl's functions. The teacher's head goes inline (a
    function keeps no handle to drop)."""
    runtime = _runtime(runtime, server)
    module = LossdFusedLinearJSDLoss(weight_hard_loss, weight_soft_loss, beta, ignore_index,
                                     temperature, compiled, chunk_size, return_soft_hard_loss,
                                     runtime=runtime)
    module.other_runtime = LossdRuntime(runtime.client, cache_weights=False,
                                        timeout=runtime.timeout)
    return module(student_input, student_weight, teacher_input, teacher_weight, true_labels,
                  student_bias, teacher_bias)
