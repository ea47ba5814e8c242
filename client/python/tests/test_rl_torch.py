# SPDX-License-Identifier: Apache-2.0
"""lossd.rl against torch float64 autograd: the verl-style log-prob and entropy helpers, the
GRPO loss module (LigerFusedLinearGRPOLoss's arguments) and the JSD module
(LigerFusedLinearJSD's), forward values and dX, dW, db, on CPU in float32 inputs.

Two backends: "reference" answers compute() with the float64 formulas in-process
(rl_torch_reference.ReferenceClient: the modules' plumbing without a server), "server" a real
lossd (conftest's server; skipped where it lacks the feature "loss_kind_<kind>").
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd import rl  # noqa: E402
from lossd.nn import LossdRuntime  # noqa: E402
from rl_torch_reference import (DT, ReferenceClient, as64, jsd_loss, log_softmax,  # noqa: E402
                                logprob_entropy, policy_loss)

# Server: fp32 arithmetic against float64 (conftest's fp32 table); reference: float64 cast
# to fp32 once.
RTOL, ATOL = 1e-4, 1e-5
B, S, H, V, HT = 4, 6, 16, 40, 12


def needs(*kinds):
    """The loss kinds a test's server backend must compute (else it is skipped)."""
    def mark(fn):
        fn.lossd_kinds = kinds
        return fn
    return mark


@pytest.fixture(params=["reference", "server"])
def backend(request):
    """(a LossdRuntime factory, the ReferenceClient or None)."""
    if request.param == "reference":
        fake = ReferenceClient()
        return (lambda: LossdRuntime(client=fake, cache_weights=False)), fake
    client = request.getfixturevalue("client")
    features = set(client.server_info().features)
    missing = [k for k in request.function.lossd_kinds if "loss_kind_" + k not in features]
    if missing:
        pytest.skip("the server does not compute loss kinds %s" % ", ".join(missing))
    return (lambda: LossdRuntime(client=client, cache_weights=True)), None


def expect_close(name, got, want, rtol=RTOL, atol=ATOL):
    """|got - want| <= rtol |want| + atol max|want|, element-wise, asserted."""
    got = as64(torch.as_tensor(got)).reshape(-1)
    want = as64(torch.as_tensor(want)).reshape(-1)
    assert got.shape == want.shape, name
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs()
    bound = rtol * want.abs() + atol * max(scale, 1e-30)
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), "%s[%d]: got %r want %r (max |want| %g)" % (
        name, worst, got[worst].item(), want[worst].item(), scale)


def leaves(*shapes, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * scale).requires_grad_(True) for s in shapes]


def ref_leaves(*tensors):
    return [None if t is None else as64(t).requires_grad_(True) for t in tensors]


def expect_grads(pairs):
    for name, got, ref in pairs:
        if ref is None:
            assert got is None, name
        else:
            assert got is not None, name
            expect_close(name, got.grad, ref.grad)


@needs("logprob")
@pytest.mark.parametrize("with_bias, temperature", [(False, 1.0), (True, 0.7)])
def test_fused_linear_for_ppo_values_and_gradients(backend, with_bias, temperature):
    make, fake = backend
    runtime = make()
    hidden, w, b = leaves((B, S, H), (V, H), (V,), seed=1)
    b = b if with_bias else None
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    logp, entropy = rl.fused_linear_for_ppo(hidden, w, ids, temperature, bias=b,
                                            runtime=runtime)
    assert logp.shape == (B, S) and entropy.shape == (B, S) and logp.dtype == torch.float32
    g1, g2 = (torch.randn(B, S, generator=torch.Generator().manual_seed(s)) for s in (3, 4))
    (g1 * logp + g2 * entropy).sum().backward()

    rx, rw, rb = ref_leaves(hidden.reshape(-1, H), w, b)
    rlogp, rent = logprob_entropy(rx, rw, rb, ids.reshape(-1), temperature)
    (as64(g1).reshape(-1) * rlogp + as64(g2).reshape(-1) * rent).sum().backward()
    expect_close("logp", logp, rlogp.detach())
    expect_close("entropy", entropy, rent.detach())
    expect_grads([("dx", hidden, rx), ("dw", w, rw), ("db", b, rb)])
    if fake is not None:  # a forward-only call, then one carrying both upstream gradients
        assert [c["want_dx"] for c in fake.calls] == [False, True]
        assert fake.calls[1]["has_dlogp"] and fake.calls[1]["temperature"] == temperature


