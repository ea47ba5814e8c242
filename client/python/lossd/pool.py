# SPDX-License-Identifier: Apache-2.0
"""A pool of lossd replicas (lossd.ReplicaPool): one lossd.Client per replica, every call
routed by what owns its state, and failover that never adds anything twice.

Routing (rendezvous hashing, lossd._pool_route; the contract shared with the C++ client):
weights by their client-chosen name ("weights:<name>"), accumulators and hosted heads by name
("acc:<name>", "head:<name>"), stateless computes by the trainer's rank ("rank:<rank>"). A key
with state stays where its state was placed while that replica lives; when it dies (UNAVAILABLE
and no answer to a probe) or restarts (another instance id), the key moves to the replica after
it in its order, wrapping around (order_after_loss: the same home in every pool that meets the
loss, never the replica that lost the state); weights whose handle a replica answers NOT_FOUND
for move to the next replica of their order. A
create or import of a head placed before first asks its replica's instance, so a pool that has
not met a restart yet imports where the others do. What moves with it: weights are uploaded
again once their bytes check (lossd._pool_weights); an accumulator's partial step and a hosted
head cannot be, and the caller gets StepLostError / HeadLostError saying what to redo. A head
served by a head group (HeadInfo.group) has no one home: rank r's Computes and Steps go to
members[r % S], and a member lost takes the head with it (lossd._pool_group). The calls
themselves live in lossd._pool_calls.
"""

import collections
import dataclasses
import logging
import threading
import time
import uuid

from lossd import errors
from lossd._async import DEFAULT_MAX_IN_FLIGHT, AsyncCalls
from lossd._pool_calls import PoolCalls
from lossd._pool_group import PoolGroups
from lossd._pool_tickets import PoolTickets
from lossd._pool_route import (Target, order_after_loss, rendezvous_order, resolve,
                               system_resolver)
from lossd._pool_weights import PoolWeights
from lossd._proto import pb
from lossd.client import Client

log = logging.getLogger("lossd.pool")

DEFAULT_RESOLVE_INTERVAL_S = 30.0
DEFAULT_PROBE_TIMEOUT_S = 5.0
# A replica that restarts is back within seconds: cap gRPC's reconnect backoff (120 s by
# default) so the channel tries again soon enough to find it.
_CHANNEL_DEFAULTS = [("grpc.max_reconnect_backoff_ms", 2000),
                     ("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.min_reconnect_backoff_ms", 200)]


@dataclasses.dataclass
class PoolStats:
    """Counters of a ReplicaPool (a snapshot; ReplicaPool.stats())."""

    moves: int  # a key's replica changed (its replica lost, or a stateless call resent)
    reuploads: int  # weights uploaded again to replace a handle lost with its replica
    uploads: int  # every PutWeights the pool made
    resolutions: int  # re-resolutions of the target (periodic, on UNAVAILABLE, or asked)
    steps_lost: int  # StepLostError raised
    heads_lost: int  # HeadLostError raised
    calls: dict  # replica address -> calls sent to it (every attempt)
    replicas: list  # the replicas now known
    down: list  # those marked down


class _Replica:
    def __init__(self, address, client):
        self.address = address
        self.client = client
        self.instance = None  # its server's instance id, once known
        self.down = False
        self.probing = False  # a readmission probe is under way
        self.calls = 0
        self.uploads = 0


class _Home:
    """Where a key's state lives: a replica and the server instance holding it."""

    def __init__(self, address, instance):
        self.address = address
        self.instance = instance
        # Replicas this key lost its state on (weights whose handle was NOT_FOUND skip them).
        self.excluded = set()
        self.dirty = False  # accumulator: added to since its last reset
        self.awaiting_import = False  # head: moved here, not yet imported


