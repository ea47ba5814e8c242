# SPDX-License-Identifier: Apache-2.0
"""lossd.integrations.torchtitan against torchtitan's own Llama 3 and its CrossEntropyLoss
(from the installed package): a tiny Llama 3 from torchtitan's debug configuration, its
forward with _skip_lm_head (apply_lossd) and lossd's loss against its own forward and loss,
with and without the global valid-token count: the loss and the gradients of the head and
of the last hidden state equal to fp32 rounding.

torchtitan's decoders attend through FlexAttention, which has no backward on CPU: the first
tests run the backbone without gradient and compare from its last hidden state (the part
lossd replaces); the later ones (training steps, autocast, torch.compile) put a causal SDPA
stand-in for FlexAttention into both models, so the whole model trains on CPU. Skipped where
torch or torchtitan is not installed."""

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


# -- training steps, autocast, torch.compile, a lost server -------------------------------------

class CausalSDPA(torch.nn.Module):
    """A stand-in for torchtitan's FlexAttention (no backward on CPU), put in both the
    reference and the lossd model: causal scaled-dot-product attention, which is torchtitan's
    block-causal mask for one document per row (positions 0..T-1). (B, L, N, H) in and out,
    as torchtitan's inner attentions."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kw):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def trainable_llama3():
    model = tiny_llama3()
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalSDPA()
    return model


def micro_batches(seed, n=2):
    """(ids, labels) per micro-batch, labels with an ignored prefix of a few positions."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 2048, (B, T), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        labels[i % B, : 3 + 4 * i] = -100
        out.append((ids, labels))
    return out


def step_losses(model, loss_fn, batches):
    """One optimizer step's forward and backward as torchtitan's _forward_backward_body runs
    it: the step's global valid-token count, each micro-batch's loss(pred, labels, count)
    backpropagated; returns the losses."""
    gvt = torch.tensor(float(sum(int((lab != -100).sum()) for _, lab in batches)))
    losses = []
    for ids, labels in batches:
        loss, _ = loss_fn(model(ids), labels, gvt)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses


def test_training_steps_against_its_own_loss(address):
    """Three optimizer steps of two micro-batches (torchtitan's global valid-token
    normaliser, its gradient clipping at 1.0, SGD so rounding stays rounding): every
    micro-batch's loss and the trained head and inner layer equal the run on torchtitan's
    own model head and CrossEntropyLoss to fp32 rounding."""
    ref = trainable_llama3()
    got = copy.deepcopy(ref)
    loss_fn = apply_lossd(got, address)
    own = CrossEntropyLoss(CrossEntropyLoss.Config())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, got)]
    for step in range(3):
        batches = micro_batches(30 + step)
        want = step_losses(ref, own, batches)
        have = step_losses(got, loss_fn, batches)
        for i, (h, w) in enumerate(zip(have, want)):
            assert abs(h - w) <= LOSS_RTOL * abs(w), "step %d micro-batch %d: %.9g, ref %.9g" % (
                step, i, h, w)
        for m, opt in zip((ref, got), opts):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    assert loss_fn.calls["loss"] == 6
    assert_close("trained lm_head", got.lm_head.weight, ref.lm_head.weight)
    assert_close("trained layer 0 wo", got.layers["0"].attention.wo.weight,
                 ref.layers["0"].attention.wo.weight)


# The Transformers tests' bf16 table: torchtitan's lm_head rounds the logits to bf16 under
# autocast, lossd accumulates them in fp32 (2^-8 relative on logits of a few units).
BF16_RTOL, BF16_ATOL, BF16_LOSS_RTOL = 5e-2, 2e-2, 1e-2