@needs("logprob")
def test_logprobs_and_entropy_from_hidden(backend):
    make, fake = backend
    runtime = make()
    hidden, w = leaves((B * S, H), (V, H), seed=5)
    ids = torch.randint(0, V, (B * S,), generator=torch.Generator().manual_seed(6))
    logp = rl.logprobs_from_hidden(hidden, w, ids, temperature=1.3, runtime=runtime)
    (logp * torch.linspace(-1, 1, B * S)).sum().backward()
    rx, rw = ref_leaves(hidden, w)
    rlogp, rent = logprob_entropy(rx, rw, None, ids, 1.3)
    (rlogp * torch.linspace(-1, 1, B * S, dtype=DT)).sum().backward()
    expect_close("logp", logp, rlogp.detach())
    expect_grads([("dx", hidden, rx), ("dw", w, rw)])
    entropy = rl.entropy_from_hidden(hidden.detach(), w.detach(), 1.3, runtime=runtime)
    expect_close("entropy", entropy, rent.detach())
    lp_mean, ent_mean = rl.linear_cross_entropy(hidden.detach(), w.detach(), ids, 1.3,
                                                reduction="mean", runtime=runtime)
    expect_close("mean logp", lp_mean, rlogp.detach().mean())
    expect_close("mean entropy", ent_mean, rent.detach().mean())
    with pytest.raises(lossd.InvalidArgumentError, match="vocabulary-parallel"):
        rl.linear_cross_entropy(hidden, w, ids, dist_process_group=object(), runtime=runtime)


def ratios_away_from_bounds(n, eps_low, eps_high, seed, more_bounds=()):
    """Importance ratios in (0.5, 1.6) at least 0.03 from the clip bounds (and any other kink:
    cispo's bound, delta), so fp32 and float64 agree on which tokens clip."""
    g = np.random.default_rng(seed)
    r = g.uniform(0.5, 1.6, n)
    for bound in (1 - eps_low, 1 + eps_high) + tuple(more_bounds):
        near = np.abs(r - bound) < 0.03
        r[near] = bound + np.where(r[near] < bound, -0.05, 0.05)
    return torch.from_numpy(r)


@needs("policy")
@pytest.mark.parametrize("loss_type, beta, with_old, with_bias", [
    ("dapo", 0.04, True, False), ("grpo", 0.0, True, True), ("bnpo", 0.1, False, False),
    ("dr_grpo", 0.04, True, False), ("dapo", 0.0, False, True)])
def test_grpo_loss_matches_torch(backend, loss_type, beta, with_old, with_bias):
    make, fake = backend
    x3, w, b = leaves((B, S, H), (V, H), (V,), seed=11, scale=0.7)
    b = b if with_bias else None
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.25).to(torch.int64)
    mask[0, 0] = 1
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        cur, _ = logprob_entropy(as64(x3).reshape(-1, H), as64(w), as64(b), ids.reshape(-1), 0.9)
    old = (cur - torch.log(ratios_away_from_bounds(B * S, 0.2, 0.28, 13))).reshape(B, S)
    ref = (cur + 0.2 * torch.randn(B * S, generator=g, dtype=DT)).reshape(B, S)
    module = rl.LossdFusedLinearGRPOLoss(beta=beta, epsilon_high=0.28, loss_type=loss_type,
                                         max_completion_length=S + 2, temperature=0.9,
                                         runtime=make())
    loss, metrics = module(x3, w, ids, mask, adv, bias=b, ref_per_token_logps=ref.float(),
                           old_per_token_logps=old.float() if with_old else None)
    (3.0 * loss).backward()  # an upstream gradient other than 1

    rx, rw, rb = ref_leaves(x3.reshape(-1, H), w, b)
    rlogp, _ = logprob_entropy(rx, rw, rb, ids.reshape(-1), 0.9)
    opts = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta,
                max_completion_length=S + 2, dapo_normalizer=0.0)
    rloss, rkl, rclip = policy_loss(rlogp, as64(mask).reshape(-1), as64(adv).repeat_interleave(S),
                                    as64(old.float()) if with_old else None,
                                    as64(ref.float()) if beta else None, opts, B)
    (3.0 * rloss).backward()
    expect_close("loss", loss, rloss.detach())
    assert len(metrics) == (2 if beta else 1)
    if beta:
        expect_close("kl", metrics[0], rkl, atol=1e-4)
    expect_close("clip_fraction", metrics[-1], rclip, rtol=1e-6, atol=0)
    if with_old:
        assert 0 < metrics[-1].item() < 1, "some tokens clip, some do not"
    expect_grads([("dx", x3, rx), ("dw", w, rw), ("db", b, rb)])
    if fake is not None:
        call = fake.calls[-1]
        assert call["policy"]["sequences"] == B and call["has_old"] == with_old
        assert call["has_ref"] == (beta != 0)


