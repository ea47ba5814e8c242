# SPDX-License-Identifier: Apache-2.0
"""lossd inside Hugging Face Transformers: apply_lossd(model, server) makes a causal LM's forward
with labels compute its loss through lossd's fused linear cross-entropy (mode "loss": the head
stays a parameter of the model, on the trainer) or through a hosted head (mode "head": the
head's weights and optimizer live on lossd, the model's lm_head is replaced).

It never materialises the logits when labels are given (the output's `logits` is None, as
Liger-Kernel's patched forwards return in training) and never changes the model's class, its
state_dict keys or anything of another instance: only this model's `forward` (and, in mode
"head", its `lm_head`) is replaced, and LossdPatch.remove() puts them back.

The loss is the model's own (transformers' ForCausalLMLoss): labels shifted by one (or the
`shift_labels` given), `ignore_index` -100, the mean over the tokens not ignored or, with
`num_items_in_batch` (what Trainer passes under gradient accumulation), the sum divided by it;
Gemma 2/3's final_logit_softcapping goes to lossd's softcap. Imports torch and transformers.
"""

import collections
import functools
import inspect

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from lossd import errors
from lossd.client import Client
from lossd.nn import LossdRuntime, lossd_fused_linear_cross_entropy

# The causal LMs whose forward is base model -> last hidden state -> lm_head -> (softcap) ->
# ForCausalLMLoss, by class name: the config attribute holding the final logit softcap, or None
# for a family without one. Another class is refused (its forward may do more than this).
FAMILIES = {
    "LlamaForCausalLM": None,
    "MistralForCausalLM": None,
    "Qwen2ForCausalLM": None,
    "Qwen3ForCausalLM": None,
    "GemmaForCausalLM": None,
    "Gemma2ForCausalLM": "final_logit_softcapping",
    "Gemma3ForCausalLM": "final_logit_softcapping",
}
MODES = ("loss", "head")
# The forward's keyword arguments that belong to the loss (ForCausalLMLoss's), not the model.
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _connect(client_or_address, timeout, connect_timeout):
    """(client, address) for a "host:port", a lossd.Client or a lossd.ReplicaPool, checked by
    one ServerInfo call so an unreachable server fails here, naming itself."""
    if isinstance(client_or_address, str):
        client = Client(client_or_address, **({} if timeout is None else {"timeout": timeout}))
        address = client_or_address
    elif hasattr(client_or_address, "compute") and hasattr(client_or_address, "server_info"):
        client = client_or_address
        address = getattr(client, "target", None) or repr(client)
    else:
        raise errors.InvalidArgumentError(
            "client_or_address must be a \"host:port\" string, a lossd.Client or a "
            "lossd.ReplicaPool, got %r" % (client_or_address,), method="apply_lossd")
    try:
        client.server_info(timeout=connect_timeout)
    except (errors.UnavailableError, errors.DeadlineExceededError) as e:
        raise type(e)("the lossd server at %s cannot be reached (within %g s): %s" % (
            address, connect_timeout, e.message), method="apply_lossd") from None
    return client, address


def _inline_runtime(owner):
    """owner's second LossdRuntime, which sends W inline (made on first use from
    owner.client and owner.runtime's timeout; owner.remove() closes it)."""
    rt = getattr(owner, "_inline", None)
    if rt is None:
        rt = owner._inline = LossdRuntime(client=owner.client, cache_weights=False,
                                          timeout=owner.runtime.timeout)
    return rt


def _family(model):
    """The supported class `model` is an instance of, by name: its own, or the one FSDP2's
    fully_shard subclassed (FSDPLlamaForCausalLM derives from LlamaForCausalLM)."""
    return next((c.__name__ for c in type(model).__mro__ if c.__name__ in FAMILIES), None)


