# SPDX-License-Identifier: Apache-2.0
"""lossd.integrations.transformers under torch.distributed: two processes (gloo, CPU) train a
tiny Llama built from a config for three steps, under DistributedDataParallel (mode "loss",
with a per-micro-batch mean and with Trainer's global token count; mode "head") and under
FSDP2's fully_shard (mode "loss" with the head sharded as a DTensor in the root's group, which
FSDP2 gathers before the forward; mode "head"). Each run is compared with the same
distributed run without lossd: every rank's losses, an inner layer and the head equal to fp32
rounding. A head fully_shard-ed in a group of its own is refused, naming the fix.

lossd.integrations.verl under FSDP2 too (verl trains its actor under FSDP): with the head in
the root's group, three steps of a policy-gradient loss with an entropy bonus on the log-probs
and entropies at temperature 0.7 equal verl's own forward_with_torch_backend under the same
sharding (losses, head, inner layer); under verl 0.9.1's own FSDP2 wrapping (an untied lm_head
in a group of its own) the head is refused, naming the fix. And torchtitan's loss under
FSDP2 as torchtitan groups the model ([norm, lm_head] unsharded after the forward): three steps
equal to its own head and CrossEntropyLoss; with the head resharded after the forward, refused.
And TRL's SFTTrainer over the two ranks (accelerate's DDP) against its own fused head.

This file is also the trainer: run as a script, it is one rank (see _train). Skipped where
torch (with torch.distributed) or transformers is not installed."""

import os
import subprocess
import sys
import types
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PY_ROOT = Path(__file__).resolve().parents[1]
V, H, B, T, STEPS, WORLD = 256, 32, 2, 24, 3, 2
# |got - ref| <= ATOL * max|ref| + RTOL * |ref|: the same fp32 math summed in another order
# (lossd's chunks against torch's one matmul), over three SGD steps.
RTOL, ATOL, LOSS_RTOL = 1e-4, 2e-5, 1e-5


# -- the trainer (one rank; run as a script) -----------------------------------------------

def _model():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits of a few units: the softmax is not flat
    return model


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    for r in range(B):
        labels[r, : int(torch.randint(2, 10, (1,), generator=g))] = -100
    return ids, labels


def _full(t):
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _weights(wrapped, model, patch, how):
    """(head, inner layer) whole on this rank: FSDP1 holds them in flat shards outside its
    forward, summon_full_params gathers them."""
    head = (lambda: patch.head.weight()) if how == "head" else (
        lambda: _full(model.lm_head.weight).clone())
    inner = lambda: _full(model.model.layers[0].self_attn.q_proj.weight).clone()  # noqa: E731
    if type(wrapped).__name__ == "FullyShardedDataParallel":
        with type(wrapped).summon_full_params(wrapped):
            return head(), inner()
    return head(), inner()


_VERL = []


def _verl_forward():
    """verl's forward_with_torch_backend, loaded once in this rank (its package shells stay)."""
    if not _VERL:
        from test_integrations_verl import load_verl_forward

        _VERL.append(load_verl_forward()[0])
    return _VERL[0]


def _patch(model, setup, how, server, head_name):
    """Before wrapping (the head's weights are whole here): lossd's Transformers integration
    in mode `how`, or for setup verl_*, verl's forward (how "none") or lossd's (how "loss")."""
    import lossd

    if setup.startswith("verl"):
        if how == "none":  # as verl's patch_forward_with_backends, on this instance
            model.forward = types.MethodType(_verl_forward(), model)
            return None
        from lossd.integrations.verl import apply_lossd as apply_verl

        return apply_verl(model, server)
    if how == "none":
        return None
    from lossd.integrations import apply_lossd

    kw = {} if how == "loss" else dict(
        head_name=head_name, optimizer=lossd.OptimizerConfig.sgd(lr=0.1))
    return apply_lossd(model, server, mode=how, **kw)


