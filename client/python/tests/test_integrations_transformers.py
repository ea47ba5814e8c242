# SPDX-License-Identifier: Apache-2.0
"""lossd.integrations.transformers against the real transformers package: tiny causal LMs of
each supported family, built from configs here (random weights, synthetic tokens, nothing
downloaded), patched with apply_lossd and compared with an untouched copy of the same model
(transformers' own ForCausalLMLoss): the loss, the head's gradient and an inner layer's, with
and without num_items_in_batch under gradient accumulation, bf16 and autocast,
torch.compile, a Trainer run, the hosted head, and the refusals. Skipped where torch or
transformers is not installed."""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import lossd  # noqa: E402
from lossd.integrations import apply_lossd  # noqa: E402
from conftest import LossdProcess  # noqa: E402
from lossd_servers import find_lossd_binary, free_port  # noqa: E402

V, H, LAYERS, B, T = 1000, 64, 2, 4, 40

# |got - ref| <= atol * max|ref| + rtol * |ref|, element-wise. fp32: the same math summed in
# another order (lossd's chunks against torch's one matmul). bf16: logits rounded to bf16 by
# the model's lm_head but kept in fp32 by lossd (2^-8 relative on logits of a few units).
TOLERANCES = {
    torch.float32: dict(loss_rtol=2e-6, rtol=1e-4, atol=2e-5),
    torch.bfloat16: dict(loss_rtol=1e-2, rtol=5e-2, atol=2e-2),
}


def _config(family, tied):
    c = transformers
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, tie_word_embeddings=tied)
    if family == "llama":
        return c.LlamaForCausalLM, c.LlamaConfig(**common)
    if family == "mistral":
        return c.MistralForCausalLM, c.MistralConfig(sliding_window=None, **common)
    if family == "qwen2":
        return c.Qwen2ForCausalLM, c.Qwen2Config(**common)
    if family == "qwen3":
        return c.Qwen3ForCausalLM, c.Qwen3Config(head_dim=16, **common)
    # A softcap of 3 on logits of a few units (the head is scaled below): tanh is well off
    # its linear part, so a loss without it would fail.
    if family == "gemma2":
        return c.Gemma2ForCausalLM, c.Gemma2Config(head_dim=16, final_logit_softcapping=3.0,
                                                   **common)
    if family == "gemma3":
        return c.Gemma3ForCausalLM, c.Gemma3TextConfig(head_dim=16, final_logit_softcapping=3.0,
                                                       **common)
    raise AssertionError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]


def tiny_model(family, seed=0, tied=False, dtype=torch.float32):
    """A random causal LM whose logits are a few units (an initialised head gives ~0.1,
    where every softmax is flat and a wrong loss can still look right)."""
    cls, cfg = _config(family, tied)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.to(dtype)


def batch(seed, b=B, t=T):
    """Token ids and labels with a prompt of 3-12 ignored positions per row (so rows count
    differently) and one row ending in padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    labels = ids.clone()
    for r in range(b):
        labels[r, : int(torch.randint(3, 13, (1,), generator=g))] = -100
    labels[-1, -6:] = -100
    return ids, labels


def assert_close(name, got, ref, dtype):
    tol = TOLERANCES[dtype]
    assert got is not None, "%s: no gradient" % name
    g, r = got.detach().double(), ref.detach().double()
    assert g.shape == r.shape, "%s: shape %s, expected %s" % (name, g.shape, r.shape)
    assert torch.isfinite(g).all(), "%s: non-finite values" % name
    scale = float(r.abs().max())
    err = (g - r).abs()
    bound = tol["atol"] * scale + tol["rtol"] * r.abs()
    bad = err > bound
    assert scale > 0, "%s: the reference is all zeros (the test checks nothing)" % name
    if bad.any():
        worst = int(torch.argmax(err - bound))
        pytest.fail("%s (%s): %d of %d elements off; worst flat index %d got %.7g ref %.7g; max "
                    "abs err %.3g; tolerance rtol=%g atol=%g*%.3g" % (
                        name, dtype, int(bad.sum()), bad.numel(), worst, g.flatten()[worst],
                        r.flatten()[worst], float(err.max()), tol["rtol"], tol["atol"], scale))


def assert_loss(name, got, ref, dtype):
    rtol = TOLERANCES[dtype]["loss_rtol"]
    got, ref = float(got.detach()), float(ref.detach())
    assert abs(got - ref) <= rtol * abs(ref), "%s (%s): got %.9g, ref %.9g, rel err %.3g > %g" % (
        name, dtype, got, ref, abs(got - ref) / abs(ref), rtol)


def inner(model):
    """An inner layer's weight: its gradient comes through dX from lossd."""
    return model.model.layers[0].self_attn.q_proj.weight