def _refuse_sharded(weight, what):
    """A head whose weight is a DTensor at the loss (fully_shard(model.lm_head) in its own
    group, or a tensor-parallel head) is refused rather than gathered here: FSDP2 reduces a
    group's gradients from hooks around that group's own forward, which the lossd loss never
    calls, so a gather here would leave the head's gradient unreduced across ranks. In the
    root's group (fully_shard(model) over the layers' groups) FSDP2 has unsharded it already."""
    cls = type(weight)
    if not any(c.__name__ == "DTensor" for c in cls.__mro__):
        return
    placements = getattr(weight, "placements", "?")
    raise errors.FailedPreconditionError(
        "%s: lm_head.weight is a DTensor %s of shape %s (placements %s): lossd needs the whole "
        "head. Under FSDP2 leave lm_head in the root module's group (fully_shard the layers, "
        "then the model; do not fully_shard(model.lm_head) on its own), so FSDP2 gathers it "
        "before the forward and reduce-scatters its gradient; a tensor-parallel (vocabulary-"
        "sharded) head is not supported" % (what, cls.__name__, tuple(weight.shape),
                                              placements), method="apply_lossd")


def _under_fsdp(model, weight=None):
    """Whether the head's storage belongs to FSDP, which frees it by resizing it to 0 after
    backward: under FSDP2 the model is an FSDPModule (the head gathered for the root's
    forward); under FSDP1 the head is a view into a FlatParameter (the original parameter,
    use_orig_params, or a plain view of it otherwise: both carry or view one marked
    _fsdp_flattened). The client reads a tensor through numpy, which pins its storage (not
    resizable), so such a head goes to lossd as a copy."""
    if any(c.__name__ == "FSDPModule" for c in type(model).__mro__):
        return True
    return weight is not None and any(
        getattr(t, "_fsdp_flattened", False) for t in (weight, weight._base) if t is not None)


def _zero3(weight, what):
    """Whether `weight` is a DeepSpeed ZeRO-3 parameter (it carries ds_status; deepspeed is
    not imported). Inside the model's forward ZeRO-3 gathers a parameter read there (its
    ZeROOrderedDict registers it as the running module's external parameter, so its gradient
    is reduce-scattered as the module's own): the loss gets the whole head. Such a head must
    travel inline: ZeRO-3 gathers it anew into a buffer each forward (param.data = buffer),
    which keeps the Parameter's version counter, so a buffer reused at the same address with
    the stepped values would match a cached handle's fingerprint and the server would use the
    old head. A head still partitioned (read outside any forward) is refused."""
    status = getattr(weight, "ds_status", None)
    if status is None:
        return False
    if getattr(status, "name", str(status)) != "AVAILABLE" or weight.numel() == 0:
        raise errors.FailedPreconditionError(
            "%s: lm_head.weight is a DeepSpeed ZeRO-3 parameter still partitioned (status %s, "
            "local shape %s, whole shape %s): lossd needs the whole head. Compute the loss "
            "inside the model's forward (ZeRO-3 gathers the head there), or wrap the call in "
            "deepspeed.zero.GatheredParameters([lm_head.weight]) and reduce its gradient "
            "yourself" % (what, getattr(status, "name", status), tuple(weight.shape),
                          tuple(getattr(weight, "ds_shape", ()))), method="apply_lossd")
    return True


def _check_model(model, mode):
    name = _family(model) or type(model).__name__
    if name not in FAMILIES:
        raise errors.InvalidArgumentError(
            "apply_lossd supports %s; got a %s (its forward may do more than base model -> "
            "lm_head -> loss)" % (", ".join(sorted(FAMILIES)), name), method="apply_lossd")
    if mode not in MODES:
        raise errors.InvalidArgumentError(
            "mode must be one of %s, got %r" % (", ".join(MODES), mode), method="apply_lossd")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise errors.InvalidArgumentError(
            "%s.lm_head must be a torch.nn.Linear, got %s (already patched? call "
            "LossdPatch.remove() first)" % (name, type(head).__name__), method="apply_lossd")
    if getattr(model, "_lossd_patch", None) is not None:
        raise errors.FailedPreconditionError(
            "apply_lossd was already applied to this %s (mode %r); call remove() on the "
            "LossdPatch it returned first" % (name, model._lossd_patch.mode),
            method="apply_lossd")


