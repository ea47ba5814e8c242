# SPDX-License-Identifier: Apache-2.0
"""lossd.integrations.transformers under DeepSpeed ZeRO-3, on CPU: two processes (gloo) train a
tiny Llama built from a config for three SGD steps through deepspeed.initialize with ZeRO
stage 3 (every parameter partitioned, the head included), in mode "loss" and mode "head",
each against the same ZeRO-3 run without lossd: every rank's losses, the head and an inner
layer (gathered) equal to fp32 rounding. A loss computed outside the model's forward (the head
still partitioned there) is refused, naming the fix.

Two tests need no DeepSpeed: the head ZeRO-3 gathers into a buffer refilled in place (the
Parameter's version counter unchanged) must not be taken from the weight cache, and a
partitioned head is refused; they stand in for ZeRO-3 with a parameter carrying ds_status.

This file is also the trainer: run as a script, it is one rank (see _train). The ZeRO-3
tests are skipped where deepspeed, torch or transformers is not installed."""

import copy
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
# ZeRO-3 with every parameter partitioned: below the persistence threshold (1e5 elements by
# default) a parameter stays whole on every rank, which the tiny head would. No clipping:
# DeepSpeed clips to a norm of 1.0 unless told, and a hosted head is outside its norm.
DS_CONFIG = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
             "steps_per_print": 10 ** 6}


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


# -- the trainer (one rank; run as a script) -----------------------------------------------

def _gathered(deepspeed, param):
    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


def _job(deepspeed, rank, how, server, head_name):
    """One ZeRO-3 run of STEPS steps: LOSSD none | loss | head | outside (mode "loss", the
    loss called outside the forward). Returns its losses and weights, or the lossd error."""
    import lossd
    from lossd.integrations import apply_lossd

    model = _model()
    patch = None
    if how != "none":  # before deepspeed.initialize: the head is whole here
        kw = {} if how != "head" else dict(
            head_name=head_name, optimizer=lossd.OptimizerConfig.sgd(lr=0.1))
        patch = apply_lossd(model, server, mode="head" if how == "head" else "loss", **kw)
    opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=DS_CONFIG)
    head_opt = patch.head_optimizer() if how == "head" else None
    losses = []
    try:
        if how == "outside":
            ids, labels = _batch(0, rank)
            patch.loss(torch.randn(B, T, H), labels)
        for step in range(STEPS):
            ids, labels = _batch(step, rank)
            out = engine(input_ids=ids, labels=labels)
            engine.backward(out.loss)
            engine.step()
            if head_opt is not None:
                head_opt.step()
            losses.append(float(out.loss.detach()))
    except lossd.LossdError as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}
    head = patch.head.weight() if how == "head" else _gathered(deepspeed, model.lm_head.weight)
    return {"losses": losses, "head": head.clone(),
            "inner": _gathered(deepspeed, model.model.layers[0].self_attn.q_proj.weight),
            "calls": dict(patch.calls) if patch else {},
            "cached": patch is not None and patch.runtime is not None
            and patch.runtime._handle is not None}


def _train():
    """One rank: every job of JOBS in one process group; saves {job: result} to OUT."""
    import deepspeed

    # DeepSpeed's CPU backend compiles a shared-memory all-reduce (a C++ extension: about
    # 80 s on 2 cores) when its communicator starts; gloo's own collectives serve here.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {}
    for i, how in enumerate(os.environ["JOBS"].split(",")):
        results[how] = _job(deepspeed, rank, how, os.environ["SERVER"],
                            "%s-%d" % (os.environ["HEAD"], i))
    torch.save(results, os.environ["OUT"])
    torch.distributed.destroy_process_group()


# -- the tests -----------------------------------------------------------------------------

JOBS = ["none", "loss", "head", "outside"]