def run_steps(model, micro_batches, global_count):
    """Forward + backward over the micro-batches as Trainer runs them: with a global count,
    each loss is sum / count and backpropagated as it is; without, each mean is divided by
    the number of micro-batches. Returns the losses."""
    losses = []
    k = len(micro_batches)
    for ids, labels in micro_batches:
        kw = {} if global_count is None else {"num_items_in_batch": global_count}
        out = model(input_ids=ids, labels=labels, **kw)
        loss = out.loss if global_count is not None else out.loss / k
        loss.backward()
        losses.append(out.loss.detach())
    return losses


@pytest.fixture(scope="module")
def address(lossd_server):
    return lossd_server.address


@pytest.mark.parametrize("global_count", [False, True], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_the_models_own(address, family, global_count):
    """Two micro-batches of gradient accumulation: the losses, the head's gradient and an
    inner layer's equal the untouched model's; with num_items_in_batch each micro-batch's loss
    is its sum over the global count (the rows count differently, so a per-micro-batch mean
    would differ), and the patched forward returns no logits."""
    ref = tiny_model(family, tied=family.startswith("gemma"))
    model = copy.deepcopy(ref)
    patch = apply_lossd(model, address)
    mbs = [batch(1), batch(2)]
    count = None
    if global_count:
        count = sum(int((lab[:, 1:] != -100).sum()) for _, lab in mbs)
        count = torch.tensor(count)
    got = run_steps(model, mbs, count)
    want = run_steps(ref, mbs, count)
    dtype = torch.float32
    for i, (g, w) in enumerate(zip(got, want)):
        assert_loss("%s loss %d" % (family, i), g, w, dtype)
    assert_close(family + " lm_head grad", model.lm_head.weight.grad, ref.lm_head.weight.grad,
                 dtype)
    assert_close(family + " layer 0 q_proj grad", inner(model).grad, inner(ref).grad, dtype)
    assert patch.calls == {("global" if global_count else "mean"): 2}
    out = model(input_ids=mbs[0][0], labels=mbs[0][1])
    assert out.logits is None and out.loss is not None


def test_without_labels_the_forward_is_the_models_own(address):
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    patch = apply_lossd(model, address)
    ids, _ = batch(3)
    got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.equal(got, want)
    assert patch.calls == {}


def test_shift_labels_and_remove(address):
    """A collator's shift_labels are taken as they are (not shifted again); remove() puts the
    model's own forward back (logits again, the same loss)."""
    ref = tiny_model("qwen3")
    model = copy.deepcopy(ref)
    patch = apply_lossd(model, address)
    ids, labels = batch(4)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    got = model(input_ids=ids, labels=labels, shift_labels=shifted).loss
    want = ref(input_ids=ids, labels=labels, shift_labels=shifted).loss
    assert_loss("loss with shift_labels", got, want, torch.float32)
    patch.remove()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None
    assert float(out.loss.detach()) == float(ref(input_ids=ids, labels=labels).loss.detach())
    assert "forward" not in model.__dict__


def test_bf16_model(address):
    ref = tiny_model("llama", dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    apply_lossd(model, address)
    mbs = [batch(5)]
    got, want = run_steps(model, mbs, None), run_steps(ref, mbs, None)
    assert_loss("bf16 loss", got[0], want[0], torch.bfloat16)
    assert_close("bf16 lm_head grad", model.lm_head.weight.grad, ref.lm_head.weight.grad,
                 torch.bfloat16)
    assert_close("bf16 q_proj grad", inner(model).grad, inner(ref).grad, torch.bfloat16)


def test_autocast_casts_the_fp32_head_as_nn_linear_does(address):
    """An fp32 model under torch.autocast(bf16): the head runs in bf16 (X and W cast, as
    nn.Linear under autocast), the fp32 head's gradient comes back fp32."""
    ref = tiny_model("mistral")
    model = copy.deepcopy(ref)
    apply_lossd(model, address)
    mbs = [batch(6)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run_steps(model, mbs, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run_steps(ref, mbs, None)
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert_loss("autocast loss", got[0], want[0], torch.bfloat16)
    assert_close("autocast lm_head grad", model.lm_head.weight.grad, ref.lm_head.weight.grad,
                 torch.bfloat16)
    assert_close("autocast q_proj grad", inner(model).grad, inner(ref).grad, torch.bfloat16)


def test_bf16_backbone_on_an_fp32_head(address):
    """bf16 hidden states on an fp32 lm_head (the model's own forward refuses the mix): the head
    is cast to bf16 for the call, and its fp32 gradient is that of the cast, against torch's
    linear + cross-entropy on the same cast."""
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    model.lm_head.float()
    ref = copy.deepcopy(model)
    apply_lossd(model, address)
    ids, labels = batch(8)
    got = model(input_ids=ids, labels=labels).loss
    got.backward()
    hidden = ref.model(input_ids=ids).last_hidden_state
    logits = torch.nn.functional.linear(hidden, ref.lm_head.weight.to(torch.bfloat16)).float()
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
    want.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert_loss("bf16-on-fp32 loss", got, want, torch.bfloat16)
    assert_close("bf16-on-fp32 lm_head grad", model.lm_head.weight.grad,
                 ref.lm_head.weight.grad, torch.bfloat16)
    assert_close("bf16-on-fp32 q_proj grad", inner(model).grad, inner(ref).grad,
                 torch.bfloat16)


def test_gradient_checkpointing(address):
    """The model's own activation checkpointing (gradient_checkpointing_enable) around the
    layers, lossd after them: the same loss and gradients as without checkpointing."""
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_lossd(model, address)
    mbs = [batch(12), batch(13)]
    count = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for _, lab in mbs))
    got, want = run_steps(model, mbs, count), run_steps(ref, mbs, count)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_loss("checkpointed loss %d" % i, g, w, torch.float32)
    assert_close("checkpointed lm_head grad", model.lm_head.weight.grad,
                 ref.lm_head.weight.grad, torch.float32)
    assert_close("checkpointed q_proj grad", inner(model).grad, inner(ref).grad, torch.float32)


def test_torch_compile_around_the_lossd_call(address):
    """torch.compile of the patched model: the lossd call is a graph break, the rest compiles,
    and the loss and gradients are the eager model's."""
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    apply_lossd(model, address)
    compiled = torch.compile(model, backend="aot_eager")
    mbs = [batch(7)]
    got, want = run_steps(compiled, mbs, None), run_steps(ref, mbs, None)
    assert_loss("compiled loss", got[0], want[0], torch.float32)
    assert_close("compiled lm_head grad", model.lm_head.weight.grad, ref.lm_head.weight.grad,
                 torch.float32)
    assert_close("compiled q_proj grad", inner(model).grad, inner(ref).grad, torch.float32)


# -- Trainer -------------------------------------------------------------------------------

TRAINER_STEPS = 24  # "a few dozen": 48 micro-batches through lossd per run

def _train(model, tmp_path, steps=TRAINER_STEPS, callbacks=(), max_grad_norm=1.0):
    """Two dozen optimizer steps of Trainer over 24 synthetic rows (four epochs), 2 per
    micro-batch and 2 micro-batches per step (so Trainer passes num_items_in_batch); the
    logged loss per step, and the eval loss over 6 more rows after training."""
    pytest.importorskip("accelerate")  # Trainer's own requirement
    rows = []
    for i in range(30):
        ids, labels = batch(100 + i, b=1, t=32)
        rows.append({"input_ids": ids[0], "labels": labels[0]})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=steps, learning_rate=3e-3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        max_grad_norm=max_grad_norm, optim="adamw_torch", weight_decay=0.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows[:24],
                                   eval_dataset=rows[24:], callbacks=list(callbacks))
    trainer.train()
    curve = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return curve, trainer.evaluate()["eval_loss"]


# Two dozen AdamW steps: rounding differences of the gradients (fp32) move the weights by a
# few ulps of lr-sized updates each step; the logged losses stay within this.
CURVE_RTOL = 1e-4


def assert_curves(got, want):
    assert len(got) == len(want) == TRAINER_STEPS, (got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= CURVE_RTOL * abs(w), "step %d: loss %.8g with lossd, %.8g " \
            "without (curves %s against %s)" % (i, g, w, got, want)
    assert want[-1] < want[0], "the run did not train (the comparison would be weak): %s" % want


def test_trainer_loss_curve(address, tmp_path):
    ref = tiny_model("qwen2")
    model = copy.deepcopy(ref)
    patch = apply_lossd(model, address)
    got, got_eval = _train(model, tmp_path / "lossd")
    want, want_eval = _train(ref, tmp_path / "ref")
    assert_curves(got, want)
    assert abs(got_eval - want_eval) <= CURVE_RTOL * abs(want_eval), (got_eval, want_eval)
    # Every micro-batch went through lossd, normalised by Trainer's global token count: two
    # per step in training, and the one evaluation batch.
    assert patch.calls == {"global": 2 * TRAINER_STEPS + 1}


# -- the hosted head (mode "head") ---------------------------------------------------------

ADAMW = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def _head_name(request):
    import uuid

    return "hf-test/%s-%s" % (request.node.name[:40], uuid.uuid4().hex[:8])


def test_hosted_head_trains_as_the_local_head(address, request):
    """Three steps of two micro-batches with num_items_in_batch: the hosted head (AdamW on
    lossd) and the backbone (torch AdamW) against the same model trained locally."""
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    patch = apply_lossd(model, address, mode="head", head_name=_head_name(request),
                        optimizer=lossd.OptimizerConfig.adamw(**ADAMW))
    try:
        assert "lm_head.weight" not in dict(model.named_parameters())
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW)
        ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
        head_opt = patch.head_optimizer()
        for step in range(3):
            mbs = [batch(200 + 2 * step), batch(201 + 2 * step)]
            count = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for _, lab in mbs))
            got, want = run_steps(model, mbs, count), run_steps(ref, mbs, count)
            for i, (g, w) in enumerate(zip(got, want)):
                assert_loss("step %d loss %d" % (step, i), g, w, torch.float32)
            assert_close("step %d q_proj grad" % step, inner(model).grad, inner(ref).grad,
                         torch.float32)
            for o in (opt, head_opt, ref_opt):
                o.step()
                o.zero_grad()
        assert_close("hosted head after 3 steps", patch.head.weight(), ref.lm_head.weight,
                     torch.float32)
        # Without labels the stand-in layer gives logits from the head's current copy.
        ids, _ = batch(9)
        assert_close("logits", model(input_ids=ids).logits, ref(input_ids=ids).logits,
                     torch.float32)
    finally:
        patch.head.drop()


