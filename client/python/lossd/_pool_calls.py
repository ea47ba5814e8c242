# SPDX-License-Identifier: Apache-2.0
"""The calls of lossd.ReplicaPool (a mixin over its routing in lossd.pool): computes routed by
what owns their state, accumulators, hosted heads, and the calls any replica answers.

The rule every path keeps: a Compute into an accumulator or a head is never sent again to
another replica by the pool (the first may have been added); where a replica holding such
state is lost, the caller gets StepLostError or HeadLostError saying what to redo. Stateless
computes (inline W, or weights by name) are sent again wherever their replica went.
"""

import dataclasses
import time

from lossd import errors
from lossd._pool_group import member_of
from lossd._pool_weights import PoolWeights
from lossd._results import WeightHandle


def _forget(client, kind, name):
    """Makes a replica's client forget the server instance it pinned an accumulator or a head
    to (the pool moved it: if it ever comes back there, it begins anew)."""
    if kind == "acc":
        with client._acc_lock:
            client._acc_instances.pop(name, None)
    else:
        with client._heads_lock:
            client._head_instances.pop(name, None)


# How long an import waits for another rank's import of the same head to finish.
_IMPORT_WAIT_S = 60.0


def _import_idempotent(client, export, name, timeout, group=None):
    """client.import_head, where another rank's import of the same export running at once
    is success: every rank may import after a HeadLostError. The server refuses a create while
    another is under way (ALREADY_EXISTS); wait for that one, and take its head where it has the
    export's version (and, into a group, the same group id)."""
    try:
        return client.import_head(export, name, group=group, timeout=timeout)
    except errors.AlreadyExistsError as refused:
        deadline = time.monotonic() + _IMPORT_WAIT_S
        while True:
            try:
                info = client.head_info(name, timeout=timeout)
            except errors.NotFoundError:
                if time.monotonic() > deadline:
                    raise refused from None
                time.sleep(0.05)  # the other create is still streaming its tensors
                continue
            if info.version != export.version or (
                    group is not None and (info.group or {}).get("id") != group["id"]):
                raise refused from None  # another version or group: not this import's
            return dataclasses.replace(info, created=False)