@pytest.fixture(scope="module")
def runs(lossd_server, tmp_path_factory):
    """Every job, run once by two ranks: {job: [rank 0's result, rank 1's]}."""
    from lossd_servers import free_port
    import lossd

    pytest.importorskip("deepspeed")
    jobs = list(JOBS)
    with lossd.Client(lossd_server.address) as c:
        if "hosted_head" not in c.server_info().features:
            jobs.remove("head")
    tmp = tmp_path_factory.mktemp("zero3")
    env = dict(os.environ, PYTHONPATH=str(PY_ROOT), SERVER=lossd_server.address,
               HEAD="zero3-%s" % uuid.uuid4().hex[:8], JOBS=",".join(jobs),
               WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")
    procs, outs = [], []
    for r in range(WORLD):
        outs.append(tmp / ("rank-%d.pt" % r))
        procs.append(subprocess.Popen([sys.executable, __file__], env=dict(
            env, RANK=str(r), LOCAL_RANK=str(r), OUT=str(outs[-1])), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    for p in procs:
        log = p.communicate(timeout=900)[0]
        assert p.returncode == 0, "a rank failed:\n%s" % log[-4000:]
    per_rank = [torch.load(o) for o in outs]
    return {j: [per_rank[r][j] for r in range(WORLD)] for j in jobs}


def _assert_close(name, got, ref):
    g, r = got.double(), ref.double()
    err = (g - r).abs()
    bound = ATOL * float(r.abs().max()) + RTOL * r.abs()
    assert float(r.abs().max()) > 0, "%s: the reference is all zeros" % name
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), "%s: %d of %d off; worst got %.7g ref %.7g (max err %.3g)" % (
        name, int((err > bound).sum()), err.numel(), g.flatten()[worst], r.flatten()[worst],
        float(err.max()))


@pytest.mark.parametrize("how", ["loss", "head"])
def test_zero3(runs, how):
    """Mode "loss": ZeRO-3 gathers the partitioned head when the patched forward reads it and
    reduce-scatters its gradient; W travels inline (never by cached handle). Mode "head": the
    head lives on lossd (grad_scale 1/world, DeepSpeed's average) and ZeRO-3 never sees it."""
    if how not in runs:
        pytest.skip("no hosted heads on this server")
    got, ref = runs[how], runs["none"]
    for rank in range(WORLD):
        assert "error" not in got[rank], got[rank]["error"]
        assert "error" not in ref[rank], ref[rank]["error"]
        assert len(got[rank]["losses"]) == STEPS
        for step, (a, b) in enumerate(zip(got[rank]["losses"], ref[rank]["losses"])):
            assert abs(a - b) <= LOSS_RTOL * abs(b), "rank %d step %d: loss %.9g, ref %.9g" % (
                rank, step, a, b)
        _assert_close("rank %d head" % rank, got[rank]["head"], ref[rank]["head"])
        _assert_close("rank %d layer 0 q_proj" % rank, got[rank]["inner"], ref[rank]["inner"])
        assert got[rank]["calls"] == {"mean": STEPS}
        assert not got[rank]["cached"], "a ZeRO-3 head went by cached handle"
    _assert_close("rank 1 against rank 0", got[1]["inner"], got[0]["inner"])


def test_zero3_head_read_outside_the_forward_is_refused(runs):
    for r in runs["outside"]:
        assert r.get("error", "").startswith("FailedPreconditionError"), r
        assert "DeepSpeed ZeRO-3 parameter still partitioned" in r["error"], r["error"]
        assert "deepspeed.zero.GatheredParameters" in r["error"], r["error"]


# -- without DeepSpeed: a parameter carrying ds_status stands in for ZeRO-3's ---------------

@pytest.fixture(scope="module")
def address(lossd_server):
    return lossd_server.address


def _as_zero3(param, status="AVAILABLE"):
    param.ds_status = types.SimpleNamespace(name=status)
    param.ds_shape = tuple(param.shape)


def test_a_head_refilled_in_place_is_not_taken_from_the_cache(address):
    """ZeRO-3 gathers the head into a buffer each forward (param.data = buffer) and the
    Parameter's version counter stays: with the buffer reused at the same address and the
    stepped values written into it, a cached handle's fingerprint would still match and the
    server would compute with the old head. Here the buffer is refilled in place between two
    forwards; both losses must be the model's own."""
    from lossd.integrations import apply_lossd

    ref = _model()
    model = copy.deepcopy(ref)
    buf = model.lm_head.weight.detach().clone()
    model.lm_head.weight.data = buf
    _as_zero3(model.lm_head.weight)
    apply_lossd(model, address)
    ids, labels = _batch(0, 0)
    for i in range(2):
        if i:
            with torch.no_grad():
                buf.mul_(0.5)  # in place, through the buffer: the Parameter's version stays
                ref.lm_head.weight.mul_(0.5)
        got = float(model(input_ids=ids, labels=labels).loss)
        want = float(ref(input_ids=ids, labels=labels).loss)
        assert abs(got - want) <= LOSS_RTOL * abs(want), "forward %d: %.9g, ref %.9g" % (
            i, got, want)


def test_a_partitioned_head_is_refused(address):
    import lossd
    from lossd.integrations import apply_lossd

    model = _model()
    _as_zero3(model.lm_head.weight, "NOT_AVAILABLE")
    patch = apply_lossd(model, address)
    ids, labels = _batch(0, 0)
    with pytest.raises(lossd.FailedPreconditionError) as e:
        model(input_ids=ids, labels=labels)
    assert "mode \"loss\": lm_head.weight is a DeepSpeed ZeRO-3 parameter still partitioned " \
        "(status NOT_AVAILABLE" in str(e.value), str(e.value)
    patch.remove()
    with pytest.raises(lossd.FailedPreconditionError, match="apply it before deepspeed.initialize"):
        apply_lossd(model, address, mode="head", head_name="zero3-refused",
                    optimizer=lossd.OptimizerConfig.sgd(lr=0.1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _train()