def test_hosted_head_under_trainer(address, tmp_path, request):
    """Trainer with the head's callback: the same loss curve as the local head (no gradient
    clipping in either run: Trainer's norm would not see the hosted head)."""
    ref = tiny_model("qwen3")
    model = copy.deepcopy(ref)
    patch = apply_lossd(model, address, mode="head", head_name=_head_name(request),
                        optimizer=lossd.OptimizerConfig.adamw(**ADAMW))
    try:
        got, got_eval = _train(model, tmp_path / "lossd", callbacks=[patch.trainer_callback()],
                               max_grad_norm=0.0)
        want, want_eval = _train(ref, tmp_path / "ref", max_grad_norm=0.0)
        assert_curves(got, want)
        assert abs(got_eval - want_eval) <= CURVE_RTOL * abs(want_eval), (got_eval, want_eval)
        assert patch.calls == {"global": 2 * TRAINER_STEPS + 1}
        assert patch.head.version == TRAINER_STEPS
    finally:
        patch.head.drop()


def test_hosted_head_refuses_tied_embeddings(address):
    model = tiny_model("gemma2", tied=True)
    with pytest.raises(lossd.FailedPreconditionError) as e:
        apply_lossd(model, address, mode="head", head_name="hf-test/tied")
    assert "tie_word_embeddings" in str(e.value) and "mode \"loss\"" in str(e.value)
    assert isinstance(model.lm_head, torch.nn.Linear) and "forward" not in model.__dict__


