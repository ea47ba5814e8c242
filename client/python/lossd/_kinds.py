# SPDX-License-Identifier: Apache-2.0
"""The loss kinds other than cross-entropy in one compute() request: logprob (per-token
log-probabilities and entropy at a temperature, with optional upstream gradients), policy
(GRPO / PPO-clip with LigerFusedLinearGRPOLoss's semantics) and distill (generalised JSD
against a teacher head, LigerFusedLinearJSD's semantics, or against the teacher's top-k
log-probs). docs/rl_losses.md has the math.

Builds the header's kind, temperature, PolicyOptions / DistillOptions and the specs and parts
of the kind's tensors. Which kind takes which input, and every value's range, are the
server's to check (one set of rules); here only what building the request needs.
"""

import dataclasses

from lossd import errors
from lossd._proto import pb
from lossd._results import WeightHandle
from lossd.tensors import FLOAT_DTYPES, INT_DTYPES, to_wire

KINDS = {"cross_entropy": pb.LOSS_KIND_CROSS_ENTROPY, "logprob": pb.LOSS_KIND_LOGPROB,
         "policy": pb.LOSS_KIND_POLICY, "distill": pb.LOSS_KIND_DISTILL}
LOSS_TYPES = {"dapo": pb.POLICY_LOSS_DAPO, "grpo": pb.POLICY_LOSS_GRPO,
              "bnpo": pb.POLICY_LOSS_BNPO, "dr_grpo": pb.POLICY_LOSS_DR_GRPO,
              "cispo": pb.POLICY_LOSS_CISPO, "sapo": pb.POLICY_LOSS_SAPO,
              "luspo": pb.POLICY_LOSS_LUSPO, "gpg": pb.POLICY_LOSS_GPG,
              "geo_mean": pb.POLICY_LOSS_GEO_MEAN, "kl_cov": pb.POLICY_LOSS_KL_COV,
              "vespo": pb.POLICY_LOSS_VESPO, "cispo_clamp": pb.POLICY_LOSS_CISPO_CLAMP}
KL_ESTIMATORS = {"k3": pb.KL_ESTIMATOR_K3, "k1": pb.KL_ESTIMATOR_K1, "k2": pb.KL_ESTIMATOR_K2,
                 "abs": pb.KL_ESTIMATOR_ABS, "low_var_kl": pb.KL_ESTIMATOR_LOW_VAR_KL}
AGGREGATIONS = {"loss_type": pb.AGGREGATION_LOSS_TYPE, "token-mean": pb.AGGREGATION_TOKEN_MEAN,
                "seq-mean-token-sum": pb.AGGREGATION_SEQ_MEAN_TOKEN_SUM,
                "seq-mean-token-mean": pb.AGGREGATION_SEQ_MEAN_TOKEN_MEAN,
                "seq-mean-token-sum-norm": pb.AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM}