@needs("policy", "logprob")
def test_grpo_dapo_normalizer_and_ref_from_a_reference_head(backend):
    make, fake = backend
    x3, w = leaves((B, S, H), (V, H), seed=21, scale=0.7)
    rin, rwt = (t.detach() for t in leaves((B, S, H), (V, H), seed=22, scale=0.7))
    g = torch.Generator().manual_seed(23)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S)
    adv = torch.randn(B, S, generator=g)  # per token
    module = rl.LossdFusedLinearGRPOLoss(beta=0.3, runtime=make())
    loss, (kl, clip) = module(x3, w, ids, mask, adv, ref_input=rin, ref_weight=rwt,
                              num_items_in_batch=40)
    loss.backward()
    rx, rw = ref_leaves(x3.reshape(-1, H), w)
    rlogp, _ = logprob_entropy(rx, rw, None, ids.reshape(-1), 1.0)
    with torch.no_grad():
        refl, _ = logprob_entropy(as64(rin).reshape(-1, H), as64(rwt), None, ids.reshape(-1), 1.0)
    opts = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.3,
                max_completion_length=0, dapo_normalizer=40.0)
    rloss, rkl, _ = policy_loss(rlogp, as64(mask).reshape(-1), as64(adv).reshape(-1), None,
                                refl.float().double(), opts, B)
    rloss.backward()
    expect_close("loss", loss, rloss.detach())
    expect_close("kl", kl, rkl, atol=1e-4)
    assert clip.item() == 0.0  # no old log-probs: every ratio is 1
    expect_grads([("dx", x3, rx), ("dw", w, rw)])


# The loss types beyond Liger's first four with their options: (constructor arguments, the
# ratios' kinks besides the clip bounds). cispo's bound is epsilon_high itself.
OTHER_TYPES = [
    (dict(loss_type="cispo", epsilon_high=1.3, beta=0.04), (1.3,)),
    (dict(loss_type="cispo", epsilon_high=1.3, beta=0.1, use_bias_correction_kl=True), (1.3,)),
    (dict(loss_type="sapo", sapo_temperature_pos=1.7, sapo_temperature_neg=0.6, beta=0.0), ()),
    (dict(loss_type="sapo", beta=0.2, use_bias_correction_kl=True), ()),
    (dict(loss_type="luspo", epsilon_high=0.28, beta=0.04), ()),
    (dict(loss_type="luspo", epsilon_high=0.28, beta=0.04, delta=1.45), (1.45,)),
    (dict(loss_type="grpo", epsilon_high=0.28, beta=0.1, delta=1.4,
          use_bias_correction_kl=True), (1.4,)),
    (dict(loss_type="vespo", beta=0.0), ()),
    (dict(loss_type="vespo", beta=0.1, use_bias_correction_kl=True, vespo_k_pos=1.5,
          vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.0), ()),
]


def other_type_id(case):
    kw = case[0]
    return "-".join([kw["loss_type"]] + sorted(k for k in kw if k in (
        "delta", "use_bias_correction_kl", "sapo_temperature_pos")))


