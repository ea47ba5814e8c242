# SPDX-License-Identifier: Apache-2.0
"""lossd.integrations.torchtitan against torchtitan's own Llama 3 and its CrossEntropyLoss
(from the installed package): a tiny Llama 3 from torchtitan's debug configuration, its
forward with _skip_lm_head (apply_lossd) and lossd's loss against its own forward and loss,
with and without the global valid-token count: the loss and the gradients of the head and
of the last hidden state equal to fp32 rounding.

torchtitan's decoders attend through FlexAttention, which has no backward on CPU: the
backbone runs without gradient here and the comparison starts at its last hidden state (the
part lossd replaces); a training run of several steps needs a GPU. Skipped where torch or
torchtitan is not installed."""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")
try:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.llama3 import model_registry
except ImportError as e:  # installed without a module its model needs
    pytest.skip("torchtitan's Llama 3 does not import: %s" % e, allow_module_level=True)

import lossd  # noqa: E402
from lossd.integrations.torchtitan import apply_lossd  # noqa: E402

B, T = 2, 32
RTOL, ATOL, LOSS_RTOL = 1e-4, 2e-5, 2e-6


def tiny_llama3():
    """torchtitan's debugmodel (dim 256, vocab 2048, 6 layers), initialised as it does."""
    torch.manual_seed(0)
    model = model_registry("debugmodel", attn_backend="flex").model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # logits of a few units: the softmax is not flat
    return model


def assert_close(name, got, ref):
    assert got is not None, "%s: no gradient" % name
    g, r = got.detach().double(), ref.detach().double()
    err = (g - r).abs()
    bound = ATOL * float(r.abs().max()) + RTOL * r.abs()
    worst = int(torch.argmax(err - bound))
    assert float(r.abs().max()) > 0, "%s: the reference is all zeros" % name
    assert bool((err <= bound).all()), "%s: %d of %d off; worst got %.7g ref %.7g" % (
        name, int((err > bound).sum()), err.numel(), g.flatten()[worst], r.flatten()[worst])


@pytest.fixture(scope="module")
def address(lossd_server):
    return lossd_server.address


@pytest.mark.parametrize("global_tokens", [None, 97], ids=["sum", "global_valid_tokens"])
def test_loss_equals_torchtitans_cross_entropy(address, global_tokens):
    ref = tiny_llama3()
    got = copy.deepcopy(ref)
    loss_fn = apply_lossd(got, address)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 2048, (B, T), generator=g)
    labels = torch.randint(0, 2048, (B, T), generator=g)
    labels[0, :7] = -100  # torchtitan's IGNORE_INDEX
    pos = torch.arange(T).expand(B, T)
    gvt = None if global_tokens is None else torch.tensor(float(global_tokens))
    with torch.no_grad():  # FlexAttention has no backward on CPU
        ref._skip_lm_head = True
        h = ref(ids, pos, ref.get_attention_masks(pos))
        ref._skip_lm_head = False
        h_got = got(ids, pos, got.get_attention_masks(pos))
    assert_close("last hidden state", h_got, h)  # the patched model returns it
    h_ref = h.clone().requires_grad_()
    h_got = h_got.clone().requires_grad_()
    want, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(ref.lm_head(h_ref), labels, gvt)
    have, metrics = loss_fn(h_got, labels, gvt)
    assert metrics == {}
    assert abs(float(have) - float(want)) <= LOSS_RTOL * abs(float(want)), (
        float(have), float(want))
    want.backward()
    have.backward()
    assert_close("dh", h_got.grad, h_ref.grad)
    assert_close("lm_head grad", got.lm_head.weight.grad, ref.lm_head.weight.grad)
    assert loss_fn.calls["loss"] == 1
    loss_fn.remove()
    assert got._skip_lm_head is False


def test_refusals(address):
    model = tiny_llama3()
    loss_fn = apply_lossd(model, address)
    with pytest.raises(lossd.InvalidArgumentError, match="must return its last hidden state"):
        loss_fn(torch.zeros(1, 4, 2048), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(lossd.InvalidArgumentError, match="not a torchtitan decoder"):
        apply_lossd(torch.nn.Linear(2, 2), address)
    with pytest.raises(lossd.UnavailableError, match="127.0.0.1:1 cannot be reached"):
        apply_lossd(model, "127.0.0.1:1", connect_timeout=2.0)
