# SPDX-License-Identifier: Apache-2.0
"""lossd.integrations.trl against the real TRL package: a tiny Llama built from a config and a
word-level tokenizer built here (random weights, synthetic text, nothing downloaded), trained
a few steps by SFTTrainer and by GRPOTrainer (generation by the model itself, a reward
function, TRL's own loss) with apply_lossd and without: the logged losses and metrics
(GRPO's entropy, SFT's token accuracy), and the trained weights equal to fp32 rounding.
Skipped where torch, transformers, trl or datasets is not installed."""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("accelerate")

import lossd  # noqa: E402
from lossd.integrations.trl import apply_lossd  # noqa: E402

WORDS = ["w%d" % i for i in range(120)]
H = 32
# Loss-like scalars and weights after a few SGD steps: the same fp32 math summed in another
# order (lossd's chunks against TRL's chunked log-softmax).
LOSS_RTOL, RTOL, ATOL = 2e-5, 1e-4, 2e-5


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>")
    fast.chat_template = None
    return fast


def tiny_llama(tok):
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: the softmax is not flat
    return model


def texts(n, seed, lo=6, hi=14):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,),
                                                                   generator=g)))
    return out


def common_args(tmp_path, name, bf16=False):
    # SGD: its update is linear in the gradient, so rounding differences stay rounding.
    # TRL's configs default to bf16 (autocast, on CPU too): fp32 unless asked.
    return dict(output_dir=str(tmp_path / name), max_steps=3, learning_rate=0.05, optim="sgd",
                bf16=bf16,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=7,
                max_grad_norm=0.0, dataloader_num_workers=0, disable_tqdm=True)


def assert_close(name, got, ref):
    g, r = got.detach().double(), ref.detach().double()
    err = (g - r).abs()
    bound = ATOL * float(r.abs().max()) + RTOL * r.abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), "%s: %d of %d off; worst got %.7g ref %.7g" % (
        name, int((err > bound).sum()), err.numel(), g.flatten()[worst], r.flatten()[worst])


def assert_logs(got, want, keys):
    """Every logged step's values of `keys` agree; the runs logged the same steps."""
    g = [e for e in got if "loss" in e]
    w = [e for e in want if "loss" in e]
    assert len(g) == len(w) == 3, (got, want)
    for step, (a, b) in enumerate(zip(g, w)):
        for k in keys:
            assert k in a and k in b, "step %d: %s not logged (%s)" % (step, k, sorted(a))
            tol = LOSS_RTOL * abs(b[k]) + 1e-7
            assert abs(a[k] - b[k]) <= tol, "step %d %s: %.9g, ref %.9g" % (step, k, a[k], b[k])


def assert_weights(got, ref):
    assert_close("lm_head", got.lm_head.weight, ref.lm_head.weight)
    assert_close("layer 0 q_proj", got.model.layers[0].self_attn.q_proj.weight,
                 ref.model.layers[0].self_attn.q_proj.weight)


@pytest.fixture(scope="module")
def address(lossd_server):
    return lossd_server.address


def _sft(tmp_path, address, name):
    tok = tokenizer()
    model = tiny_llama(tok)
    ds = datasets.Dataset.from_dict({"text": texts(24, 1)})
    args = trl.SFTConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_length=32, packing=False, **common_args(tmp_path, name))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    patch = apply_lossd(trainer, address) if address else None
    trainer.train()
    return trainer, patch


def test_sft_trainer(address, tmp_path):
    """SFTTrainer, 3 steps of gradient accumulation 2 (num_items_in_batch): the loss curve,
    the token accuracy and entropy metrics and the weights are the run without lossd's."""
    ref, _ = _sft(tmp_path, None, "ref")
    got, patch = _sft(tmp_path, address, "lossd")
    assert patch.calls["model"] == 6, patch.calls
    assert_logs(got.state.log_history, ref.state.log_history,
                ("loss", "mean_token_accuracy", "entropy"))
    assert_weights(got.model, ref.model)


def reward_len(completions, **kwargs):
    """A reward that differs between completions (GRPO's advantages are then not zero)."""
    return [float(len(c.split())) / 4.0 + (0.5 if "w3" in c else 0.0) for c in completions]