@needs("policy")
@pytest.mark.parametrize("case", OTHER_TYPES, ids=[other_type_id(c) for c in OTHER_TYPES])
def test_grpo_other_loss_types_match_torch(backend, case):
    kw, kinks = case
    make, fake = backend
    x3, w, b = leaves((B, S, H), (V, H), (V,), seed=71, scale=0.7)
    g = torch.Generator().manual_seed(72)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.25).to(torch.int64)
    mask[0, 0] = 1
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        cur, _ = logprob_entropy(as64(x3).reshape(-1, H), as64(w), as64(b), ids.reshape(-1), 0.9)
    eps_high = kw.get("epsilon_high", 0.2)
    old = (cur - torch.log(ratios_away_from_bounds(B * S, 0.2, eps_high, 73, kinks)))
    old = old.reshape(B, S).float()
    ref = (cur + 0.2 * torch.randn(B * S, generator=g, dtype=DT)).reshape(B, S).float()
    module = rl.LossdFusedLinearGRPOLoss(temperature=0.9, runtime=make(), **kw)
    loss, metrics = module(x3, w, ids, mask, adv, bias=b, ref_per_token_logps=ref,
                           old_per_token_logps=old)
    (2.0 * loss).backward()

    rx, rw, rb = ref_leaves(x3.reshape(-1, H), w, b)
    rlogp, _ = logprob_entropy(rx, rw, rb, ids.reshape(-1), 0.9)
    opts = dict(epsilon_low=0.2, epsilon_high=eps_high, max_completion_length=0,
                dapo_normalizer=0.0, **{k: v for k, v in kw.items() if k != "epsilon_high"})
    rloss, rkl, rclip = policy_loss(rlogp, as64(mask).reshape(-1), as64(adv).repeat_interleave(S),
                                    as64(old), as64(ref) if kw["beta"] else None, opts, B)
    (2.0 * rloss).backward()
    expect_close("loss", loss, rloss.detach())
    assert len(metrics) == (2 if kw["beta"] else 1)
    if kw["beta"]:
        expect_close("kl", metrics[0], rkl, atol=1e-4)
    expect_close("clip_fraction", metrics[-1], rclip, rtol=1e-6, atol=0)
    if kw["loss_type"] not in ("sapo", "vespo"):  # they never clip
        assert 0 < metrics[-1].item() < 1, "some tokens clip, some do not"
    expect_grads([("dx", x3, rx), ("dw", w, rw), ("db", b, rb)])
    if fake is not None:
        sent = fake.calls[-1]["policy"]
        for name in ("loss_type", "delta", "use_bias_correction_kl", "sapo_temperature_pos",
                     "vespo_k_pos", "vespo_lambda_neg"):
            if name in kw:
                assert sent[name] == kw[name], name


@pytest.mark.parametrize("kw, message", [
    (dict(loss_type="vespo", importance_sampling_level="sequence"),
     "Sequence-level importance sampling is not supported for loss_type='vespo'"),
    (dict(loss_type="vespo", delta=2.0), "delta applies to the clipped loss types"),
    (dict(loss_type="ppo"), "Unknown loss type: ppo"),
    (dict(importance_sampling_level="group"), "Unknown importance sampling level: group"),
    (dict(loss_type="cispo", importance_sampling_level="sequence"),
     "Sequence-level importance sampling is not supported for loss_type='cispo'"),
    (dict(loss_type="sapo", importance_sampling_level="sequence"),
     "Sequence-level importance sampling is not supported for loss_type='sapo'"),
    (dict(sapo_temperature_pos=0.0), "sapo_temperature_pos must be positive, got 0.0"),
    (dict(sapo_temperature_neg=-1), "sapo_temperature_neg must be positive, got -1"),
    (dict(delta=-2.0), "delta must be positive, got -2.0"),
    (dict(delta=1.1), r"delta must be > 1 \+ epsilon_high = 1.2"),
    (dict(loss_type="sapo", delta=2.0), "delta applies to the clipped loss types"),
    (dict(loss_type="cispo", delta=2.0), "loss_type 'cispo' has no clipped surrogate"),
    (dict(loss_type="dr_grpo"), "max_completion_length must be provided")])