def _check_number(field, value, positive=True, integer=False):
    try:
        v = int(value) if integer else float(value)
    except (TypeError, ValueError):
        raise errors.InvalidArgumentError("%s must be a number, got %r" % (field, value)) \
            from None
    if integer and v != value:
        raise errors.InvalidArgumentError("%s must be an integer, got %r" % (field, value))
    if (positive and not v > 0) or (not positive and v < 0):
        raise errors.InvalidArgumentError("%s must be %s, got %r" % (
            field, "> 0" if positive else ">= 0", value))
    return v


class ReplicaPool(AsyncCalls, PoolCalls, PoolGroups, PoolTickets):
    """Several lossd replicas used as one, with lossd.Client's methods.

    endpoints: "ip:port,ip:port" (or a list): those replicas, hashed by these strings; or one
      name, "dns:///name:port" or "name:port", resolved here (every address record one replica
      "ip:port", IPv6 "[ip]:port"), e.g. a Kubernetes headless Service.
    rank: this trainer's rank: stateless computes go by the key "rank:<rank>".
    import_rank: the rank HeadLostError asks to import a lost head (default 0).
    resolver: resolver(host, port) -> [IP address strings] (default socket.getaddrinfo).
    resolve_interval: seconds between re-resolutions (default 30); a call failing with
      UNAVAILABLE re-resolves at once. Re-resolution adds new replicas, drops unlisted ones and
      re-admits a down replica that answers again.
    probe_timeout: seconds a probe (ServerInfo, waiting for the connection) may take before
      a replica that failed a call counts as down (default 5).
    clock: time source for the re-resolution interval (default time.monotonic).
    client_factory: (address, **client_kwargs) -> lossd.Client, for tests (default Client).
    client_kwargs: lossd.Client's options for every replica (timeout, part_bytes,
      connections, TLS, auth_token, channel_options, ...); not target or channel.
      max_in_flight is the pool's own: its compute_async calls running at once (lossd._async).

    Calls: put_weights(w, bias, name=) -> PoolWeights (pass it as w), compute (compute_async),
    fetch_gradients,
    drop_accumulator, drop_weights, the hosted-head calls (create_head, import_head, step,
    export_head, head_info, drop_head; create_head and import_head take group= to make a head
    group of the pool's replicas), server_info, health, require_feature. stats() gives
    the counters; every move and re-upload is logged once on logger "lossd.pool". A two-phase
    log-prob's backward (compute(ticket=)) goes to the replica that took the ticket, or fails
    with NotFoundError where that cannot be (lossd._pool_tickets).
    """

    is_pool = True

    def __init__(self, endpoints, *, rank=0, import_rank=0, resolver=None,
                 resolve_interval=DEFAULT_RESOLVE_INTERVAL_S,
                 probe_timeout=DEFAULT_PROBE_TIMEOUT_S, clock=None, client_factory=None,
                 **client_kwargs):
        self.rank = _check_number("rank", rank, positive=False, integer=True)
        self.import_rank = _check_number("import_rank", import_rank, positive=False,
                                         integer=True)
        self.resolve_interval = _check_number("resolve_interval", resolve_interval)
        self.probe_timeout = _check_number("probe_timeout", probe_timeout)
        for field, fn in (("resolver", resolver), ("clock", clock),
                          ("client_factory", client_factory)):
            if fn is not None and not callable(fn):
                raise errors.InvalidArgumentError("%s must be callable, got %r" % (field, fn))
        for field in ("target", "channel"):
            if field in client_kwargs:
                raise errors.InvalidArgumentError(
                    "%s: a pool opens its own client per replica; give endpoints (and "
                    "channel_options / credentials for the channels)" % field)
        self.init_async(client_kwargs.pop("max_in_flight", DEFAULT_MAX_IN_FLIGHT))
        self._target = Target(endpoints)
        self._resolver = resolver or system_resolver
        self._clock = clock or time.monotonic
        self._factory = client_factory or Client
        opts = list(client_kwargs.pop("channel_options", None) or [])
        given = {k for k, _ in opts}
        client_kwargs["channel_options"] = [o for o in _CHANNEL_DEFAULTS
                                            if o[0] not in given] + opts
        self._client_kwargs = client_kwargs
        self._lock = threading.RLock()
        self._resolve_lock = threading.Lock()
        self._replicas = {}  # address -> _Replica
        self._homes = {}  # key -> _Home (keys with state)
        self._head_groups = {}  # head name -> its group (lossd._pool_group)
        self._last_route = {}  # stateless key -> the replica it went to last
        self._weights = {}  # name -> PoolWeights
        self._tickets = collections.OrderedDict()  # two-phase ticket -> its replica's address
        self._counts = dict(moves=0, reuploads=0, uploads=0, resolutions=0, steps_lost=0,
                            heads_lost=0)
        self._closed = False
        self._next_resolve = 0.0
        self._resolve(None)
        if not self._replicas:
            raise errors.UnavailableError("endpoints %r resolved to no replica" % (
                self._target.describe(),), method="resolve")

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def target(self):
        return self._target.describe()

    def close(self):
        self.close_async()
        with self._lock:
            self._closed = True
            for rep in self._replicas.values():
                rep.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "ReplicaPool(%r, rank=%d, replicas=%s)" % (self.target, self.rank,
                                                          self.replicas())

    def _check_open(self):
        if self._closed:
            raise errors.ClientClosedError("this lossd.ReplicaPool (%s) was closed" %
                                           self.target)

    def replicas(self):
        with self._lock:
            return sorted(self._replicas)

    def stats(self):
        with self._lock:
            return PoolStats(calls={a: r.calls for a, r in self._replicas.items()},
                             replicas=sorted(self._replicas),
                             down=sorted(a for a, r in self._replicas.items() if r.down),
                             **self._counts)

    def order(self, key):
        """Every known replica for `key`, by descending rendezvous score."""
        with self._lock:
            return rendezvous_order(key, list(self._replicas))

    def owner(self, key):
        """The replica a call of `key` goes to now: its home where it has state, else the
        first live replica in its order."""
        with self._lock:
            h = self._homes.get(key)
            return h.address if h is not None else self._first_live(key)

    def home(self, key):
        """The replica holding a key's state now (None before its first call)."""
        with self._lock:
            h = self._homes.get(key)
            return None if h is None else h.address

    # -- resolution and probes --------------------------------------------------------------

    def resolve(self):
        """Re-resolves the target now, as the periodic one does, and waits for the probes of
        the down replicas (the periodic one probes them in the background)."""
        self._check_open()
        self._resolve("asked", wait=True)

    def _maybe_resolve(self):
        self._check_open()
        if self._target.resolves and self._clock() >= self._next_resolve:
            self._resolve("periodic")
        elif not self._target.resolves and self._clock() >= self._next_resolve:
            self._readmit()  # fixed replicas: only bring back the down ones that answer
            self._next_resolve = self._clock() + self.resolve_interval

    def _resolve(self, why, wait=False):
        """Resolves the target and updates the replicas; why None: the first one."""
        with self._resolve_lock:
            try:
                addrs = resolve(self._target, self._resolver)
            except errors.UnavailableError as e:
                if why is None:
                    raise
                log.warning("re-resolving %s (%s) failed, keeping %d replicas: %s",
                            self.target, why, len(self._replicas), e.message)
                addrs = None
            with self._lock:
                if why is not None and self._target.resolves:
                    self._counts["resolutions"] += 1
                if addrs:
                    self._update_replicas(addrs, why)
                elif addrs is not None and why is not None:
                    # No record at all is more likely a DNS hiccup than no replica left.
                    log.warning("%s resolved to no address (%s): keeping %d replicas",
                                self.target, why, len(self._replicas))
                self._next_resolve = self._clock() + self.resolve_interval
        self._readmit(wait)

    def _update_replicas(self, addrs, why):
        new, gone = set(addrs) - set(self._replicas), set(self._replicas) - set(addrs)
        for a in sorted(new):
            self._replicas[a] = _Replica(a, self._factory(a, **self._client_kwargs))
        for a in sorted(gone):
            self._replicas.pop(a).client.close()
            self._handles_lost(a)
        if why is not None and (new or gone):
            log.info("%s resolved (%s): added %s, removed %s; replicas now %s", self.target,
                     why, sorted(new) or "none", sorted(gone) or "none", sorted(self._replicas))

    def _readmit(self, wait=False):
        """A down replica that answers a probe is live again (keys placed elsewhere stay where
        they are; new keys and stateless calls may go to it). The probes wait for the
        connection (up to probe_timeout: a channel backs off between attempts), so unless
        `wait` they run on threads of their own, not in the caller's call."""
        with self._lock:
            down = [r for r in self._replicas.values() if r.down and not r.probing]
            for rep in down:
                rep.probing = True

        def probe(rep):
            inst = self._probe(rep, patient=True)
            with self._lock:
                rep.probing = False
                if inst is None or self._replicas.get(rep.address) is not rep:
                    return
                rep.down = False
                self._saw_instance(rep, inst)
            log.warning("replica %s answers again (instance %s): live", rep.address, inst)

        for rep in down:
            if wait:
                probe(rep)
            else:
                threading.Thread(target=probe, args=(rep,), daemon=True,
                                 name="lossd-pool-probe").start()

    def _probe(self, rep, patient):
        """The replica's instance id, or None where it does not answer. patient: wait for the
        connection (up to probe_timeout), as after a failed call."""
        kw = rep.client._call_kwargs(self.probe_timeout)
        kw["wait_for_ready"] = bool(patient)
        try:
            return rep.client._stub.ServerInfo(pb.ServerInfoRequest(), **kw).instance or ""
        except Exception:  # any failure to answer means: not usable now
            return None

    def _learn_instance(self, rep):
        if rep.instance is None:
            info = rep.client.server_info(timeout=self.probe_timeout)
            with self._lock:
                self._saw_instance(rep, info.instance)

    def _saw_instance(self, rep, instance):
        """A reply from `rep` named `instance` (call with the lock held)."""
        if not instance:
            return
        if rep.instance and rep.instance != instance:
            log.warning("replica %s restarted: instance %s, before %s (the state it held is "
                        "gone)", rep.address, instance, rep.instance)
            self._handles_lost(rep.address, instance)
        rep.instance = instance

    def _handles_lost(self, address, instance=None):
        """Every named weight's handle at `address` (not made by `instance`) is gone: each
        is then replaced at most once, and that upload counts as a re-upload. Lock held."""
        for pw in self._weights.values():
            held = pw._held.get(address)
            if held is not None and (instance is None or held.instance != instance):
                pw.lose(address)

    def _replica_failed(self, rep, home=None):
        """After a call to `rep` failed with UNAVAILABLE: re-resolve, probe, and say whether
        the replica is "down", "restarted" (relative to `home`'s instance, else the last one
        seen) or "alive" (the failure was passing)."""
        self._resolve("UNAVAILABLE from %s" % rep.address)
        return self._check_replica(rep, home)

    def _check_replica(self, rep, home=None):
        inst = self._probe(rep, patient=True)
        with self._lock:
            if inst is None:
                if not rep.down:
                    rep.down = True
                    self._handles_lost(rep.address)
                    log.warning("replica %s is down (no answer within %.3g s)", rep.address,
                                self.probe_timeout)
                return "down"
            before = (home.instance if home is not None and home.instance else rep.instance)
            self._saw_instance(rep, inst)
            return "restarted" if before and before != inst else "alive"

    # -- routing ----------------------------------------------------------------------------

    def _first_live(self, key, excluded=()):
        order = rendezvous_order(key, list(self._replicas))
        live = [a for a in order if not self._replicas[a].down]
        pick = [a for a in live if a not in excluded] or live
        if not pick:
            raise errors.UnavailableError(
                "no live replica for %s: %s %s down" % (
                    key, ", ".join(order), "is" if len(order) == 1 else "are all"),
                method="route")
        return pick[0]

    def _home_after_loss(self, key, lost_on):
        """Where a key lost on `lost_on` goes: the first live replica of order_after_loss (the
        same in every pool that meets the loss), else `lost_on` itself where it is the only
        live one (a pool of one replica). Lock held."""
        after = order_after_loss(key, list(self._replicas), lost_on)
        for addr in after:
            rep = self._replicas.get(addr)
            if rep is not None and not rep.down:
                return addr
        rep = self._replicas.get(lost_on)
        if rep is not None and not rep.down:
            return lost_on
        raise errors.UnavailableError(
            "no live replica for %s: %s lost it and %s %s down" % (
                key, lost_on, ", ".join(after) or "no other",
                "is" if len(after) == 1 else "are all"), method="route")

    def _note_move(self, key, old, new, why):
        self._counts["moves"] += 1
        log.warning("%s moved from %s to %s: %s", key, old, new, why)

    def _route_stateless(self, key):
        with self._lock:
            addr = self._first_live(key)
            prev = self._last_route.get(key)
            if prev is not None and prev != addr:
                rep = self._replicas.get(prev)
                self._note_move(key, prev, addr, "%s is %s" % (
                    prev, "down" if rep is None or rep.down else "back"))
            self._last_route[key] = addr
            return self._replicas[addr]

    def _lost_why(self, home):
        rep = self._replicas.get(home.address)
        if rep is None:
            return "left the resolved replicas"
        if rep.down:
            return "is down"
        if home.instance and rep.instance and rep.instance != home.instance:
            return "restarted (instance %s, was %s)" % (rep.instance, home.instance)
        return None

    def _home_of(self, key, at=None):
        """(replica, home, lost): the key's replica, placing a new key on its first live one
        (or on `at`); a home whose replica was lost moves to the next live one in the key's
        order, and lost is then (old address, why)."""
        with self._lock:
            home = self._homes.get(key)
            if home is None:
                addr = at or self._first_live(key)
                home = self._homes[key] = _Home(addr, self._replicas[addr].instance)
                return self._replicas[addr], home, None
            why = self._lost_why(home)
            if why is None:
                rep = self._replicas[home.address]
                if home.instance is None:
                    home.instance = rep.instance
                return rep, home, None
            old = home.address
            home.excluded.add(old)
            home.address = self._home_after_loss(key, old)
            rep = self._replicas[home.address]
            home.instance = rep.instance
            self._note_move(key, old, home.address, "%s %s" % (old, why))
            return rep, home, (old, why)

    def _attempts(self):
        with self._lock:
            return len(self._replicas) + 2

    def _call(self, rep, fn):
        """fn(rep.client), counted; the replica's instance learned first."""
        with self._lock:
            rep.calls += 1
        self._learn_instance(rep)
        return fn(rep.client)

    # -- weights ----------------------------------------------------------------------------

    def put_weights(self, w, bias=None, *, name=None, keep_copy=False, place=True, near=None,
                    timeout=None):
        """Uploads W (V, H) and an optional bias (V) under `name` (default: a new unique one)
        and returns a PoolWeights to pass as `w` to compute. A name given again replaces its
        weights (the old handles are dropped).

        The pool keeps a reference to w and bias (keep_copy: its own copy, memory for
        safety) and a checksum of their bytes: where a handle is lost with its replica, W is
        uploaded to the next one only if they still hash the same, else WeightsChangedError
        asks for W again. place: upload now, to the replica of "weights:<name>" (else the
        first compute that needs W uploads it where it goes, e.g. an accumulator's replica).
        near: a key ("acc:<name>", "head:<name>", ...) whose replica the weights live on
        instead of their own name's: W for an accumulator's computes goes up once, there
        (the loss-only computes of the same W then go there too).
        """
        self._maybe_resolve()
        if name is None:
            name = "w-" + uuid.uuid4().hex
        if not isinstance(name, str) or not name:
            raise errors.InvalidArgumentError("name must be a non-empty string, got %r" % (
                name,))
        if near is not None and (not isinstance(near, str) or near.split(":", 1)[0] not in (
                "weights", "acc", "head", "rank") or ":" not in near):
            raise errors.InvalidArgumentError(
                "near must be a key 'acc:<name>', 'head:<name>', 'weights:<name>' or "
                "'rank:<n>', got %r" % (near,))
        pw = PoolWeights(name, w, bias, keep_copy)
        if near is not None:
            rep, near_home, lost = self._home_of(near)
            if lost and near.startswith("acc:"):
                self._acc_lost(near[4:], near_home, lost, sent=False)  # raises if it held any
            elif lost and near.startswith("head:"):
                self._head_moved(near[5:], near_home, lost, recover=False)  # raises
            with self._lock:
                home = self._homes.get(pw.key)
                if home is None:
                    self._homes[pw.key] = _Home(rep.address, rep.instance)
                else:  # the caller's choice, not a failover: not a move
                    home.address, home.instance = rep.address, rep.instance
        with self._lock:
            old = self._weights.get(name)
            self._weights[name] = pw
        if old is not None:
            self._drop_held(old, timeout)
        if place:
            self._place(pw, timeout)
        return pw

    def _place(self, pw, timeout):
        last = None
        for _ in range(self._attempts()):
            rep, _, lost = self._home_of(pw.key)
            if lost:
                pw.lose(lost[0])
            try:
                return self._handle_at(pw, rep, timeout)
            except errors.UnavailableError as e:
                last = e
                if self._replica_failed(rep) == "alive":
                    raise
        raise last

    def _handle_at(self, pw, rep, timeout):
        """pw's handle on `rep`, uploading it there first where it is not held."""
        if self._weights.get(pw.name) is not pw:
            raise errors.FailedPreconditionError(
                "weights %r are not this pool's current ones (replaced or dropped): "
                "put_weights them again" % pw.name, method="Compute")
        with pw.lock:
            handle = pw.held_at(rep.address, rep.instance)
            if handle is not None:
                return handle
            w, bias = pw.verified_source("no handle on %s" % rep.address)
            handle = self._call(rep, lambda c: c.put_weights(w, bias, timeout=timeout))
            replaced = pw.record(rep.address, handle, rep.instance)
            with self._lock:
                rep.uploads += 1
                self._counts["uploads"] += 1
                if replaced:
                    self._counts["reuploads"] += 1
        if replaced:
            log.warning("weights %r re-uploaded to %s (%s bytes, checksum verified)", pw.name,
                        rep.address, handle.bytes)
        return handle

    def drop_weights(self, w, *, timeout=None):
        """Drops named weights (a PoolWeights or its name) from every replica holding them."""
        self._check_open()
        name = w.name if isinstance(w, PoolWeights) else str(w)
        with self._lock:
            pw = self._weights.get(name)
            if pw is not None and (not isinstance(w, PoolWeights) or w is pw):
                del self._weights[name]
            elif isinstance(w, PoolWeights):
                pw = w  # an older PoolWeights of the name: drop what it holds still
        if pw is not None:
            self._drop_held(pw, timeout)

    def _drop_held(self, pw, timeout):
        with pw.lock:
            pw.dropped = True
            held, pw._held = dict(pw._held), {}
        for addr, h in held.items():
            rep = self._replicas.get(addr)
            if rep is None or rep.down:
                continue
            try:
                rep.client.drop_weights(h.handle, timeout=timeout)
            except errors.LossdError:
                pass  # evicted, or the replica went: nothing left to free


def connect_pool(endpoints, **kwargs) -> ReplicaPool:
    """ReplicaPool(endpoints, **kwargs)."""
    return ReplicaPool(endpoints, **kwargs)


__all__ = ["ReplicaPool", "PoolStats", "PoolWeights", "connect_pool"]
