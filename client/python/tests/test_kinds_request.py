# SPDX-License-Identifier: Apache-2.0
"""The request of compute()'s loss kinds (logprob, policy, distill), built without a server:
the header's kind, temperature, options and tensor specs, the parts' order (X last, the
teacher's head first), what the call returns, and the checks made before anything is sent.
The math is the server's: test_kinds_torch.py runs these kinds through a real server."""

import numpy as np
import pytest

import lossd
from lossd._compute import Inputs, check_out, returned_outputs, set_outputs
from lossd._kinds import set_kind
from lossd._proto import pb

RNG = np.random.default_rng(7)
BT, H, V, HT = 6, 5, 9, 3


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def build(kind="cross_entropy", targets="default", w="default", want_entropy=False, **kw):
    """(header, inline, returned outputs) of a request with random X, W and targets."""
    x = rand(BT, H)
    w = rand(V, H) if isinstance(w, str) and w == "default" else w
    t = RNG.integers(0, V, BT) if isinstance(targets, str) else targets
    inputs = Inputs(x, w, t, None, None, None, "mean")
    args = dict(temperature=None, policy=None, distill=None, dlogp=None, dentropy=None,
                advantages=None, old_logp=None, ref_logp=None, teacher_x=None, teacher_w=None,
                teacher_bias=None)
    args.update(kw)
    set_kind(inputs.header, inputs.inline, kind=kind, want_entropy=want_entropy, **args)
    set_outputs(inputs.header, False, None, want_dx=True, want_dw=False, want_db=None,
                want_lse=False, want_z_loss=False, want_accuracy=False, want_predictions=False)
    got = returned_outputs(inputs.header, inputs.xdt, inputs.xshape, inputs.wshape, False)
    return inputs.header, inputs.inline, got


def order(inline):
    return [tid for tid, _ in inline]


def test_cross_entropy_sets_none_of_the_kind_fields():
    h, inline, got = build()
    assert h.kind == pb.LOSS_KIND_CROSS_ENTROPY
    assert not h.options.HasField("temperature")
    assert not h.outputs.entropy
    assert not (h.HasField("policy") or h.HasField("distill") or h.HasField("dlogp"))
    assert order(inline) == [pb.TENSOR_TARGETS, pb.TENSOR_W, pb.TENSOR_X]
    assert set(got) == {"dx"}
    # A temperature other than 1 is sent even for cross-entropy, for the server to refuse.
    h, _, _ = build(temperature=0.5)
    assert h.options.HasField("temperature") and h.options.temperature == 0.5


def test_logprob_request():
    dlogp, dent = rand(BT), rand(BT)
    h, inline, got = build("logprob", temperature=0.7, dlogp=dlogp, dentropy=dent,
                           want_entropy=True)
    assert h.kind == pb.LOSS_KIND_LOGPROB
    assert h.options.temperature == pytest.approx(0.7)
    assert h.outputs.entropy
    assert (h.dlogp.dtype, list(h.dlogp.shape)) == (pb.DTYPE_FP32, [BT])
    assert list(h.dentropy.shape) == [BT]
    assert order(inline) == [pb.TENSOR_TARGETS, pb.TENSOR_W, pb.TENSOR_DLOGP,
                             pb.TENSOR_DENTROPY, pb.TENSOR_X]
    sent = dict(inline)
    np.testing.assert_array_equal(sent[pb.TENSOR_DLOGP], dlogp)
    np.testing.assert_array_equal(sent[pb.TENSOR_DENTROPY], dent)
    assert got["logp"] == (pb.DTYPE_FP32, (BT,)) and got["entropy"] == (pb.DTYPE_FP32, (BT,))
    # The default temperature of a kind is sent as 1.
    h, _, got = build("logprob")
    assert h.options.HasField("temperature") and h.options.temperature == 1.0
    assert "entropy" not in got and "logp" in got


def test_logprob_outputs_into_caller_buffers_are_checked():
    _, _, got = build("logprob", want_entropy=True)
    buf = np.zeros(BT, np.float32)
    assert pb.TENSOR_LOGP in check_out({"logp": buf}, got)
    with pytest.raises(lossd.InvalidArgumentError, match=r"out\['logp'\]: needs a float32"):
        check_out({"logp": np.zeros(BT + 1, np.float32)}, got)
    _, _, got = build("policy", advantages=rand(BT))
    with pytest.raises(lossd.InvalidArgumentError, match="does not return logp"):
        check_out({"logp": buf}, got)


def test_policy_request_with_options():
    adv, old, ref = rand(BT), rand(BT), rand(BT)
    h, inline, got = build("policy", temperature=1.5, advantages=adv, old_logp=old,
                           ref_logp=ref,
                           policy=dict(loss_type="dr_grpo", epsilon_low=0.1, epsilon_high=0.3,
                                       beta=0.0, sequences=2, max_completion_length=4,
                                       dapo_normalizer=2.5))
    assert h.kind == pb.LOSS_KIND_POLICY
    p = h.policy
    assert p.loss_type == pb.POLICY_LOSS_DR_GRPO
    assert (p.epsilon_low, p.epsilon_high) == pytest.approx((0.1, 0.3))
    assert p.HasField("beta") and p.beta == 0.0
    assert (p.sequences, p.max_completion_length, p.dapo_normalizer) == (2, 4, 2.5)
    assert order(inline) == [pb.TENSOR_TARGETS, pb.TENSOR_W, pb.TENSOR_ADVANTAGES,
                             pb.TENSOR_OLD_LOGP, pb.TENSOR_REF_LOGP, pb.TENSOR_X]
    # Not fp32 where the wire wants fp32: refused, not converted behind the caller's back.
    with pytest.raises(lossd.InvalidArgumentError, match="ref_logp has dtype float64; lossd takes fp32"):
        build("policy", advantages=adv, ref_logp=ref.astype(np.float64))
    assert set(got) == {"dx"}