def test_grpo_refuses_what_it_does_not_compute(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        rl.LossdFusedLinearGRPOLoss(client=ReferenceClient(), **kw)
    assert isinstance(e.value, lossd.InvalidArgumentError)


@needs("distill")
@pytest.mark.parametrize("jsd_beta, labels, with_bias, temperature", [
    (0.5, "some ignored", False, 1.0), (0.0, None, True, 2.0), (1.0, "some ignored", False, 1.0),
    (0.25, "all kept", True, 0.8)])
def test_jsd_matches_torch(backend, jsd_beta, labels, with_bias, temperature):
    make, fake = backend
    x, w, b = leaves((B * S, H), (V, H), (V,), seed=31, scale=0.6)
    tx, tw, tb = (t.detach() for t in leaves((B * S, HT), (V, HT), (V,), seed=32, scale=0.6))
    b, tb = (b, tb) if with_bias else (None, None)
    g = torch.Generator().manual_seed(33)
    lab = None
    if labels is not None:
        lab = torch.randint(0, V, (B * S,), generator=g)
        if labels == "some ignored":
            lab[::3] = -100
    module = rl.LossdFusedLinearJSD(jsd_beta=jsd_beta, temperature=temperature, runtime=make())
    loss = module(x, w, tx, tw, lab, student_bias=b, teacher_bias=tb)
    (0.5 * loss).backward()
    rx, rw, rb = ref_leaves(x, w, b)
    keep = torch.ones(B * S, dtype=torch.bool) if lab is None else lab != -100
    rloss = jsd_loss(log_softmax(rx, rw, rb, temperature),
                     log_softmax(as64(tx), as64(tw), as64(tb), temperature), jsd_beta, keep)
    (0.5 * rloss).backward()
    expect_close("loss", loss, rloss.detach())
    expect_grads([("dx", x, rx), ("dw", w, rw), ("db", b, rb)])
    if fake is not None:
        assert fake.calls[-1]["has_targets"] == (lab is not None)
        assert fake.calls[-1]["distill"] == {"jsd_beta": jsd_beta}


@needs("distill")
def test_frozen_weight_gets_no_gradient(backend):
    make, _ = backend
    x = leaves((B * S, H), seed=41)[0]
    w = torch.randn(V, H, generator=torch.Generator().manual_seed(42))  # no requires_grad
    tx, tw = torch.randn(B * S, HT), torch.randn(V, HT)
    loss = rl.LossdFusedLinearJSD(runtime=make())(x, w, tx, tw, None)
    loss.backward()
    assert x.grad is not None and w.grad is None
    assert float(x.grad.abs().max()) > 0


def test_retained_graph_and_double_backward():
    runtime = LossdRuntime(client=ReferenceClient(), cache_weights=False)
    x, w = leaves((B * S, H), (V, H), seed=51)
    tx, tw = torch.randn(B * S, HT), torch.randn(V, HT)
    loss = rl.LossdFusedLinearJSD(runtime=runtime)(x, w, tx, tw, None)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    expect_close("dx twice", x.grad, 2 * first, rtol=1e-6, atol=0)
    ids = torch.randint(0, V, (B * S,))
    logp = rl.logprobs_from_hidden(x, w, ids, runtime=runtime)
    with pytest.raises(lossd.UnimplementedError, match="double backward"):
        torch.autograd.grad(logp.sum(), x, create_graph=True)
    loss = rl.LossdFusedLinearJSD(runtime=runtime)(x, w, tx, tw, None)
    with pytest.raises(lossd.UnimplementedError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


@needs("policy")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_grpo_module_matches_ligers_module(backend, loss_type):
    """The same constructor and forward arguments given to Liger-Kernel 0.8.5's own
    LigerFusedLinearGRPOLoss (CPU, compiled=False) and to ours: equal loss, metrics and
    gradients (Liger's log-probs are float32: 2e-5 of each output's largest value)."""
    from test_rl_reference_torch import import_liger
    grpo = import_liger("liger_kernel.chunked_loss.grpo_loss")
    make, _ = backend
    x3, w, b = leaves((B, S, H), (V, H), (V,), seed=61, scale=0.7)
    g = torch.Generator().manual_seed(62)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.2).to(torch.int64)
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        cur, _ = logprob_entropy(as64(x3).reshape(-1, H), as64(w), as64(b), ids.reshape(-1), 1.2)
    old = (cur - torch.log(ratios_away_from_bounds(B * S, 0.2, 0.3, 63))).reshape(B, S).float()
    ref = (cur + 0.2 * torch.randn(B * S, generator=g, dtype=DT)).reshape(B, S).float()
    args = dict(beta=0.05, epsilon_low=0.2, epsilon_high=0.3, loss_type=loss_type,
                max_completion_length=S + 1, temperature=1.2)
    ours = rl.LossdFusedLinearGRPOLoss(compiled=False, runtime=make(), **args)
    theirs = grpo.LigerFusedLinearGRPOLoss(compiled=False, **args)
    results = []
    for module in (ours, theirs):
        leaves_now = [t.detach().clone().requires_grad_(True) for t in (x3, w, b)]
        loss, metrics = module(leaves_now[0], leaves_now[1], ids, mask, adv, bias=leaves_now[2],
                               ref_per_token_logps=ref, old_per_token_logps=old,
                               num_items_in_batch=30)
        loss.backward()
        results.append((loss.detach(), [m.detach() for m in metrics],
                        [t.grad for t in leaves_now]))
    (loss, metrics, grads), (lloss, lmetrics, lgrads) = results
    tol = 2e-5
    expect_close("loss", loss, lloss, rtol=0, atol=tol)
    assert len(metrics) == len(lmetrics) == 2
    expect_close("kl", metrics[0], lmetrics[0], rtol=0, atol=tol)
    expect_close("clip_fraction", metrics[1], lmetrics[1], rtol=1e-6, atol=0)
    for name, got, want in zip(("dx", "dw", "db"), grads, lgrads):
        expect_close(name, got, want, rtol=0, atol=tol)


# vespo's loss is a cancelling sum of terms phi A logp whose weight phi moves with the
# sequence's summed log-ratios: Liger's fp32 module sits ~4e-5 of the loss from float64 here,
# past this test's 2e-5. Liger's own vespo cases (tools/liger_check, its tolerances) and the
# float64 comparisons above check it instead.
LIGER_MODULE_TYPES = [c for c in OTHER_TYPES if c[0]["loss_type"] != "vespo"]


@needs("policy")
@pytest.mark.parametrize("case", LIGER_MODULE_TYPES,
                         ids=[other_type_id(c) for c in LIGER_MODULE_TYPES])
def test_grpo_other_loss_types_match_ligers_module(backend, case):
    """As above for cispo, sapo, luspo, delta and use_bias_correction_kl. luspo's mask is all
    ones: Liger's token-level luspo counts masked tokens in, lossd's leaves them out."""
    from test_rl_reference_torch import import_liger
    grpo = import_liger("liger_kernel.chunked_loss.grpo_loss")
    kw, kinks = case
    make, _ = backend
    x3, w, b = leaves((B, S, H), (V, H), (V,), seed=81, scale=0.7)
    g = torch.Generator().manual_seed(82)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.2).to(torch.int64)
    if kw["loss_type"] == "luspo":
        mask = torch.ones(B, S, dtype=torch.int64)
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        cur, _ = logprob_entropy(as64(x3).reshape(-1, H), as64(w), as64(b), ids.reshape(-1), 1.2)
    eps_high = kw.get("epsilon_high", 0.2)
    old = (cur - torch.log(ratios_away_from_bounds(B * S, 0.2, eps_high, 83, kinks)))
    old = old.reshape(B, S).float()
    ref = (cur + 0.2 * torch.randn(B * S, generator=g, dtype=DT)).reshape(B, S).float()
    ours = rl.LossdFusedLinearGRPOLoss(compiled=False, runtime=make(), temperature=1.2, **kw)
    theirs = grpo.LigerFusedLinearGRPOLoss(compiled=False, temperature=1.2, **kw)
    results = []
    for module in (ours, theirs):
        leaves_now = [t.detach().clone().requires_grad_(True) for t in (x3, w, b)]
        loss, metrics = module(leaves_now[0], leaves_now[1], ids, mask, adv, bias=leaves_now[2],
                               ref_per_token_logps=ref, old_per_token_logps=old,
                               num_items_in_batch=30)
        loss.backward()
        results.append((loss.detach(), [m.detach() for m in metrics],
                        [t.grad for t in leaves_now]))
    (loss, metrics, grads), (lloss, lmetrics, lgrads) = results
    tol = 2e-5
    expect_close("loss", loss, lloss, rtol=0, atol=tol)
    assert len(metrics) == len(lmetrics) == (2 if kw["beta"] else 1)
    if kw["beta"]:
        expect_close("kl", metrics[0], lmetrics[0], rtol=0, atol=tol)
    expect_close("clip_fraction", metrics[-1], lmetrics[-1], rtol=1e-6, atol=0)
    for name, got, want in zip(("dx", "dw", "db"), grads, lgrads):
        expect_close(name, got, want, rtol=0, atol=tol)


