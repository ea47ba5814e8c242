# SPDX-License-Identifier: Apache-2.0
"""Two-phase log-prob tickets in lossd.ReplicaPool (a mixin, with lossd._pool_calls): a
ticket lives on the replica whose forward took it, so its backward must go there.

The pool remembers which replica answered each forward that took a ticket (the newest
_TICKETS_KEPT of them). A backward naming a ticket goes to that replica; with an
accumulator, only where the accumulator lives there too (one not begun yet begins there).
Where that cannot be (a ticket this pool did not take, or has forgotten; its replica down or
restarted; the accumulator on another replica) the backward fails with NotFoundError before
anything is sent, as a server does for a ticket it does not hold: the caller then sends the
one-phase call, routed as any other.
"""

from lossd import errors

_TICKETS_KEPT = 4096  # a forward whose backward never came is forgotten after this many more


class PoolTickets:
    """ReplicaPool's ticket routing (see the module); the pool sets self._tickets to an
    OrderedDict (ticket -> replica address)."""

    def _note_ticket(self, r, address):
        """A forward answered by the replica at `address` took a ticket (r.ticket set): its
        backward goes there."""
        ticket = getattr(r, "ticket", "")
        if not ticket:
            return
        with self._lock:
            self._tickets[ticket] = address
            self._tickets.move_to_end(ticket)
            while len(self._tickets) > _TICKETS_KEPT:
                self._tickets.popitem(last=False)

    def _note_head_ticket(self, r, head):
        """As _note_ticket, for a forward against hosted head `head` (on the head's replica)."""
        with self._lock:
            home = self._homes.get("head:" + head)
            address = None if home is None else home.address
        if address is not None:
            self._note_ticket(r, address)

    def _forget_ticket(self, ticket):
        with self._lock:
            self._tickets.pop(ticket, None)

    def _ticket_replica(self, ticket):
        """The live replica that took `ticket`; NotFoundError where there is none."""
        with self._lock:
            addr = self._tickets.get(ticket)
            rep = self._replicas.get(addr) if addr is not None else None
            down = rep is None or rep.down
        if addr is None:
            raise errors.NotFoundError(
                "ticket %r was not taken through this pool (or is long forgotten): send the "
                "one-phase call" % ticket, method="Compute")
        if down:
            self._forget_ticket(ticket)
            raise errors.NotFoundError(
                "ticket %r: its replica %s is gone, and the ticket with it: send the one-phase "
                "call" % (ticket, addr), method="Compute")
        return rep

    def _ticket_at_accumulator(self, ticket, name):
        """Before a backward that names both a ticket and accumulator `name`: the accumulator
        must live on the ticket's replica (one not begun yet is placed there). Only looks
        where the accumulator has a home: its moves and losses are _acc_compute's to handle."""
        rep = self._ticket_replica(ticket)
        key = "acc:" + name
        with self._lock:
            home = self._homes.get(key)
            at = None if home is None else home.address
        if at is None:
            self._home_of(key, at=rep.address)
        elif at != rep.address:
            raise errors.NotFoundError(
                "ticket %r lives on replica %s, accumulator %r on %s: send the one-phase call "
                "(it goes to the accumulator)" % (ticket, rep.address, name, at),
                method="Compute")

    def _ticket_compute(self, ticket, x, w, targets, timeout, kw):
        """A backward naming `ticket` (no accumulator, no head), sent to the ticket's replica.
        A passing UNAVAILABLE is tried once more there (a ticket already consumed answers
        NOT_FOUND); a replica found down or restarted took the ticket with it."""
        retried = False
        while True:
            rep = self._ticket_replica(ticket)
            try:
                r = self._call(rep, lambda c: c.compute(x, w, targets, timeout=timeout, **kw))
            except errors.UnavailableError:
                state = self._replica_failed(rep)
                if state == "alive" and not retried:
                    retried = True
                    continue
                if state == "alive":
                    raise
                self._forget_ticket(ticket)
                raise errors.NotFoundError(
                    "ticket %r: its replica %s is %s, and the ticket went with it: send the "
                    "one-phase call" % (ticket, rep.address, state), method="Compute") from None
            self._done(rep, None, r.instance)
            return r