def test_autocast_bf16_hidden_states_on_an_fp32_head(address):
    """A bf16 backbone (bf16 hidden states) on an fp32 head under torch.autocast(bf16), as
    torchtitan's train context enables it without FSDP: lossd casts X and W to bf16 as
    nn.Linear does under autocast; the loss and the gradients (the head's in fp32) equal
    torchtitan's own to bf16 rounding."""
    ref = trainable_llama3().to(torch.bfloat16)
    ref.lm_head.float()
    got = copy.deepcopy(ref)
    loss_fn = apply_lossd(got, address)
    batches = micro_batches(40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = step_losses(ref, CrossEntropyLoss(CrossEntropyLoss.Config()), batches)
        have = step_losses(got, loss_fn, batches)
    for h, w in zip(have, want):
        assert abs(h - w) <= BF16_LOSS_RTOL * abs(w), (have, want)
    assert got.lm_head.weight.grad.dtype == torch.float32
    for name, g, r in (("lm_head grad", got.lm_head.weight.grad, ref.lm_head.weight.grad),
                       ("layer 0 wo grad", got.layers["0"].attention.wo.weight.grad,
                        ref.layers["0"].attention.wo.weight.grad)):
        g, r = g.double(), r.double()
        bound = BF16_ATOL * float(r.abs().max()) + BF16_RTOL * r.abs()
        assert bool(((g - r).abs() <= bound).all()), "%s: %d of %d off" % (
            name, int(((g - r).abs() > bound).sum()), r.numel())


def test_torch_compile_around_the_lossd_call(address):
    """torch.compile (aot_eager) of the model and its loss together, as torchtitan compiles
    both: the lossd call is a graph break; the loss and the gradients are the eager run's."""
    ref = trainable_llama3()
    got = copy.deepcopy(ref)
    loss_fn = apply_lossd(got, address)
    own = CrossEntropyLoss(CrossEntropyLoss.Config())
    compiled = torch.compile(lambda ids, labels, gvt: loss_fn(got(ids), labels, gvt),
                             backend="aot_eager")
    batches = micro_batches(50)
    want = step_losses(ref, own, batches)
    have = step_losses(lambda ids: ids, lambda ids, labels, gvt: compiled(ids, labels, gvt),
                       batches)
    for h, w in zip(have, want):
        assert abs(h - w) <= LOSS_RTOL * abs(w), (have, want)
    assert loss_fn.calls["loss"] == 2
    assert_close("compiled lm_head grad", got.lm_head.weight.grad, ref.lm_head.weight.grad)
    assert_close("compiled layer 0 wo grad", got.layers["0"].attention.wo.weight.grad,
                 ref.layers["0"].attention.wo.weight.grad)


def test_a_server_lost_mid_training_is_named(tmp_path):
    from conftest import LossdProcess
    from lossd_servers import find_lossd_binary

    srv = LossdProcess(find_lossd_binary(), str(tmp_path / "lossd.log"))
    try:
        model = trainable_llama3()
        loss_fn = apply_lossd(model, srv.address)
        batches = micro_batches(60, n=1)
        step_losses(model, loss_fn, batches)
    finally:
        srv.stop()
    with pytest.raises(lossd.UnavailableError) as e:
        step_losses(model, loss_fn, batches)
    assert "lossd server %s:" % srv.address in str(e.value)


def test_a_zero3_head_goes_inline_and_a_partitioned_one_is_refused(address):
    """torchtitan calls its loss after the model returned, outside any forward: under
    DeepSpeed ZeRO-3 the head would be partitioned there, and lossd refuses it naming the
    fix; one gathered around the call (ds_status AVAILABLE; a parameter carrying ds_status
    stands in) travels inline, as ZeRO-3 refills its buffer in place keeping the Parameter's
    version counter: with the buffer refilled between two calls both equal torchtitan's own
    loss on the head of the time."""
    import types

    ref = tiny_llama3()
    got = copy.deepcopy(ref)
    loss_fn = apply_lossd(got, address)
    buf = got.lm_head.weight.detach().clone()
    got.lm_head.weight.data = buf
    got.lm_head.weight.ds_status = types.SimpleNamespace(name="AVAILABLE")
    got.lm_head.weight.ds_shape = tuple(buf.shape)
    own = CrossEntropyLoss(CrossEntropyLoss.Config())
    (ids, labels), = micro_batches(70, n=1)
    h = torch.randn(B, T, buf.shape[1], generator=torch.Generator().manual_seed(71))
    for i in range(2):
        if i:
            with torch.no_grad():
                buf.mul_(0.5)  # in place, through the buffer: the Parameter's version stays
                ref.lm_head.weight.mul_(0.5)
        want, _ = own(ref.lm_head(h), labels, None)
        have, _ = loss_fn(h, labels)
        assert abs(float(have) - float(want)) <= LOSS_RTOL * abs(float(want)), (
            i, float(have), float(want))
    assert loss_fn.runtime._handle is None, "a ZeRO-3 head went by cached handle"
    got.lm_head.weight.ds_status.name = "NOT_AVAILABLE"
    with pytest.raises(lossd.FailedPreconditionError) as e:
        loss_fn(h, labels)
    assert "torchtitan's loss: lm_head.weight is a DeepSpeed ZeRO-3 parameter still " \
        "partitioned (status NOT_AVAILABLE" in str(e.value), str(e.value)