def sequence_level_inputs(seed):
    """A (B, S) problem whose sequences' mean log-ratios sit at -0.5, 0.05, 0.45 and -0.1
    (+- 0.05 per token): two sequences clipped (bounds log 0.8, log 1.3), two not, none near."""
    x3, w, b = leaves((B, S, H), (V, H), (V,), seed=seed, scale=0.7)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.2).to(torch.int64)
    mask[:, 0] = 1
    adv = torch.tensor([-0.8, 0.6, 1.1, -0.4])
    with torch.no_grad():
        cur, _ = logprob_entropy(as64(x3).reshape(-1, H), as64(w), as64(b), ids.reshape(-1), 1.2)
    shift = torch.tensor([-0.5, 0.05, 0.45, -0.1], dtype=DT).repeat_interleave(S)
    noise = 0.1 * torch.rand(B * S, generator=g, dtype=DT) - 0.05
    old = (cur - shift - noise).reshape(B, S).float()
    ref = (cur + 0.2 * torch.randn(B * S, generator=g, dtype=DT)).reshape(B, S).float()
    return x3, w, b, ids, mask, adv, old, ref


@needs("policy")
@pytest.mark.parametrize("loss_type, kw", [
    ("dapo", {}), ("grpo", dict(use_bias_correction_kl=True)), ("bnpo", dict(delta=1.5)),
    ("dr_grpo", {}), ("luspo", {})])