def _grpo(tmp_path, address, name, beta):
    tok = tokenizer()
    # From a folder, as GRPOTrainer loads its reference model (beta > 0) from the policy's
    # path: the tiny model is saved there first.
    model = tmp_path / "tiny-llama"
    if not model.exists():
        tiny_llama(tok).save_pretrained(model)
    model = str(model)
    ds = datasets.Dataset.from_dict({"prompt": texts(16, 2, 3, 6)})
    args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, temperature=0.7, beta=beta,
                          gradient_accumulation_steps=1,
                          **common_args(tmp_path, name, bf16=beta > 0))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=ds,
                              processing_class=tok)
    patch = apply_lossd(trainer, address) if address else None
    trainer.train()
    return trainer, patch


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-reference", "kl-to-reference"])
def test_grpo_trainer(address, tmp_path, beta):
    """GRPOTrainer, 3 steps: generation by the model itself, per-token log-probs and entropy
    at temperature 0.7 through lossd (and the reference model's, with beta > 0), TRL's GRPO
    loss on top. The losses, the entropy metric, the KL and the weights are the run
    without lossd's. With beta > 0 the run is TRL's default bf16 (autocast): accelerate then
    wraps the reference model's forward, and both runs compute the head in bf16 with fp32
    accumulation."""
    ref, _ = _grpo(tmp_path, None, "ref", beta)
    got, patch = _grpo(tmp_path, address, "lossd", beta)
    assert patch.calls["model"] >= 3, patch.calls
    if beta:
        assert patch.calls["ref_model"] >= 3, patch.calls
    keys = ("loss", "entropy", "reward") + (("kl",) if beta else ())
    assert_logs(got.state.log_history, ref.state.log_history, keys)
    assert_weights(got.model, ref.model)


def test_refusals(address, tmp_path):
    tok = tokenizer()
    model = tiny_llama(tok)
    ds = datasets.Dataset.from_dict({"text": texts(8, 1)})
    args = trl.SFTConfig(per_device_train_batch_size=4, max_length=32,
                         **common_args(tmp_path, "refusals"))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    with pytest.raises(lossd.InvalidArgumentError, match="supports GRPOTrainer, SFTTrainer"):
        apply_lossd(object(), address)
    patch = apply_lossd(trainer, address)
    with pytest.raises(lossd.FailedPreconditionError, match="already applied"):
        apply_lossd(trainer, address)
    patch.remove()
    with pytest.raises(lossd.UnavailableError, match="127.0.0.1:1 cannot be reached"):
        apply_lossd(trainer, "127.0.0.1:1", connect_timeout=2.0)
    soft = copy.deepcopy(trainer)
    soft.model.config.final_logit_softcapping = 30.0
    with pytest.raises(lossd.InvalidArgumentError, match="final_logit_softcapping=30.0"):
        apply_lossd(soft, address)


# -- item 6: autocast with a bf16 backbone on an fp32 head, torch.compile, a lost server --------

# The Transformers tests' bf16 table: both runs round X and W to bf16 and accumulate the logits
# in fp32, in another order and tiling (2^-8 relative on logits of a few units).
BF16 = dict(loss_rtol=1e-2, rtol=5e-2, atol=2e-2)
FP32 = dict(loss_rtol=LOSS_RTOL, rtol=RTOL, atol=ATOL)


def assert_near(name, got, ref, tol):
    g, r = got.detach().double(), ref.detach().double()
    assert g.shape == r.shape, "%s: shape %s, expected %s" % (name, g.shape, r.shape)
    assert float(r.abs().max()) > 0, "%s: the reference is all zeros" % name
    err = (g - r).abs()
    bound = tol["atol"] * float(r.abs().max()) + tol["rtol"] * r.abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), "%s: %d of %d off; worst got %.7g ref %.7g" % (
        name, int((err > bound).sum()), err.numel(), g.flatten()[worst], r.flatten()[worst])


def _pair(kind, tmp_path, address, model_fn, bf16=False):
    """(reference trainer, trainer through lossd) of `kind` ("sft" or "grpo") over two
    identical models from model_fn(tokenizer); nothing is trained."""
    tok = tokenizer()
    out = []
    for name in ("ref", "lossd"):
        model = model_fn(tok)
        if kind == "sft":
            args = trl.SFTConfig(per_device_train_batch_size=4, max_length=32,
                                 **common_args(tmp_path, kind + name, bf16=bf16))
            trainer = trl.SFTTrainer(model=model, args=args, processing_class=tok,
                                     train_dataset=datasets.Dataset.from_dict({"text": texts(4, 1)}))
        else:
            args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4,
                                  max_completion_length=8, temperature=0.7, beta=0.0,
                                  **common_args(tmp_path, kind + name, bf16=bf16))
            trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_len, args=args,
                                      processing_class=tok, train_dataset=datasets.Dataset.from_dict(
                                          {"prompt": texts(4, 2, 3, 6)}))
        out.append(trainer)
    return out[0], out[1], apply_lossd(out[1], address)


