# SPDX-License-Identifier: Apache-2.0
"""lossd's drop-ins against Liger-Kernel 0.8.5: the signatures (a table transcribed from that
release's source, since Liger needs triton and a GPU to import), and each behaviour where the
two once differed: the functional form's chunk_mem_const, per-token accuracy under reduction
'none', the z-loss's dtype, AssertionError-compatible argument errors, ce_weight checks, and
Liger's Function argument list given to lossd's. The differences that remain on purpose are
listed in client/python/README.md ("Differences from Liger-Kernel 0.8.5") and
docs/rl_clients.md (GRPO and JSD)."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd.nn import (  # noqa: E402
    CrossEntropyOutput,
    LossdFusedLinearCrossEntropyFunction,
    LossdFusedLinearCrossEntropyLoss,
    LossdRuntime,
    lossd_fused_linear_cross_entropy,
)
from lossd.rl import LossdFusedLinearGRPOLoss, LossdFusedLinearJSD  # noqa: E402
from torch_reference import BT, V, make  # noqa: E402

_ = inspect.Parameter.empty  # no default
# Liger-Kernel 0.8.5, transcribed from its source: (name, default) in declaration order.
LIGER_085 = {
    # liger_kernel/transformers/fused_linear_cross_entropy.py
    "LigerFusedLinearCrossEntropyLoss.__init__": [
        ("ce_weight", None), ("ignore_index", -100), ("lse_square_scale", 0.0),
        ("label_smoothing", 0.0), ("reduction", "mean"), ("softcap", None),
        ("return_z_loss", False), ("accum_dtype", None), ("use_token_scaling", False),
        ("return_token_accuracy", False), ("return_predicted_tokens", False)],
    "LigerFusedLinearCrossEntropyLoss.forward": [
        ("lin_weight", _), ("_input", _), ("target", _), ("bias", None)],
    # liger_kernel/transformers/functional.py
    "liger_fused_linear_cross_entropy": [
        ("input", _), ("weight", _), ("target", _), ("bias", None), ("ce_weight", None),
        ("ignore_index", -100), ("lse_square_scale", 0.0), ("label_smoothing", 0.0),
        ("reduction", "mean"), ("softcap", None), ("return_z_loss", False),
        ("accum_dtype", None), ("use_token_scaling", False), ("return_token_accuracy", False),
        ("return_predicted_tokens", False), ("chunk_mem_const", 1)],
    "CrossEntropyOutput": [
        ("loss", _), ("z_loss", None), ("token_accuracy", None), ("predicted_tokens", None)],
    # liger_kernel/chunked_loss/grpo_loss.py
    "LigerFusedLinearGRPOLoss.__init__": [
        ("beta", 0.04), ("compiled", True), ("use_ref_model", True), ("chunk_size", 1),
        ("epsilon_low", 0.2), ("epsilon_high", 0.2), ("loss_type", "dapo"),
        ("max_completion_length", None), ("importance_sampling_level", "token"),
        ("sapo_temperature_pos", 1.0), ("sapo_temperature_neg", 1.05), ("temperature", 1.0),
        ("delta", None), ("use_bias_correction_kl", False), ("vespo_k_pos", 2.0),
        ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0)],
    "LigerFusedLinearGRPOLoss.forward": [
        ("_input", _), ("lin_weight", _), ("selected_token_ids", _), ("attention_mask", _),
        ("advantages", _), ("bias", None), ("ref_per_token_logps", None),
        ("old_per_token_logps", None), ("ref_input", None), ("ref_weight", None),
        ("ref_bias", None), ("vllm_is_ratio", None), ("num_items_in_batch", None)],
    # liger_kernel/transformers/fused_linear_jsd.py
    "LigerFusedLinearJSD.__init__": [
        ("jsd_beta", 0.5), ("ignore_index", -100), ("temperature", 1.0), ("accum_dtype", None)],
    # shift_labels has no default in Liger's module; lossd's None (no labels) is a superset.
    "LigerFusedLinearJSD.forward": [
        ("student_input", _), ("student_weight", _), ("teacher_input", _),
        ("teacher_weight", _), ("shift_labels", None)],
}

LOSSD = {
    "LigerFusedLinearCrossEntropyLoss.__init__": LossdFusedLinearCrossEntropyLoss.__init__,
    "LigerFusedLinearCrossEntropyLoss.forward": LossdFusedLinearCrossEntropyLoss.forward,
    "liger_fused_linear_cross_entropy": lossd_fused_linear_cross_entropy,
    "CrossEntropyOutput": CrossEntropyOutput,
    "LigerFusedLinearGRPOLoss.__init__": LossdFusedLinearGRPOLoss.__init__,
    "LigerFusedLinearGRPOLoss.forward": LossdFusedLinearGRPOLoss.forward,
    "LigerFusedLinearJSD.__init__": LossdFusedLinearJSD.__init__,
    "LigerFusedLinearJSD.forward": LossdFusedLinearJSD.forward,
}
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
# lossd's additions that stand after Liger's arguments and may be given by position.
EXTRA_POSITIONAL = {"LigerFusedLinearCrossEntropyLoss.__init__": ["chunk_size"],
                    "LigerFusedLinearJSD.forward": ["student_bias", "teacher_bias"]}


@pytest.mark.parametrize("name", sorted(LIGER_085))
def test_signature_matches_liger_085(name):
    """Liger's arguments come first, in its order, with its defaults; whatever lossd adds
    comes after them and is keyword-only (or listed in EXTRA_POSITIONAL), so a call written
    for Liger binds every argument to the same parameter."""
    params = [p for p in inspect.signature(LOSSD[name]).parameters.values()
              if p.name != "self"]
    liger = LIGER_085[name]
    got = [(p.name, p.default) for p in params[:len(liger)]]
    assert got == liger, name
    assert all(p.kind in POSITIONAL for p in params[:len(liger)]), name
    extra_pos = [p.name for p in params[len(liger):] if p.kind in POSITIONAL]
    assert extra_pos == EXTRA_POSITIONAL.get(name, []), name


def test_function_refuses_liger_argument_list():
    """Liger's Function takes ce_impl, ce_mode and chunk_mem_const where lossd's takes
    chunk_size and runtime: Liger's module passes (..., None, None), which must be refused
    by name rather than fail deep inside."""
    x, w, _, t = make("fp32", seed=91)
    with pytest.raises(lossd.InvalidArgumentError, match="runtime must be a lossd.nn"):
        LossdFusedLinearCrossEntropyFunction.apply(
            x, w, t, None, None, -100, 0.0, 0.0, "mean", None, False, None, False, False,
            False, None, None)


def test_functional_takes_chunk_mem_const(client):
    """A Liger call passing chunk_mem_const (by keyword, or as the 16th argument) runs; the
    value is checked as Liger checks it; chunk_size is keyword-only."""
    x, w, _, t = make("fp32", seed=92)
    rt = LossdRuntime(client=client)
    ref = lossd_fused_linear_cross_entropy(x, w, t, runtime=rt)
    by_kw = lossd_fused_linear_cross_entropy(x, w, t, chunk_mem_const=4, runtime=rt)
    by_pos = lossd_fused_linear_cross_entropy(x, w, t, None, None, -100, 0.0, 0.0, "mean",
                                              None, False, None, False, False, False, 2,
                                              runtime=rt)
    chunked = lossd_fused_linear_cross_entropy(x, w, t, chunk_size=8, runtime=rt)
    want = float(ref.detach())
    for got in (by_kw, by_pos, chunked):
        assert abs(float(got.detach()) - want) <= 1e-5 * abs(want)
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(ValueError, match="chunk_mem_const must be a positive integer"):
            lossd_fused_linear_cross_entropy(x, w, t, chunk_mem_const=bad, runtime=rt)


def test_per_token_accuracy_with_reduction_none(client):
    """Liger's reduction 'none' returns token_accuracy per token: 1.0 where the argmax is the
    target, 0.0 elsewhere and on ignored rows; mean and sum return the fraction."""
    x, w, b, t = make("fp32", bias=True, seed=93)
    # Half the targets are each row's own argmax, so the accuracy is neither 0 nor 1.
    argmax = (x.detach() @ w.detach().T + b.detach()).argmax(-1)
    g = torch.Generator().manual_seed(5)
    right = torch.rand(BT, generator=g) < 0.5
    t = torch.where(right, argmax, (argmax + 1) % V)
    t[::7] = -100
    valid = t != -100
    expect = ((argmax == t) & valid).to(torch.float32)
    assert 0 < float(expect.sum()) < float(valid.sum())
    module = LossdFusedLinearCrossEntropyLoss(reduction="none", return_token_accuracy=True,
                                              client=client)
    out = module(w, x, t, b)
    assert out.token_accuracy.shape == t.shape
    assert out.token_accuracy.dtype == torch.float32
    assert torch.equal(out.token_accuracy, expect)
    assert out.predicted_tokens is None  # asked of the server, not returned
    for reduction in ("mean", "sum"):
        m = LossdFusedLinearCrossEntropyLoss(reduction=reduction, return_token_accuracy=True,
                                             client=client)
        acc = m(w, x, t, b).token_accuracy
        assert acc.dim() == 0
        assert abs(float(acc) - float(expect.sum() / valid.sum())) < 1e-6, reduction


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_z_loss_in_input_dtype(client, dtype, reduction):
    """Liger keeps the z-loss in the hidden states' dtype; the loss is fp32 either way."""
    x, w, _, t = make(dtype, seed=94)
    module = LossdFusedLinearCrossEntropyLoss(lse_square_scale=0.05, return_z_loss=True,
                                              reduction=reduction, client=client)
    out = module(w, x, t)
    assert out.z_loss.dtype == x.dtype
    assert out.loss.dtype == torch.float32
    assert float(out.z_loss.float().sum()) > 0


