# SPDX-License-Identifier: Apache-2.0
"""The loss kinds other than cross-entropy in one compute() request: logprob (per-token
log-probabilities and entropy at a temperature, with optional upstream gradients), policy
(GRPO / PPO-clip with LigerFusedLinearGRPOLoss's semantics) and distill (generalised JSD
against a teacher head, LigerFusedLinearJSD's semantics). docs/rl_losses.md has the math.

Builds the header's kind, temperature, PolicyOptions / DistillOptions and the specs and parts
of the kind's tensors. Which kind takes which input, and every value's range, are the
server's to check (one set of rules); here only what building the request needs.
"""

import dataclasses

from lossd import errors
from lossd._proto import pb
from lossd._results import WeightHandle
from lossd.tensors import FLOAT_DTYPES, to_wire

KINDS = {"cross_entropy": pb.LOSS_KIND_CROSS_ENTROPY, "logprob": pb.LOSS_KIND_LOGPROB,
         "policy": pb.LOSS_KIND_POLICY, "distill": pb.LOSS_KIND_DISTILL}
LOSS_TYPES = {"dapo": pb.POLICY_LOSS_DAPO, "grpo": pb.POLICY_LOSS_GRPO,
              "bnpo": pb.POLICY_LOSS_BNPO, "dr_grpo": pb.POLICY_LOSS_DR_GRPO,
              "cispo": pb.POLICY_LOSS_CISPO, "sapo": pb.POLICY_LOSS_SAPO,
              "luspo": pb.POLICY_LOSS_LUSPO}


