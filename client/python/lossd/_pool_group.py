# SPDX-License-Identifier: Apache-2.0
"""Hosted heads served by a head group, in lossd.ReplicaPool (a mixin, with lossd._pool_calls;
docs/hosted_head.md "Head groups"). Rank r's Computes and Steps go to members[r % S] of the
head's HeadInfo.group: a function of the member list only, so every rank's pool (and the C++
client's) sends a rank to the same member.

A group's head never moves: each member holds a slice of the master and the optimizer state,
so a member lost (down, restarted) takes the head with it and the caller gets HeadLostError
naming the member and saying to import the last export into a new group. A member answering
that a rank is another member's (FAILED_PRECONDITION "... go to member ...") means the pool's
group and the server's differ: that is raised, never sent to another member (a Compute resent
elsewhere could be added twice).
"""

import threading
import uuid

from lossd import errors


class _Pinned:
    """The server instance a member held the head on (what _check_replica compares with)."""

    def __init__(self, instance):
        self.instance = instance


def member_of(rank, size):
    """The member serving `rank` in a group of `size` (engine/head_group.h HeadGroupMemberOf)."""
    return int(rank) % int(size)


class PoolGroups:
    """ReplicaPool's head-group routing (see the module); the pool sets self._head_groups to
    a dict: head name -> {"members": tuple, "id": str, "instances": [instance per member]}."""

    # -- what the pool knows of a head's group ------------------------------------------

    def _group(self, name):
        with self._lock:
            return self._head_groups.get(name)

    def _learn_group(self, name, info, instances=None):
        """Records head `name`'s group from a HeadInfo a server sent (or forgets it where the
        head is one server's). A group's head has no home of its own."""
        g = getattr(info, "group", None)
        with self._lock:
            if not g:
                self._head_groups.pop(name, None)
                return None
            old = self._head_groups.get(name)
            members = tuple(g["members"])
            if instances is None:
                same = old is not None and old["members"] == members and old["id"] == g["id"]
                instances = list(old["instances"]) if same else [None] * len(members)
                instances[g["member"]] = info.instance or instances[g["member"]]
            rec = {"members": members, "id": g["id"], "instances": instances}
            self._head_groups[name] = rec
            self._homes.pop("head:" + name, None)
            return rec

    def _forget_group(self, name):
        with self._lock:
            self._head_groups.pop(name, None)

    def _check_group_arg(self, group):
        """(members, id) of a pool's create_head/import_head `group`: {"members": [endpoint,
        ...] (default: this pool's replicas, sorted), "id": the group's id (default: a new
        one)}. The pool creates the head on every member and gives each its index."""
        if not isinstance(group, dict):
            raise errors.InvalidArgumentError(
                "group must be a dict of members and id, got %r" % (group,))
        if "member" in group:
            raise errors.InvalidArgumentError(
                "group['member']: a pool creates the head on every member at once and gives "
                "each its index; give members and id only")
        unknown = sorted(set(group) - {"members", "id"})
        if unknown:
            raise errors.InvalidArgumentError("group: unknown key(s) %s (keys: members, id)"
                                              % ", ".join(map(repr, unknown)))
        members = group.get("members")
        members = self.replicas() if members is None else [str(m) for m in members]
        if not members:
            raise errors.InvalidArgumentError("group['members'] is empty")
        if len(set(members)) != len(members):
            raise errors.InvalidArgumentError("group['members'] lists a member twice: %r" % (
                members,))
        with self._lock:
            for i, m in enumerate(members):
                if m not in self._replicas:
                    raise errors.InvalidArgumentError(
                        "group['members'][%d] %r is not one of this pool's replicas (%s): "
                        "name the members as the pool names its replicas" % (
                            i, m, ", ".join(sorted(self._replicas))))
        gid = group.get("id")
        gid = "group-" + uuid.uuid4().hex if gid is None else str(gid)
        if not gid:
            raise errors.InvalidArgumentError("group['id'] is empty")
        return members, gid

    # -- calls ----------------------------------------------------------------------------

    def _create_in_group(self, name, group, create):
        """create(client, {"members", "member", "id"}) on every member at once (forming the
        group blocks each until all have joined). Returns member 0's HeadInfo; the first
        member's error (by index) where any failed. A group of one member is a one-server
        head placed on it."""
        members, gid = self._check_group_arg(group)
        if len(members) == 1:
            self._forget_group(name)
            with self._lock:
                self._homes.pop("head:" + name, None)
            self._home_of("head:" + name, at=members[0])
            return self._head_call(name, lambda c: create(c, None), recover=True)
        with self._lock:
            reps = [self._replicas[m] for m in members]
        out, errs = [None] * len(members), [None] * len(members)

        def run(m):
            spec = {"members": list(members), "member": m, "id": gid}
            try:
                out[m] = self._call(reps[m], lambda c: create(c, spec))
            except errors.LossdError as e:
                errs[m] = e

        threads = [threading.Thread(target=run, args=(m,), daemon=True,
                                    name="lossd-pool-group") for m in range(len(members))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [(m, e) for m, e in enumerate(errs) if e is not None]
        if failed:
            m, e = failed[0]
            raise type(e)("head %r: creating it as group %r failed on member %d (%s)%s: %s" % (
                name, gid, m, members[m], "" if len(failed) == 1 else
                " (and on member%s %s)" % ("s" if len(failed) > 2 else "",
                                          ", ".join(str(i) for i, _ in failed[1:])),
                e.message), method=e.method, request_id=e.request_id) from None
        self._learn_group(name, out[0], instances=[r.instance for r in out])
        for m, r in enumerate(out):
            self._done(reps[m], None, r.instance)
        return out[0]

    def _member_rep(self, name, group, m):
        """The replica of member m; HeadLostError where it is known down (and does not answer
        a probe now) or left the pool."""
        addr = group["members"][m]
        with self._lock:
            rep = self._replicas.get(addr)
        if rep is None:
            self._member_lost(name, group, m, "left the resolved replicas")
        if rep.down:
            state = self._check_replica(rep, _Pinned(group["instances"][m]))
            if state != "alive":
                self._member_lost(name, group, m, state)
            with self._lock:
                rep.down = False
        return rep

    def _group_call(self, name, group, m, fn, rank=None):
        """fn(client) on member m of head `name`'s group. rank: the rank routed there (named
        where the member says the rank is another's)."""
        rep = self._member_rep(name, group, m)
        pinned = _Pinned(group["instances"][m])
        try:
            r = self._call(rep, fn)
        except errors.UnavailableError:
            state = self._replica_failed(rep, pinned)
            if state != "alive":
                self._member_lost(name, group, m, state)
            raise  # the member answers: a passing failure, or its own (a collective's)
        except (errors.NotFoundError, errors.FailedPreconditionError) as e:
            state = self._check_replica(rep, pinned)
            if state != "alive":
                self._member_lost(name, group, m, state)
            if rank is not None and "go to member" in e.message:
                raise errors.FailedPreconditionError(
                    "head %r: this pool sent rank %d to member %d (%s), members[%d %% %d] of "
                    "group %r as it knows it, and that member answered: %s. The pool's group "
                    "and the server's differ (the head was created again as another group, "
                    "or a routing bug); nothing was sent to another member (a Compute sent "
                    "twice may be added twice): call head_info(%r) to learn the group again"
                    % (name, rank, m, rep.address, rank, len(group["members"]), group["id"],
                       e.message, name), method=e.method, request_id=e.request_id) from None
            raise
        instance = getattr(r, "instance", None) or getattr(
            getattr(r, "head", None), "instance", None)
        if instance:
            with self._lock:
                group["instances"][m] = group["instances"][m] or instance
        self._done(rep, None, instance)
        return r

    def _member_lost(self, name, group, m, why):
        addr = group["members"][m]
        with self._lock:
            self._counts["heads_lost"] += 1
            rep = self._replicas.get(addr)
        if rep is not None:
            with rep.client._heads_lock:
                rep.client._head_instances.pop(name, None)
        why = {"down": "is down (no answer to a probe)",
               "restarted": "restarted (another server instance)"}.get(why, why)
        raise errors.HeadLostError(
            "head %r: member %d (%s) of its group %r %s, and its slice of the head's master "
            "and optimizer state and this step's gradient sum went with it (a group's head "
            "never moves to another member). Import the head's last export into a new group: "
            "rank %d calls import_head(export, group={'members': [the live members], 'id': a "
            "new id}) (RemoteLMHead.load_export(export, group=...)); then every rank redoes "
            "the step from its first micro-batch" % (
                name, m, addr, group["id"], why, self.import_rank),
            head=name, replica=addr, moved_to=None, import_rank=self.import_rank,
            method="head")

    def _group_drop(self, name, group, kw):
        """DropHead on every member (each holds the head); one not answering is skipped."""
        for addr in group["members"]:
            with self._lock:
                rep = self._replicas.get(addr)
            if rep is None or rep.down:
                continue
            try:
                self._call(rep, lambda c: c.drop_head(name, **kw))
            except (errors.NotFoundError, errors.UnavailableError):
                pass


__all__ = ["PoolGroups", "member_of"]
