# SPDX-License-Identifier: Apache-2.0
"""lossd.integrations.verl against verl's own torch implementation of `use_fused_kernels`
(verl.models.transformers.dense_common.forward_with_torch_backend and
verl.utils.experimental.torch_functional.FusedLinearForPPO, from the installed package): a
tiny Llama built from a config, the same forward and a PPO-like loss on top, at temperature
0.7; the log-probs, the entropies and the gradients of the head and an inner layer equal to
fp32 rounding.

verl's package __init__ imports ray (verl.protocol), which these tests do not need: the two
modules are loaded from the installed package's files under empty package shells, so no
other verl code runs. Skipped where torch, transformers or verl is not installed."""

import copy
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import lossd  # noqa: E402
from lossd.integrations.verl import apply_lossd  # noqa: E402

V, H, B, T = 300, 32, 3, 20
# (rtol, atol): fp32, the same math summed in another order; under bf16 autocast, both round
# X and W to bf16 (2^-8 relative) and differ in where the logits are accumulated.
TOL = {None: (1e-4, 2e-5), torch.bfloat16: (5e-2, 2e-2)}

_SHELLS = ("verl", "verl.utils", "verl.utils.experimental", "verl.models",
           "verl.models.transformers")


def load_verl_forward():
    """verl's forward_with_torch_backend, its FusedLinearForPPO import included, without
    running verl/__init__.py (which imports ray): empty package shells stand in for verl's
    packages. Returns (forward, the sys.modules entries replaced, to restore); raises
    ImportError where verl is not installed or its modules do not import."""
    spec = importlib.util.find_spec("verl")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    saved = {n: sys.modules.get(n) for n in _SHELLS + (
        "verl.utils.experimental.torch_functional", "verl.models.transformers.dense_common")}
    for name in _SHELLS:
        shell = types.ModuleType(name)
        shell.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = shell
    try:
        importlib.import_module("verl.utils.experimental.torch_functional")
        dense = importlib.import_module("verl.models.transformers.dense_common")
    except ImportError as e:
        _restore(saved)
        raise ImportError("verl's fused-kernel modules do not import: %s" % e) from None
    return dense.forward_with_torch_backend, saved


def _restore(saved):
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


@pytest.fixture(scope="module")
def verl_forward():
    try:
        forward, saved = load_verl_forward()
    except ImportError as e:
        pytest.skip(str(e))
    try:
        yield forward
    finally:
        _restore(saved)


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # logits of a few units: the softmax is not flat
    return model


def assert_close(name, got, ref, tol=TOL[None]):
    rtol, atol = tol
    assert got is not None, "%s: no gradient" % name
    g, r = got.detach().double(), ref.detach().double()
    assert g.shape == r.shape, "%s: shape %s, expected %s" % (name, g.shape, r.shape)
    err = (g - r).abs()
    bound = atol * float(r.abs().max()) + rtol * r.abs()
    worst = int(torch.argmax(err - bound))
    assert float(r.abs().max()) > 0, "%s: the reference is all zeros" % name
    assert bool((err <= bound).all()), "%s: %d of %d off; worst got %.7g ref %.7g" % (
        name, int((err > bound).sum()), err.numel(), g.flatten()[worst], r.flatten()[worst])


def ppo_like_loss(out, mask, adv):
    """A policy-gradient term on the log-probs and an entropy bonus (dlogp and dentropy both
    non-zero), as verl's actor combines them."""
    n = mask.sum()
    return (-(out.log_probs * adv * mask).sum() / n
            - 0.01 * (out.entropy * mask).sum() / n)


@pytest.fixture(scope="module")
def address(lossd_server):
    return lossd_server.address


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_kernels_path_equals_verls_torch_backend(address, verl_forward, temperature):
    ref = tiny_llama()
    got = copy.deepcopy(ref)
    patch = apply_lossd(got, address)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[:, -1] = 0  # the rolled label of the last position wraps around
    adv = torch.randn(B, T, generator=g)
    want = verl_forward(ref, input_ids=ids, return_dict=True, temperature=temperature)
    have = got(input_ids=ids, return_dict=True, temperature=temperature)
    assert have.log_probs.dtype == want.log_probs.dtype == torch.float32
    assert have.entropy.dtype == want.entropy.dtype
    assert_close("log_probs", have.log_probs, want.log_probs)
    assert_close("entropy", have.entropy, want.entropy)
    ppo_like_loss(want, mask, adv).backward()
    ppo_like_loss(have, mask, adv).backward()
    assert_close("lm_head grad", got.lm_head.weight.grad, ref.lm_head.weight.grad)
    assert_close("layer 0 q_proj grad", got.model.layers[0].self_attn.q_proj.weight.grad,
                 ref.model.layers[0].self_attn.q_proj.weight.grad)
    assert patch.calls["ppo"] == 1
    # The reference model's use (no gradient): the same values, nothing kept for a backward.
    with torch.no_grad():
        again = got(input_ids=ids, return_dict=True, temperature=temperature)
    assert_close("log_probs without grad", again.log_probs, want.log_probs)
    patch.remove()
    assert "forward" not in got.__dict__