@dataclasses.dataclass
class PolicyOptions:
    """Options of kind "policy"; the defaults are LigerFusedLinearGRPOLoss's.

    sequences: the rows are this many completions of BT / sequences tokens each,
    sequence-major (grpo averages per sequence; dr_grpo divides by sequences x
    max_completion_length). dapo_normalizer (dapo, cispo): 0 = this call's mask count, else
    the count to divide by (Liger's num_items_in_batch / world size). sapo_temperature_pos /
    _neg: sapo's gate temperatures where A > 0 / A <= 0. delta: None (or 0) = none, else the
    clipped types' cap on the ratio (> 1 + epsilon_high). use_bias_correction_kl: the KL term
    times the ratio. importance_sampling: "token" (each token's own ratio) or "sequence"
    (GSPO: one ratio per sequence, the clipped types only; servers listing
    "policy_sequence_importance_sampling")."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.04
    sequences: int = 1
    max_completion_length: int = 0
    dapo_normalizer: float = 0.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    delta: float = None
    use_bias_correction_kl: bool = False
    importance_sampling: str = "token"


IMPORTANCE_SAMPLING = {"token": pb.IMPORTANCE_SAMPLING_TOKEN,
                       "sequence": pb.IMPORTANCE_SAMPLING_SEQUENCE}


@dataclasses.dataclass
class DistillOptions:
    """Options of kind "distill"; the defaults are LigerFusedLinearJSD's. jsd_beta: 0 forward
    KL(teacher || student), 1 reverse KL, in between the generalised JSD. weight_hard_loss /
    weight_soft_loss: LigerFusedLinearJSDLoss's, loss = weight_hard_loss x the labels'
    cross-entropy (temperature 1) + weight_soft_loss x the divergence, each over the counted
    rows; other than (0, 1) on servers listing "distill_hard_loss" (a hard weight needs the
    targets, each in [0, V) or ignore_index)."""

    jsd_beta: float = 0.5
    weight_hard_loss: float = 0.0
    weight_soft_loss: float = 1.0


def _options_of(value, cls, name):
    """A PolicyOptions / DistillOptions from one, a dict of its fields, or None (defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise errors.InvalidArgumentError("%s: unknown option %s (one of %s)" % (
                name, ", ".join(unknown), ", ".join(sorted(fields))))
        return cls(**value)
    raise errors.InvalidArgumentError("%s must be a %s or a dict, got %s" % (
        name, cls.__name__, type(value).__name__))


def _fp32_input(header, inline, value, name, tid):
    if value is None:
        return
    dt, shape, arr = to_wire(value, name, (pb.DTYPE_FP32,))
    getattr(header, name).CopyFrom(pb.TensorSpec(dtype=dt, shape=shape))
    inline.append((tid, arr))


def set_kind(header, inline, *, kind, temperature, policy, distill, dlogp, dentropy,
             advantages, old_logp, ref_logp, teacher_x, teacher_w, teacher_bias,
             want_entropy, is_ratio=None):
    """The kind's fields into `header` and its tensors into `inline` (the Inputs' list, whose
    last entry is X: everything goes before it, the teacher's head first with the big
    tensors, since the server needs all but X in place before X's rows arrive; a two-phase
    backward's header names no X and its list holds none). Plain
    cross-entropy at temperature 1 sets nothing, so such a request reads as it always has.
    Returns the teacher's weight handle, or None."""
    if kind not in KINDS:
        raise errors.InvalidArgumentError("kind must be one of %s, got %r" % (
            ", ".join(KINDS), kind))
    if kind != "cross_entropy":
        header.kind = KINDS[kind]
    if kind != "cross_entropy" or (temperature is not None and float(temperature) != 1.0):
        header.options.temperature = 1.0 if temperature is None else float(temperature)
    if want_entropy:
        header.outputs.entropy = True
    if kind == "policy":
        p = _options_of(policy, PolicyOptions, "policy")
        if p.loss_type not in LOSS_TYPES:
            raise errors.InvalidArgumentError("policy.loss_type must be one of %s, got %r" % (
                ", ".join(LOSS_TYPES), p.loss_type))
        header.policy.CopyFrom(pb.PolicyOptions(
            loss_type=LOSS_TYPES[p.loss_type], epsilon_low=float(p.epsilon_low),
            epsilon_high=float(p.epsilon_high), beta=float(p.beta), sequences=int(p.sequences),
            max_completion_length=int(p.max_completion_length),
            dapo_normalizer=float(p.dapo_normalizer),
            sapo_temperature_pos=float(p.sapo_temperature_pos),
            sapo_temperature_neg=float(p.sapo_temperature_neg),
            use_bias_correction_kl=bool(p.use_bias_correction_kl)))
        if p.delta is not None:
            header.policy.delta = float(p.delta)
        if p.importance_sampling not in IMPORTANCE_SAMPLING:
            raise errors.InvalidArgumentError(
                "policy.importance_sampling must be one of %s, got %r" % (
                    ", ".join(IMPORTANCE_SAMPLING), p.importance_sampling))
        # Token level leaves the field unset: an older server reads the request as before.
        if p.importance_sampling != "token":
            header.policy.importance_sampling = IMPORTANCE_SAMPLING[p.importance_sampling]
    elif policy is not None:
        raise errors.InvalidArgumentError("policy options go with kind 'policy', not %r" % kind)
    if kind == "distill":
        d = _options_of(distill, DistillOptions, "distill")
        header.distill.jsd_beta = float(d.jsd_beta)
        # The default weights stay unset: an older server reads the request as before.
        if (float(d.weight_hard_loss), float(d.weight_soft_loss)) != (0.0, 1.0):
            header.distill.weight_hard_loss = float(d.weight_hard_loss)
            header.distill.weight_soft_loss = float(d.weight_soft_loss)
    elif distill is not None:
        raise errors.InvalidArgumentError("distill options go with kind 'distill', not %r" % kind)
    x_part = inline.pop() if header.HasField("x") else None  # X stays last
    front = []
    handle = None
    if isinstance(teacher_w, (WeightHandle, str)):
        handle = str(teacher_w)
        header.teacher_weight_handle = handle
        if teacher_bias is not None:
            raise errors.InvalidArgumentError(
                "teacher_bias given with a teacher weight handle: the handle carries its own "
                "bias")
    elif teacher_w is not None:
        dt, shape, arr = to_wire(teacher_w, "teacher_w", FLOAT_DTYPES)
        header.teacher_w.CopyFrom(pb.TensorSpec(dtype=dt, shape=shape))
        front.append((pb.TENSOR_TEACHER_W, arr))
        if teacher_bias is not None:
            dt, shape, arr = to_wire(teacher_bias, "teacher_bias", FLOAT_DTYPES)
            header.teacher_bias.CopyFrom(pb.TensorSpec(dtype=dt, shape=shape))
            front.append((pb.TENSOR_TEACHER_BIAS, arr))
    elif teacher_bias is not None:
        raise errors.InvalidArgumentError("teacher_bias goes with an inline teacher_w")
    if kind == "distill" and teacher_w is None:
        raise errors.InvalidArgumentError(
            "kind 'distill' needs the teacher's head: teacher_w (an array or a weight handle)")
    inline[:0] = front
    _fp32_input(header, inline, dlogp, "dlogp", pb.TENSOR_DLOGP)
    _fp32_input(header, inline, dentropy, "dentropy", pb.TENSOR_DENTROPY)
    _fp32_input(header, inline, advantages, "advantages", pb.TENSOR_ADVANTAGES)
    _fp32_input(header, inline, old_logp, "old_logp", pb.TENSOR_OLD_LOGP)
    _fp32_input(header, inline, ref_logp, "ref_logp", pb.TENSOR_REF_LOGP)
    if is_ratio is not None and kind != "policy":
        raise errors.InvalidArgumentError("is_ratio goes with kind 'policy', not %r" % kind)
    _fp32_input(header, inline, is_ratio, "is_ratio", pb.TENSOR_IS_RATIO)
    if teacher_x is not None:
        dt, shape, arr = to_wire(teacher_x, "teacher_x", FLOAT_DTYPES)
        header.teacher_x.CopyFrom(pb.TensorSpec(dtype=dt, shape=shape))
        inline.append((pb.TENSOR_TEACHER_X, arr))
    if x_part is not None:
        inline.append(x_part)
    return handle


def kind_outputs(header, bt):
    """{output name: (dtype, shape)} the kind adds to what a Compute returns."""
    got = {}
    if header.kind == pb.LOSS_KIND_LOGPROB:
        got["logp"] = (pb.DTYPE_FP32, (bt,))
        if header.outputs.entropy:
            got["entropy"] = (pb.DTYPE_FP32, (bt,))
    return got