def test_all_ignored(client):
    """Every target ignored: loss and z-loss 0 and zero gradients, as Liger; token_accuracy
    0.0 (Liger divides by the zero count and gives NaN: a documented difference)."""
    x, w, b, t = make("fp32", bias=True, seed=95)
    t[:] = -100
    module = LossdFusedLinearCrossEntropyLoss(lse_square_scale=0.1, return_z_loss=True,
                                              return_token_accuracy=True,
                                              return_predicted_tokens=True, client=client)
    out = module(w, x, t, b)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and float(out.z_loss) == 0.0
    assert float(out.token_accuracy) == 0.0
    assert torch.equal(out.predicted_tokens, torch.full_like(t, -1))
    for leaf in (x, w, b):
        assert torch.count_nonzero(leaf.grad) == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"label_smoothing": 1.5}, "label_smoothing"),
    ({"reduction": "avg"}, "reduction"),
    ({"softcap": 0.0}, "softcap"),
    ({"softcap": -1.0}, "softcap"),
])
def test_module_argument_errors_are_assertion_errors(kwargs, match):
    """Liger's module asserts its arguments: code catching AssertionError still does, and
    the error is lossd's InvalidArgumentError (a ValueError) naming the argument."""
    with pytest.raises(AssertionError, match=match) as info:
        LossdFusedLinearCrossEntropyLoss(server="127.0.0.1:9", **kwargs)
    assert isinstance(info.value, lossd.InvalidArgumentError)
    assert isinstance(info.value, ValueError)