def _wrap(model, setup):
    if setup == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if setup.endswith("fsdp1"):
        import functools
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        # FSDP1 wrapped by decoder layer, the head in the root's unit: accelerate's default
        # (use_orig_params) for Trainer, verl's strategy "fsdp" (use_orig_params false).
        policy = functools.partial(transformer_auto_wrap_policy,
                                   transformer_layer_cls={type(model.model.layers[0])})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                        use_orig_params=not setup.startswith("verl"),
                                        device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if setup == "fsdp_head_alone":
        fully_shard(model.lm_head)
    if setup == "verl_policy":
        # verl 0.9.1's apply_fsdp2 (_select_fsdp2_wrap_targets): the decoder layers, the
        # embedding and an untied lm_head each in a group of their own, then the model.
        fully_shard(model.model.embed_tokens)
        fully_shard(model.lm_head)
    fully_shard(model)
    return model


def _verl_loss(wrapped, ids, labels, step, rank):
    """verl's actor's use of the fused path: log-probs and entropies at temperature 0.7, a
    policy-gradient term with an entropy bonus (dlogp and dentropy both non-zero) over the
    response tokens (the last position's rolled label is the first token: masked)."""
    from test_integrations_verl import ppo_like_loss

    g = torch.Generator().manual_seed(7 + 100 * step + rank)
    mask = (labels != -100).float()
    mask[:, -1] = 0
    out = wrapped(input_ids=ids, return_dict=True, temperature=0.7)
    return ppo_like_loss(out, mask, torch.randn(B, T, generator=g))


def _job(dist, setup, how, count, server, head_name):
    """One run of STEPS steps on this rank: SETUP ddp | fsdp | fsdp_head_alone | verl_fsdp |
    verl_policy, LOSSD none | loss | head, COUNT mean | global (num_items_in_batch over both
    ranks, the loss times the world size before backward, as Trainer does with
    average_tokens_across_devices). Returns its losses and weights, or the lossd error it
    raised."""
    import lossd

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    patch = _patch(model, setup, how, server, head_name)
    wrapped = _wrap(model, setup)
    # SGD: its update is linear in the gradient, so the runs' summation orders stay at
    # rounding level (AdamW can turn a last-bit difference of a tiny gradient into a step).
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, foreach=False)
    head_opt = patch.head_optimizer() if how == "head" else None
    losses = []
    try:
        for step in range(STEPS):
            ids, labels = _batch(step, rank)
            if setup.startswith("verl"):
                loss = _verl_loss(wrapped, ids, labels, step, rank)
                loss.backward()
                losses.append(float(loss.detach()))
            else:
                kw = {}
                if count == "global":
                    n = (labels[:, 1:] != -100).sum()
                    dist.all_reduce(n)
                    kw["num_items_in_batch"] = n
                out = wrapped(input_ids=ids, labels=labels, **kw)
                (out.loss * world if count == "global" else out.loss).backward()
                losses.append(float(out.loss.detach()))
            opt.step()
            if head_opt is not None:
                head_opt.step()
            opt.zero_grad()
    except lossd.LossdError as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}
    finally:
        dist.barrier()
    head, inner = _weights(wrapped, model, patch, how)
    result = {"losses": losses, "head": head.clone(), "inner": inner,
              "calls": dict(patch.calls) if patch else {}}
    if patch is not None and how == "loss" and not setup.startswith("verl"):
        patch.remove()
    return result


def _torchtitan_job(dist, setup, how, server):
    """torchtitan's Llama 3 debug model (a causal SDPA in place of FlexAttention, which has no
    CPU backward) under FSDP2 as torchtitan's apply_fsdp groups it: each layer, the
    embedding, [norm, lm_head] together, then the model; [norm, lm_head] not resharded after
    forward (torchtitan's default policy; setup tt_always: resharded, its "always"). Three
    steps of two micro-batches as its trainer runs them (the global valid-token count,
    clipping at 1.0, SGD), its own head and CrossEntropyLoss (how "none") or LossdLoss."""
    import lossd
    from torch.distributed.fsdp import fully_shard
    import test_integrations_torchtitan as tt
    from torchtitan.components.loss import CrossEntropyLoss

    rank = dist.get_rank()
    model = tt.trainable_llama3()
    if how == "none":
        loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    else:
        from lossd.integrations.torchtitan import apply_lossd as apply_torchtitan

        loss_fn = apply_torchtitan(model, server)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model.tok_embeddings)
    fully_shard([model.norm, model.lm_head], reshard_after_forward=setup == "tt_always")
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    losses = []
    try:
        for step in range(STEPS):
            losses += tt.step_losses(model, loss_fn, tt.micro_batches(30 + step + 10 * rank))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    except lossd.LossdError as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}
    finally:
        dist.barrier()
    return {"losses": losses, "head": _full(model.lm_head.weight).clone(),
            "inner": _full(model.layers["0"].attention.wo.weight).clone(),
            "calls": dict(loss_fn.calls) if how != "none" else {}}