def test_grpo_sequence_level_matches_torch(backend, loss_type, kw):
    """importance_sampling_level="sequence" (GSPO) against torch float64 autograd of Liger's
    formulas: one ratio per sequence, its gradient through the mean of the log-ratios."""
    make, fake = backend
    if fake is None and "policy_sequence_importance_sampling" not in set(
            make().client.server_info().features):
        pytest.skip("the server does not compute sequence-level importance sampling")
    x3, w, b, ids, mask, adv, old, ref = sequence_level_inputs(91)
    args = dict(beta=0.05, epsilon_low=0.2, epsilon_high=0.3, loss_type=loss_type,
                max_completion_length=S + 1, temperature=1.2, **kw)
    module = rl.LossdFusedLinearGRPOLoss(importance_sampling_level="sequence", runtime=make(),
                                         **args)
    loss, (kl, clip) = module(x3, w, ids, mask, adv, bias=b, ref_per_token_logps=ref,
                              old_per_token_logps=old)
    (2.0 * loss).backward()
    rx, rw, rb = ref_leaves(x3.reshape(-1, H), w, b)
    rlogp, _ = logprob_entropy(rx, rw, rb, ids.reshape(-1), 1.2)
    opts = dict(dapo_normalizer=0.0, importance_sampling="sequence",
                **{k: v for k, v in args.items() if k != "temperature"})
    rloss, rkl, rclip = policy_loss(rlogp, as64(mask).reshape(-1), as64(adv).repeat_interleave(S),
                                    as64(old), as64(ref), opts, B)
    (2.0 * rloss).backward()
    expect_close("loss", loss, rloss.detach())
    expect_close("kl", kl, rkl, atol=1e-4)
    expect_close("clip_fraction", clip, rclip, rtol=1e-6, atol=0)
    assert 0 < clip.item() < 1, "some sequences clip, some do not"
    expect_grads([("dx", x3, rx), ("dw", w, rw), ("db", b, rb)])
    if fake is not None:
        assert fake.calls[-1]["policy"]["importance_sampling"] == "sequence"