def _inputs(seed, b=3, t=16):
    """Token ids (no special tokens), an attention mask with right padding on one row, and
    labels with a prompt of a few ignored positions per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 4 + len(WORDS), (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    for r in range(b):
        labels[r, : 2 + r] = -100
    return ids, mask, labels


def _sft_path(model, inputs, count):
    """SFTTrainer's call (compute_loss's): the fused head with labels and the global count;
    a loss on log p and the entropy, so both upstream gradients are not zero."""
    ids, mask, labels = inputs
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True,
                num_items_in_batch=count)
    (out.loss - 0.01 * (out.entropy * out.label_mask).sum() / count).backward()
    return out


def _grpo_path(trainer, model, inputs, keep=8):
    """GRPOTrainer's log-prob path: _get_per_token_logps_and_entropies under the trainer's
    accelerator autocast, the last `keep` positions scored; a loss on both outputs."""
    ids, mask, _ = inputs
    logp, ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep,
                                                              compute_entropy=True)
    m = mask[:, -keep:]
    adv = torch.linspace(-1.0, 1.0, ids.shape[0]).unsqueeze(1)
    (-(logp * adv * m).sum() / m.sum() - 0.01 * (ent * m).sum() / m.sum()).backward()
    return logp, ent


def _compare_sft(ref, got, tol):
    assert_near("log_probs", got.log_probs, ref.log_probs, tol)
    assert_near("entropy", got.entropy.float(), ref.entropy.float(), tol)
    assert abs(float(got.loss) - float(ref.loss)) <= tol["loss_rtol"] * abs(float(ref.loss))
    assert torch.equal(got.is_top1, ref.is_top1), (got.is_top1, ref.is_top1)


def _compare_grads(got, ref, tol):
    assert got.lm_head.weight.grad.dtype == ref.lm_head.weight.grad.dtype
    assert_near("lm_head grad", got.lm_head.weight.grad, ref.lm_head.weight.grad, tol)
    assert_near("layer 0 q_proj grad", got.model.layers[0].self_attn.q_proj.weight.grad,
                ref.model.layers[0].self_attn.q_proj.weight.grad, tol)


def _bf16_backbone(tok):
    model = tiny_llama(tok).to(torch.bfloat16)
    model.lm_head.float()  # the head kept in fp32, as a mixed-precision trainer keeps it
    return model


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_autocast_bf16_backbone_fp32_head(address, tmp_path, kind):
    """A bf16 backbone (bf16 hidden states) on an fp32 head, under torch.autocast(bf16) (TRL's
    bf16=True): TRL's chunked log-softmax casts W to bf16 and accumulates in fp32, as lossd
    does; log p, the entropy, SFT's is_top1 and the gradients (the head's in fp32) equal TRL's
    own to bf16 rounding."""
    ref, got, patch = _pair(kind, tmp_path, address, _bf16_backbone, bf16=True)
    inputs = _inputs(21)
    if kind == "sft":
        count = torch.tensor(int((inputs[2][:, 1:] != -100).sum()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = _sft_path(ref.model, inputs, count)
            have = _sft_path(got.model, inputs, count)
        assert have.log_probs.dtype == want.log_probs.dtype
        _compare_sft(want, have, BF16)
    else:
        want = _grpo_path(ref, ref.model, inputs)
        have = _grpo_path(got, got.model, inputs)
        assert_near("log_probs", have[0], want[0], BF16)
        assert_near("entropy", have[1].float(), want[1].float(), BF16)
    assert patch.calls["model"] == 1, patch.calls
    _compare_grads(got.model, ref.model, BF16)


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_torch_compile_around_the_fused_head(address, tmp_path, kind):
    """torch.compile of the trainer's model (aot_eager): the lossd call is a graph break, the
    backbone compiles; the values and gradients are TRL's eager ones to fp32 rounding."""
    ref, got, patch = _pair(kind, tmp_path, address, tiny_llama)
    compiled = torch.compile(got.model, backend="aot_eager")
    inputs = _inputs(22)
    if kind == "sft":
        count = torch.tensor(int((inputs[2][:, 1:] != -100).sum()))
        _compare_sft(_sft_path(ref.model, inputs, count), _sft_path(compiled, inputs, count),
                     FP32)
    else:
        want, have = _grpo_path(ref, ref.model, inputs), _grpo_path(got, compiled, inputs)
        assert_near("log_probs", have[0], want[0], FP32)
        assert_near("entropy", have[1], want[1], FP32)
    assert patch.calls["model"] == 1, patch.calls
    _compare_grads(got.model, ref.model, FP32)