def _trl_job(how, server, out_dir):
    """TRL's SFTTrainer under DDP (accelerate on this process group: two CPU ranks, the
    model wrapped in DistributedDataParallel), 3 steps of gradient accumulation 2 as
    test_integrations_trl's single-process run, with lossd's fused-head call (how "loss") or
    TRL's own (how "none"): the logged losses and the trained weights."""
    import test_integrations_trl as tt
    from lossd.integrations.trl import apply_lossd as apply_trl

    tok = tt.tokenizer()
    model = tt.tiny_llama(tok)
    args = tt.trl.SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                            max_length=32, packing=False,
                            **tt.common_args(Path(out_dir), "sft-ddp-" + how))
    trainer = tt.trl.SFTTrainer(model=model, args=args, processing_class=tok,
                                train_dataset=tt.datasets.Dataset.from_dict(
                                    {"text": tt.texts(24, 1)}))
    patch = apply_trl(trainer, server) if how == "loss" else None
    trainer.train()
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "head": model.lm_head.weight.detach().clone(),
            "inner": model.model.layers[0].self_attn.q_proj.weight.detach().clone(),
            "wrapper": type(trainer.model_wrapped).__name__,
            "calls": dict(patch.calls) if patch else {}}


def _train():
    """One rank: every job of JOBS ("setup/how/count,...") in one process group (one start
    of torch and transformers for all of them); saves {job: result} to OUT."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for i, job in enumerate(os.environ["JOBS"].split(",")):
        setup, how, count = job.split("/")
        if setup.startswith("tt_"):
            results[job] = _torchtitan_job(dist, setup, how, os.environ["SERVER"])
            continue
        if setup == "trl_ddp":
            results[job] = _trl_job(how, os.environ["SERVER"], os.environ["OUT"] + ".d")
            continue
        results[job] = _job(dist, setup, how, count, os.environ["SERVER"],
                            "%s-%d" % (os.environ["HEAD"], i))
    torch.save(results, os.environ["OUT"])
    dist.destroy_process_group()


# -- the tests -----------------------------------------------------------------------------

JOBS = ["ddp/none/mean", "ddp/loss/mean", "ddp/none/global", "ddp/loss/global",
        "ddp/head/mean", "fsdp/none/mean", "fsdp/loss/mean", "fsdp/head/mean",
        "fsdp_head_alone/loss/mean", "fsdp1/none/mean", "fsdp1/loss/mean"]
VERL_JOBS = ["verl_fsdp/none/mean", "verl_fsdp/loss/mean", "verl_policy/loss/mean",
             "verl_fsdp1/none/mean", "verl_fsdp1/loss/mean"]


TORCHTITAN_JOBS = ["tt_fsdp/none/mean", "tt_fsdp/loss/mean", "tt_always/loss/mean"]


TRL_JOBS = ["trl_ddp/none/mean", "trl_ddp/loss/mean"]


def _trl_loads():
    try:
        import accelerate  # noqa: F401
        import datasets  # noqa: F401
        import trl  # noqa: F401
        return True
    except ImportError:
        return False


def _torchtitan_loads():
    """Whether torchtitan's Llama 3 and loss import here."""
    try:
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
        return True
    except ImportError:
        return False