def _softcap_of(model):
    attr = FAMILIES[_family(model)]
    cap = getattr(model.config, attr, None) if attr else None
    return float(cap) if cap else None


def _compute_dtype(hidden):
    """The dtype the head runs in: torch.autocast's where it is on for the hidden states'
    device (nn.Linear's would cast X and W to it), else the hidden states' own."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


def _targets(labels, shift_labels, ignore_index, device):
    """ForCausalLMLoss's targets: position i predicts labels[i + 1]; the last position has
    none (ignore_index). A collator's shift_labels (already shifted) are taken as they are."""
    if shift_labels is not None:
        return shift_labels.to(device)
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(device)


def _normalise(loss_sum, num_items_in_batch):
    """sum / the global token count, as transformers' fixed_cross_entropy divides."""
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


class LossdPatch:
    """What apply_lossd did to one model: `mode`, `address`, `runtime` (mode "loss": the
    lossd.nn.LossdRuntime of its calls) or `head` (mode "head": the lossd.nn.RemoteLMHead);
    `head_optimizer()` and `trainer_callback()` for mode "head"; `remove()` undoes it."""

    def __init__(self, model, mode, client, address, softcap):
        self.model = model
        self.mode = mode
        self.client = client
        self.address = address
        self.softcap = softcap
        self.runtime = None
        self.head = None
        self.layer = None  # mode "head": the HostedLMHead standing in for lm_head
        self._inline = None  # the runtime for a head cast to another dtype (autocast)
        self._saved = {}
        # Losses computed, by how they were normalised ("mean": over the micro-batch's
        # tokens; "global": by num_items_in_batch), for a trainer's logs and the tests.
        self.calls = collections.Counter()

    # -- mode "loss" ----------------------------------------------------------------------

    def _runtime_for(self, cast):
        """A head cast for this call (autocast, or bf16 hidden states on an fp32 head) is a
        new tensor every micro-batch: sent inline, as a cached handle would be uploaded and
        dropped again each time. The model's own head goes by handle."""
        if not cast:
            return self.runtime
        if self._inline is None:
            self._inline = LossdRuntime(client=self.client, cache_weights=False,
                                        timeout=self.runtime.timeout)
        return self._inline

    def loss(self, hidden, labels, num_items_in_batch=None, shift_labels=None,
             ignore_index=-100):
        lm_head = self.model.lm_head
        _refuse_sharded(lm_head.weight, "mode \"loss\"")
        zero3 = _zero3(lm_head.weight, "mode \"loss\"")
        dtype = _compute_dtype(hidden)
        x, w, b = (None if t is None else (t if t.dtype == dtype else t.to(dtype))
                   for t in (hidden, lm_head.weight, lm_head.bias))
        if _under_fsdp(self.model, lm_head.weight):
            # The client reads W through numpy, which pins its storage (not resizable), and
            # FSDP frees the head it gathered by resizing that storage to 0 after backward:
            # lossd gets a differentiable copy (V x H copied here, sent inline).
            w, b = (None if t is None else (t.clone() if t is getattr(lm_head, n) else t)
                    for t, n in ((w, "weight"), (b, "bias")))
        t = _targets(labels, shift_labels, ignore_index, hidden.device)
        reduction = "mean" if num_items_in_batch is None else "sum"
        self.calls["mean" if num_items_in_batch is None else "global"] += 1
        loss = _named(self.address, lossd_fused_linear_cross_entropy, x, w, t, b,
                      ignore_index=ignore_index, reduction=reduction, softcap=self.softcap,
                      runtime=self._runtime_for(zero3 or w is not lm_head.weight))
        return loss if num_items_in_batch is None else _normalise(loss, num_items_in_batch)

    # -- mode "head" ----------------------------------------------------------------------

    def head_loss(self, hidden, labels, num_items_in_batch=None, shift_labels=None,
                  ignore_index=-100):
        head = self.head
        if ignore_index != head.ignore_index:
            raise errors.InvalidArgumentError(
                "ignore_index %r differs from the hosted head's %r (set at apply_lossd)" % (
                    ignore_index, head.ignore_index), method="apply_lossd")
        t = _targets(labels, shift_labels, ignore_index, hidden.device)
        # The head sums; the divisor is the global token count when Trainer gives it, else
        # this micro-batch's (the mean). The eager Compute adds dW/db with the upstream
        # gradient backward will bring, 1/divisor, so it is passed as loss_scale.
        if num_items_in_batch is None:
            count = torch.clamp((t != ignore_index).sum(), min=1).to(torch.float32)
        else:
            count = torch.as_tensor(num_items_in_batch, dtype=torch.float32)
        count = count.to(hidden.device)
        self.calls["mean" if num_items_in_batch is None else "global"] += 1
        dtype = self.layer.compute_dtype
        x = hidden if hidden.dtype == dtype else hidden.to(dtype)
        loss_sum = _named(self.address, head, x, t, loss_scale=float(1.0 / count))
        return loss_sum / count

    def head_optimizer(self):
        """The hosted head's torch.optim.Optimizer (RemoteLMHead.optimizer()): step it with
        the model's optimizer, or let trainer_callback() do so under Trainer."""
        self._need_head("head_optimizer")
        return self.head.optimizer()

    def trainer_callback(self):
        """A transformers.TrainerCallback stepping the hosted head right after Trainer's
        optimizer step, at the learning rate that step used (so Trainer's scheduler drives
        both). Pass it to Trainer(callbacks=[...])."""
        self._need_head("trainer_callback")
        from lossd.integrations._hf_head import HostedHeadCallback

        return HostedHeadCallback(self.head_optimizer())

    def _need_head(self, what):
        if self.mode != "head":
            raise errors.FailedPreconditionError(
                "%s is for mode \"head\"; this model was patched in mode %r" % (
                    what, self.mode), method="apply_lossd")

    def __deepcopy__(self, memo):
        # A copied model would keep this forward, bound to the original model, and share the
        # connection: refuse rather than train the wrong model.
        raise errors.FailedPreconditionError(
            "a model patched by apply_lossd cannot be deep-copied (its forward is bound to this "
            "instance): copy the model before apply_lossd, or call remove() first",
            method="apply_lossd")

    # -- undo ------------------------------------------------------------------------------

    def remove(self):
        """Puts the model's own forward (and lm_head) back and frees the cached weights."""
        model = self.model
        if getattr(model, "_lossd_patch", None) is not self:
            return
        if "forward" in self._saved:
            model.forward = self._saved["forward"]
        else:
            del model.forward  # the class's forward again
        if "lm_head" in self._saved:
            model.lm_head = self._saved["lm_head"]
        for rt in (self.runtime, self._inline):
            if rt is not None:
                rt.close()
        model._lossd_patch = None