class PoolCalls:
    """ReplicaPool's calls (see ReplicaPool)."""

    # -- computes ---------------------------------------------------------------------------

    def compute(self, x, w, targets, *, accumulator=None, head=None, timeout=None, **kw):
        """lossd.Client.compute, routed: with `head` by the head, with `accumulator` by the
        accumulator (W, a PoolWeights, is uploaded there if it is not held there yet), else
        by the weights' name (a PoolWeights) or, for inline W, by this trainer's rank; a
        two-phase backward (`ticket`) to the replica that took its ticket."""
        self._maybe_resolve()
        if isinstance(w, (WeightHandle, str)):
            raise errors.InvalidArgumentError(
                "w: a WeightHandle names weights on one replica; give a pool the PoolWeights "
                "its put_weights returned (or W itself)")
        pw = w if isinstance(w, PoolWeights) else None
        if head is not None:
            fn = lambda c: c.compute(  # noqa: E731
                x, w, targets, accumulator=accumulator, head=head, timeout=timeout, **kw)
            group = self._locate_head(str(head))
            if group is not None:
                # A group's head: rank r goes to members[r % S] (lossd._pool_group).
                rank = int(kw.get("rank", 0))
                m = member_of(rank, len(group["members"]))
                r = self._group_call(str(head), group, m, fn, rank=rank)
                self._note_ticket(r, group["members"][m])
                return r
            r = self._head_call(str(head), fn)
            self._note_head_ticket(r, str(head))
            return r
        ticket = kw.get("ticket")
        if ticket is None:
            if accumulator:
                return self._acc_compute(str(accumulator), pw, x, w, targets, timeout, kw)
            return self._plain_compute(pw, x, w, targets, timeout, kw)
        # A two-phase backward: to the replica that holds its ticket (lossd._pool_tickets).
        if accumulator:
            self._ticket_at_accumulator(str(ticket), str(accumulator))
            r = self._acc_compute(str(accumulator), pw, x, w, targets, timeout, kw)
        else:
            r = self._ticket_compute(str(ticket), x, w, targets, timeout, kw)
        self._forget_ticket(str(ticket))  # consumed
        return r

    def _plain_compute(self, pw, x, w, targets, timeout, kw):
        """A compute that changes no state: sent again on a live replica after a failure."""
        last, passing = None, 0
        for _ in range(self._attempts()):
            if pw is not None:
                rep, home, lost = self._home_of(pw.key)
                if lost:
                    pw.lose(lost[0])
                    if rep.address in pw.replicas():
                        pw.covered()
            else:
                rep, home = self._route_stateless("rank:%d" % self.rank), None
            try:
                r = self._call(rep, lambda c: c.compute(
                    x, w if pw is None else self._handle_at(pw, rep, timeout), targets,
                    timeout=timeout, **kw))
            except errors.WeightsChangedError:
                raise
            except errors.UnavailableError as e:
                last = e
                if self._replica_failed(rep, home) == "alive":
                    passing += 1
                    if passing > 1:
                        raise
                continue
            except errors.NotFoundError as e:
                if pw is None:
                    raise
                last = e
                self._handle_not_found(pw, rep)
                continue
            self._done(rep, home, r.instance)
            self._note_ticket(r, rep.address)
            return r
        raise last

    def _handle_not_found(self, pw, rep):
        """The weights' handle on `rep` is gone: the key moves to its next replica (the
        contract's rule, also for an eviction), where W goes up again once it checks."""
        pw.lose(rep.address)
        with self._lock:
            home = self._homes.get(pw.key)
            if home is not None and home.address == rep.address:
                home.excluded.add(rep.address)
                old, home.address = rep.address, self._first_live(pw.key, home.excluded)
                home.instance = self._replicas[home.address].instance
                self._note_move(pw.key, old, home.address, "NOT_FOUND for its handle on %s"
                                % old)

    def _done(self, rep, home, instance):
        with self._lock:
            self._saw_instance(rep, instance)
            if home is not None and instance:
                home.instance = instance

    def _acc_compute(self, name, pw, x, w, targets, timeout, kw):
        key = "acc:" + name
        for _ in range(self._attempts()):
            rep, home, lost = self._home_of(key)
            if lost:
                self._acc_lost(name, home, lost, sent=False)
            try:
                r = self._call(rep, lambda c: c.compute(
                    x, w if pw is None else self._handle_at(pw, rep, timeout), targets,
                    accumulator=name, timeout=timeout, **kw))
            except errors.WeightsChangedError:
                raise
            except errors.UnavailableError:
                state = self._replica_failed(rep, home)
                if state == "alive":
                    self._raise_step_lost(name, home, rep.address, None,
                                          "a compute into it failed with UNAVAILABLE and "
                                          "whether it was added is unknown")
                _, home, lost = self._home_of(key)
                self._acc_lost(name, home, lost or (rep.address, state), sent=True)
            except (errors.NotFoundError, errors.FailedPreconditionError) as e:
                # Refused before adding: a handle gone (NOT_FOUND), or the accumulator pinned
                # to an instance this server is not (FAILED_PRECONDITION).
                state = self._check_replica(rep, home)
                if state == "alive":
                    if pw is None or not isinstance(e, errors.NotFoundError):
                        raise
                    pw.lose(rep.address)  # the accumulator stays; W goes up again there
                    continue
                _, home, lost = self._home_of(key)
                self._acc_lost(name, home, lost or (rep.address, state), sent=False)
                continue
            with self._lock:
                home.dirty = True
            self._done(rep, home, r.instance)
            return r
        raise errors.UnavailableError("accumulator %r: no replica took the compute" % name,
                                      method="Compute")

    def _acc_lost(self, name, home, lost, sent):
        """The accumulator's replica was lost and it moved: an error if it held micro-batches
        (or this call may have been added), else it simply begins on its new replica."""
        old, why = lost
        with self._lock:
            rep = self._replicas.get(old)
        if rep is not None:
            _forget(rep.client, "acc", name)
        if home.dirty or sent:
            self._raise_step_lost(name, home, old, why, None)

    def _raise_step_lost(self, name, home, old, why, unknown):
        with self._lock:
            home.dirty = False
            self._counts["steps_lost"] += 1
        what = ("its replica %s %s, and the micro-batches added to it since its last reset went "
                "with it" % (old, why)) if unknown is None else "on replica %s %s" % (old,
                                                                                      unknown)
        raise errors.StepLostError(
            "accumulator %r: %s. A compute into an accumulator is never sent again to another "
            "replica, so redo the step: drop_accumulator(%r), then send every micro-batch of "
            "the step again (they go to %s)" % (name, what, name, home.address),
            accumulator=name, replica=old, moved_to=home.address, method="Compute")

    # -- accumulators -----------------------------------------------------------------------

    def fetch_gradients(self, accumulator, *, reset=False, timeout=None, **kw):
        """lossd.Client.fetch_gradients on the accumulator's replica; StepLostError where that
        replica was lost with micro-batches in it (or a resetting fetch's outcome is
        unknown)."""
        self._maybe_resolve()
        name = str(accumulator)
        key = "acc:" + name
        rep, home, lost = self._home_of(key)
        if lost:
            self._acc_lost(name, home, lost, sent=False)
        try:
            g = self._call(rep, lambda c: c.fetch_gradients(name, reset=reset, timeout=timeout,
                                                           **kw))
        except errors.UnavailableError:
            state = self._replica_failed(rep, home)
            if state == "alive" and not reset:
                raise
            if state == "alive":
                self._raise_step_lost(name, home, rep.address, None,
                                      "a resetting fetch failed with UNAVAILABLE and whether "
                                      "it reset is unknown")
            _, home, lost = self._home_of(key)
            self._acc_lost(name, home, lost or (rep.address, state), sent=True)
            raise  # not reached: _acc_lost raises for sent=True
        except (errors.NotFoundError, errors.FailedPreconditionError):
            if self._check_replica(rep, home) == "alive":
                raise
            _, home, lost = self._home_of(key)
            self._acc_lost(name, home, lost or (rep.address, "restarted"), sent=False)
            raise
        if reset:
            with self._lock:
                home.dirty = False
        self._done(rep, home, g.instance)
        return g

    def drop_accumulator(self, accumulator, *, timeout=None):
        """Drops the accumulator on its replica (nothing to drop where it was lost, or never
        began there)."""
        self._maybe_resolve()
        name = str(accumulator)
        rep, home, lost = self._home_of("acc:" + name)
        with self._lock:
            home.dirty = False
        if lost:
            old = self._replicas.get(lost[0])
            if old is not None:
                _forget(old.client, "acc", name)
        try:
            self._call(rep, lambda c: c.drop_accumulator(name, timeout=timeout))
        except errors.NotFoundError:
            pass

    # -- hosted heads -----------------------------------------------------------------------

    def _locate_head(self, name, look=()):
        """A head this pool has not used yet goes where it already is (the first replica in
        its order holding it: where the other ranks' pools moved it), else to its first live
        replica. Returns its group (lossd._pool_group) where a head group serves it, learnt
        from the HeadInfo of the replica found holding it; None for a one-server head. look:
        replicas to ask first (a group's members, when learning the group again)."""
        key = "head:" + name
        group = self._group(name)
        if group is not None and not look:
            return group
        with self._lock:
            if key in self._homes and not look:
                return None
        order = self.order(key)
        for addr in list(look) + [a for a in order if a not in look]:
            with self._lock:
                rep = self._replicas.get(addr)
            if rep is None or rep.down:
                continue
            try:
                info = self._call(rep, lambda c: c.head_info(name, timeout=self.probe_timeout))
            except (errors.NotFoundError, errors.UnavailableError,
                    errors.DeadlineExceededError):
                continue
            if info.group:
                return self._learn_group(name, info)
            self._forget_group(name)
            with self._lock:
                home = self._homes.get(key)
                if home is not None and home.address != addr:
                    self._homes.pop(key)  # found elsewhere: an import moved it
            self._home_of(key, at=addr)
            return None
        if look:
            self._forget_group(name)  # no member holds it any more
        return None

    def _head_call(self, name, fn, recover=False):
        """fn(client) on the head's replica. recover (create, import): goes to the head's
        current replica, moved or not; any other call raises HeadLostError where the head's
        replica was lost."""
        key = "head:" + name
        self._locate_head(name)
        checked = not recover
        for _ in range(self._attempts()):
            rep, home, lost = self._home_of(key)
            if lost:
                self._head_moved(name, home, lost, recover)
            elif not checked and home.instance and not home.awaiting_import:
                # A create or import of a head placed here before, which this pool may not
                # have met the loss of yet: a replica that restarted since is empty and would
                # make a second head, beside the one the ranks that met the loss import on the
                # home after it. Ask its instance first; lost, the head moves there.
                checked = True
                if self._check_replica(rep, home) != "alive":
                    continue
            try:
                r = self._call(rep, fn)
            except errors.UnavailableError:
                state = self._replica_failed(rep, home)
                if state == "alive":
                    raise
                _, home, lost = self._home_of(key)
                self._head_moved(name, home, lost or (rep.address, state), recover)
                continue
            except (errors.NotFoundError, errors.FailedPreconditionError) as e:
                state = self._check_replica(rep, home)
                if state == "alive":
                    if home.awaiting_import and isinstance(e, errors.NotFoundError):
                        self._raise_head_lost(name, home, None, None)
                    raise
                _, home, lost = self._home_of(key)
                self._head_moved(name, home, lost or (rep.address, state), recover)
                continue
            with self._lock:
                home.awaiting_import = False
            self._done(rep, home, getattr(r, "instance", None) or getattr(
                getattr(r, "head", None), "instance", None))
            return r
        raise errors.UnavailableError("head %r: no replica took the call" % name,
                                      method="head")

    def _head_moved(self, name, home, lost, recover):
        old, why = lost
        with self._lock:
            rep = self._replicas.get(old)
            home.awaiting_import = True
        if rep is not None:
            _forget(rep.client, "head", name)
        if not recover:
            self._raise_head_lost(name, home, old, why)

    def _raise_head_lost(self, name, home, old, why):
        with self._lock:
            self._counts["heads_lost"] += 1
        what = ("its replica %s %s, and the head's weights, optimizer state and this step's "
                "gradient sum went with it" % (old, why)) if old else (
                    "it moved to %s and was not imported there yet" % home.address)
        raise errors.HeadLostError(
            "head %r: %s. Import it from its last export: rank %d should call "
            "import_head(export) (RemoteLMHead.load_export), which goes to %s; ImportHead is "
            "idempotent by head and version, so every rank may make the same call. Then redo "
            "the step from its first micro-batch" % (name, what, self.import_rank,
                                                      home.address),
            head=name, replica=old, moved_to=home.address, import_rank=self.import_rank,
            method="head")

    def create_head(self, name, w, bias=None, *, group=None, **kw):
        """lossd.Client.create_head on the head's replica (where it already is, else the
        first in its order). group: {"members": [replica, ...], "id": ...} (both optional:
        the pool's replicas, a new id): a head group, created on every member at once
        (lossd._pool_group); returns member 0's HeadInfo."""
        self._maybe_resolve()
        if group is not None:
            return self._create_in_group(str(name), group, lambda c, g: c.create_head(
                name, w, bias, group=g, **kw))
        self._forget_group(str(name))
        return self._head_call(str(name), lambda c: c.create_head(name, w, bias, **kw),
                               recover=True)

    def import_head(self, export, name=None, *, group=None, timeout=None):
        """lossd.Client.import_head on the head's current replica: the recovery after a
        HeadLostError (idempotent by head and version). group: as create_head's (the
        recovery of a group's head: a new group, of live members, with a new id)."""
        self._maybe_resolve()
        n = str(name or export.name)
        if group is not None:
            return self._create_in_group(n, group, lambda c, g: _import_idempotent(
                c, export, n, timeout, g))
        self._forget_group(n)
        return self._head_call(n, lambda c: _import_idempotent(c, export, n, timeout),
                               recover=True)

    def step(self, head, version, **kw):
        """lossd.Client.step on the head's replica; for a group's head on member rank % S."""
        self._maybe_resolve()
        fn = lambda c: c.step(head, version, **kw)  # noqa: E731
        group = self._locate_head(str(head))
        if group is not None:
            rank = int(kw.get("rank", 0))
            return self._group_call(str(head), group, member_of(rank, len(group["members"])),
                                    fn, rank=rank)
        return self._head_call(str(head), fn)

    def export_head(self, head, **kw):
        """lossd.Client.export_head on the head's replica; for a group's head on member 0."""
        self._maybe_resolve()
        fn = lambda c: c.export_head(head, **kw)  # noqa: E731
        group = self._locate_head(str(head))
        if group is not None:
            return self._group_call(str(head), group, 0, fn)
        return self._head_call(str(head), fn)

    def head_info(self, head, **kw):
        """lossd.Client.head_info on the head's replica. A group's head is asked of its
        members (this pool's rank's first) and its group learnt again from the answer: after
        an import into a new group, every rank's head_info finds the new one."""
        self._maybe_resolve()
        name = str(head)
        group = self._locate_head(name)
        if group is not None:
            S = len(group["members"])
            m = member_of(self.rank, S)
            group = self._locate_head(name, look=group["members"][m:] + group["members"][:m])
        if group is not None:
            m = member_of(self.rank, len(group["members"]))
            info = self._group_call(name, group, m, lambda c: c.head_info(head, **kw))
            self._learn_group(name, info)
            return info
        return self._head_call(name, lambda c: c.head_info(head, **kw))

    def drop_head(self, head, **kw):
        """Drops the head on its replica, or on every member of its group (nothing to drop
        where that replica was lost)."""
        self._maybe_resolve()
        group = self._locate_head(str(head))
        if group is not None:
            self._group_drop(str(head), group, kw)
        else:
            try:
                self._head_call(str(head), lambda c: c.drop_head(head, **kw), recover=True)
            except errors.NotFoundError:
                pass
        self._forget_group(str(head))
        with self._lock:
            self._homes.pop("head:" + str(head), None)

    # -- any replica ------------------------------------------------------------------------

    def _stateless(self, fn):
        self._maybe_resolve()
        last = None
        for _ in range(self._attempts()):
            rep = self._route_stateless("rank:%d" % self.rank)
            try:
                return self._call(rep, fn)
            except errors.UnavailableError as e:
                last = e
                if self._replica_failed(rep) == "alive":
                    raise
        raise last

    def server_info(self, timeout=None):
        """ServerInfo of this rank's replica."""
        return self._stateless(lambda c: c.server_info(timeout=timeout))

    def health(self, service="", timeout=None):
        return self._stateless(lambda c: c.health(service, timeout=timeout))

    def require_feature(self, name, *, timeout=None):
        return self._stateless(lambda c: c.require_feature(name, timeout=timeout))

    def list_state(self, *, timeout=None):
        """{replica address: [StateEntry]} over the live replicas."""
        self._maybe_resolve()
        out = {}
        for addr in self.replicas():
            rep = self._replicas.get(addr)
            if rep is not None and not rep.down:
                out[addr] = self._call(rep, lambda c: c.list_state(timeout=timeout))
        return out
