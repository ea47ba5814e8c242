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