def test_a_server_lost_mid_training_is_named(tmp_path):
    """The server goes away after apply_lossd: the next fused-head call raises
    UnavailableError naming its address."""
    from conftest import LossdProcess
    from lossd_servers import find_lossd_binary

    srv = LossdProcess(find_lossd_binary(), str(tmp_path / "lossd.log"))
    try:
        _, got, _ = _pair("sft", tmp_path, srv.address, tiny_llama)
        inputs = _inputs(23)
        _sft_path(got.model, inputs, torch.tensor(10))
    finally:
        srv.stop()
    with pytest.raises(lossd.UnavailableError) as e:
        _sft_path(got.model, inputs, torch.tensor(10))
    assert "lossd server %s:" % srv.address in str(e.value)


def test_the_head_goes_once_per_version(address, tmp_path):
    """SFTTrainer's call sends the head twice (log p, then is_top1) under one cached handle:
    W is uploaded once while unchanged, and once more after the optimizer changed it."""
    _, got, patch = _pair("sft", tmp_path, address, tiny_llama)
    client = patch.runtime.client
    uploads = []
    put = client.put_weights
    client.put_weights = lambda *a, **k: uploads.append(1) or put(*a, **k)
    inputs = _inputs(24)
    for _ in range(2):
        _sft_path(got.model, inputs, torch.tensor(10))
    assert len(uploads) == 1, "W uploaded %d times for one version" % len(uploads)
    with torch.no_grad():
        got.model.lm_head.weight.mul_(0.5)  # an optimizer step, in place
    _sft_path(got.model, inputs, torch.tensor(10))
    assert len(uploads) == 2, "W uploaded %d times for two versions" % len(uploads)


def test_under_autocast_the_head_goes_once_per_version_in_bf16(address, tmp_path):
    """A bf16 backbone on an fp32 head under autocast (TRL's bf16=True): lossd casts the
    head to bf16 once per version, uploads it under one handle for both of SFTTrainer's
    calls, and does not upload it again until the optimizer changes it."""
    _, got, patch = _pair("sft", tmp_path, address, _bf16_backbone, bf16=True)
    client = patch.runtime.client
    uploads = []
    put = client.put_weights
    client.put_weights = lambda w, *a, **k: uploads.append(w.dtype) or put(w, *a, **k)
    inputs = _inputs(25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            _sft_path(got.model, inputs, torch.tensor(10))
        assert len(uploads) == 1, "W uploaded %d times for one version" % len(uploads)
        with torch.no_grad():
            got.model.lm_head.weight.mul_(0.5)  # an optimizer step, in place
        _sft_path(got.model, inputs, torch.tensor(10))
    assert len(uploads) == 2, "W uploaded %d times for two versions" % len(uploads)
    assert all("bf16" in str(d) or "bfloat16" in str(d) for d in uploads), uploads


def _as_zero3(param, status="AVAILABLE"):
    """What lossd.integrations reads of a ZeRO-3 parameter (deepspeed is not imported)."""
    import types

    param.ds_status = types.SimpleNamespace(name=status)
    param.ds_shape = tuple(param.shape)


def test_a_zero3_head_goes_inline_and_a_partitioned_one_is_refused(address, tmp_path):
    """Under ZeRO-3 (accelerate's DeepSpeed plugin) the fused-head call runs inside the
    model's forward, where ZeRO-3 gathers the head into a buffer each forward
    (param.data = buffer) and keeps the Parameter's version counter: a buffer refilled in
    place with the stepped head would match a cached handle, so a ZeRO-3 head travels
    inline. A parameter carrying ds_status stands in: its buffer refilled in place between
    two calls, both give TRL's own log p, entropy and is_top1; a head still partitioned is
    refused, naming the fix."""
    ref, got, patch = _pair("sft", tmp_path, address, tiny_llama)
    buf = got.model.lm_head.weight.detach().clone()
    got.model.lm_head.weight.data = buf
    _as_zero3(got.model.lm_head.weight)
    inputs = _inputs(26)
    count = torch.tensor(int((inputs[2][:, 1:] != -100).sum()))
    for i in range(2):
        if i:
            with torch.no_grad():
                buf.mul_(0.5)  # in place, through the buffer: the Parameter's version stays
                ref.model.lm_head.weight.mul_(0.5)
        _compare_sft(_sft_path(ref.model, inputs, count), _sft_path(got.model, inputs, count),
                     FP32)
    assert patch.runtime._handle is None, "a ZeRO-3 head went by cached handle"
    assert patch.calls["model"] == 2, patch.calls
    got.model.lm_head.weight.ds_status.name = "NOT_AVAILABLE"
    with pytest.raises(lossd.FailedPreconditionError) as e:
        _sft_path(got.model, inputs, count)
    assert "TRL's fused LM head: lm_head.weight is a DeepSpeed ZeRO-3 parameter still " \
        "partitioned (status NOT_AVAILABLE" in str(e.value), str(e.value)