def _named(address, fn, *args, **kwargs):
    """fn(...) with a lost server named in the error (gRPC's own text names only the
    resolved peer, and not always)."""
    try:
        return fn(*args, **kwargs)
    except (errors.UnavailableError, errors.DeadlineExceededError) as e:
        raise type(e)("lossd server %s: %s" % (address, e.message), method=e.method) from None


def _output(outputs, loss):
    """CausalLMOutputWithPast with the loss, no logits, and what the base model returned
    (the cache field is `cache` in newer transformers, `past_key_values` before)."""
    fields = CausalLMOutputWithPast.__dataclass_fields__
    kw = {k: getattr(outputs, k) for k in ("cache", "past_key_values", "hidden_states",
                                           "attentions") if k in fields and hasattr(outputs, k)}
    return CausalLMOutputWithPast(loss=loss, logits=None, **kw)


def _patched_forward(model, patch, original):
    """The replacement forward: without labels, the model's own; with labels, the base model,
    then lossd on its last hidden state. Same signature as the original (Trainer reads its
    **kwargs to decide whether to pass num_items_in_batch)."""
    sig = inspect.signature(original)
    var_kw = next((p.name for p in sig.parameters.values()
                   if p.kind == inspect.Parameter.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        extra = dict(arguments.pop(var_kw, {}) if var_kw else {})
        labels = arguments.pop("labels", None)
        if labels is None:
            return original(*args, **kwargs)
        keep = arguments.pop("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise errors.InvalidArgumentError(
                "logits_to_keep=%r with labels: the lossd loss is over every position (pass "
                "logits_to_keep=0, the default, when training)" % (keep,), method="apply_lossd")
        return_dict = extra.pop("return_dict", None)
        loss_kw = {k: extra.pop(k) for k in _LOSS_KWARGS if k in extra}
        outputs = model.model(**arguments, **extra)
        hidden = outputs.last_hidden_state
        if patch.mode == "loss":
            loss = _loss_outside_compile(patch.loss, hidden, labels, **loss_kw)
        else:
            loss = _loss_outside_compile(patch.head_loss, hidden, labels, **loss_kw)
        out = _output(outputs, loss)
        return out.to_tuple() if return_dict is False else out

    return forward


@torch.compiler.disable
def _loss_outside_compile(fn, *args, **kwargs):
    # The loss is a gRPC call: under torch.compile it runs eagerly (one graph break), and the
    # base model's graph is compiled as before.
    return fn(*args, **kwargs)


def apply_lossd(model, client_or_address, mode="loss", *, timeout=None, connect_timeout=10.0,
                cache_weights=True, head_name=None, optimizer=None, compute_dtype=None,
                **head_options):
    """Makes `model`'s forward with labels compute its loss through lossd; returns the
    LossdPatch (keep it: remove(), and in mode "head" the head's optimizer and Trainer
    callback).

    model: a causal LM of a family in FAMILIES (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2,
      Gemma 3 text), as built or loaded, before Trainer wraps it.
    client_or_address: "host:port", a lossd.Client or a lossd.ReplicaPool; reached once here
      (within connect_timeout seconds) so an unreachable server fails now, naming itself.
    mode: "loss": the head stays the model's parameter; each micro-batch sends X and the
      targets (and W when it changed: once per optimizer step) and gets the loss, dX and dW.
      "head": the head moves to lossd as a lossd.nn.RemoteLMHead named head_name, with
      `optimizer` (a lossd.OptimizerConfig) and compute_dtype (default: the head's dtype);
      the model's lm_head becomes a HostedLMHead with no parameters; each micro-batch sends
      X and gets the loss and dX, and the head steps on the server (head_optimizer(), or
      trainer_callback() under Trainer). A head tied to the input embedding is refused.
    timeout: each call's deadline in seconds (default: the Client's). cache_weights (mode
      "loss"): W by handle while unchanged. head_options (mode "head"): RemoteLMHead's
      grad_scaler, deferred, retries, rank, world_size, grad_scale, state, version, ...
    """
    _check_model(model, mode)
    softcap = _softcap_of(model)
    if mode == "loss" and head_options:
        raise errors.InvalidArgumentError(
            "%s: options of mode \"head\", not of mode \"loss\"" % ", ".join(
                sorted(head_options)), method="apply_lossd")
    if mode == "head":
        from lossd.integrations._hf_head import refuse_tied

        _refuse_sharded(model.lm_head.weight, "mode \"head\" (apply it before fully_shard)")
        _zero3(model.lm_head.weight, "mode \"head\" (apply it before deepspeed.initialize)")
        refuse_tied(model)
    client, address = _connect(client_or_address, timeout, connect_timeout)
    patch = LossdPatch(model, mode, client, address, softcap)
    if mode == "loss":
        patch.runtime = LossdRuntime(client=client, cache_weights=cache_weights,
                                     timeout=timeout)
    else:
        from lossd.integrations._hf_head import make_hosted_head

        patch.head, patch.layer = make_hosted_head(model, client, head_name, softcap,
                                                   optimizer, compute_dtype, head_options)
        patch._saved["lm_head"] = model.lm_head
        model.lm_head = patch.layer
    if "forward" in model.__dict__:
        patch._saved["forward"] = model.__dict__["forward"]
    model.forward = _patched_forward(model, patch, model.forward)
    model._lossd_patch = patch
    return patch


__all__ = ["FAMILIES", "MODES", "LossdPatch", "apply_lossd"]