# verl's kl_loss_type names (a trailing "+" is the straight-through variant). verl's "k3" is
# its clamped low_var_kl, not Liger's k3 (this client's "k3").
VERL_KL = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
           "low_var_kl": "low_var_kl", "k3": "low_var_kl"}


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
    "policy_sequence_importance_sampling").

    verl's menu (each on servers listing the feature named): kl_estimator, the beta term's
    estimator of KL(pi || ref) at d = logp - ref_logp: "k3" (exp(-d) + d - 1, Liger's, the
    default), "k1" (d), "k2" (d^2 / 2), "abs" (|d|), "low_var_kl" (verl's k3: clamped);
    kl_straight_through: its value with k2's gradient (verl's "k3+"); "policy_kl_estimator".
    entropy_coeff: the bonus, loss_i -= entropy_coeff * entropy_i; "policy_entropy_bonus".
    aggregation: "loss_type" (the loss type's own) or verl's loss_agg_mode "token-mean",
    "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm" (dapo_normalizer is
    then the global token count, or sequence count for the seq-mean modes; loss_scale_factor
    the -norm mode's divisor, 0 = the sequence length); "policy_aggregation". loss_type "gpg":
    verl's -A logp; "policy_loss_type_gpg". loss_type "geo_mean": verl's GMPO (each token's
    log-ratio clipped to [-epsilon_low, epsilon_high] on its advantage's side, the mean over
    the sequences of -mean(A) times the sequence's geometric-mean ratio; the aggregation then
    weights only the KL and entropy terms); "policy_loss_type_geo_mean". loss_type "kl_cov":
    verl's KL-Cov (-A r unclipped, plus ppo_kl_coef |logp - old_logp| on the kl_cov_ratio share
    of the call's tokens with the largest covariance of A and logp; dapo's normalisation);
    "policy_loss_type_kl_cov". loss_type "vespo": Liger's and TRL's (-phi A logp, phi a
    detached gamma weight of the sequence's summed log-ratio and summed log is_ratio, by the
    advantage's sign: vespo_k_pos / vespo_lambda_pos where A >= 0, the _neg pair where A < 0;
    is_ratio enters phi only; dapo's normalisation); "policy_loss_type_vespo". loss_type
    "cispo_clamp": verl's cispo (-sg(clamp(r, 1 - epsilon_low, 1 + epsilon_high)) A logp, where
    "cispo" is Liger's -sg(min(r, epsilon_high)) A logp); "policy_loss_type_cispo_clamp".
    verl_policy_options() maps verl's names."""

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
    kl_estimator: str = "k3"
    kl_straight_through: bool = False
    entropy_coeff: float = 0.0
    aggregation: str = "loss_type"
    loss_scale_factor: float = 0.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


def verl_policy_options(*, policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=None,
                        clip_ratio_high=None, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                        kl_loss_type="low_var_kl", kl_loss_coef=0.0, entropy_coeff=0.0,
                        sequences=1, global_normalizer=0.0, loss_scale_factor=None,
                        kl_cov_ratio=0.0002, ppo_kl_coef=1.0, tau_pos=1.0, tau_neg=1.05):
    """PolicyOptions for verl's actor settings (its names and defaults): policy_loss
    "vanilla" (PPO with dual clip: clip_ratio_c is the ratio's cap where A < 0, lossd's delta),
    "gpg", "geo_mean" (GMPO: clip_ratio(_low/_high) bound each token's log-ratio; no dual
    clip; loss_agg_mode aggregates its KL and entropy terms only, as in verl), "kl_cov"
    (KL-Cov, with verl's policy_loss.kl_cov_ratio and ppo_kl_coef; no clipping), "gspo"
    (lossd's sequence-level importance sampling; no dual clip; advantages constant over each
    sequence, as GRPO's are, give verl's gradient), "cispo" (lossd's cispo_clamp: the
    detached weight clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) or "sapo" (its gate
    temperatures tau_pos and tau_neg; verl aggregates sapo's term by seq-mean-token-mean
    whatever loss_agg_mode says, so a KL or entropy term needs loss_agg_mode
    "seq-mean-token-mean" too); loss_agg_mode;
    kl_loss_type (a trailing "+" for the straight-through variant) with kl_loss_coef as beta
    (use_kl_loss off: 0); entropy_coeff; global_normalizer: verl's batch_num_tokens
    (token-mean) or global_batch_size (seq-mean modes) over dp_size, 0 = this call's count.
    Raises InvalidArgumentError naming a name that is not built."""
    built = ("vanilla", "gpg", "geo_mean", "kl_cov", "gspo", "sapo", "cispo")
    if policy_loss not in built:
        raise errors.InvalidArgumentError(
            "verl policy_loss %r is not built (%s are; docs/rl_clients.md lists verl's names)"
            % (policy_loss, ", ".join(built)))
    base = kl_loss_type[:-1] if kl_loss_type.endswith("+") else kl_loss_type
    if base not in VERL_KL:
        raise errors.InvalidArgumentError("verl kl_loss_type must be one of %s (with an "
                                          "optional '+'), got %r" % (", ".join(VERL_KL),
                                                                     kl_loss_type))
    if loss_agg_mode not in AGGREGATIONS or loss_agg_mode == "loss_type":
        raise errors.InvalidArgumentError("verl loss_agg_mode must be one of %s, got %r" % (
            ", ".join(a for a in AGGREGATIONS if a != "loss_type"), loss_agg_mode))
    if policy_loss == "sapo" and loss_agg_mode != "seq-mean-token-mean":
        if kl_loss_coef or entropy_coeff:
            raise errors.InvalidArgumentError(
                "verl's sapo aggregates its term by seq-mean-token-mean and the KL and entropy "
                "terms by loss_agg_mode %r; lossd aggregates a call one way: pass "
                "loss_agg_mode='seq-mean-token-mean'" % loss_agg_mode)
        loss_agg_mode = "seq-mean-token-mean"
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    vanilla = policy_loss == "vanilla"
    loss_type = {"vanilla": "dapo", "gspo": "dapo", "cispo": "cispo_clamp"}.get(policy_loss,
                                                                                policy_loss)
    return PolicyOptions(
        loss_type=loss_type, epsilon_low=low, epsilon_high=high,
        beta=kl_loss_coef, sequences=sequences, dapo_normalizer=global_normalizer,
        delta=clip_ratio_c if vanilla else None,
        importance_sampling="sequence" if policy_loss == "gspo" else "token",
        sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
        kl_estimator=VERL_KL[base],
        kl_straight_through=kl_loss_type.endswith("+") and VERL_KL[base] != "k2",
        entropy_coeff=entropy_coeff, aggregation=loss_agg_mode,
        loss_scale_factor=(loss_scale_factor or 0.0)
        if loss_agg_mode == "seq-mean-token-sum-norm" else 0.0,
        kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef)


def policy_features(header):
    """The features a policy header's verl-menu fields need (a server without one answers
    UNIMPLEMENTED; asking first gives the clearer error)."""
    if header.kind != pb.LOSS_KIND_POLICY:
        return []
    p = header.policy
    wanted = [(p.loss_type == pb.POLICY_LOSS_GPG, "policy_loss_type_gpg"),
              (p.loss_type == pb.POLICY_LOSS_GEO_MEAN, "policy_loss_type_geo_mean"),
              (p.loss_type == pb.POLICY_LOSS_KL_COV, "policy_loss_type_kl_cov"),
              (p.loss_type == pb.POLICY_LOSS_VESPO, "policy_loss_type_vespo"),
              (p.loss_type == pb.POLICY_LOSS_CISPO_CLAMP, "policy_loss_type_cispo_clamp"),
              (p.kl_estimator != pb.KL_ESTIMATOR_K3 or p.kl_straight_through,
               "policy_kl_estimator"),
              (p.entropy_coeff != 0, "policy_entropy_bonus"),
              (p.aggregation != pb.AGGREGATION_LOSS_TYPE, "policy_aggregation")]
    return [name for need, name in wanted if need]


IMPORTANCE_SAMPLING = {"token": pb.IMPORTANCE_SAMPLING_TOKEN,
                       "sequence": pb.IMPORTANCE_SAMPLING_SEQUENCE}
TOPK_TAILS = {"bucket": pb.TOPK_TAIL_BUCKET, "renormalize": pb.TOPK_TAIL_RENORMALIZE,
              "none": pb.TOPK_TAIL_NONE}


@dataclasses.dataclass
class DistillOptions:
    """Options of kind "distill"; the defaults are LigerFusedLinearJSD's. jsd_beta: 0 forward
    KL(teacher || student), 1 reverse KL, in between the generalised JSD. weight_hard_loss /
    weight_soft_loss: LigerFusedLinearJSDLoss's, loss = weight_hard_loss x the labels'
    cross-entropy (temperature 1) + weight_soft_loss x the divergence, each over the counted
    rows; other than (0, 1) on servers listing "distill_hard_loss" (a hard weight needs the
    targets, each in [0, V) or ignore_index). topk_tail: with a top-k teacher
    (teacher_topk_ids / teacher_topk_logp), the teacher's mass outside its k ids: "bucket"
    (one more event against the student's mass outside them), "renormalize" (both over the
    k ids) or "none" (the k terms alone, verl's forward_kl_topk); docs/rl_losses.md."""

    jsd_beta: float = 0.5
    weight_hard_loss: float = 0.0
    weight_soft_loss: float = 1.0
    topk_tail: str = "bucket"


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


def _set_verl_options(msg, p):
    """verl's menu into PolicyOptions `msg`; defaults stay unset, so an older server reads a
    request without them as before."""
    for name, table, value in (("kl_estimator", KL_ESTIMATORS, p.kl_estimator),
                               ("aggregation", AGGREGATIONS, p.aggregation)):
        if value not in table:
            raise errors.InvalidArgumentError("policy.%s must be one of %s, got %r" % (
                name, ", ".join(table), value))
        setattr(msg, name, table[value])
    msg.kl_straight_through = bool(p.kl_straight_through)
    msg.entropy_coeff = float(p.entropy_coeff)
    msg.loss_scale_factor = float(p.loss_scale_factor)
    if p.loss_type == "kl_cov":  # kl_cov's own: unset otherwise
        msg.kl_cov_ratio = float(p.kl_cov_ratio)
        msg.ppo_kl_coef = float(p.ppo_kl_coef)
    if p.loss_type == "vespo":  # vespo's own: likewise
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            setattr(msg, name, float(getattr(p, name)))


def set_kind(header, inline, *, kind, temperature, policy, distill, dlogp, dentropy,
             advantages, old_logp, ref_logp, teacher_x, teacher_w, teacher_bias,
             want_entropy, is_ratio=None, teacher_topk_ids=None, teacher_topk_logp=None):
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
        _set_verl_options(header.policy, p)
    elif policy is not None:
        raise errors.InvalidArgumentError("policy options go with kind 'policy', not %r" % kind)
    if kind == "distill":
        d = _options_of(distill, DistillOptions, "distill")
        header.distill.jsd_beta = float(d.jsd_beta)
        # The default weights stay unset: an older server reads the request as before.
        if (float(d.weight_hard_loss), float(d.weight_soft_loss)) != (0.0, 1.0):
            header.distill.weight_hard_loss = float(d.weight_hard_loss)
            header.distill.weight_soft_loss = float(d.weight_soft_loss)
        if d.topk_tail not in TOPK_TAILS:
            raise errors.InvalidArgumentError("distill.topk_tail must be one of %s, got %r" % (
                ", ".join(TOPK_TAILS), d.topk_tail))
        if d.topk_tail != "bucket":  # the default stays unset, as the weights'
            header.distill.topk_tail = TOPK_TAILS[d.topk_tail]
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
    topk = teacher_topk_ids is not None or teacher_topk_logp is not None
    if topk and kind != "distill":
        raise errors.InvalidArgumentError(
            "teacher_topk_ids / teacher_topk_logp go with kind 'distill', not %r" % kind)
    if kind == "distill" and teacher_w is None and not topk:
        raise errors.InvalidArgumentError(
            "kind 'distill' needs the teacher's head (teacher_w: an array or a weight handle) "
            "or its top-k (teacher_topk_ids and teacher_topk_logp)")
    inline[:0] = front
    _fp32_input(header, inline, dlogp, "dlogp", pb.TENSOR_DLOGP)
    _fp32_input(header, inline, dentropy, "dentropy", pb.TENSOR_DENTROPY)
    _fp32_input(header, inline, advantages, "advantages", pb.TENSOR_ADVANTAGES)
    _fp32_input(header, inline, old_logp, "old_logp", pb.TENSOR_OLD_LOGP)
    _fp32_input(header, inline, ref_logp, "ref_logp", pb.TENSOR_REF_LOGP)
    if is_ratio is not None and kind != "policy":
        raise errors.InvalidArgumentError("is_ratio goes with kind 'policy', not %r" % kind)
    _fp32_input(header, inline, is_ratio, "is_ratio", pb.TENSOR_IS_RATIO)
    # The top-k teacher's shapes, values and pairing are the server's to check (one set of
    # rules); here only the wire dtypes.
    if teacher_topk_ids is not None:
        dt, shape, arr = to_wire(teacher_topk_ids, "teacher_topk_ids", INT_DTYPES)
        header.teacher_topk_ids.CopyFrom(pb.TensorSpec(dtype=dt, shape=shape))
        inline.append((pb.TENSOR_TEACHER_TOPK_IDS, arr))
    _fp32_input(header, inline, teacher_topk_logp, "teacher_topk_logp",
                pb.TENSOR_TEACHER_TOPK_LOGP)
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