def test_functional_checks_softcap_and_ce_weight(client):
    """What Liger's function asserts of ce_weight (size V, floating point), and a softcap
    that is not positive (lossd's wire would read 0 as no softcap), refused by name."""
    x, w, _, t = make("fp32", seed=96)
    rt = LossdRuntime(client=client)
    bad = [(dict(ce_weight=torch.rand(V + 1)), "ce_weight must be a tensor of size V"),
           (dict(ce_weight=torch.rand(V, 2)), "ce_weight must be a tensor of size V"),
           (dict(ce_weight=torch.ones(V, dtype=torch.int64)), "floating point"),
           (dict(softcap=0.0), "softcap must be greater than 0.0"),
           (dict(softcap=-2.0), "softcap must be greater than 0.0")]
    for kw, match in bad:
        with pytest.raises(AssertionError, match=match):
            lossd_fused_linear_cross_entropy(x, w, t, runtime=rt, **kw)


def test_rl_argument_errors_are_assertion_errors():
    """LigerFusedLinearJSD asserts temperature != 0; the GRPO base asserts dr_grpo's
    max_completion_length: both stay catchable as AssertionError (and ValueError)."""
    with pytest.raises(AssertionError, match="temperature cannot be 0"):
        LossdFusedLinearJSD(temperature=0, server="127.0.0.1:9")
    with pytest.raises(AssertionError, match="max_completion_length"):
        LossdFusedLinearGRPOLoss(loss_type="dr_grpo", server="127.0.0.1:9")
    with pytest.raises(ValueError, match="max_completion_length"):
        LossdFusedLinearGRPOLoss(loss_type="dr_grpo", server="127.0.0.1:9")


@pytest.fixture
def heads(client):
    from head_harness import made_heads

    yield from made_heads(client)


def test_remote_head_outputs_as_the_module(client, heads):
    """RemoteLMHead returns the same CrossEntropyOutput as the module: per-token accuracy
    under reduction 'none', the z-loss in the hidden states' dtype."""
    from head_harness import make_batch, make_head
    from lossd.nn import RemoteLMHead

    w, b = make_head(97)
    mod = RemoteLMHead(heads.name("parity"), w, b, client=client, reduction="none",
                       lse_square_scale=0.05, return_z_loss=True, return_token_accuracy=True)
    x, t = make_batch(97)
    argmax = (x @ w.T + b).argmax(-1)
    half = torch.rand(t.shape, generator=torch.Generator().manual_seed(6)) < 0.5
    t = torch.where(half & (t != -100), argmax, t)  # some right, some wrong, some ignored
    expect = ((argmax == t) & (t != -100)).to(torch.float32)
    assert 0 < float(expect.sum()) < float((t != -100).sum())
    with torch.no_grad():
        out = mod(x, t)
    assert torch.equal(out.token_accuracy, expect)
    assert out.z_loss.dtype == x.dtype and out.z_loss.shape == t.shape
