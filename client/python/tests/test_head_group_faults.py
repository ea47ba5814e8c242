# SPDX-License-Identifier: Apache-2.0
"""A head group's member lost mid-step (docs/hosted_head.md "Head groups", Faults), with
three lossd processes on 127.0.0.1: a member SIGKILLed (or stopped) while another member's
ranks wait in the step's first collective, and the third member's ranks call Step only after
that failed. No rank hangs and none is told the step ran: every rank's Step fails naming the
lost member and saying to import the last export into a new group; a retry is refused, so
nothing is applied twice; the member started again holds nothing and joins no group; the last
export imported into a new group continues as an uninterrupted run."""

import signal
import threading
import time
import uuid

import pytest

import lossd
from test_head_group_export import (  # the three members and the step loop
    MEMBERS, WORLD, Members, _create, _data, _run, _same, _start_state, _wait_serving)

GROUP_TIMEOUT_S = 15  # test_head_group_export's --head_group_timeout
STORE_CALL_S = 10  # the deadline of a member's call to member 0's store
AGAIN = "import its last export into a new group"


def _steps(head, ranks):
    """Starts Step of version 1 on each rank at once; returns (threads, results)."""
    got = {}

    def step(r):
        try:
            got[r] = head.client(r).step(head.name, 1, rank=r, world_size=WORLD)
        except lossd.LossdError as e:
            got[r] = e

    threads = [threading.Thread(target=step, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    return threads, got


def _join(threads):
    for t in threads:
        t.join(timeout=GROUP_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"


def _lost_named(g, lost, first, late):
    """What each surviving member's error says of the lost member (first: its ranks waited
    in the collective; late: its ranks came after first's had failed)."""
    a = g.addrs
    if lost == 0:  # member 0 keeps the group's store: its loss is named as the store's
        gone = "the group's store (member 0, %s) cannot be reached" % a[0]
        return {first: [gone], late: [gone]}
    return {first: ["members %d (%s), %d (%s) never arrived" % (late, a[late], lost, a[lost])],
            late: ["member %d (%s) left the group before (" % (first, a[first]),
                   "); member %d (%s) never arrived" % (lost, a[lost])]}


@pytest.mark.parametrize("fault,lost", [("SIGKILL", 2), ("SIGSTOP", 2), ("SIGKILL", 0),
                                        ("SIGSTOP", 0)])
def test_a_member_lost_mid_step_fails_every_rank_and_is_never_applied(tmp_path, fault, lost):
    """SIGKILL: the peers see its connections close and fail at once. SIGSTOP (a stalled
    member, its connections open): the collective's --head_group_timeout fails them. Member
    0 lost takes the group's rendezvous store with it; stalled, its store's calls wait out
    their own deadline (STORE_CALL_S) before a member knows it cannot read the marks."""
    g = Members(tmp_path)
    try:
        w, b, opt = _start_state(17)
        head = _create(g, MEMBERS, w, b, opt)
        _run(head, 0, 1, list(range(WORLD)))
        last = head.export()  # version 1
        for r in range(WORLD):
            x, t = _data(1, r, 0)
            head.client(r).compute(x, None, t, head=head.name, head_version=1, rank=r,
                                   micro_batch=0)
        first, late = [m for m in range(MEMBERS) if m != lost]
        ranks_of = {m: [r for r in range(WORLD) if r % MEMBERS == m] for m in range(MEMBERS)}
        # Member `first` gets all its ranks' Steps and enters the step's first collective.
        started = time.monotonic()
        threads, got = _steps(head, ranks_of[first])
        time.sleep(1.0)
        assert not got, got  # waiting in the collective
        g.procs[lost].send_signal(getattr(signal, fault))
        killed = time.monotonic()
        _join(threads)
        print("%s of member %d: member %d's ranks answered %.2f s after it" % (
            fault, lost, first, time.monotonic() - killed))
        if fault == "SIGSTOP":  # the collective waited out its timeout, from its start
            assert time.monotonic() - started >= GROUP_TIMEOUT_S
        # Member `late`'s ranks call Step now: they fail at once (member `first` closed its
        # connections as its collective failed), never waiting out the timeout; with a
        # stalled member 0, once the mark of their arrival has waited out its store call.
        came = time.monotonic()
        late_threads, late_got = _steps(head, ranks_of[late])
        _join(late_threads)
        took = time.monotonic() - came
        print("member %d's ranks, arriving after, answered in %.2f s" % (late, took))
        assert took < (STORE_CALL_S + 3 if (fault, lost) == ("SIGSTOP", 0) else 5), took
        got.update(late_got)
        g.procs[lost].kill()  # a stopped member is then lost for good as well
        g.procs[lost].wait()
        named = _lost_named(g, lost, first, late)
        for m in (first, late):
            for r in ranks_of[m]:
                e = got[r]
                assert isinstance(e, lossd.UnavailableError), (r, e)
                for want in named[m] + [AGAIN, "nothing of this step will be applied twice"]:
                    assert want in str(e), (r, want, str(e))
        # The lost member's own ranks cannot reach it.
        with pytest.raises(lossd.UnavailableError):
            head.client(lost).step(head.name, 1, rank=lost, world_size=WORLD, timeout=5)
        # A retried Step, or a Compute, is refused on the members that are up, naming the
        # lost member: the step never runs, once or twice.
        for m in (first, late):
            with pytest.raises(lossd.FailedPreconditionError) as e:
                g.clients[m].step(head.name, 1, rank=m, world_size=WORLD)
            for want in named[m] + ["of head group '", AGAIN, "Nothing is applied twice"]:
                assert want in str(e.value), (want, str(e.value))
            x, t = _data(1, m, 1)
            with pytest.raises(lossd.FailedPreconditionError) as e:
                g.clients[m].compute(x, None, t, head=head.name, head_version=1, rank=m,
                                     micro_batch=1)
            assert named[m][0] in str(e.value) and AGAIN in str(e.value), str(e.value)
        # The lost member comes back with nothing and rejoins no group by itself.
        g.start(lost)
        _wait_serving(g.procs[lost], g.addrs[lost])
        with pytest.raises(lossd.NotFoundError):
            g.clients[lost].head_info(head.name)
        with pytest.raises(lossd.FailedPreconditionError) as e:  # named the old instance
            g.clients[lost].step(head.name, 1, rank=lost, world_size=WORLD, timeout=5)
        assert "create or import the head here" in str(e.value), str(e.value)
        ids = {g.clients[m].head_info(head.name).group["id"] for m in (first, late)}
        assert len(ids) == 1  # the old group, still refusing
        # What the error says to do: the last export into a new group (a new id).
        for m in (first, late):
            g.clients[m].drop_head(head.name)
        g.clients[0].import_head_into_group(last, g.addrs, "g-%s" % uuid.uuid4().hex)
        for m in range(MEMBERS):
            assert g.clients[m].head_info(head.name).group["id"] not in ids
        _same(head.export(), last)
        _run(head, 1, 2, list(range(WORLD)))
        ref = _create(g, MEMBERS, w, b, opt)  # the same two steps, never interrupted
        _run(ref, 0, 2, list(range(WORLD)))
        _same(head.export(), ref.export())
    finally:
        g.close()
