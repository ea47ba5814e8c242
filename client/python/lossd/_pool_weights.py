# SPDX-License-Identifier: Apache-2.0
"""Named weights in a replica pool: the caller's W (and bias) as given to put_weights, a
checksum of the bytes uploaded, and the handle each replica holds.

The pool uploads W again only when it can prove the bytes are the ones first uploaded: it
keeps a reference to the caller's tensors (or, with keep_copy, its own copy) and hashes them
again before every later upload. A torch Parameter updated in place since is not the same
bytes, and the upload is refused (WeightsChangedError) rather than put other weights under
the name.
"""

import dataclasses
import hashlib
import threading

import numpy as np

from lossd import errors
from lossd.tensors import FLOAT_DTYPES, to_wire


def weights_digest(w, bias):
    """A checksum of (W, bias) as they go on the wire: dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for field, t in (("w", w), ("bias", bias)):
        if t is None:
            h.update(b"none;")
            continue
        dt, shape, arr = to_wire(t, field, FLOAT_DTYPES)
        h.update(("%d:%s;" % (dt, ",".join(str(int(s)) for s in shape))).encode())
        h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.hexdigest()


@dataclasses.dataclass
class _Held:
    """One replica's handle of the weights, on the server instance that made it."""

    handle: object  # lossd.WeightHandle
    instance: str


class PoolWeights:
    """Weights uploaded through a ReplicaPool under a name; pass it as `w` to pool.compute.

    name: the client-chosen name (its key is "weights:<name>"). v, h, dtype, has_bias: as
    the first upload's WeightHandle. digest: the checksum of the bytes uploaded.
    replicas(): where a handle is held now. The pool keeps the caller's tensors (not a copy,
    unless keep_copy) to upload them again after a failover, once their checksum matches.
    """

    def __init__(self, name, w, bias, keep_copy):
        self.name = str(name)
        self.key = "weights:" + self.name
        if keep_copy:
            w = _own_copy(w)
            bias = None if bias is None else _own_copy(bias)
        self._w, self._bias = w, bias
        self.keep_copy = bool(keep_copy)
        # A copy of our own needs no proof; the caller's tensors are hashed now, as uploaded.
        self.digest = None if keep_copy else weights_digest(w, bias)
        self.v = self.h = 0
        self.dtype = ""
        self.has_bias = bias is not None
        self.uploads = 0  # PutWeights made for it (every replica)
        self._held = {}  # replica address -> _Held
        self._lost = 0  # handles lost and not yet replaced (what makes an upload a re-upload)
        self.dropped = False
        self.lock = threading.Lock()  # one upload at a time: a second caller uses the first's

    def __repr__(self):
        return "PoolWeights(%r, %dx%d %s, replicas=%s)" % (self.name, self.v, self.h,
                                                           self.dtype, self.replicas())

    def replicas(self):
        return sorted(self._held)

    def held_at(self, address, instance):
        """The handle held at `address` by server `instance`, or None."""
        got = self._held.get(address)
        if got is None:
            return None
        if instance and got.instance and got.instance != instance:
            self.lose(address)  # that server restarted: its handle went with it
            return None
        return got.handle

    def lose(self, address):
        """The handle at `address` is gone (replica lost, restarted, or NOT_FOUND)."""
        if self._held.pop(address, None) is not None:
            self._lost += 1

    def covered(self):
        """A lost handle needed no upload: the key's new replica held one already."""
        if self._lost > 0:
            self._lost -= 1

    def record(self, address, handle, instance):
        """An upload to `address` made `handle`; returns True if it replaced a lost one."""
        first = self.uploads == 0
        self.uploads += 1
        if first:
            self.v, self.h, self.dtype = handle.v, handle.h, handle.dtype
        self._held[address] = _Held(handle, instance)
        if self._lost > 0:
            self._lost -= 1
            return True
        return False

    def verified_source(self, why):
        """(w, bias) to upload again, after checking they still hash as first uploaded."""
        if self.dropped:
            raise errors.FailedPreconditionError(
                "weights %r were dropped from the pool: put_weights them again" % self.name,
                method="PutWeights")
        if self.uploads == 0 or self.keep_copy:
            return self._w, self._bias
        now = weights_digest(self._w, self._bias)
        if now != self.digest:
            raise errors.WeightsChangedError(
                "weights %r must be uploaded again (%s), but the tensors given to put_weights "
                "no longer hold the bytes first uploaded (checksum %s, now %s; a tensor "
                "updated in place is not the same bytes): call put_weights(w, bias, name=%r) "
                "with the weights this step uses, then redo the call" % (
                    self.name, why, self.digest, now, self.name), name=self.name,
                method="PutWeights")
        return self._w, self._bias


def _own_copy(t):
    """A host copy of a tensor that keeps its wire form (bf16 stays bf16)."""
    if hasattr(t, "detach"):  # torch
        return t.detach().to("cpu", copy=True)
    if hasattr(t, "bits"):  # BF16Array
        return type(t)(np.array(t.bits, copy=True))
    return np.array(t, copy=True)


__all__ = ["PoolWeights", "weights_digest"]