# -- refusals and a lost server ------------------------------------------------------------

def test_refusals(address):
    model = tiny_model("llama")
    cases = [
        (lambda: apply_lossd(torch.nn.Linear(2, 2), address), lossd.InvalidArgumentError,
         "apply_lossd supports"),
        (lambda: apply_lossd(model, address, mode="logits"), lossd.InvalidArgumentError,
         "mode must be one of loss, head, got 'logits'"),
        (lambda: apply_lossd(model, 50051), lossd.InvalidArgumentError,
         "client_or_address must be"),
        (lambda: apply_lossd(model, address, grad_scaler=None), lossd.InvalidArgumentError,
         "grad_scaler: options of mode \"head\""),
        (lambda: apply_lossd(model, address, mode="head"), lossd.InvalidArgumentError,
         "needs head_name"),
        (lambda: apply_lossd(model, address, mode="head", head_name="x", reduction="mean"),
         lossd.InvalidArgumentError, "reduction: set by apply_lossd"),
    ]
    for call, err, text in cases:
        with pytest.raises(err) as e:
            call()
        assert text in str(e.value), str(e.value)
    apply_lossd(model, address)
    with pytest.raises(lossd.FailedPreconditionError, match="already applied"):
        apply_lossd(model, address)
    ids, labels = batch(10)
    with pytest.raises(lossd.InvalidArgumentError, match="logits_to_keep=1 with labels"):
        model(input_ids=ids, labels=labels, logits_to_keep=1)
    # A copy's forward would still be the original's: copy before apply_lossd.
    with pytest.raises(lossd.FailedPreconditionError, match="copy the model before apply_lossd"):
        copy.deepcopy(model)