def _verl_loads():
    """Whether verl's fused-kernel modules load here (they are loaded, then put back)."""
    from test_integrations_verl import _restore, load_verl_forward

    try:
        _restore(load_verl_forward()[1])
        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def runs(lossd_server, tmp_path_factory):
    """Every job, run once by two ranks: {job: [rank 0's result, rank 1's]}."""
    from lossd_servers import free_port
    import lossd

    if not torch.distributed.is_available():
        pytest.skip("torch without its distributed package")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        jobs = (list(JOBS) + (VERL_JOBS if _verl_loads() else [])
                + (TORCHTITAN_JOBS if _torchtitan_loads() else [])
                + (TRL_JOBS if _trl_loads() else []))
    except ImportError:  # torch without FSDP2: the DDP jobs alone
        jobs = [j for j in JOBS if j.startswith("ddp/")]
    with lossd.Client(lossd_server.address) as c:
        if "hosted_head" not in c.server_info().features:
            jobs = [j for j in jobs if "/head/" not in j]
    tmp = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, PYTHONPATH=str(PY_ROOT), SERVER=lossd_server.address,
               HEAD="dist-%s" % uuid.uuid4().hex[:8], JOBS=",".join(jobs),
               WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    procs, outs = [], []
    for r in range(WORLD):
        outs.append(tmp / ("rank-%d.pt" % r))
        procs.append(subprocess.Popen([sys.executable, __file__], env=dict(
            env, RANK=str(r), OUT=str(outs[-1])), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    for p in procs:
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, "a rank failed:\n%s" % log[-4000:]
    per_rank = [torch.load(o) for o in outs]
    return {j: [per_rank[r][j] for r in range(WORLD)] for j in jobs}


def _of(runs, job):
    if job not in runs:
        pytest.skip("%s not run (no FSDP2, no verl, torchtitan or TRL, or no hosted heads on "
                    "this server)" % job)
    return runs[job]


def _assert_close(name, got, ref):
    g, r = got.double(), ref.double()
    err = (g - r).abs()
    bound = ATOL * float(r.abs().max()) + RTOL * r.abs()
    assert float(r.abs().max()) > 0, "%s: the reference is all zeros" % name
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), "%s: %d of %d off; worst got %.7g ref %.7g (max err %.3g)" % (
        name, int((err > bound).sum()), err.numel(), g.flatten()[worst], r.flatten()[worst],
        float(err.max()))


def _compare(got, ref):
    for rank in range(WORLD):
        assert "error" not in got[rank], got[rank]["error"]
        assert "error" not in ref[rank], ref[rank]["error"]
        for step, (a, b) in enumerate(zip(got[rank]["losses"], ref[rank]["losses"])):
            assert abs(a - b) <= LOSS_RTOL * abs(b), "rank %d step %d: loss %.9g, ref %.9g" % (
                rank, step, a, b)
        _assert_close("rank %d head" % rank, got[rank]["head"], ref[rank]["head"])
        _assert_close("rank %d layer 0 q_proj" % rank, got[rank]["inner"], ref[rank]["inner"])
    # The ranks trained one model: their weights agree (DDP's all-reduce, FSDP's gather).
    _assert_close("rank 1 against rank 0", got[1]["inner"], got[0]["inner"])


@pytest.mark.parametrize("how,count", [("loss", "mean"), ("loss", "global"), ("head", "mean")],
                         ids=["loss-mean", "loss-num_items_in_batch", "head"])
def test_ddp(runs, how, count):
    got = _of(runs, "ddp/%s/%s" % (how, count))
    _compare(got, _of(runs, "ddp/none/%s" % count))
    assert got[0]["calls"] == {"mean" if count == "mean" else "global": STEPS}


@pytest.mark.parametrize("how", ["loss", "head"])
def test_fsdp2_head_in_the_root_group(runs, how):
    """fully_shard over each layer, then the model: the head is a DTensor (Shard(0)) at rest,
    and FSDP2 has gathered it when the forward reaches lossd; its gradient is reduce-scattered
    as the model's own loss's would be. In mode "head" there is no local head to shard."""
    _compare(_of(runs, "fsdp/%s/mean" % how), _of(runs, "fsdp/none/mean"))


def test_fsdp1_head_in_the_root_unit(runs):
    """FSDP1 (FullyShardedDataParallel, use_orig_params as accelerate sets it for Trainer),
    wrapped by decoder layer: the head is a view into the root unit's flat parameter, which
    FSDP1 frees after backward by resizing its storage; lossd gets a copy."""
    got = _of(runs, "fsdp1/loss/mean")
    _compare(got, _of(runs, "fsdp1/none/mean"))
    assert got[0]["calls"] == {"mean": STEPS}


def test_fsdp2_head_in_a_group_of_its_own_is_refused(runs):
    for r in _of(runs, "fsdp_head_alone/loss/mean"):
        assert r.get("error", "").startswith("FailedPreconditionError"), r
        assert "lm_head.weight is a DTensor" in r["error"], r["error"]
        assert "do not fully_shard(model.lm_head) on its own" in r["error"], r["error"]



def test_verl_under_fsdp2_with_the_head_in_the_root_group(runs):
    """verl's use_fused_kernels path through lossd under fully_shard (the layers, then the
    model): FSDP2 gathers the head for the root's forward, lossd computes log p and the
    entropy, FSDP2 reduce-scatters the head's gradient: verl's own run's numbers."""
    got = _of(runs, "verl_fsdp/loss/mean")
    _compare(got, _of(runs, "verl_fsdp/none/mean"))
    assert got[0]["calls"] == {"ppo": STEPS}


def test_verl_under_fsdp1(runs):
    """verl's strategy "fsdp" (FSDP1, use_orig_params false, wrapped by decoder layer): the
    head is a plain view into the root unit's flat parameter in the forward; lossd copies
    it (FSDP1 frees that storage after backward) and the run is verl's own."""
    got = _of(runs, "verl_fsdp1/loss/mean")
    _compare(got, _of(runs, "verl_fsdp1/none/mean"))
    assert got[0]["calls"] == {"ppo": STEPS}


def test_verl_under_its_own_fsdp2_wrapping_is_refused(runs):
    """verl 0.9.1 wraps an untied lm_head in an FSDP2 group of its own, whose forward the
    fused path never calls: the head is still a sharded DTensor there. Refused, naming it."""
    for r in _of(runs, "verl_policy/loss/mean"):
        assert r.get("error", "").startswith("FailedPreconditionError"), r
        assert "verl's fused kernels: lm_head.weight is a DTensor" in r["error"], r["error"]
        assert "do not fully_shard(model.lm_head) on its own" in r["error"], r["error"]



def test_torchtitan_under_fsdp2(runs):
    """torchtitan's loss is called after the model returned, reading lm_head.weight: in its
    FSDP2 grouping [norm, lm_head] stay unsharded after the forward, so lossd gets the whole
    head (copied) and FSDP2 reduce-scatters its gradient when backward reaches the group:
    every micro-batch's loss and the trained weights equal torchtitan's own head and loss."""
    got = _of(runs, "tt_fsdp/loss/mean")
    _compare(got, _of(runs, "tt_fsdp/none/mean"))
    assert got[0]["calls"] == {"loss": 2 * STEPS}


def test_torchtitan_with_the_head_resharded_after_forward_is_refused(runs):
    """With [norm, lm_head] resharded after the forward (torchtitan's policy "always") the
    head is a sharded DTensor when the loss reads it: refused, naming it."""
    for r in _of(runs, "tt_always/loss/mean"):
        assert r.get("error", "").startswith("FailedPreconditionError"), r
        assert "torchtitan's loss: lm_head.weight is a DTensor" in r["error"], r["error"]



def test_trl_sft_trainer_under_ddp(runs):
    """SFTTrainer launched over two ranks (accelerate wraps the model in DDP): the fused-head
    call through lossd gives dW into lm_head.weight.grad, which DDP all-reduces; the logged
    losses and the trained weights equal the same DDP run of TRL's own fused head."""
    got = _of(runs, "trl_ddp/loss/mean")
    _compare(got, _of(runs, "trl_ddp/none/mean"))
    assert [r["wrapper"] for r in got] == ["DistributedDataParallel"] * WORLD, got
    assert got[0]["calls"] == {"model": 2 * STEPS}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _train()