def test_policy_defaults_are_ligers():
    h, _, _ = build("policy", advantages=rand(BT))
    p = h.policy
    assert p.loss_type == pb.POLICY_LOSS_DAPO
    assert (p.epsilon_low, p.epsilon_high, p.beta) == pytest.approx((0.2, 0.2, 0.04))
    assert p.sequences == 1
    assert (p.sapo_temperature_pos, p.sapo_temperature_neg) == pytest.approx((1.0, 1.05))
    assert not p.HasField("delta") and not p.use_bias_correction_kl
    h2, _, _ = build("policy", advantages=rand(BT), policy=lossd.PolicyOptions(beta=0.5))
    assert h2.policy.beta == 0.5 and h2.policy.loss_type == pb.POLICY_LOSS_DAPO


@pytest.mark.parametrize("loss_type, value", [("cispo", pb.POLICY_LOSS_CISPO),
                                              ("sapo", pb.POLICY_LOSS_SAPO),
                                              ("luspo", pb.POLICY_LOSS_LUSPO)])
def test_policy_other_loss_types_and_options(loss_type, value):
    h, _, _ = build("policy", advantages=rand(BT),
                    policy=dict(loss_type=loss_type, sapo_temperature_pos=2.0,
                                sapo_temperature_neg=0.5, delta=1.5,
                                use_bias_correction_kl=True))
    p = h.policy
    assert p.loss_type == value
    assert (p.sapo_temperature_pos, p.sapo_temperature_neg) == (2.0, 0.5)
    assert p.HasField("delta") and p.delta == 1.5 and p.use_bias_correction_kl


def test_distill_inline_teacher_and_no_targets():
    tx, tw, tb = rand(BT, HT), rand(V, HT), rand(V)
    h, inline, _ = build("distill", targets=None, teacher_x=tx, teacher_w=tw, teacher_bias=tb,
                         distill={"jsd_beta": 0.25})
    assert h.kind == pb.LOSS_KIND_DISTILL
    assert h.distill.jsd_beta == 0.25
    assert not h.HasField("targets")
    assert list(h.teacher_x.shape) == [BT, HT] and list(h.teacher_w.shape) == [V, HT]
    assert list(h.teacher_bias.shape) == [V]
    assert order(inline) == [pb.TENSOR_TEACHER_W, pb.TENSOR_TEACHER_BIAS, pb.TENSOR_W,
                             pb.TENSOR_TEACHER_X, pb.TENSOR_X]
    np.testing.assert_array_equal(dict(inline)[pb.TENSOR_TEACHER_X], tx)


def test_distill_teacher_by_handle():
    handle = lossd.WeightHandle(handle="w-teacher", bytes=V * HT * 4, v=V, h=HT, has_bias=True,
                                dtype="fp32")
    h, inline, _ = build("distill", teacher_x=rand(BT, HT), teacher_w=handle)
    assert h.teacher_weight_handle == "w-teacher"
    assert not h.HasField("teacher_w")
    assert pb.TENSOR_TEACHER_W not in order(inline)
    assert h.distill.jsd_beta == 0.5  # Liger's default


@pytest.mark.parametrize("kind, kw, message", [
    ("ppo", {}, "kind must be one of cross_entropy, logprob, policy, distill, got 'ppo'"),
    ("policy", {"policy": {"loss_type": "ppo"}}, "policy.loss_type must be one of"),
    ("policy", {"policy": {"clip": 0.2}}, "policy: unknown option clip"),
    ("policy", {"policy": 0.2}, "policy must be a PolicyOptions or a dict, got float"),
    ("logprob", {"policy": {}}, "policy options go with kind 'policy', not 'logprob'"),
    ("policy", {"distill": {}}, "distill options go with kind 'distill', not 'policy'"),
    ("distill", {"teacher_x": np.ones((BT, HT), np.float32)}, "needs the teacher's head"),
    ("distill", {"teacher_w": "w-1", "teacher_bias": np.ones(V, np.float32)},
     "teacher_bias given with a teacher weight handle"),
    ("distill", {"teacher_bias": np.ones(V, np.float32), "teacher_w": None},
     "teacher_bias goes with an inline teacher_w"),
    ("logprob", {"dlogp": np.ones(BT, np.int32)}, "dlogp has dtype int32"),
])
def test_refused_before_sending(kind, kw, message):
    with pytest.raises(lossd.InvalidArgumentError, match=message.replace("(", r"\(")):
        build(kind, **kw)


def test_compute_refuses_a_bad_kind_before_connecting():
    # No server listens: the call fails on its arguments, not on the connection.
    with lossd.Client("127.0.0.1:1", timeout=5) as c:
        with pytest.raises(lossd.InvalidArgumentError, match="kind must be one of"):
            c.compute(rand(BT, H), rand(V, H), RNG.integers(0, V, BT), kind="ppo")