def test_an_unreachable_server_is_named():
    address = "127.0.0.1:%d" % free_port()  # nothing listens there
    model = tiny_model("llama")
    with pytest.raises(lossd.UnavailableError) as e:
        apply_lossd(model, address, connect_timeout=5.0)
    assert "the lossd server at %s cannot be reached" % address in str(e.value)
    assert "forward" not in model.__dict__


def test_a_server_lost_mid_training_is_named(tmp_path):
    srv = LossdProcess(find_lossd_binary(), str(tmp_path / "lossd.log"))
    try:
        model = tiny_model("llama")
        apply_lossd(model, srv.address)
        ids, labels = batch(11)
        model(input_ids=ids, labels=labels).loss.backward()
    finally:
        srv.stop()
    with pytest.raises(lossd.UnavailableError) as e:
        model(input_ids=ids, labels=labels)
    assert "lossd server %s:" % srv.address in str(e.value)


def test_importing_the_package_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, lossd.integrations; heavy = [m for m in ('torch', 'transformers') "
            "if m in sys.modules]; assert not heavy, heavy")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_over_a_replica_pool(cluster):
    """client_or_address may be a lossd.ReplicaPool (several replicas behind one name): the
    same loss and gradients as the model's own."""
    cluster.ensure_all()
    ref = tiny_model("mistral")
    model = copy.deepcopy(ref)
    with lossd.ReplicaPool(cluster.target(), resolver=cluster.resolver, probe_timeout=5,
                           timeout=60) as pool:
        apply_lossd(model, pool)
        mbs = [batch(14), batch(15)]
        got, want = run_steps(model, mbs, None), run_steps(ref, mbs, None)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_loss("pool loss %d" % i, g, w, torch.float32)
    assert_close("pool lm_head grad", model.lm_head.weight.grad, ref.lm_head.weight.grad,
                 torch.float32)
    assert_close("pool q_proj grad", inner(model).grad, inner(ref).grad, torch.float32)