@needs("policy")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_grpo_sequence_level_matches_ligers_module(backend, loss_type):
    """The same arguments, importance_sampling_level="sequence", given to Liger-Kernel
    0.8.5's LigerFusedLinearGRPOLoss (CPU, compiled=False) and to ours (2e-5 of each output's
    largest value: Liger's log-probs are float32)."""
    from test_rl_reference_torch import import_liger
    grpo = import_liger("liger_kernel.chunked_loss.grpo_loss")
    make, fake = backend
    if fake is None and "policy_sequence_importance_sampling" not in set(
            make().client.server_info().features):
        pytest.skip("the server does not compute sequence-level importance sampling")
    x3, w, b, ids, mask, adv, old, ref = sequence_level_inputs(95)
    args = dict(beta=0.05, epsilon_low=0.2, epsilon_high=0.3, loss_type=loss_type,
                max_completion_length=S + 1, temperature=1.2, compiled=False,
                importance_sampling_level="sequence")
    results = []
    for module in (rl.LossdFusedLinearGRPOLoss(runtime=make(), **args),
                   grpo.LigerFusedLinearGRPOLoss(**args)):
        now = [t.detach().clone().requires_grad_(True) for t in (x3, w, b)]
        loss, metrics = module(now[0], now[1], ids, mask, adv, bias=now[2],
                               ref_per_token_logps=ref, old_per_token_logps=old,
                               num_items_in_batch=30)
        loss.backward()
        results.append((loss.detach(), [m.detach() for m in metrics], [t.grad for t in now]))
    (loss, metrics, grads), (lloss, lmetrics, lgrads) = results
    expect_close("loss", loss, lloss, rtol=0, atol=2e-5)
    expect_close("kl", metrics[0], lmetrics[0], rtol=0, atol=2e-5)
    expect_close("clip_fraction", metrics[1], lmetrics[1], rtol=1e-6, atol=0)
    for name, got, want in zip(("dx", "dw", "db"), grads, lgrads):
        expect_close(name, got, want, rtol=0, atol=2e-5)


@needs("policy", "distill", "logprob")
def test_server_accumulator_sums_every_kind(backend):
    """With a server accumulator dW goes there (scaled by the upstream gradient and the
    runtime's grad_scale) and dX comes back: two micro-batches of each loss kind, summed, equal
    torch's summed gradients."""
    make, fake = backend
    if fake is not None:
        pytest.skip("accumulators live on a server")
    client = make().client
    w = leaves((V, H), seed=71)[0]
    grpo = rl.LossdFusedLinearGRPOLoss(beta=0.0, client=client, accumulator=True, grad_scale=0.5)
    jsd = rl.LossdFusedLinearJSD(client=client, accumulator=True, grad_scale=0.5)
    ppo = rl.LossdFusedLinearForPPO(client=client, accumulator=True, grad_scale=0.5)
    rw = ref_leaves(w)[0]
    dx_pairs = []
    for mb in range(2):
        g = torch.Generator().manual_seed(80 + mb)
        x3 = (torch.randn(B, S, H, generator=g) * 0.7).requires_grad_(True)
        ids = torch.randint(0, V, (B, S), generator=g)
        mask = torch.ones(B, S, dtype=torch.int64)
        adv = torch.randn(B, generator=g)
        tx, tw = torch.randn(B * S, HT, generator=g), torch.randn(V, HT, generator=g)
        up = torch.randn(B, S, generator=g)
        loss, _ = grpo(x3, w, ids, mask, adv)
        jl = jsd(x3.reshape(-1, H), w, tx, tw, None)
        logp, _ = ppo(x3, w, ids)
        (2.0 * loss + jl + (up * logp).sum()).backward()
        rx = as64(x3).reshape(-1, H).requires_grad_(True)
        rlogp, _ = logprob_entropy(rx, rw, None, ids.reshape(-1), 1.0)
        opts = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                    max_completion_length=0, dapo_normalizer=0.0)
        rloss, _, _ = policy_loss(rlogp, as64(mask).reshape(-1), as64(adv).repeat_interleave(S),
                                  None, None, opts, B)
        rjl = jsd_loss(log_softmax(rx, rw, None, 1.0), log_softmax(as64(tx), as64(tw), None, 1.0),
                       0.5, torch.ones(B * S, dtype=torch.bool))
        # grad_scale 0.5 scales what goes to the server: dX comes back halved too.
        (0.5 * (2.0 * rloss + rjl + (as64(up).reshape(-1) * rlogp).sum())).backward()
        dx_pairs.append((x3, rx))
    assert w.grad is None  # dW went to the accumulators
    for i, (x3, rx) in enumerate(dx_pairs):
        expect_close("dx%d" % i, x3.grad, rx.grad)
    for module in (grpo, jsd, ppo):
        module.apply_accumulated_gradients(w)
    expect_close("dw summed over kinds and micro-batches", w.grad, rw.grad)
    for module in (grpo, jsd, ppo):
        module.runtime.drop_accumulator()
        module.release()