def test_under_bf16_autocast(address, verl_forward):
    """verl's actor runs the forward under autocast: both compute the head in bf16 (lossd
    casts X and W to it, as nn.Linear would), log-probs in fp32; the gradients come back in
    the parameters' fp32."""
    ref = tiny_llama()
    got = copy.deepcopy(ref)
    apply_lossd(got, address)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[:, -1] = 0
    adv = torch.randn(B, T, generator=g)
    tol = TOL[torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = verl_forward(ref, input_ids=ids, return_dict=True, temperature=0.7)
        have = got(input_ids=ids, return_dict=True, temperature=0.7)
    assert have.log_probs.dtype == want.log_probs.dtype == torch.float32
    assert_close("log_probs (bf16)", have.log_probs, want.log_probs, tol)
    assert_close("entropy (bf16)", have.entropy.float(), want.entropy.float(), tol)
    ppo_like_loss(want, mask, adv).backward()
    ppo_like_loss(have, mask, adv).backward()
    assert got.lm_head.weight.grad.dtype == torch.float32
    assert_close("lm_head grad (bf16)", got.lm_head.weight.grad, ref.lm_head.weight.grad, tol)


def test_refusals(address):
    model = tiny_llama()
    patch = apply_lossd(model, address)
    with pytest.raises(lossd.FailedPreconditionError, match="already applied"):
        apply_lossd(model, address)
    with pytest.raises(lossd.InvalidArgumentError, match="returns a dict only"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    patch.remove()
    with pytest.raises(lossd.UnavailableError, match="127.0.0.1:1 cannot be reached"):
        apply_lossd(model, "127.0.0.1:1", connect_timeout=2.0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(lossd.InvalidArgumentError, match="final_logit_softcapping=30.0"):
        apply_lossd(model, address)


# -- item 6: a bf16 backbone on an fp32 head, torch.compile, a lost server ------------------

def _pair_and_inputs(address, seed, model_fn=tiny_llama):
    ref = model_fn()
    got = copy.deepcopy(ref)
    patch = apply_lossd(got, address)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[:, -1] = 0
    return ref, got, patch, ids, mask, torch.randn(B, T, generator=g)


def _bf16_backbone():
    model = tiny_llama().to(torch.bfloat16)
    model.lm_head.float()  # the head kept in fp32
    return model


def test_bf16_backbone_on_an_fp32_head_under_autocast(address, verl_forward):
    """bf16 hidden states from a bf16 backbone on an fp32 head, under autocast (verl's actor
    runs its forward in one): lossd computes the head in bf16 with fp32 accumulation and
    returns the fp32 head's gradient in fp32. verl's own FusedLinearForPPO fails on this mix
    in backward (its backward runs outside autocast: bf16 X times fp32 W), so the reference
    is verl's on the head cast to bf16 as autocast casts it (the gradient of the cast is the
    fp32 head's); log p, the entropy and the gradients agree to bf16 rounding."""
    ref, got, patch, ids, mask, adv = _pair_and_inputs(address, 6, _bf16_backbone)
    ref.lm_head.to(torch.bfloat16)
    tol = TOL[torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = verl_forward(ref, input_ids=ids, return_dict=True, temperature=0.7)
        have = got(input_ids=ids, return_dict=True, temperature=0.7)
    assert have.log_probs.dtype == want.log_probs.dtype
    assert_close("log_probs (bf16 backbone)", have.log_probs, want.log_probs, tol)
    assert_close("entropy (bf16 backbone)", have.entropy.float(), want.entropy.float(), tol)
    ppo_like_loss(want, mask, adv).backward()
    ppo_like_loss(have, mask, adv).backward()
    assert got.lm_head.weight.grad.dtype == torch.float32
    assert_close("lm_head grad (bf16 backbone)", got.lm_head.weight.grad,
                 ref.lm_head.weight.grad, tol)
    assert_close("layer 0 q_proj grad (bf16 backbone)",
                 got.model.layers[0].self_attn.q_proj.weight.grad,
                 ref.model.layers[0].self_attn.q_proj.weight.grad, tol)
    assert patch.calls["ppo"] == 1


def test_under_autocast_the_head_goes_once_per_version_in_bf16(address):
    """The fp32 head under bf16 autocast is cast and uploaded once per version (a cached
    handle in bf16), not per micro-batch: two forwards and backwards, one upload; another
    after an in-place step."""
    _, got, patch, ids, mask, adv = _pair_and_inputs(address, 10, _bf16_backbone)
    client = patch.runtime.client
    uploads = []
    put = client.put_weights
    client.put_weights = lambda w, *a, **k: uploads.append(w.dtype) or put(w, *a, **k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            ppo_like_loss(got(input_ids=ids, return_dict=True, temperature=0.7), mask,
                          adv).backward()
        assert len(uploads) == 1, "W uploaded %d times for one version" % len(uploads)
        with torch.no_grad():
            got.lm_head.weight.mul_(0.5)  # an optimizer step, in place
        got(input_ids=ids, return_dict=True, temperature=0.7)
    assert uploads == [torch.bfloat16] * 2, uploads


def test_torch_compile_around_the_lossd_call(address, verl_forward):
    """torch.compile of the patched model (aot_eager): the lossd call is a graph break, the
    backbone compiles; log p, the entropy and the gradients are verl's eager ones."""
    ref, got, patch, ids, mask, adv = _pair_and_inputs(address, 7)
    compiled = torch.compile(got, backend="aot_eager")
    want = verl_forward(ref, input_ids=ids, return_dict=True, temperature=0.7)
    have = compiled(input_ids=ids, return_dict=True, temperature=0.7)
    assert_close("log_probs (compiled)", have.log_probs, want.log_probs)
    assert_close("entropy (compiled)", have.entropy, want.entropy)
    ppo_like_loss(want, mask, adv).backward()
    ppo_like_loss(have, mask, adv).backward()
    assert_close("lm_head grad (compiled)", got.lm_head.weight.grad, ref.lm_head.weight.grad)
    assert_close("layer 0 q_proj grad (compiled)",
                 got.model.layers[0].self_attn.q_proj.weight.grad,
                 ref.model.layers[0].self_attn.q_proj.weight.grad)
    assert patch.calls["ppo"] == 1


def test_a_server_lost_mid_training_is_named(tmp_path):
    from conftest import LossdProcess
    from lossd_servers import find_lossd_binary

    srv = LossdProcess(find_lossd_binary(), str(tmp_path / "lossd.log"))
    try:
        model = tiny_llama()
        apply_lossd(model, srv.address)
        ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(8))
        model(input_ids=ids, return_dict=True).log_probs.sum().backward()
    finally:
        srv.stop()
    with pytest.raises(lossd.UnavailableError) as e:
        model(input_ids=ids, return_dict=True)
    assert "lossd server %s:" % srv.address in str(e.value)


# -- under DeepSpeed ZeRO-3: a parameter carrying ds_status stands in for ZeRO-3's ------------

def _as_zero3(param, status="AVAILABLE"):
    """What lossd.integrations reads of a ZeRO-3 parameter (deepspeed is not imported)."""
    param.ds_status = types.SimpleNamespace(name=status)
    param.ds_shape = tuple(param.shape)


def test_a_zero3_head_goes_inline_and_a_partitioned_one_is_refused(address, verl_forward):
    """ZeRO-3 gathers the head into a buffer each forward (param.data = buffer), keeping the
    Parameter's version counter: a buffer refilled in place with the stepped head would match
    a cached handle, so a ZeRO-3 head travels inline. Here the buffer is refilled in place
    between two forwards; both give verl's own log p and entropy for the head of the time.
    A head still partitioned where lossd reads it is refused, naming the fix."""
    ref, got, patch, ids, mask, adv = _pair_and_inputs(address, 9)
    buf = got.lm_head.weight.detach().clone()
    got.lm_head.weight.data = buf
    _as_zero3(got.lm_head.weight)
    for i in range(2):
        if i:
            with torch.no_grad():
                buf.mul_(0.5)  # in place, through the buffer: the Parameter's version stays
                ref.lm_head.weight.mul_(0.5)
        want = verl_forward(ref, input_ids=ids, return_dict=True, temperature=0.7)
        have = got(input_ids=ids, return_dict=True, temperature=0.7)
        assert_close("log_probs (forward %d)" % i, have.log_probs, want.log_probs)
        assert_close("entropy (forward %d)" % i, have.entropy, want.entropy)
    ppo_like_loss(want, mask, adv).backward()
    ppo_like_loss(have, mask, adv).backward()
    assert_close("lm_head grad (ZeRO-3 stand-in)", got.lm_head.weight.grad,
                 ref.lm_head.weight.grad)
    assert patch.runtime._handle is None, "a ZeRO-3 head went by cached handle"
    assert patch.calls["ppo"] == 2
    got.lm_head.weight.ds_status.name = "NOT_AVAILABLE"
    with pytest.raises(lossd.FailedPreconditionError) as e:
        got(input_ids=ids, return_dict=True, temperature=0.7)
    assert "verl's fused kernels: lm_head.weight is a DeepSpeed ZeRO-3 parameter still " \
        "partitioned (status NOT_AVAILABLE" in str(e.value), str(e.value)
    assert "deepspeed.zero.GatheredParameters" in str(e.value), str(e.value)
