# SPDX-License-Identifier: Apache-2.0
"""What the torch modules share with one lossd server: LossdRuntime (the connection, the
weight cache, the server accumulator and the micro-batch bookkeeping of one loss module) and
the conversion of received arrays into torch tensors. Split from lossd.nn, which re-exports
both; importing this module imports torch.
"""

import collections
import uuid
import weakref

import numpy as np
import torch

from lossd import errors
from lossd.client import Client
from lossd.tensors import BF16Array


def _cast(t, dtype):
    """t in `dtype` (None, or t's own dtype: t itself), detached: what travels."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    return t.detach().to(dtype)


def _to_torch(value, device):
    """A received ndarray / BF16Array -> torch tensor on `device` (no copy on the host)."""
    if value is None:
        return None
    if isinstance(value, BF16Array):
        t = torch.from_numpy(value.bits.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(value)
    return t.to(device) if device is not None and device.type != "cpu" else t


class LossdRuntime:
    """Connection, weight cache and accumulator shared by the calls of one loss module.

    cache_weights: upload W (and bias) once with PutWeights and send only the handle while the
      tensors are unchanged: the same tensor objects at the same autograd version (in-place
      optimizer steps bump it). A weight made anew each step (a bf16 copy of fp32 master
      weights, a merged adapter) is another tensor, so it is uploaded again even where the
      allocator reuses the old one's memory. A handle the server dropped is uploaded again
      once. Writes that bypass the version counter (through `w.data`, a numpy view, or a
      buffer re-filled in place by a sharding wrapper) are not seen: call `drop_weights()`
      after them, or turn caching off.
    timeout: deadline of every call in seconds; None = the Client's default (600 s).
    accumulator: None, a name, or True for a fresh unique name: dW and db go into that
      server-side fp32 accumulator instead of weight.grad / bias.grad; call
      `apply_accumulated_gradients` before the optimizer step.
    eager_accumulation: accumulate in the forward Compute (one call per micro-batch instead of
      two). The upstream gradient of the loss must then be exactly 1: scale with `grad_scale`.
      Activation checkpointing runs the forward again inside backward; that forward adds
      nothing when it redoes one that already added (use_reentrant=False: it asks for dX
      alone), and adds when the first ran without grad (use_reentrant=True). Which is which
      is told by the micro-batch's content (samples of X, the targets, W and the bias).
    grad_scale: the factor dW and db are added to the accumulator with; only with an
      accumulator (without one, scale the loss).
    """

    def __init__(self, client=None, server="localhost:50051", *, cache_weights=True,
                 accumulator=None, eager_accumulation=False, grad_scale=1.0, timeout=None,
                 part_bytes=None):
        if float(grad_scale) != 1.0 and not accumulator:
            raise errors.InvalidArgumentError(
                "grad_scale %r applies to a server accumulator; without one, scale the loss "
                "(its backward scales every gradient)" % (grad_scale,), method="nn")
        if client is None:
            kw = {} if part_bytes is None else {"part_bytes": part_bytes}
            # timeout None: the Client's own default deadline, as for its methods (a Client
            # built with timeout=None would have no deadline at all, and a stalled call would
            # hang the training step).
            if timeout is not None:
                kw["timeout"] = timeout
            client = Client(server, **kw)
        self.client = client
        self.timeout = timeout
        self.cache_weights = cache_weights
        if accumulator is True:
            accumulator = "acc-" + uuid.uuid4().hex
        self.accumulator = accumulator or None
        self.eager_accumulation = eager_accumulation
        self.grad_scale = float(grad_scale)
        self._handle = None
        self._key = None
        self._dtype = None  # the dtype the cached handle's weights were asked in (None: own)
        # Eager forwards that added to the accumulator and whose backward has not run yet, by
        # micro-batch content: key -> [added, not yet redone; redone]. A forward run again
        # inside backward (activation checkpointing) that matches one of them redoes it.
        # Forwards of one key are interchangeable, so counts suffice.
        self._added = collections.OrderedDict()
        # lossd.rl's two-phase log-probs: what their calls did, by event (lossd._rl_logprob's
        # _note), the events already logged (each once), and until when (time.monotonic())
        # forwards keep nothing after the server refused to keep one.
        self.two_phase_counts = collections.Counter()
        self.two_phase_logged = set()
        self.two_phase_paused_until = 0.0
        # Whether the server answers a loss that overflowed (feature "nonfinite_loss"), asked
        # once by lossd.rl's scalar losses (lossd._rl_common._nonfinite_kw); None = not yet.
        self.nonfinite_loss = None

    # -- eager accumulation under activation checkpointing ------------------------------

    _ADDED_KEPT = 256  # forwards without a backward (evaluation with grad on) age out

    @staticmethod
    def micro_batch_key(x2, t1, weight, bias, opts):
        """What identifies a micro-batch across a recomputation: a recomputed X is a new
        tensor with the same values, and so may W be (a cast or a merged adapter made inside
        the checkpointed region), so evenly spaced samples of X, the targets, W and the bias
        (gathers of at most 1024 elements each), their shapes and dtypes, and the options."""
        def sample(t):
            if t is None:
                return None
            t = t.detach()
            n = t.numel()
            if n == 0:
                return (tuple(t.shape), t.dtype, b"")
            k = min(n, 1024)
            # Integer positions: float ones (linspace) round past the end above 2^24 elements.
            idx = torch.arange(k, device=t.device, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
            if t.is_contiguous():
                vals = t.view(-1)[idx]
            else:  # a transposed W, say: gathered in place, not flattened by a full copy
                vals = t[torch.unravel_index(idx, t.shape)]
            vals = vals.cpu().double()  # exact for every input dtype
            return (tuple(t.shape), t.dtype, vals.numpy().tobytes())

        return (sample(x2), sample(t1), sample(weight), sample(bias),
                repr(sorted((k, v) for k, v in opts.items() if k != "class_weights")))

    def note_added(self, key):
        """An eager forward added its micro-batch; returns the key for forget_added."""
        counts = self._added.setdefault(key, [0, 0])
        counts[0] += 1
        self._added.move_to_end(key)
        while len(self._added) > self._ADDED_KEPT:
            self._added.popitem(last=False)
        return key

    def take_redo(self, key):
        """True when a forward of this content added and was not yet redone: this one (run
        inside backward) redoes it, and must not add again."""
        counts = self._added.get(key)
        if counts is None or counts[0] == 0:
            return False
        counts[0] -= 1
        counts[1] += 1
        return True

    def forget_added(self, key):
        """The backward of a forward that added has run: a redone forward of its key is done
        with (the redo ran for this backward), else one not redone (no checkpointing)."""
        counts = self._added.get(key)
        if counts is None:
            return
        if counts[1] > 0:
            counts[1] -= 1
        elif counts[0] > 0:
            counts[0] -= 1
        if counts == [0, 0]:
            del self._added[key]

    # -- weights ------------------------------------------------------------------------

    @staticmethod
    def _fingerprint(t):
        """What else must not change: the memory, shape and dtype (`w.data = other` keeps the
        tensor object and its version counter but not these)."""
        return (t.data_ptr(), t._version, tuple(t.shape), t.dtype, str(t.device))

    @classmethod
    def _key_of(cls, weight, bias):
        """What the cached handle was made from: weak references to the tensors themselves
        (an address alone would match a new tensor that took over a freed one's memory) and
        their fingerprints."""
        def k(t):
            if t is None:
                return None
            return (weakref.ref(t), cls._fingerprint(t))

        return (k(weight), k(bias))

    def _key_matches(self, weight, bias):
        if self._key is None:
            return False
        for t, cached in zip((weight, bias), self._key):
            if (t is None) != (cached is None):
                return False
            if t is not None and (cached[0]() is not t or cached[1] != self._fingerprint(t)):
                return False
        return True

    def weight_ref(self, weight, bias, dtype=None):
        """A WeightHandle for (weight, bias), uploading when they changed; None = send inline.
        dtype: the compute dtype they are uploaded in (cast once per upload, so an fp32 head
        under bf16 autocast is not uploaded anew each call); None = their own."""
        if not self.cache_weights:
            return None
        if self._handle is not None and self._key_matches(weight, bias) and self._dtype == dtype:
            return self._handle
        key = self._key_of(weight, bias)
        self.drop_weights()
        kw = {}
        if getattr(self.client, "is_pool", False) and self.accumulator:
            # A replica pool: W lives on the accumulator's replica, where its computes go
            # (one upload a step, not two).
            kw["near"] = "acc:" + self.accumulator
        self._handle = self.client.put_weights(_cast(weight, dtype), _cast(bias, dtype),
                                               timeout=self.timeout, **kw)
        self._key = key
        self._dtype = dtype
        return self._handle

    def drop_weights(self):
        if self._handle is not None:
            try:
                self.client.drop_weights(self._handle, timeout=self.timeout)
            except errors.LossdError:
                pass  # already evicted or the server restarted: nothing left to free
            self._handle = None
            self._key = None
            self._dtype = None

    def compute(self, x, weight, target, bias, *, weight_dtype=None, **kw):
        """client.compute with W by handle when caching, re-uploading once if it was dropped.
        weight_dtype: W and the bias travel (or are uploaded) cast to it; None = as they are."""
        ref = self.weight_ref(weight, bias, weight_dtype)
        try:
            if ref is None:
                return self.client.compute(x, _cast(weight, weight_dtype), target,
                                           bias=_cast(bias, weight_dtype), timeout=self.timeout,
                                           **kw)
            return self.client.compute(x, ref, target, timeout=self.timeout, **kw)
        except errors.NotFoundError:
            # Only a handle the server no longer holds is worth an upload; any other error
            # (a poisoned accumulator is FailedPrecondition) would fail the same way again.
            if ref is None:
                raise
            self._handle = None
            self._key = None
            ref = self.weight_ref(weight, bias, weight_dtype)
            return self.client.compute(x, ref, target, timeout=self.timeout, **kw)

    # -- accumulator --------------------------------------------------------------------

    def fetch_gradients(self, reset=True):
        if self.accumulator is None:
            raise errors.FailedPreconditionError("no accumulator configured", method="nn")
        g = self.client.fetch_gradients(self.accumulator, reset=reset, timeout=self.timeout)
        if reset:
            self._added.clear()  # a new step: no forward before it is redone in it
        return g

    def apply_accumulated_gradients(self, weight, bias=None, reset=True):
        """Adds the accumulated fp32 dW (and db) into weight.grad (bias.grad); returns the
        Gradients read (micro_batches, tokens)."""
        g = self.fetch_gradients(reset=reset)
        if g.micro_batches == 0:
            # Nothing was added since the last reset: no backward ran, or a fetch that reset
            # the sum was lost on its way (the server zeroes when it takes the snapshot).
            # Adding zeros would make the step look done.
            raise errors.FailedPreconditionError(
                "accumulator %r holds no micro-batches: no backward added to it since its last "
                "reset, or the fetch that reset it did not arrive" % self.accumulator,
                method="nn")
        for p, val in ((weight, g.dw), (bias, g.db)):
            if p is None or val is None:
                continue
            t = torch.from_numpy(val).to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = t.clone()  # own the memory; t may share the received buffer
            else:
                p.grad.add_(t)
        return g

    def drop_accumulator(self):
        """Drops the server's sum (what a StepLostError asks before the step is redone)."""
        if self.accumulator is not None:
            self._added.clear()
            self.client.drop_accumulator(self.accumulator, timeout=self.timeout)

    def close(self):
        self.drop_weights()
